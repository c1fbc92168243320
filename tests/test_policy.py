"""Scheduling, retry and quarantine policy, decided on made-up devices and jobs (no processes)."""

from __future__ import annotations

from collections import Counter

import pytest

from harness.fleet import policy
from harness.fleet.policy import Fleet, Job
from harness.fleet.slots import split_devices
from harness.results.rows import Measurement


def m(outcome: str, **kw) -> Measurement:
    return Measurement(model_id="x", outcome=outcome, **kw)


def fleet(n: int = 3, spare: int = 0, **kw) -> Fleet:
    active, spares = split_devices([f"d{i}" for i in range(n)], spare)
    return Fleet(active, spares, **kw)


def test_split_devices_holds_back_spares_and_refuses_to_hold_back_everything() -> None:
    assert split_devices(["a", "b", "c"], 1) == (["a", "b"], ["c"])
    with pytest.raises(ValueError, match="leaves no active device"):
        split_devices(["a", "b"], 2)
    with pytest.raises(ValueError, match=">= 0"):
        split_devices(["a", "b"], -1)


def test_pick_device_balances_workers_then_prefers_the_first() -> None:
    f = fleet(3)
    assert policy.pick_device(f, Counter()) == "d0"
    assert policy.pick_device(f, Counter({"d0": 1})) == "d1"
    assert policy.pick_device(f, Counter({"d0": 1, "d1": 1, "d2": 1})) == "d0"
    assert policy.pick_device(Fleet([]), Counter()) is None


def test_pick_device_never_fills_a_device_beyond_its_capacity() -> None:
    """One Ray actor per device: a new worker goes to a device without one, or nowhere."""
    f = fleet(2)
    assert policy.pick_device(f, Counter({"d0": 1}), cap=1) == "d1"
    assert policy.pick_device(f, Counter({"d0": 1, "d1": 1}), cap=1) is None
    assert policy.pick_device(f, Counter({"d0": 1, "d1": 1})) == "d0"  # local workers may share a device
    probe = Job("a", probe="d0")
    assert policy.pick_device(f, Counter({"d0": 1}), [probe], cap=1) == "d1"  # d0 has its worker for the probe


def test_biggest_first_where_sizes_are_known_then_list_order() -> None:
    sizes = {"small": 1e6, "big": 7e9, "mid": 1.1e8}
    assert policy.biggest_first(["u1", "small", "u2", "big", "mid", "u3"], sizes) == [
        "big", "mid", "small", "u1", "u2", "u3"]
    assert policy.biggest_first(["b", "a"], {}) == ["b", "a"]


def test_ready_to_assign_waits_for_the_pool_or_the_grace_period() -> None:
    assert not policy.ready_to_assign(False, 1.0, grace_s=60)
    assert policy.ready_to_assign(True, 0.0, grace_s=60)
    assert policy.ready_to_assign(False, 61.0, grace_s=60)


def test_a_crash_is_retried_elsewhere_and_cordons_its_device() -> None:
    f = fleet(2, retries=1)
    job = Job("a")
    verdict = policy.settle(f, job, m("crash"), "d0", 1.0)
    assert verdict.retry and not verdict.outcome
    assert job.avoid == {"d0"} and f.probation == {"d0": {"a"}}
    fresh = Job("b")
    # d0 is cordoned: it takes only retries; d1 takes the fresh job, and the retry avoids d0
    assert policy.pick_job(f, "d0", [fresh]) is None
    assert policy.pick_job(f, "d1", [job, fresh]) is job
    assert policy.pick_job(f, "d0", [job, fresh]) is None


def test_a_retry_may_return_to_its_device_when_every_active_device_failed_it() -> None:
    f = fleet(2)
    job = Job("a", avoid={"d0", "d1"})
    assert policy.pick_job(f, "d0", [job]) is job
    one = fleet(1)  # one device: "elsewhere" is the same device
    assert policy.pick_job(one, "d0", [Job("b", avoid={"d0"})]).id == "b"


