"""--parallel: a model's ranks on a group slot (`sim:0+sim:1`); a rank's death or device fault counts against its
device, and a quarantine replaces that device only (policy decided on made-up data, no processes)."""

from __future__ import annotations

import pytest

from harness.fleet import policy
from harness.fleet.policy import Fleet, Job
from harness.fleet.runconfig import RunConfig
from harness.fleet.runner import fleet_for
from harness.results.rows import Measurement

A, B = "sim:0+sim:1", "sim:2+sim:3"


def row(outcome: str, culprit: dict | None = None, **kw) -> Measurement:
    return Measurement(model_id="x", outcome=outcome, parallel={"spec": "fsdp:2", **({"culprit": culprit} if culprit
                                                                                    else {})}, **kw)


def died(rank: int, device: str) -> dict:
    return {"rank": rank, "device": device, "phase": "step", "kind": "death"}


@pytest.mark.parametrize(("measurement", "phase", "expected"), [
    # a rank killed by a signal (or the one that hung): the worker sent the row, yet it is a death on the group
    (row("crash", died(1, "sim:1"), error_type="RankDied", signal=11), "", "death"),
    (row("timeout", died(0, "sim:0"), error_type="RankHung"), "", "death"),
    # a rank's device fault is a fault, whoever's device
    (row("device_error", {"rank": 1, "device": "sim:1", "phase": "step", "kind": "fault"}, device_fault=True), "",
     "fault"),
    # every rank hung (no culprit): the deadline's timeout is no evidence against any device, as on one device
    (row("timeout", error_type="RankHung"), "", "none"),
    # a rank that raised (a model's crash, unsupported op): the group ran the model
    (row("crash", error_type="RuntimeError"), "", "survived"),
    (row("unsupported_op"), "", "survived"),
])
def test_evidence_of_a_group_row(measurement: Measurement, phase: str, expected: str) -> None:
    assert policy.evidence(measurement, phase) == expected


def test_a_rank_fault_quarantines_the_group_and_a_spare_replaces_that_device_only() -> None:
    f = Fleet([A, B], ["sim:4"], quarantine_after=1)
    job = Job("m1")
    out = policy.settle(f, job, row("device_error", {"rank": 1, "device": "sim:1", "phase": "step", "kind": "fault"},
                                    device_fault=True), A, 1.0)
    (q,) = out.quarantined
    assert (q.device, q.member, q.spare) == (A, "sim:1", "sim:0+sim:4")  # rank 1's position keeps its order
    assert "at fault: sim:1" in q.why
    assert f.active == [B, "sim:0+sim:4"] and f.spares == [] and f.spares_used == ["sim:4"]
    assert out.retry  # the model runs again elsewhere: the fault was the device's


def test_deaths_of_one_rank_strike_the_group_and_name_that_device_at_quarantine() -> None:
    f = Fleet([A, B], ["sim:4", "sim:5"], quarantine_after=2)
    policy.settle(f, Job("m1"), row("crash", died(0, "sim:2"), signal=11), B, 1.0, others_waiting=True)
    out = policy.settle(f, Job("m2"), row("crash", died(0, "sim:2"), signal=11), B, 1.0, others_waiting=True)
    (q,) = out.quarantined  # two different models died there, nothing survived in between, no canary
    assert (q.member, q.spare) == ("sim:2", "sim:4+sim:3")
    assert f.spares == ["sim:5"]


def test_without_a_culprit_every_device_is_replaced_or_none() -> None:
    f = Fleet([A], ["sim:4", "sim:5"])
    q = policy.quarantine(f, A, why="test")
    assert (q.spare, q.member) == ("sim:4+sim:5", "")
    f = Fleet([A, B], ["sim:4"], quarantine_after=1)
    q = policy.quarantine(f, A, why="test")  # two to replace, one spare: the group leaves, the spare stays
    assert q.spare is None and f.active == [B] and f.spares == ["sim:4"]


def test_a_single_device_spare_still_replaces_a_single_device() -> None:
    f = Fleet(["sim:0", "sim:1"], ["sim:2"], quarantine_after=1)
    q = policy.quarantine(f, "sim:0", why="test")
    assert (q.spare, q.member) == ("sim:2", "")


