"""Scheduling, retry and quarantine policy, decided on made-up devices and jobs (no processes)."""

from __future__ import annotations

from collections import Counter

import pytest

from harness.results.rows import Measurement
from harness.run import policy
from harness.run.policy import Fleet, Job


def m(outcome: str, **kw) -> Measurement:
    return Measurement(model_id="x", outcome=outcome, **kw)


def fleet(n: int = 3, spare: int = 0, **kw) -> Fleet:
    active, spares = policy.split_devices([f"d{i}" for i in range(n)], spare)
    return Fleet(active, spares, **kw)


def test_split_devices_holds_back_spares_and_refuses_to_hold_back_everything() -> None:
    assert policy.split_devices(["a", "b", "c"], 1) == (["a", "b"], ["c"])
    with pytest.raises(ValueError, match="leaves no active device"):
        policy.split_devices(["a", "b"], 2)
    with pytest.raises(ValueError, match=">= 0"):
        policy.split_devices(["a", "b"], -1)


def test_pick_device_balances_workers_then_prefers_the_first() -> None:
    f = fleet(3)
    assert policy.pick_device(f, Counter()) == "d0"
    assert policy.pick_device(f, Counter({"d0": 1})) == "d1"
    assert policy.pick_device(f, Counter({"d0": 1, "d1": 1, "d2": 1})) == "d0"
    assert policy.pick_device(Fleet([]), Counter()) is None


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
    assert policy.pick_job(f, "d0", [fresh], ["d0", "d1"]) is None
    assert policy.pick_job(f, "d1", [job, fresh], ["d0", "d1"]) is job
    assert policy.pick_job(f, "d0", [job, fresh], ["d0", "d1"]) is None


def test_a_retry_may_return_to_its_device_when_every_worker_failed_it() -> None:
    f = fleet(2)
    job = Job("a", avoid={"d0", "d1"})
    assert policy.pick_job(f, "d0", [job], ["d0", "d1"]) is job


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
    assert policy.pick_job(f, "d0", [job], ["d0", "d1"]) is None  # quarantined devices take nothing
    passed = policy.settle(f, job, m("pass"), "d1", 1.0)
    assert passed.outcome == "pass" and f.strikes["d0"] == 1  # not struck twice for one fault


def test_a_device_fault_never_makes_a_model_flaky_nor_uses_its_retries() -> None:
    f = fleet(3, quarantine_after=5, retries=0)
    job = Job("a")
    assert policy.settle(f, job, m("device_error", device_fault=True), "d0", 1.0).retry
    assert policy.pick_job(f, "d0", [job], ["d0"]) is None  # never back to the device that failed it
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
    assert verdict.outcome == "unsupported_op" and job.last is not None


def test_interrupted_attempts_do_not_use_the_retry_budget() -> None:
    f = fleet(3, retries=1)
    job = Job("a")
    policy.interrupt(job, "d0")
    assert job.avoid == {"d0"} and job.attempts[0].outcome == "interrupted"
    assert policy.settle(f, job, m("crash"), "d1", 1.0).retry
    assert policy.settle(f, job, m("pass"), "d2", 1.0).outcome == "flaky"


def test_no_retry_without_a_healthy_device() -> None:
    f = Fleet([], quarantined=["d0", "d1"])
    assert policy.settle(f, Job("a"), m("crash"), "d0", 1.0).outcome == "crash"


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