def test_a_retry_waits_for_a_device_it_has_not_failed_on_and_an_idle_worker_moves_there() -> None:
    f = fleet(2)
    job = Job("a", avoid={"d0"})
    assert policy.pick_job(f, "d0", [job]) is None  # one worker, on d0: it should not take it back
    assert policy.idle_move(f, [job], Counter({"d0": 1})) == "d1"
    assert policy.idle_move(f, [job], Counter({"d0": 1, "d1": 1})) is None  # d1's worker will take it
    assert policy.pick_device(f, Counter(), [job]) == "d1"  # a new worker goes where the head job can run
    assert policy.pick_device(f, Counter({"d1": 1}), [job]) == "d0"  # ... but the fewest workers first


def test_failed_then_passed_elsewhere_is_flaky_and_strikes_the_first_device() -> None:
    f = fleet(3, quarantine_after=2)
    job = Job("a")
    assert policy.settle(f, job, m("crash"), "d0", 1.0).retry
    verdict = policy.settle(f, job, m("pass"), "d1", 1.0)
    assert verdict.outcome == "flaky" and not verdict.quarantined
    assert f.strikes == Counter({"d0": 1})
    assert f.flaky_on == {"d0": [job]} and f.probation["d0"] == set()
    assert [a.device for a in job.attempts] == ["d0", "d1"]


def test_second_strike_quarantines_brings_in_a_spare_and_relabels_the_flaky() -> None:
    f = fleet(3, spare=1, quarantine_after=2)
    first = Job("a")
    policy.settle(f, first, m("crash"), "d0", 1.0)
    assert policy.settle(f, first, m("pass"), "d1", 1.0).outcome == "flaky"
    second = Job("b")
    policy.settle(f, second, m("timeout"), "d0", 1.0)
    verdict = policy.settle(f, second, m("pass"), "d1", 1.0)
    # the strike lands before the verdict: the only device it failed on is quarantined, so it passed
    assert verdict.outcome == "pass"
    (q,) = verdict.quarantined
    assert q.device == "d0" and q.spare == "d2" and q.relabel == [first]
    assert f.active == ["d1", "d2"] and f.quarantined == ["d0"] and f.spares == [] and f.spares_used == ["d2"]


def test_device_faults_strike_at_once_and_count() -> None:
    f = fleet(2, quarantine_after=1)
    job = Job("a")
    verdict = policy.settle(f, job, m("device_error", device_fault=True), "d0", 1.0)
    assert f.faults_seen == 1 and [q.device for q in verdict.quarantined] == ["d0"]
    assert verdict.retry  # re-run on a healthy device
    assert policy.pick_job(f, "d0", [job]) is None  # quarantined devices take nothing
    passed = policy.settle(f, job, m("pass"), "d1", 1.0)
    assert passed.outcome == "pass" and f.strikes["d0"] == 1  # not struck twice for one fault


def test_a_device_fault_never_makes_a_model_flaky_nor_uses_its_retries() -> None:
    f = fleet(3, quarantine_after=5, retries=0)
    job = Job("a")
    assert policy.settle(f, job, m("device_error", device_fault=True), "d0", 1.0).retry
    assert policy.pick_job(f, "d0", [job]) is None  # never back to the device that failed it
    assert policy.settle(f, job, m("pass"), "d1", 1.0).outcome == "pass"
    other = Job("b")
    assert policy.settle(f, other, m("device_error", device_fault=True), "d0", 1.0).retry
    assert policy.settle(f, other, m("crash"), "d1", 1.0).outcome == "crash"  # retries=0: its own crash is final


def test_device_error_with_no_healthy_device_left_is_pending() -> None:
    f = fleet(2, quarantine_after=1)
    job = Job("a")
    assert policy.settle(f, job, m("device_error", device_fault=True), "d0", 1.0).retry
    verdict = policy.settle(f, job, m("device_error", device_fault=True), "d1", 1.0)
    assert verdict.outcome == "device_error" and verdict.pending and not verdict.retry
    assert f.active == [] and f.quarantined == ["d0", "d1"]


