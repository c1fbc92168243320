"""The runner against a typed fake pool (issue 46): the executor Protocols (`PoolWorker`, `WorkerPool`,
`Executor`) implemented by scripted workers, no processes, no models, as pytest-xdist tests its schedulers.
What each model does on each device is a line of a script; the runner's policy, its records and what the
store keeps are what is under test."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from harness.fleet import executor as ex
from harness.fleet.budgets import JobClock
from harness.fleet.executor import PoolSpec, PoolWorker, WorkerPool
from harness.fleet.policy import Job
from harness.fleet.pool import Event
from harness.fleet.runner import RunConfig, run_models
from harness.models.model_list import ModelEntry
from harness.results.rows import Measurement
from harness.results.store import ResultStore

# What a model does on a device: a result's outcome, or ("died", phase[, signal]), or ("hang", phase)
Act = str | tuple[str, ...]


@dataclass(eq=False)
class FakeWorker:
    key: str
    script: Callable[[str, str], Act]
    noun: str = "worker"
    host: str = "fakehost"
    ready: bool = False
    job: Job | None = None
    clock: JobClock = field(default_factory=JobClock)
    found: dict[str, Any] | None = None
    killed_for: str | None = None
    cause: str = ""
    sig: int | None = None

    @property
    def device(self) -> str:
        return self.key

    @property
    def busy(self) -> bool:
        return self.job is not None

    def send(self, job: Job, payload: dict[str, Any]) -> None:
        self.job, self.clock, self.found = job, JobClock.start(time.monotonic()), None

    def kill(self, reason: str) -> None:
        self.killed_for, self.sig = reason, signal.SIGKILL

    def stop(self) -> None:
        self.kill(self.killed_for or "stop")

    def death(self) -> tuple[int | None, int | None]:
        return None, self.sig


class FakePool:
    per_device: int | None = None

    def __init__(self, script: Callable[[str, str], Act]) -> None:
        self.script = script
        self.workers: list[PoolWorker] = []
        self.started = 0

    def spawn(self, key: str) -> PoolWorker:
        w = FakeWorker(key, self.script)
        self.workers.append(w)
        self.started += 1
        return w

    def retire(self, w: PoolWorker) -> None:
        if w in self.workers:
            self.workers.remove(w)

    def poll(self, max_wait: float = 1.0) -> list[Event]:
        events = []
        for w in list(self.workers):
            assert isinstance(w, FakeWorker)
            if not w.ready:
                w.ready = True
                events.append(Event("ready", w))  # type: ignore[arg-type]
                continue
            if w.job is None or w.killed_for is not None or w.sig is not None:
                continue
            act = self.script(w.job.id, w.key)
            if isinstance(act, str):
                events.append(Event("result", w, Measurement(model_id=w.job.id, outcome=act, device=w.key)))  # type: ignore[arg-type]
                continue
            what, phase, *rest = act
            w.clock.enter("load", 0.0)
            w.clock.enter(phase, 0.0)
            if phase in ("confirm", "perf"):  # the first run's verdict was heard before the follow-up began
                w.found = {"outcome": "pass_declared", "contract": "bf16-matmul", "rmse_ratio": 2.0}
            if what == "hang":
                w.kill("timeout")
                events.append(Event("timeout", w))  # type: ignore[arg-type]
            else:
                w.sig = int(rest[0]) if rest else signal.SIGSEGV
                events.append(Event("died", w))  # type: ignore[arg-type]
        return events

    def node_devices(self, w: PoolWorker) -> list[str]:
        return [w.key]

    def close(self) -> None:
        self.workers.clear()


class FakeExecutor:
    name = "fake"
    one_host = True
    address_option = False
    all_devices_by_default = False
    per_device = None

    def __init__(self, devices: list[str], script: Callable[[str, str], Act]) -> None:
        self._devices, self._script = devices, script

    def check(self) -> None:
        pass

    def devices(self, target: str, address: str | None) -> list[str]:
        return list(self._devices)

    def pool(self, spec: PoolSpec, usable: Callable[[str], bool]) -> WorkerPool:
        return FakePool(self._script)

    def release(self) -> None:
        pass


@pytest.fixture(name="fake")
def _fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., FakeExecutor]]:
    def install(devices: list[str], script: Callable[[str, str], Act]) -> FakeExecutor:
        made = FakeExecutor(devices, script)
        monkeypatch.setitem(ex.EXECUTORS, "fake", lambda: made)  # type: ignore[dict-item]
        return made

    yield install


SUMMARY: dict[str, Any] = {}


def _run(tmp_path: Path, ids: list[str], **config: Any) -> dict[str, dict[str, Any]]:
    entries = [ModelEntry(id=i, source="tiny", arch="bert", task="base", modality="text") for i in ids]
    cfg = RunConfig(target="cpu", settings={}, jobs=config.pop("jobs", 2), executor="fake", progress=False, **config)
    summary = run_models(entries, cfg, tmp_path / "r.db", list_name="fake.csv")
    SUMMARY.update(quarantined=summary.quarantined, spares_used=summary.spares_used, unfinished=summary.unfinished)
    with ResultStore(tmp_path / "r.db", read_only=True) as st:
        return {r["model_id"]: r for r in st.results().to_dict("records")}


def test_results_come_back_as_rows(tmp_path: Path, fake: Callable[..., FakeExecutor]) -> None:
    fake(["cpu:0", "cpu:1"], lambda m, d: {"a": "pass", "b": "drift", "c": "unsupported_op"}[m])
    rows = _run(tmp_path, ["a", "b", "c"])
    assert {m: r["outcome"] for m, r in rows.items()} == {"a": "pass", "b": "drift", "c": "unsupported_op"}


def test_a_death_in_confirm_strikes_the_device_and_keeps_the_declared_verdict(
        tmp_path: Path, fake: Callable[..., FakeExecutor]) -> None:
    """A model that dies at full precision on cpu:0 and passes on cpu:1: the death was the device's (flaky, cpu:0
    struck); one that dies in confirm everywhere keeps its declared-precision pass beside the crash."""
    fake(["cpu:0", "cpu:1"], lambda m, d: ("died", "confirm") if (m == "everywhere" or d == "cpu:0") else "pass")
    rows = _run(tmp_path, ["everywhere", "once", "other"], retries=1)
    assert rows["everywhere"]["outcome"] == "crash" and rows["everywhere"]["earlier_outcome"] == "pass_declared"
    assert rows["everywhere"]["attempts"][-1]["phase"] == "confirm"
    assert "before it, the step was pass_declared" in rows["everywhere"]["error_message"]
    died_once = [r for r in rows.values() if r["model_id"] != "everywhere" and len(r["attempts"]) > 1]
    assert died_once and all(r["outcome"] == "flaky" for r in died_once)


@pytest.mark.parametrize("phase,outcome", [("oracle", "ref_timeout"), ("perf", "timeout"), ("target", "timeout")])
def test_a_hang_is_the_reference_sides_or_the_devices_by_its_phase(
        tmp_path: Path, fake: Callable[..., FakeExecutor], phase: str, outcome: str) -> None:
    fake(["cpu:0"], lambda m, d: ("hang", phase) if m == "slow" else "pass")
    rows = _run(tmp_path, ["slow", "fine"], retries=0, jobs=1)
    assert rows["slow"]["outcome"] == outcome and rows["fine"]["outcome"] == "pass"
    assert rows["slow"]["attempts"][-1]["phase"] == phase


def test_a_device_that_kills_everything_is_quarantined_and_a_spare_takes_over(
        tmp_path: Path, fake: Callable[..., FakeExecutor]) -> None:
    fake(["cpu:0", "cpu:1", "cpu:2"], lambda m, d: ("died", "target") if d == "cpu:0" else "pass")
    rows = _run(tmp_path, [f"m{i}" for i in range(6)], spare=1, quarantine_after=2, retries=1)
    assert {r["outcome"] for r in rows.values()} <= {"pass", "flaky"} and len(rows) == 6
    assert SUMMARY["quarantined"] == ["cpu:0"] and SUMMARY["spares_used"] == ["cpu:2"] and not SUMMARY["unfinished"]