def test_a_parallel_run_groups_its_active_devices_and_keeps_spares_and_the_odd_device_out_as_single_devices() -> None:
    parallel = {"precision": "default", "ops": "young", "parallel": "fsdp:2"}
    f = fleet_for(RunConfig(settings=parallel, devices=["sim:0", "sim:1", "sim:2", "sim:3", "sim:4", "sim:5"],
                            spare=1, progress=False))
    assert (f.active, f.spares) == (["sim:0+sim:1", "sim:2+sim:3"], ["sim:4", "sim:5"])
    with pytest.raises(ValueError, match="needs 2 devices per model"):
        fleet_for(RunConfig(settings=parallel, devices=["sim:0", "sim:1"], spare=1, progress=False))


def test_on_a_cluster_a_group_and_its_replacement_stay_on_one_node() -> None:
    from harness.fleet.slots import plan

    devices = ["a/sim:0", "a/sim:1", "a/sim:2", "b/sim:0", "b/sim:1"]
    active, spares = plan(devices, 0, 2)
    assert (active, spares) == (["a/sim:0+a/sim:1", "b/sim:0+b/sim:1"], ["a/sim:2"])  # a's odd device stands by
    f = Fleet(list(active), list(spares), quarantine_after=1)
    f.blamed["b/sim:0+b/sim:1"] = "b/sim:1"
    q = policy.quarantine(f, "b/sim:0+b/sim:1", why="test")
    assert q.spare is None and f.spares == ["a/sim:2", "b/sim:0"]  # a's spare cannot join b's; b's healthy one waits
    f.blamed["a/sim:0+a/sim:1"] = "a/sim:0"
    q = policy.quarantine(f, "a/sim:0+a/sim:1", why="test")
    assert q.spare == "a/sim:2+a/sim:1"
    with pytest.raises(ValueError, match="on one node"):
        plan(["a/sim:0", "b/sim:0"], 0, 2)


def test_the_culprit_is_the_groups_device_at_the_ranks_position_whatever_the_worker_called_it() -> None:
    """On Ray a worker knows its devices as `sim:0+sim:1`; the fleet as `node/sim:0+node/sim:1`."""
    key = "n/sim:0+n/sim:1"
    f = Fleet([key], ["n/sim:2"], quarantine_after=1)
    out = policy.settle(f, Job("m1"), row("crash", died(1, "sim:1"), signal=11), key, 1.0)
    (q,) = out.quarantined
    assert (q.member, q.spare) == ("n/sim:1", "n/sim:0+n/sim:2")


def test_a_group_that_survives_forgets_whom_it_blamed() -> None:
    f = Fleet([A], ["sim:4"], quarantine_after=3)
    policy.settle(f, Job("m1"), row("crash", died(1, "sim:1"), signal=11), A, 1.0, others_waiting=True)
    assert f.blamed == {A: "sim:1"}
    policy.settle(f, Job("m2"), row("pass"), A, 1.0)
    assert f.blamed == {}


def test_a_lost_node_takes_its_groups_with_it_worker_or_not() -> None:
    f = Fleet(["a/sim:0+a/sim:1", "b/sim:0+b/sim:1"], ["a/sim:2", "b/sim:2"])
    f.blamed["b/sim:0+b/sim:1"] = "b/sim:1"
    qs = policy.lose(f, ["b/sim:0", "b/sim:1", "b/sim:2"], "b")  # the node's single devices, as Ray lists them
    assert [q.device for q in qs] == ["b/sim:0+b/sim:1"] and qs[0].spare is None
    assert f.active == ["a/sim:0+a/sim:1"] and f.spares == ["a/sim:2"]  # nothing of b stands by


def test_a_shared_device_group_is_replaced_whole() -> None:
    f = Fleet(["cpu+cpu"], ["other"], quarantine_after=1)
    f.blamed["cpu+cpu"] = "cpu"
    q = policy.quarantine(f, "cpu+cpu", why="test")  # both positions are the device at fault: 2 needed, 1 spare
    assert q.spare is None