def test_retries_run_out() -> None:
    f = fleet(3, retries=1)
    job = Job("a")
    assert policy.settle(f, job, m("crash"), "d0", 1.0).retry
    verdict = policy.settle(f, job, m("crash"), "d1", 1.0)
    assert not verdict.retry and verdict.outcome == "crash"
    assert f.probation == {"d0": set()}


def test_only_suspicious_failures_are_retried() -> None:
    f = fleet(2)
    assert policy.settle(f, Job("a"), m("unsupported_op"), "d0", 1.0).outcome == "unsupported_op"
    assert policy.settle(f, Job("b"), m("drift"), "d0", 1.0).outcome == "drift"
    assert policy.settle(f, Job("c"), m("drift", nonfinite=True), "d0", 1.0).retry
    assert policy.settle(f, Job("d"), m("timeout"), "d0", 1.0).retry


def test_a_different_failure_elsewhere_is_recorded_as_is() -> None:
    f = fleet(2)
    job = Job("a")
    policy.settle(f, job, m("crash"), "d0", 1.0)
    verdict = policy.settle(f, job, m("unsupported_op"), "d1", 1.0)
    assert verdict.outcome == "unsupported_op" and not f.strikes  # not a clean run: no evidence against d0


def test_interrupted_attempts_do_not_use_the_retry_budget() -> None:
    f = fleet(3, retries=1)
    job = Job("a")
    policy.interrupt(job, "d0")
    assert job.avoid == {"d0"} and job.attempts[0].outcome == "interrupted"
    assert policy.settle(f, job, m("crash"), "d1", 1.0).retry
    assert policy.settle(f, job, m("pass"), "d2", 1.0).outcome == "flaky"


def test_no_retry_without_a_healthy_device() -> None:
    f = Fleet([], quarantined=["d0", "d1"])
    verdict = policy.settle(f, Job("a"), m("crash"), "d0", 1.0)  # a quarantined device's answer is not the model's
    assert verdict.outcome == "device_error" and verdict.pending
    assert policy.settle(Fleet(["d1"]), Job("b"), m("crash"), "d1", 1.0).retry  # a retry, on the same device


# ----------------------------------------------------------------------------------------------
# --rerun-flaky: which models are sampled again, and what the samples decide
# ----------------------------------------------------------------------------------------------


def test_a_model_whose_attempts_disagreed_is_rerun_and_one_that_agreed_is_not() -> None:
    f = fleet(2, quarantine_after=9)
    flipped = Job("a")
    policy.settle(f, flipped, m("crash"), "d0", 1.0)
    assert policy.settle(f, flipped, m("pass"), "d1", 1.0).outcome == "flaky"
    assert policy.counted(flipped) == ["crash", "pass"] and policy.needs_rerun(flipped, "flaky")
    steady = Job("b")
    policy.settle(f, steady, m("crash"), "d0", 1.0)
    assert policy.settle(f, steady, m("crash"), "d1", 1.0).outcome == "crash"
    assert not policy.needs_rerun(steady, "crash")
    faulted = Job("c")  # a device fault is the device's: it is not a disagreement of the model
    policy.settle(f, faulted, m("device_error", device_fault=True), "d0", 1.0)
    assert policy.settle(f, faulted, m("pass"), "d1", 1.0).outcome == "pass"
    assert policy.counted(faulted) == ["pass"] and not policy.needs_rerun(faulted, "pass")
    pending = Job("d")
    policy.interrupt(pending, "d0")
    pending.attempts += flipped.attempts
    assert not policy.needs_rerun(pending, "device_error")  # not a result yet: re-run on resume instead


@pytest.mark.parametrize(
    ("first", "reruns", "verdict"),
    [
        ("pass", ["pass", "pass", "pass"], "pass"),  # stable: the earlier failure was a one-off
        ("drift", ["drift", "drift"], "drift"),
        ("pass", ["pass", "drift", "pass"], "flaky"),  # it really flips
        ("pass", ["crash", "crash", "crash"], "flaky"),  # it passed once, it fails now: flaky
        ("crash", ["pass"], "flaky"),
        ("crash", ["timeout", "crash", "timeout", "timeout"], "timeout"),  # flips among failures: most common
        ("crash", ["timeout"], "crash"),  # a tie goes to the worse outcome, never to flaky (flaky counts as matched)
        ("pass", [], "pass"),  # no sample came back (no healthy device left)
    ],
)
def test_rerun_verdict(first: str, reruns: list[str], verdict: str) -> None:
    assert policy.rerun_verdict(first, reruns) == verdict


