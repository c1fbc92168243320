"""Run a model list on a target: isolated workers, timeouts, retries, device quarantine, resume.

At cluster scale a single sick accelerator or one pathological model must not sink a nightly run, so
the supervisor here treats workers as disposable:

- every model runs in a long-lived worker process pinned to one target device (`worker.py`); a worker
  that segfaults, is OOM-killed, exits or hangs past `timeout_s` costs only the model it held: that row
  is recorded (crash/oom/timeout with exit code or signal) and the worker is replaced;
- suspicious failures (worker death, timeout, device runtime errors, non-finite outputs, crashes) are
  retried on a different device within a bounded budget. A retry that passes means the model is
  `flaky`, unless its first device turns out to be bad: a device collects a strike for every
  device error and for every model that failed on it but passed elsewhere; at `quarantine_after`
  strikes it is quarantined: its workers are retired, in-flight models are re-run on healthy devices,
  a hot spare (`spare`) is brought in if one is held back, and models that were marked flaky because
  of it are re-recorded as their result elsewhere. Every row keeps all its attempts;
- each finished model is committed to the SQLite store before the next is handed out, so after a
  `kill -9` of the whole run, `resume=True` finishes the remaining models and loses nothing.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field, fields
from multiprocessing.connection import wait
from typing import Any

import torch

from harness.models.model_list import ModelEntry
from harness.outcomes import RETRYABLE
from harness.results.store import ResultRow, ResultStore, RunInfo
from harness.run.worker import Task, task_dict, worker_main

POOL_START_GRACE_S = 60.0
_ROW_FIELDS = {f.name for f in fields(ResultRow)}


@dataclass
class RunConfig:
    """How to run a list: which target, with which backend settings, and how defensively."""

    target: str = "sim"
    settings: dict[str, Any] = field(default_factory=lambda: {"precision": "default", "ops": "young"})
    jobs: int = 1
    timeout_s: float = 300.0
    retries: int = 1  # extra attempts per model for suspicious failures
    spare: int = 0  # devices held back as hot spares
    quarantine_after: int = 2  # strikes before a device is quarantined
    mem_cap_mb: int | None = 8192  # address space a worker may add after start-up
    seed: int = 0
    localize: bool = True
    devices: list[str] | None = None  # default: every device of the target's type
    progress: bool = True


@dataclass
class RunSummary:
    run_id: str
    db_path: str
    total: int
    resumed_skipped: int
    counts: dict[str, int]
    wall_s: float
    quarantined: list[str]
    faults_seen: int
    spares_used: list[str] = field(default_factory=list)
    unfinished: int = 0

    @property
    def rows_written(self) -> int:
        return sum(self.counts.values())


def target_devices(target: str) -> list[str]:
    """Every device index of the target's type, or just the one named (`sim:1`)."""
    if target.split(":")[0] == "sim":
        import harness.sim  # noqa: F401  makes "sim" a device type even with torch autoload off
    dev = torch.device(target)
    if dev.index is not None:
        return [str(dev)]
    if dev.type == "cpu":
        return ["cpu"]
    if dev.type == "sim":
        # Workers read the count from the environment when they start; so must we (this process may
        # have registered sim earlier under another environment).
        from harness.sim.device import _read_device_count

        return [f"sim:{i}" for i in range(_read_device_count())]
    mod = getattr(torch, dev.type, None)
    count = mod.device_count() if mod is not None and hasattr(mod, "device_count") else 0
    if count < 1:
        raise RuntimeError(f"target {target!r}: no {dev.type} devices visible in this process")
    return [f"{dev.type}:{i}" for i in range(count)]


def shard(entries: list[ModelEntry], spec: str) -> list[ModelEntry]:
    """Select shard i of N (1-based, 'i/N') by position in id order, so shards never overlap."""
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"bad shard {spec!r}: expected i/N with 1 <= i <= N, e.g. 2/8") from None
    if not 1 <= i <= n:
        raise ValueError(f"bad shard {spec!r}: expected i/N with 1 <= i <= N, e.g. 2/8")
    ordered = sorted(entries, key=lambda e: e.id)
    return ordered[i - 1 :: n]


_PRELOAD = ["torch", "transformers", "harness.run.worker"]


