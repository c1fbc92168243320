"""A job's time budgets (harness/fleet/budgets.py), without processes: loading, the compiler and the rest each
have their own; a supervisor that sees a job's phases only when it looks (the Ray executor reads them
from the actor's node) must still end a job when a supervisor that heard every phase would."""

from __future__ import annotations

import pytest

from harness.fleet.budgets import Budgets, JobClock
from harness.phases import COMPILE_PHASE as COMPILE

TIMEOUT, LOAD, COMPILE_S = 10.0, 30.0, 20.0
BUDGETS = Budgets(TIMEOUT, LOAD, COMPILE_S)
STEP = 0.01


def state_at(t: float, phases: list[tuple[float, str]]) -> JobClock:
    """The job's budget state at time t, as the worker itself keeps it (every phase heard)."""
    clock = JobClock.start(0.0)
    for at, name in phases:
        if at <= t:
            clock.enter(name, at)
    return clock


def killed_by_listener(phases: list[tuple[float, str]], end: float) -> float | None:
    """When a supervisor that hears every phase (the local pool) ends the job; None if it finishes at `end`."""
    t = 0.0
    while t < end:
        if t >= BUDGETS.deadline(state_at(t, phases)):
            return t
        t = round(t + STEP, 6)
    return None


def killed_by_looker(phases: list[tuple[float, str]], end: float) -> tuple[float | None, int]:
    """When a supervisor that looks only at `next_check` times ends the job, and how often it looked."""
    check, looks = BUDGETS.shortest, 0
    while check < end:
        looks += 1
        w = state_at(check, phases)
        if check >= BUDGETS.deadline(w):
            return check, looks
        check = BUDGETS.next_check(w, check)
    return None, looks


SCENARIOS = {
    # name: (phases [(time, phase)], when the job would finish by itself, when it must be ended)
    "hangs right after loading": ([(0, "load"), (2, "target")], 1e9, 12.0),
    "loads slowly, then hangs": ([(0, "load"), (25, "reference"), (26, "target")], 1e9, 35.0),
    "never finishes loading": ([(0, "load")], 1e9, 30.0),
    "compiles in the middle, then hangs": ([(0, "load"), (1, "target"), (4, COMPILE), (19, "target")], 1e9, 26.0),
    "the compiler hangs": ([(0, "load"), (1, "reference"), (2, COMPILE)], 1e9, 22.0),
    "compiles late, little budget left after": ([(0, "load"), (1, "target"), (9.5, COMPILE), (12, "target")], 1e9, 13.5),
    "compiles twice": ([(0, "load"), (1, COMPILE), (15, "target"), (18, COMPILE), (35, "target")], 1e9, 42.0),
    "finishes in time": ([(0, "load"), (5, "target"), (12, COMPILE), (30, "compare")], 31.0, None),
    "loading uses most of its budget, then finishes": ([(0, "load"), (29, "target")], 38.0, None),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_supervisor_that_only_looks_now_and_then_ends_a_job_on_time(name: str) -> None:
    phases, end, expected = SCENARIOS[name]
    heard = killed_by_listener(phases, end)
    assert heard == pytest.approx(expected, abs=2 * STEP) if expected is not None else heard is None
    looked, looks = killed_by_looker(phases, end)
    if expected is None:
        assert looked is None
    else:
        assert looked == pytest.approx(heard, abs=2 * STEP)  # never late, never early
    assert looks <= 12  # a job that runs within its shortest budget costs no look at all; a hang, a few


def test_a_job_shorter_than_every_budget_is_never_looked_at() -> None:
    assert killed_by_looker([(0, "load"), (0.05, "reference"), (0.08, "target")], end=0.1) == (None, 0)


def test_a_clock_survives_its_line_on_a_node() -> None:
    """A Ray actor keeps its job's clock as a line in a file on its node; the driver reads it back."""
    clock = JobClock.start(5.0)
    for at, name in [(5.0, "load"), (7.5, "target"), (9.0, COMPILE), (12.25, "target")]:
        clock.enter(name, at)
    assert JobClock.parse(clock.line()) == clock
    assert JobClock.parse(" " * 128) is None  # no job in flight


@pytest.mark.parametrize(("phases", "error_type", "words"), [
    ([(0, "load")], "Timeout", "still loading after 30s (--load-timeout) on sim:0"),
    ([(0, "load"), (1, COMPILE)], "CompileTimeout", "still compiling after 20s (--compile-timeout) on sim:0"),
    ([(0, "load"), (1, "target")], "Timeout", "no result 10s after loading (--timeout, compiling excluded, in phase "
                                             "target) on sim:0"),
])
def test_a_timeout_names_the_budget_of_the_phase_it_ran_out_in(phases, error_type, words) -> None:
    assert BUDGETS.why(state_at(100, phases), "sim:0") == (error_type, words)