# ----------------------------------------------------------------------------------------------
# The attribution rule (policy.py's docstring), as a table: what each attempt's evidence does
# ----------------------------------------------------------------------------------------------

EVIDENCE = {  # shorthand -> (measurement, phase where the worker died, "" for a result it sent)
    "pass": (m("pass"), ""),
    "drift": (m("drift"), ""),
    "unsupported": (m("unsupported_op"), ""),
    "raised": (m("crash", error_type="RuntimeError"), ""),  # an exception: the worker lived
    "ref_fail": (m("ref_fail"), ""),
    "fault": (m("device_error", device_fault=True), ""),
    "unreachable": (m("device_error", device_fault=True, device_unreachable=True), ""),  # connection refused
    "segv": (m("crash", error_type="WorkerDied", signal=11), "target"),
    "hang": (m("timeout", error_type="Timeout", signal=9), "target"),
    "segv-in-reference": (m("crash", error_type="WorkerDied", signal=11), "reference"),
    # "lost": the model was running on the device when its node left the cluster (no measurement)
}


def verdict_text(v: policy.Settled) -> str:
    parts = ["defer" if v.defer else "retry"] if v.retry else [f"={v.outcome}"] if v.outcome else []
    parts += ["pending"] if v.pending else []
    parts += ["probe"] if v.probes else []
    parts += [f"q:{q.device}" + (f"+{q.spare}" if q.spare else "") for q in v.quarantined]
    parts += [f"reopen:{j.id}" for q in v.quarantined for j in q.reopen]
    return " ".join(parts)