def _worker_context() -> Any:
    """A forkserver that has imported torch + transformers once, so a replacement worker starts in
    a fraction of a second instead of re-importing for several seconds (spawn). The server is
    started with torch's backend autoload off: `sim` must be registered in each worker, after it has
    applied its own environment (device count, faults), not inherited from the server."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    from multiprocessing import forkserver

    prev = os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD")
    os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    try:
        forkserver.ensure_running()
    finally:
        if prev is None:
            os.environ.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
        else:
            os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = prev
    return ctx


@dataclass
class _Pending:
    entry: ModelEntry
    attempts: list[dict[str, Any]] = field(default_factory=list)
    avoid: set[str] = field(default_factory=set)
    last_row: dict[str, Any] | None = None


class _Worker:
    def __init__(self, ctx: Any, device: str, threads: int, mem_cap_mb: int | None) -> None:
        self.device = device
        parent, child = ctx.Pipe()
        self.conn = parent
        env = dict(os.environ)  # the forkserver's env is from whenever it started; workers get today's
        self.proc = ctx.Process(target=worker_main, args=(child, device, threads, mem_cap_mb, env), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.job: _Pending | None = None
        self.started = 0.0
        self.killed_for: str | None = None

    def send(self, p: _Pending, task: Task) -> None:
        self.job = p
        self.started = time.monotonic()
        self.conn.send(task_dict(task))

    def kill(self, reason: str) -> None:
        self.killed_for = reason
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        self.proc.join(2)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(2)


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.counts: Counter[str] = Counter()
        self.t0 = time.monotonic()
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    def update(self, outcome: str) -> None:
        self.done += 1
        self.counts[outcome] += 1
        now = time.monotonic()
        if self.enabled and (self.tty or now - self._last > 5 or self.done == self.total):
            self._last = now
            elapsed = now - self.t0
            eta = elapsed / self.done * (self.total - self.done) if self.done else 0
            width = 24
            fill = int(width * self.done / max(self.total, 1))
            counts = " ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
            line = (
                f"[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
                f"{elapsed:5.0f}s ETA {eta:5.0f}s  {counts}"
            )
            print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)


def _suspicious(row: dict[str, Any]) -> bool:
    if row["outcome"] in RETRYABLE:
        return True
    return row["outcome"] == "drift" and bool(row.get("nonfinite"))


def _device_error(row: dict[str, Any]) -> bool:
    return row.get("error_type") == "SimDeviceError"


def run_models(
    entries: list[ModelEntry],
    config: RunConfig,
    db_path: str | os.PathLike,
    *,
    list_name: str = "",
    shard_spec: str = "1/1",
    resume: bool = False,
    argv: str = "",
) -> RunSummary:
    """Run every entry on the target and record one row each in the store at `db_path`."""
    store = ResultStore(db_path)
    try:
        return _Supervisor(entries, config, store, list_name, shard_spec, resume, argv).run()
    finally:
        store.close()


class _Supervisor:
    def __init__(self, entries, config, store, list_name, shard_spec, resume, argv) -> None:
        self.cfg: RunConfig = config
        self.store: ResultStore = store
        settings = dict(config.settings)
        run_id = store.latest_run(list_name=list_name, target=config.target, settings=settings, unfinished_only=True)
        done: set[str] = set()
        if resume and run_id is not None:
            done = store.finished_ids(run_id)
        else:
            run_id = store.begin_run(
                RunInfo(list_name=list_name, target=config.target, settings=settings, shard=shard_spec, argv=argv)
            )
        self.run_id = run_id
        self.skipped = sum(1 for e in entries if e.id in done)
        self.queue: deque[_Pending] = deque(_Pending(e) for e in entries if e.id not in done)
        devices = list(config.devices or target_devices(config.target))
        if config.spare >= len(devices):
            raise ValueError(f"--spare {config.spare} leaves no active device out of {len(devices)} ({devices})")
        self.active = devices[: len(devices) - config.spare]
        self.spares = devices[len(devices) - config.spare :]
        self.quarantined: list[str] = []
        self.spares_used: list[str] = []
        self.strikes: Counter[str] = Counter()
        self.flaky_by_device: dict[str, list[_Pending]] = {}
        self.probation: dict[str, set[str]] = {}  # device -> models whose failure there awaits a re-run
        self.counts: Counter[str] = Counter()
        self.faults_seen = 0
        self.threads = max(1, (os.cpu_count() or 1) // max(1, config.jobs))
        self.ctx = _worker_context()
        self.workers: list[_Worker] = []
        self.startup_failures = 0
        self.pool_ready = False
        self.t_start = time.monotonic()
        self.progress = _Progress(len(self.queue), config.progress)

    # -- workers -----------------------------------------------------------------------------

    def _spawn(self, device: str) -> None:
        self.workers.append(_Worker(self.ctx, device, self.threads, self.cfg.mem_cap_mb))

    def _pick_device(self) -> str | None:
        if not self.active:
            return None
        load = Counter(w.device for w in self.workers)
        return min(self.active, key=lambda d: (load[d], self.active.index(d)))

    def _replace(self, w: _Worker) -> None:
        self.workers.remove(w)
        try:
            w.conn.close()
        except OSError:
            pass
        if len(self.workers) < self.cfg.jobs and (self.queue or any(x.job for x in self.workers)):
            dev = w.device if w.device in self.active else self._pick_device()
            if dev is not None:
                self._spawn(dev)

    # -- recording ---------------------------------------------------------------------------

    def _write(self, p: _Pending, row: dict[str, Any], outcome: str) -> None:
        data = {k: v for k, v in row.items() if k in _ROW_FIELDS}
        data.update(
            run_id=self.run_id,
            model_id=p.entry.id,
            target=self.cfg.target,
            settings=dict(self.cfg.settings),
            outcome=outcome,
            arch=p.entry.arch,
            task=p.entry.task,
            modality=p.entry.modality,
            attempts=list(p.attempts),
        )
        self.store.record(ResultRow(**data))

    def _finish(self, p: _Pending, row: dict[str, Any], outcome: str) -> None:
        for a in p.attempts:
            self.probation.get(a["device"], set()).discard(p.entry.id)
        self._write(p, row, outcome)
        self.counts[outcome] += 1
        self.progress.update(outcome)

    def _strike(self, device: str) -> None:
        if device in self.quarantined or device not in self.active:
            return
        self.strikes[device] += 1
        if self.strikes[device] >= self.cfg.quarantine_after:
            self._quarantine(device)

    def _quarantine(self, device: str) -> None:
        self.quarantined.append(device)
        self.probation.pop(device, None)
        self.active.remove(device)
        print(f"\nportharness: quarantining {device} after {self.strikes[device]} device-attributable "
              f"failures", file=sys.stderr)
        if self.spares:
            spare = self.spares.pop(0)
            self.active.append(spare)
            self.spares_used.append(spare)
            print(f"portharness: bringing in hot spare {spare}", file=sys.stderr)
        for w in [w for w in self.workers if w.device == device]:
            p = w.job
            w.kill("quarantine")
            if p is not None:
                p.attempts.append({"device": device, "outcome": "interrupted", "error_type": "quarantine"})
                p.avoid.add(device)
                self.queue.appendleft(p)
            self._replace(w)
        # Models that looked flaky only because this device was bad: their result elsewhere stands.
        for p in self.flaky_by_device.pop(device, []):
            assert p.last_row is not None
            self._write(p, p.last_row, p.last_row["outcome"])
            self.counts["flaky"] -= 1
            self.counts[p.last_row["outcome"]] += 1
        if not self.active:
            print("portharness: every device is quarantined; stopping (resume later with --resume)",
                  file=sys.stderr)

    def _handle(self, w: _Worker, row: dict[str, Any]) -> None:
        p = w.job
        w.job = None
        assert p is not None
        duration = time.monotonic() - w.started
        outcome = row["outcome"]
        p.attempts.append(
            {
                "device": w.device,
                "outcome": outcome,
                "error_type": row.get("error_type", ""),
                "exit_code": row.get("exit_code"),
                "signal": row.get("signal"),
                "duration_s": round(duration, 3),
            }
        )
        if _device_error(row):
            self.faults_seen += 1
            self._strike(w.device)
        failed_before = [a for a in p.attempts[:-1] if a["outcome"] != "interrupted"]
        if failed_before and not _suspicious(row):
            # It ran cleanly here after failing elsewhere: those failures were the devices' (or flakes).
            for a in failed_before:
                if not _device_error(a):  # device errors already struck when they happened
                    self._strike(a["device"])
            p.last_row = row
            if outcome != "pass" or all(a["device"] in self.quarantined for a in failed_before):
                self._finish(p, row, outcome)
            else:
                self._finish(p, row, "flaky")
                for a in failed_before:
                    self.flaky_by_device.setdefault(a["device"], []).append(p)
            return
        retries_used = sum(1 for a in p.attempts if a["outcome"] != "interrupted") - 1
        if _suspicious(row) and retries_used < self.cfg.retries and self.active:
            p.avoid.add(w.device)
            self.probation.setdefault(w.device, set()).add(p.entry.id)
            self.queue.appendleft(p)
            return
        self._finish(p, row, outcome)

    def _death_row(self, w: _Worker) -> dict[str, Any]:
        code = w.proc.exitcode
        sig = -code if code is not None and code < 0 else None
        if w.killed_for == "timeout":
            return {"outcome": "timeout", "error_type": "Timeout", "signal": sig,
                    "error_message": f"no result after {self.cfg.timeout_s:.0f}s on {w.device}; worker killed"}
        if sig == signal.SIGKILL:
            return {"outcome": "oom", "error_type": "WorkerKilled", "signal": sig,
                    "error_message": f"worker on {w.device} was SIGKILLed (likely the OOM killer)"}
        name = signal.Signals(sig).name if sig else f"exit code {code}"
        return {"outcome": "crash", "error_type": "WorkerDied", "signal": sig, "exit_code": None if sig else code,
                "error_message": f"worker process on {w.device} died: {name}"}

    # -- main loop ---------------------------------------------------------------------------

    def _assign(self) -> None:
        if not self.pool_ready:
            # Hand out work only once the initial pool is up (or after a grace period), so the first
            # worker to finish importing doesn't drain a short list before the others can take part.
            if all(w.ready for w in self.workers) or time.monotonic() - self.t_start > POOL_START_GRACE_S:
                self.pool_ready = True
            else:
                return
        for w in self.workers:
            if not w.ready or w.job is not None or not self.queue or w.device not in self.active:
                continue
            # A device whose failure is awaiting a verdict elsewhere is cordoned: it takes retries only.
            cordoned = bool(self.probation.get(w.device))
            everywhere_failed = {x.device for x in self.workers if x.device in self.active}
            pick = None
            for p in self.queue:
                if cordoned and not p.attempts:
                    continue
                if w.device in p.avoid and not everywhere_failed <= p.avoid:
                    continue
                pick = p
                break
            if pick is None:
                continue
            self.queue.remove(pick)
            self._send(w, pick)
        idle = [w for w in self.workers if w.ready and w.job is None and w.device in self.active]
        if self.queue and idle and not any(w.job for w in self.workers):
            # Safety net: the preferences above must never stall a run; take the head of the queue.
            self._send(idle[0], self.queue.popleft())

    def _send(self, w: _Worker, p: _Pending) -> None:
        task = Task(
            entry=asdict(p.entry),
            target=w.device,
            settings=dict(self.cfg.settings),
            seed=self.cfg.seed,
            localize=self.cfg.localize,
        )
        w.send(p, task)

    def run(self) -> RunSummary:
        t0 = time.monotonic()
        try:
            for _ in range(min(self.cfg.jobs, max(1, len(self.queue)))):
                dev = self._pick_device()
                if dev is not None:
                    self._spawn(dev)
            while (self.queue and self.active) or any(w.job for w in self.workers):
                self._assign()
                self._poll()
        finally:
            for w in self.workers:
                w.stop()
            self.progress.close()
        unfinished = len(self.queue)
        if unfinished == 0:
            self.store.finish_run(self.run_id)
        return RunSummary(
            run_id=self.run_id,
            db_path=str(self.store.path),
            total=len(self.queue) + sum(self.counts.values()) + self.skipped,
            resumed_skipped=self.skipped,
            counts={k: v for k, v in self.counts.items() if v},
            wall_s=time.monotonic() - t0,
            quarantined=list(self.quarantined),
            faults_seen=self.faults_seen,
            spares_used=list(self.spares_used),
            unfinished=unfinished,
        )

    def _poll(self) -> None:
        now = time.monotonic()
        deadlines = [w.started + self.cfg.timeout_s - now for w in self.workers if w.job]
        timeout = max(0.0, min([1.0, *deadlines]))
        handles = {}
        for w in self.workers:
            handles[w.conn] = w
            handles[w.proc.sentinel] = w
        ready = wait(list(handles), timeout=timeout)
        seen: set[int] = set()
        for h in ready:
            w = handles[h]
            if id(w) in seen or w not in self.workers:
                continue
            seen.add(id(w))
            msg = None
            if w.conn.poll():
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):
                    msg = None
            if msg is not None:
                if msg["type"] == "ready":
                    w.ready = True
                elif msg["type"] == "result":
                    self._handle(w, msg["row"])
                continue
            if not w.proc.is_alive():
                w.proc.join()
                if not w.ready:
                    self.startup_failures += 1
                    if self.startup_failures >= 3:
                        raise RuntimeError(
                            f"worker processes for {w.device} keep dying at start-up (exit code "
                            f"{w.proc.exitcode}); run `portharness check` on one model to see the error"
                        )
                p = w.job
                if p is not None:
                    self._handle(w, self._death_row(w))
                self._replace(w)
        now = time.monotonic()
        for w in list(self.workers):
            if w.job is not None and now - w.started > self.cfg.timeout_s:
                w.kill("timeout")
                self._handle(w, self._death_row(w))
                self._replace(w)
