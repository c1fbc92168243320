"""A job's time: where it is (`JobClock`, kept alike by every executor) and how long it may take (`Budgets`).

Loading has its own budget (a real checkpoint may take minutes to read), and so has the compiler each
time it runs (``--compile-timeout``); the rest of the job has ``--timeout`` from the end of loading, the
compiler's time left out. A local pool hears every phase as it starts; a Ray driver reads a job's clock
from its node only when it looks (`Budgets.next_check` says when, so that no deadline passes unseen).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.phases import COMPILE_PHASE as COMPILE


@dataclass
class JobClock:
    """One job's phase and budget state, on one monotonic clock (the worker's, or the actor's node's)."""

    started: float = 0.0  # when the job was handed out
    phase: str = ""  # the phase it is in, as its worker reported it ("" before the first)
    phase_started: float = 0.0  # when its current budget window began (after loading, or a compile)
    spent: float = 0.0  # seconds of the --timeout window used before the compiler last ran

    @classmethod
    def start(cls, now: float) -> JobClock:
        return cls(started=now, phase_started=now)

    def enter(self, name: str, now: float) -> None:
        """The job entered phase `name` at `now`: where its budget window starts."""
        if self.phase == "load" or not self.phase:
            self.phase_started = now  # the compute budget starts when loading ends
        elif name == COMPILE or self.phase == COMPILE:  # the compiler has its own budget, each time it runs
            if self.phase != COMPILE:
                self.spent += now - self.phase_started
            self.phase_started = now
        self.phase = name

    @property
    def loading(self) -> bool:
        return self.phase in ("", "load")

    def line(self) -> str:
        """The clock as one line of text (a Ray actor keeps it in a file on its node); `parse` reads it."""
        return f"{self.phase} {self.started:.6f} {self.phase_started:.6f} {self.spent:.6f}"

    @classmethod
    def parse(cls, text: str) -> JobClock | None:
        parts = text.split()
        if len(parts) != 4:
            return None
        return cls(phase=parts[0], started=float(parts[1]), phase_started=float(parts[2]), spent=float(parts[3]))


@dataclass(frozen=True)
class Budgets:
    """The seconds a job may take: `timeout_s` from the end of loading, loading's own `load_s` and the
    compiler's own `compile_s` each time it runs (None: that phase shares `timeout_s`)."""

    timeout_s: float
    load_s: float | None = None
    compile_s: float | None = None

    @property
    def shortest(self) -> float:
        """The soonest any job can run out of time: before it, nobody needs to look at a job's clock."""
        return max(0.0, min(b for b in (self.timeout_s, self.load_s, self.compile_s) if b is not None))

    def deadline(self, clock: JobClock) -> float:
        """When the job on `clock` runs out of time, as of its current phase."""
        if self.load_s is not None and clock.loading:
            return clock.started + max(self.load_s, 0.0)
        if self.compile_s is not None and clock.phase == COMPILE:
            return clock.phase_started + self.compile_s
        return clock.phase_started + self.timeout_s - clock.spent

    def next_check(self, clock: JobClock, now: float) -> float:
        """For a supervisor that sees the clock only when it looks: when to look next. The deadline as of
        now, or sooner if a phase change could bring it (loading ends: `timeout_s` from then; the compiler
        starts or stops)."""
        compute = self.timeout_s - (0.0 if clock.loading else clock.spent)
        soonest = min(compute, self.compile_s if self.compile_s is not None else math.inf)
        return min(self.deadline(clock), now + max(1.0, soonest))

    def why(self, clock: JobClock, where: str) -> tuple[str, str]:
        """(error type, message) for a job on `where` that ran out of time in its current phase."""
        if clock.loading:
            return "Timeout", f"still loading after {self.load_s or self.timeout_s:.0f}s (--load-timeout) on {where}"
        if clock.phase == COMPILE:
            return "CompileTimeout", (f"still compiling after {self.compile_s or 0:.0f}s (--compile-timeout) "
                                      f"on {where}")
        return "Timeout", (f"no result {self.timeout_s:.0f}s after loading (--timeout, compiling excluded, "
                           f"in phase {clock.phase}) on {where}")