# (name, devices, spares, quarantine_after, retries, steps: (model, device, evidence, expected verdict),
#  then (quarantined devices, final outcome per model))
TABLE = [
    ("one device, a model segfaults deterministically: its crash, no quarantine", 1, 0, 2, 1,
     [("a", "d0", "pass", "=pass"), ("x", "d0", "segv", "retry"), ("x", "d0", "segv", "=crash"),
      ("b", "d0", "pass", "=pass")],
     ([], {"a": "pass", "x": "crash", "b": "pass"})),
    ("one device, two crashers in a row: the canary re-runs, survives, the streak is revoked", 1, 0, 2, 1,
     [("a", "d0", "pass", "=pass"), ("x", "d0", "segv", "retry"), ("x", "d0", "segv", "=crash"),
      ("y", "d0", "segv", "retry probe"), ("probe", "d0", "pass", ""), ("y", "d0", "segv", "=crash"),
      ("b", "d0", "pass", "=pass")],
     ([], {"a": "pass", "x": "crash", "y": "crash", "b": "pass"})),
    ("one device, a crash then unsupported_op on the retry (issue 25.1): the same device is not elsewhere", 1, 0, 2, 1,
     [("a", "d0", "raised", "retry"), ("a", "d0", "unsupported", "=unsupported_op"),
      ("b", "d0", "raised", "retry"), ("b", "d0", "unsupported", "=unsupported_op"), ("c", "d0", "pass", "=pass")],
     ([], {"a": "unsupported_op", "b": "unsupported_op", "c": "pass"})),
    ("one device that kills every model from the start: quarantined, its victims pending", 1, 0, 2, 1,
     [("a", "d0", "segv", "retry"), ("a", "d0", "segv", "defer"), ("b", "d0", "segv", "=device_error pending q:d0")],
     (["d0"], {"b": "device_error"})),
    ("one device that stops working mid-run: the canary dies too; its earlier victim is re-opened", 1, 0, 2, 1,
     [("c", "d0", "pass", "=pass"), ("a", "d0", "segv", "retry"), ("a", "d0", "segv", "=crash"),
      ("b", "d0", "segv", "retry probe"), ("probe", "d0", "segv", "q:d0 reopen:a")],
     (["d0"], {"c": "pass", "a": "device_error"})),
    ("3 devices, --spare 1, d0 and d1 segfault every model (issue 25.8): both out, results from the spare", 2, 1, 2, 1,
     [("a", "d0", "segv", "retry"), ("b", "d1", "segv", "retry"), ("b", "d0", "segv", "retry q:d0+d2"),
      ("a", "d1", "segv", "retry q:d1"), ("a", "d2", "pass", "=pass"), ("b", "d2", "pass", "=pass"),
      ("c", "d2", "pass", "=pass")],
     (["d0", "d1"], {"a": "pass", "b": "pass", "c": "pass"})),
    ("the same with hangs: no timeout blamed on a model", 2, 1, 2, 1,
     [("a", "d0", "hang", "retry"), ("b", "d1", "hang", "retry"), ("b", "d0", "hang", "retry q:d0+d2"),
      ("a", "d1", "hang", "retry q:d1"), ("a", "d2", "pass", "=pass"), ("b", "d2", "pass", "=pass")],
     (["d0", "d1"], {"a": "pass", "b": "pass"})),
    ("one sick device among healthy ones: struck when its victim passes elsewhere, then quarantined", 2, 0, 2, 1,
     [("a", "d0", "segv", "retry"), ("b", "d1", "pass", "=pass"), ("a", "d1", "pass", "=flaky"),
      ("c", "d0", "segv", "retry q:d0"), ("c", "d1", "pass", "=pass")],
     (["d0"], {"a": "flaky", "b": "pass", "c": "pass"})),  # (a's row is relabelled pass by the runner)
    ("a model that segfaults on a trusted device too fails by itself: the first device's strike is revoked", 2, 0, 2, 1,
     [("b", "d1", "pass", "=pass"), ("c", "d0", "pass", "=pass"), ("x", "d0", "segv", "retry"),
      ("x", "d1", "segv", "=crash"), ("d", "d1", "pass", "=pass"), ("y", "d0", "segv", "retry"),
      ("y", "d1", "segv", "=crash"), ("e", "d0", "pass", "=pass")],
     ([], {"b": "pass", "c": "pass", "d": "pass", "e": "pass", "x": "crash", "y": "crash"})),
    ("reference-side outcomes and CPU-phase deaths say nothing about the device", 1, 0, 1, 1,
     [("a", "d0", "ref_fail", "=ref_fail"), ("b", "d0", "segv-in-reference", "retry"),
      ("b", "d0", "segv-in-reference", "=crash"), ("c", "d0", "drift", "=drift")],
     ([], {"a": "ref_fail", "b": "crash", "c": "drift"})),
    ("a raised crash then unsupported_op on another device: not a clean run, no strike", 2, 0, 1, 1,
     [("a", "d0", "raised", "retry"), ("a", "d1", "unsupported", "=unsupported_op")],
     ([], {"a": "unsupported_op"})),
    ("a node leaves mid-run (Ray): no strike, its device out, the spare in, the model runs elsewhere outside "
     "--retries", 2, 1, 2, 0,
     [("a", "d0", "pass", "=pass"), ("x", "d1", "lost", "q:d1+d2"), ("x", "d0", "pass", "=pass"),
      ("y", "d2", "pass", "=pass")],
     (["d1"], {"a": "pass", "x": "pass", "y": "pass"})),
    ("a node that killed a model before it left: that death is re-opened, not the model's", 2, 0, 2, 0,
     [("b", "d1", "pass", "=pass"), ("x", "d1", "segv", "=crash"), ("c", "d1", "lost", "q:d1 reopen:x"),
      ("x", "d0", "pass", "=pass"), ("c", "d0", "pass", "=pass")],
     (["d1"], {"b": "pass", "x": "pass", "c": "pass"})),
    ("device faults strike at once; the model waits, pending, when no device is left", 1, 0, 2, 1,
     [("a", "d0", "fault", "=device_error pending"), ("b", "d0", "fault", "=device_error pending q:d0")],
     (["d0"], {"a": "device_error", "b": "device_error"})),
    ("a device server gone (issue 32.1): refused after the client's reconnect window, quarantined at once, so "
     "no other model waits that window out", 1, 0, 2, 1,
     [("a", "d0", "unreachable", "=device_error pending q:d0")],
     (["d0"], {"a": "device_error"})),
    ("... dying mid-run: the model it ran is reset (a strike), the next one is refused (quarantine); with a "
     "spare the rest runs there", 1, 1, 2, 1,
     [("a", "d0", "pass", "=pass"), ("b", "d0", "fault", "=device_error pending"),
      ("c", "d0", "unreachable", "retry q:d0+d1"), ("c", "d1", "pass", "=pass")],
     (["d0"], {"a": "pass", "b": "device_error", "c": "pass"})),
]


