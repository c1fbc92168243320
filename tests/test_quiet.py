"""The run's quiet lock (harness/fleet/quiet.py): a timed phase runs while no other worker runs a phase, and
workers whose phases follow one another cannot starve it. Each QuietLock opens the file anew, so two in
one process conflict as two processes' would (flock locks belong to the open file)."""

from __future__ import annotations

import threading
import time

from harness.fleet.quiet import QuietLock


def test_a_timed_phase_waits_for_the_phase_in_progress_and_holds_back_the_next(tmp_path) -> None:
    path = str(tmp_path / "run.lock")
    a, b, c = QuietLock(path, 30), QuietLock(path, 30), QuietLock(path, 30)
    log: list[tuple[str, float]] = []
    a.enter("load")

    def timer() -> None:
        b.enter("perf")
        log.append(("timing", time.monotonic()))
        time.sleep(0.3)
        log.append(("timed", time.monotonic()))
        b.enter("compare")  # back among the others
        b.release()

    def other() -> None:
        c.enter("reference")
        log.append(("other phase", time.monotonic()))
        c.release()

    t = threading.Thread(target=timer)
    t.start()
    time.sleep(0.3)
    assert log == []  # a's load is still in progress
    u = threading.Thread(target=other)
    u.start()
    time.sleep(0.3)
    assert log == []  # a timer waits: no new phase starts
    a.enter("target")  # a's next phase: the timer goes first
    log.append(("a next phase", time.monotonic()))
    t.join(5)
    u.join(5)
    names = [n for n, _ in log]
    assert names.index("timed") < names.index("a next phase") and names.index("timed") < names.index("other phase")
    a.release()
    for lock in (a, b, c):
        lock.close()


def test_phases_run_side_by_side_when_nobody_times(tmp_path) -> None:
    path = str(tmp_path / "run.lock")
    a, b = QuietLock(path, 30), QuietLock(path, 30)
    t0 = time.monotonic()
    for phase in ("load", "reference", "target", "compare"):
        a.enter(phase)
        b.enter(phase)
    assert time.monotonic() - t0 < 1.0
    a.close()
    b.close()


def test_a_timer_that_hangs_delays_its_neighbours_only_up_to_the_bound(tmp_path) -> None:
    """A hung timed step must not make the other workers' models time out: they wait `wait_s` once, then
    go on without the lock for the rest of their job; a timer that cannot get the host says so."""
    path = str(tmp_path / "run.lock")
    hung, other, timer = QuietLock(path, 0.3), QuietLock(path, 0.3), QuietLock(path, 0.3)
    hung.enter("perf")  # and never leaves it
    t0 = time.monotonic()
    other.enter("load")
    waited = time.monotonic() - t0
    assert 0.25 <= waited < 2.0, waited
    t0 = time.monotonic()
    for phase in ("reference", "target", "compare"):
        other.enter(phase)
    assert time.monotonic() - t0 < 0.1  # no second wait in the same job
    assert other.end_job() is True  # it timed nothing
    timer.enter("perf")  # the host is held: it times beside the hung one
    assert timer.end_job() is False and timer.job_wait_s >= 0.25  # it waited the bound for the host
    assert timer.end_job() is True and timer.job_wait_s == 0.0  # said once, for that job
    for lock in (hung, other, timer):
        lock.close()
