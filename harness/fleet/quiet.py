"""While a worker times a model (`--perf`), no other worker of the run on this host runs a phase.

Workers share the host: one timing a model while another loads, runs an fp64 oracle or localizes a
drift is timed on a busier machine, and that lasts the whole timing window, so the run's own interval
cannot see it (perf_rates, 2 workers on 2 cores: one model's clean time went from 16.4 ms to 30.1 ms,
its CPU reference's from 11.5 ms to 15.5 ms, which made one false positive and hid one planted
slowdown). So a run's workers take a lock file: each phase holds it shared, the timed phase holds it
alone. A timer first takes an intent lock that stops new phases from starting (flock has no writer
preference: workers whose phases follow one another would starve it), then waits for the phases in
progress to end. Waiting happens before a phase's clock starts, and the kernel drops a dead worker's
locks. A wait is bounded (`wait_s`, well inside the run's --timeout): a timer that hangs must not make
its neighbours' models time out, so a worker that waited that long goes on without the lock for the
rest of its job (a timer that did so records ``perf.ran_alone = False``).
"""

from __future__ import annotations

import fcntl
import os
import time
from typing import IO

TIMED = "perf"  # the phase that runs alone


class QuietLock:
    """One worker's side of the run's lock (`path`; `path`.intent beside it)."""

    POLL_S = 0.005

    def __init__(self, path: str, wait_s: float) -> None:
        self._main: IO[bytes] = open(path, "ab")  # noqa: SIM115 - held across phases, closed in `close`
        self._intent: IO[bytes] = open(f"{path}.intent", "ab")  # noqa: SIM115
        self._wait_s = wait_s
        self._held = ""  # how the lock is held: "", "shared", "alone", or "off" (waited too long: no lock until the job ends)
        self.timed_alone = True  # this job's timed phase ran alone (or there was none)
        self.waited_s = 0.0  # how long this job's timed phase waited for the host so far
        self.job_wait_s = 0.0  # ... and the last finished job's (the price of running alone)

    def _take(self, f: IO[bytes], how: int, until: float) -> bool:
        while True:
            try:
                fcntl.flock(f, how | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= until:
                    return False
                time.sleep(self.POLL_S)

    def enter(self, phase: str) -> None:
        """The worker's job enters `phase` (waits while another worker times, or, for the timed phase,
        until the others' phases end)."""
        if self._held == "off":
            return
        until = time.monotonic() + self._wait_s
        if phase == TIMED:
            if self._held != "alone":
                self.release()
                t0 = time.monotonic()
                if self._take(self._intent, fcntl.LOCK_EX, until) and self._take(self._main, fcntl.LOCK_EX, until):
                    self._held = "alone"
                else:
                    self._off()
                    self.timed_alone = False
                self.waited_s += time.monotonic() - t0
            return
        if self._held == "shared":
            if self._take(self._intent, fcntl.LOCK_SH, 0.0):  # no timer waiting: keep the phase's lock
                fcntl.flock(self._intent, fcntl.LOCK_UN)
                return
        self.release()  # a timer waits: let it have the host
        if self._take(self._intent, fcntl.LOCK_SH, until) and self._take(self._main, fcntl.LOCK_SH, until):
            fcntl.flock(self._intent, fcntl.LOCK_UN)
            self._held = "shared"
        else:
            self._off()

    def _unlock(self) -> None:
        fcntl.flock(self._main, fcntl.LOCK_UN)  # unlocking what is not held is a no-op
        fcntl.flock(self._intent, fcntl.LOCK_UN)

    def _off(self) -> None:
        self._unlock()
        self._held = "off"

    def release(self) -> None:
        """Hold nothing (between jobs, or before taking the lock another way)."""
        self._unlock()
        self._held = ""

    def end_job(self) -> bool:
        """The job is over: hold nothing; whether its timed phase ran alone (and in `job_wait_s` how long it
        waited for the host)."""
        alone = self.timed_alone
        self.job_wait_s, self.waited_s = self.waited_s, 0.0
        self.release()
        self.timed_alone = True
        return alone

    def close(self) -> None:
        self.release()
        self._main.close()
        self._intent.close()


def lock_path(run_dir: str, run_id: str) -> str:
    """The lock file of run `run_id` on this host."""
    return os.path.join(run_dir, f".perf-quiet-{run_id}.lock")