@pytest.mark.parametrize("case", TABLE, ids=[c[0] for c in TABLE])
def test_attribution_table(case) -> None:
    _name, n, spare, after, retries, steps, (quarantined, outcomes) = case
    f = fleet(n + spare, spare=spare, quarantine_after=after, retries=retries)
    jobs: dict[str, Job] = {}
    probes: dict[str, Job] = {}
    final: dict[str, str] = {}
    for model, device, what, expected in steps:
        job = probes.pop(device) if model == "probe" else jobs.setdefault(model, Job(model))
        assert model == "probe" or policy.pick_job(f, device, [job]) is job, (model, device, "not runnable there")
        if what == "lost":  # the runner: interrupt what ran there, take the node's devices out
            policy.interrupt(job, device, policy.NODE_LOST)
            v = policy.Settled(quarantined=policy.lose(f, [device], "node"))
        else:
            measured, phase = EVIDENCE[what]
            v = policy.settle(f, job, measured, device, 1.0, phase, others_waiting=True)
        assert verdict_text(v) == expected, (model, device, what)
        probes.update((p.probe, p) for p in v.probes)
        if v.outcome:
            final[model] = v.outcome
        for q in v.quarantined:
            for reopened in q.reopen:
                again = policy.reopen(f, reopened)
                final[reopened.id] = again.outcome if again.pending else final.pop(reopened.id)
    assert f.quarantined == quarantined
    assert final == outcomes
    assert quarantined or not f.strikes  # no lasting evidence against a device that kept its place
    assert not policy.never_worked(f) or not any(o in ("pass", "crash") for o in final.values())


def test_a_deferred_death_is_recorded_at_once_when_nothing_else_could_vouch_for_its_device() -> None:
    f = fleet(1, retries=0)
    v = policy.settle(f, Job("x"), EVIDENCE["segv"][0], "d0", 1.0, EVIDENCE["segv"][1])
    assert v.outcome == "crash"  # `check` on one model that segfaults: its crash, at once


def test_a_lost_node_takes_its_spares_along_and_leaves_no_strike() -> None:
    f = Fleet(*split_devices(["a/d0", "b/d0", "b/d1"], 1), retries=0)
    policy.settle(f, Job("x"), EVIDENCE["segv"][0], "b/d0", 1.0, "target", others_waiting=True)
    assert f.count("b/d0") == 1  # a provisional strike: x joined b/d0's streak
    [q] = policy.lose(f, ["b/d0", "b/d1"], "b")
    assert (q.device, q.spare, q.why) == ("b/d0", None, "its node b left the cluster")
    assert f.active == ["a/d0"] and f.spares == [] and not f.strikes and "b/d0" not in f.deaths
    assert policy.lose(f, ["b/d0", "b/d1"], "b") == []  # told twice (each of its actors reports it): once


def test_never_worked() -> None:
    f = fleet(1, quarantine_after=1)
    policy.settle(f, Job("a"), m("device_error", device_fault=True), "d0", 1.0)
    assert policy.never_worked(f)
    g = fleet(1)
    policy.settle(g, Job("a"), m("unsupported_op"), "d0", 1.0)
    policy.settle(g, Job("b"), m("device_error", device_fault=True), "d0", 1.0)
    assert not policy.never_worked(g)  # it ran a model (the missing op is the model's result)
