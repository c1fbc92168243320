"""While a worker times a model (`--perf`), no other worker of the run on this host runs a phase.

Workers share the host: one timing a model while another loads, runs an fp64 oracle or localizes a
drift is timed on a busier machine, and that lasts the whole timing window, so the run's own interval
cannot see it (perf_rates, 2 workers on 2 cores: one model's clean time went from 16.4 ms to 30.1 ms,
its CPU reference's from 11.5 ms to 15.5 ms, which made one false positive and hid one planted
slowdown). So a run's workers take a lock file: each phase holds it shared, the timed phase holds it
alone. A timer first takes an intent lock that stops new phases from starting (flock has no writer
preference: workers whose phases follow one another would starve it), then waits for the phases in
progress to end. Waiting happens before a phase's clock starts, and the kernel drops a dead worker's
locks.
"""

from __future__ import annotations

import fcntl
import os
from typing import IO

TIMED = "perf"  # the phase that runs alone


class QuietLock:
    """One worker's side of the run's lock (`path`; `path`.intent beside it)."""

    def __init__(self, path: str) -> None:
        self._main: IO[bytes] = open(path, "ab")  # noqa: SIM115 - held across phases, closed in `close`
        self._intent: IO[bytes] = open(f"{path}.intent", "ab")  # noqa: SIM115
        self._mode = ""  # "", "shared" or "alone"

    def enter(self, phase: str) -> None:
        """The worker's job enters `phase` (blocks while another worker times, or until the others'
        phases end when this one is the timed phase)."""
        if phase == TIMED:
            if self._mode != "alone":
                self.release()
                fcntl.flock(self._intent, fcntl.LOCK_EX)
                fcntl.flock(self._main, fcntl.LOCK_EX)
                self._mode = "alone"
            return
        if self._mode == "shared":
            try:  # no timer waiting: keep the phase's lock
                fcntl.flock(self._intent, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(self._intent, fcntl.LOCK_UN)
                return
            except BlockingIOError:
                pass
        self.release()  # a timer waits: let it have the host
        fcntl.flock(self._intent, fcntl.LOCK_SH)
        fcntl.flock(self._main, fcntl.LOCK_SH)
        fcntl.flock(self._intent, fcntl.LOCK_UN)
        self._mode = "shared"

    def release(self) -> None:
        """Between jobs: hold nothing."""
        if self._mode:
            fcntl.flock(self._main, fcntl.LOCK_UN)
            fcntl.flock(self._intent, fcntl.LOCK_UN)
            self._mode = ""

    def close(self) -> None:
        self.release()
        self._main.close()
        self._intent.close()


def lock_path(run_dir: str, run_id: str) -> str:
    """The lock file of run `run_id` on this host."""
    return os.path.join(run_dir, f".perf-quiet-{run_id}.lock")
