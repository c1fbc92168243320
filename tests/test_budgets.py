"""A job's time budgets (harness/fleet/pool.py), without processes: loading, the compiler and the rest each
have their own; a supervisor that sees a job's phases only when it looks (the Ray executor reads them
from the actor's node) must still end a job when a supervisor that heard every phase would."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from harness.fleet.pool import deadline, enter_phase, next_check
from harness.results.rows import COMPILE_PHASE as COMPILE

TIMEOUT, LOAD, COMPILE_S = 10.0, 30.0, 20.0
STEP = 0.01


def state_at(t: float, phases: list[tuple[float, str]]) -> SimpleNamespace:
    """The job's budget state at time t, as the worker itself keeps it (every phase heard)."""
    w = SimpleNamespace(started=0.0, phase="", phase_started=0.0, spent=0.0)
    for at, name in phases:
        if at <= t:
            enter_phase(w, name, at)
    return w


def killed_by_listener(phases: list[tuple[float, str]], end: float) -> float | None:
    """When a supervisor that hears every phase (the local pool) ends the job; None if it finishes at `end`."""
    t = 0.0
    while t < end:
        if t >= deadline(state_at(t, phases), TIMEOUT, LOAD, COMPILE_S):
            return t
        t = round(t + STEP, 6)
    return None


def killed_by_looker(phases: list[tuple[float, str]], end: float) -> tuple[float | None, int]:
    """When a supervisor that looks only at `next_check` times ends the job, and how often it looked."""
    check, looks = min(TIMEOUT, LOAD, COMPILE_S), 0
    while check < end:
        looks += 1
        w = state_at(check, phases)
        if check >= deadline(w, TIMEOUT, LOAD, COMPILE_S):
            return check, looks
        check = next_check(w, check, TIMEOUT, LOAD, COMPILE_S)
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
