"""Every phase that can take long says what it is doing: sim's first build, a model
stuck in one phase (a cold compile, a big checkpoint's load, the fp64 oracle), workers slow to start.
Pure or monkeypatched: nothing here builds or runs anything for long."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.fleet.budgets import JobClock
from harness.fleet.notices import PhaseNotices


def _worker(job: str | None, phase: str = "", ready: bool = True) -> SimpleNamespace:
    return SimpleNamespace(job=SimpleNamespace(id=job) if job else None, clock=JobClock(phase=phase), ready=ready,
                           busy=job is not None)


def test_a_long_phase_says_what_it_is_doing_then_again_now_and_then() -> None:
    lines: list[str] = []
    notices = PhaseNotices(lines.append, after_s=5, every_s=30, settings={"compile": "inductor"})
    w = _worker("tiny/bert/base", "compile")
    for t in (0, 4, 6, 20, 37):
        notices.poll([w], now=1000.0 + t)
    assert lines == ["portharness: tiny/bert/base: compiling the target's step (inductor; a cold Inductor cache "
                     "takes minutes, later runs reuse it), 6 s so far",
                     "portharness: tiny/bert/base: compiling the target's step (inductor; a cold Inductor cache "
                     "takes minutes, later runs reuse it), 37 s so far"]
    w.clock.phase = "oracle"  # a new phase starts its own clock
    notices.poll([w], now=1040.0)
    notices.poll([w], now=1046.0)
    assert lines[-1] == ("portharness: tiny/bert/base: computing the fp64 oracle (a float64 copy of the model: the "
                         "slowest reference phase), 6 s so far")
    quick = _worker("tiny/gpt2/causal-lm", "target")
    notices.poll([quick], now=1050.0)
    quick.clock.phase = "compare"
    notices.poll([quick], now=1053.0)
    assert len(lines) == 3  # phases shorter than after_s say nothing


def test_workers_slow_to_start_say_so_once() -> None:
    lines: list[str] = []
    notices = PhaseNotices(lines.append, after_s=5, every_s=30)
    ws = [_worker(None, ready=False), _worker(None, ready=False)]
    notices.poll(ws, now=notices._start + 1)
    notices.poll(ws, now=notices._start + 6)
    notices.poll(ws, now=notices._start + 9)
    assert lines == ["portharness: starting 2 worker(s): each imports torch and transformers and loads the "
                     "target's backend"]


def test_sims_first_build_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    import harness.sim.native as native

    def stop(name: str, out: Path) -> None:
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(native, "library_path", lambda: tmp_path / "key" / "portharness_sim_key.so")
    monkeypatch.setattr(native, "_compile", stop)
    with pytest.raises(RuntimeError, match="no compiler today"):
        native.load()
    captured = capsys.readouterr()
    assert captured.out == ""  # stdout may be a command's JSON
    assert "portharness: building sim's C++ library (first run only" in captured.err
