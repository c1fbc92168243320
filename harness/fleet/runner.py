"""Run a model list on a target: the glue between the pool, the policy and the store.

Every model runs in a long-lived worker pinned to one device (`worker.py`), from the run's executor
(`executor.py`: processes on this host, or one actor per device of a cluster; the same events, the same
policy).
What happens to it (a result, a death, a timeout) becomes a measurement; `policy.py` decides whether
to retry it elsewhere, strike or quarantine a device, or record the outcome; the store commits each
finished row before the next is handed out, so after a `kill -9` of the whole run, `resume=True`
finishes the remaining models and loses nothing.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import asdict, replace

from tqdm import tqdm

from harness.backends import adapter_for
from harness.console import terminal_text
from harness.fleet import policy, quiet, stages
from harness.fleet.executor import Executor, PoolSpec, PoolWorker, WorkerPool, death, device_cap, executor_for
from harness.fleet.notices import PhaseNotices
from harness.fleet.pool import Event, ExecutorError
from harness.fleet.resume import resumable
from harness.fleet.runconfig import RunConfig, compile_cache_root
from harness.fleet.stages import fleet_for, shard
from harness.fleet.summary import RunSummary
from harness.fleet.worker import task_payload
from harness.models.model_list import ModelEntry
from harness.ops.signature import merge_gens
from harness.results.rows import Measurement, ResultRow, RunInfo
from harness.results.store import ResultStore
from harness.results.variations import record_harvest
from harness.run.attribution import CAP_TOO_SMALL
from harness.run.compiled import cache_dir
from harness.run.pipeline import Task


def run_models(
    entries: list[ModelEntry],
    config: RunConfig,
    db_path: str | os.PathLike,
    *,
    list_name: str = "",
    shard_spec: str = "1/1",
    resume: bool = False,
    argv: str = "",
    kind: str = "model",
    variations: Mapping[str, dict] | None = None,
) -> RunSummary:
    """Run every entry on the target and record one row each in the store at `db_path`.

    `kind` is what each job is (`Task.kind`): a model; a model's harvest; an op variation, whose
    signature `variations` holds by entry id. Every kind goes through the same pool, policy and store.
    Everything that can be wrong with the configuration or the target is found before the DB is opened,
    so bad input leaves it as it was."""
    executor = executor_for(config.executor)
    try:
        fleet = fleet_for(config, entries)
        shard(entries, shard_spec)  # validates the spec
        store = ResultStore(db_path)
        try:
            return _Run(entries, config, store, fleet, list_name, shard_spec, resume, argv, kind, variations).run()
        finally:
            store.close()
    finally:
        executor.release()


class WorkerStartupError(ExecutorError):
    """Workers cannot start at all (an environment problem, not a model's): the run stops, resumable."""


class _Run:
    def __init__(self, entries, config, store, fleet, list_name, shard_spec, resume, argv, kind="model",
                 variations=None) -> None:
        self.cfg: RunConfig = config
        self.kind = kind
        self.variations: Mapping[str, dict] = variations or {}
        self.signatures: dict[str, dict] = {}  # harvested variations written so far, their observations merged
        self.store: ResultStore = store
        self.fleet: policy.Fleet = fleet
        settings = dict(config.settings)
        adapter = adapter_for(config.target)
        ids = [e.id for e in entries]
        run_id = resumable(store, ids, list_name, config.target, settings, shard_spec) if resume else None
        done: set[str] = set()
        self.resumed_run = run_id
        if run_id is not None:
            done = store.finished_ids(run_id)
        else:
            run_id = store.begin_run(
                RunInfo(list_name=list_name, target=config.target, settings=settings, shard=shard_spec, argv=argv)
            )
        store.plan(run_id, [i for i in ids if i not in done])  # what the run must finish before it is closed
        self.run_id = run_id
        self.repro_dir = config.repro_dir or str(store.path.with_name(store.path.stem + "-repro"))
        self.compile_cache = "" if "compile" not in settings else cache_dir(
            compile_cache_root(config, store.path), adapter.compile_cache_tag())
        self.entries = {e.id: e for e in entries}
        self.skipped = sum(1 for e in entries if e.id in done)
        sizes = {e.id: e.params or (1.0 if "slow" in e.tags else None) for e in entries}  # `slow`: a time hint
        todo = policy.biggest_first([e.id for e in entries if e.id not in done], sizes)
        self.ways = stages.ways(entries, config.settings)  # how each model is spread: one stage per way (`slots.stages`)
        self.stages = stages.of({i: self.ways[i] for i in todo})
        self.queue: deque[policy.Job] = deque()
        self.shared = adapter.ranks_share_device
        self.survived = False  # a model survived on a device of an earlier stage
        self.stage_ids: set[str] = set()
        self.counts: Counter[str] = Counter()
        self.with_fallback: Counter[str] = Counter()
        self.executor: Executor = executor_for(config.executor)
        self.cap = device_cap(self.executor, adapter)  # one worker per device where a device takes one process
        self.jobs = policy.workers(config.jobs, len(todo), len(fleet.active), self.cap)
        self.budgets = config.budgets
        self.pool_spec = PoolSpec(jobs=self.jobs, worker_env=adapter.worker_env(settings), mem_cap_mb=config.mem_cap_mb,
                                  backends=config.backends, budgets=self.budgets,
                                  startup_timeout_s=config.startup_timeout_s, fork_workers=config.fork_workers)
        self.pool: WorkerPool | None = None  # the stage's (`_stage`)
        self.started_before = 0  # workers the stages' pools started
        # --perf with several workers on this host: a timed step runs while no other worker runs a phase
        self.quiet_lock = (quiet.lock_path(tempfile.gettempdir(), run_id)
                           if config.perf and self.jobs > 1 and self.executor.one_host else "")
        self.startup_failures = 0
        self.finished: dict[str, tuple[policy.Job, Measurement, str]] = {}  # model -> its recorded row
        self.samples: dict[policy.Job, str] = {}  # --rerun-flaky sample job -> the model it samples
        self.sampled: dict[str, list[tuple[policy.Job, Measurement]]] = {}  # model -> its finished samples
        self.samples_left: Counter[str] = Counter()
        self.rerun_from: dict[str, int] = {}  # model -> index of its first rerun attempt (rows mark them)
        self.rerun_stats: Counter[str] = Counter()
        self.pending = 0  # rows recorded as device_error: re-run on resume
        self.first_failure = ""  # the first device fault or death, for a target that never worked
        self.assigning = False
        self.t_start = time.monotonic()
        self.progress = tqdm(total=len(todo), disable=not config.progress, file=sys.stderr, unit="model",
                             mininterval=0.5 if sys.stderr.isatty() else 5.0, dynamic_ncols=True)
        # a long phase says what it is doing: soon for one model (check), above the progress bar for a run
        self.notices = PhaseNotices(self._say,
                                    after_s=30.0 if config.progress else 5.0,
                                    every_s=60.0 if config.progress else 30.0, settings=settings)

    # -- workers -----------------------------------------------------------------------------

    def _say(self, line: str) -> None:
        """A line above the progress bar (ids and devices in it cannot act on the terminal)."""
        self.progress.write(terminal_text(line, one_line=True), file=sys.stderr)

    def _load(self) -> Counter[str]:
        return Counter(w.key for w in self.pool.workers)

    def _spawn(self) -> None:
        dev = policy.pick_device(self.fleet, self._load(), self.queue, cap=self.cap)
        if dev is not None:
            self.pool.spawn(dev)

    def _replace(self, w: PoolWorker) -> None:
        self.pool.retire(w)
        if len(self.pool.workers) < self.jobs and (self.queue or any(x.busy for x in self.pool.workers)):
            self._spawn()

    # -- recording ---------------------------------------------------------------------------

    def _write(self, job: policy.Job, m: Measurement, outcome: str) -> None:
        e = self.entries[job.id]
        first_rerun = self.rerun_from.get(job.id, len(job.attempts))
        if m.harvest.get("uses") is not None:  # the op calls it recorded go to the op tables, not into the row
            record_harvest(self.store, self.run_id, e.id, self.cfg.settings, m.harvest, self.signatures, merge_gens)
        self.store.record(
            ResultRow.from_measurement(
                m, model_id=e.id, harvest={} if "uses" in m.harvest else m.harvest, run_id=self.run_id,
                target=self.cfg.target, settings=dict(self.cfg.settings),
                outcome=outcome, arch=e.arch, task=e.task, modality=e.modality,
                attempts=[{**asdict(a), **({"rerun": True} if i >= first_rerun else {})}
                          for i, a in enumerate(job.attempts)],
            )
        )

    def _finish(self, job: policy.Job, m: Measurement, outcome: str) -> None:
        self.finished[job.id] = (job, m, outcome)
        self._write(job, m, outcome)
        self._count(m, outcome, 1)
        self.progress.update(1)
        self.progress.set_postfix_str(" ".join(f"{k}={v}" for k, v in sorted(self.counts.items()) if v),
                                      refresh=False)

    def _count(self, m: Measurement, outcome: str, n: int) -> None:
        self.counts[outcome] += n
        if m.fallback_ops:
            self.with_fallback[outcome] += n

    def _quarantine(self, q: policy.Quarantined, interrupted: str = "quarantine") -> None:
        self._say(f"portharness: quarantining {q.device}: {q.why}")
        if q.spare:
            self._say(f"portharness: bringing in hot spare {q.spare}"
                      + (f" (the group without {q.member})" if q.member else ""))
        for w in [w for w in self.pool.workers if w.key == q.device]:
            job = w.job
            w.kill("quarantine")
            if job is not None:
                policy.interrupt(job, q.device, interrupted)
                self.queue.appendleft(job)
            w.job = None
            self._replace(w)
        # Models that looked flaky only because this device was bad: their result elsewhere stands.
        for job in q.relabel:
            assert job.last is not None
            if job in self.samples or job.id not in self.finished:
                continue  # a --rerun-flaky sample is not a row: its attempts count when the model concludes
            self.finished[job.id] = (job, job.last, job.last.outcome)
            self._write(job, job.last, job.last.outcome)
            self.counts["flaky"] -= 1
            self.counts[job.last.outcome] += 1
        # Models recorded with a death on this device: that was the device's, not their result.
        self.queue = deque(j for j in self.queue if not j.probe or j.probe in self.fleet.probing)
        for job in q.reopen:
            if job in self.samples or job.id not in self.finished:
                continue
            _, m, recorded = self.finished.pop(job.id)
            self._count(m, recorded, -1)
            self.progress.update(-1)
            verdict = policy.reopen(self.fleet, job)
            if verdict.retry:
                self._write(job, m, "device_error")  # not its result any more: a resume re-runs it meanwhile
            self._apply(job, m, verdict)
        if not self.fleet.active:
            self.progress.write("portharness: every device is quarantined; stopping (resume later with --resume)",
                                file=sys.stderr)

    def _lost(self, w: PoolWorker) -> None:
        """`w`'s node left the cluster: its devices leave the fleet, and what ran there runs elsewhere
        (nothing it did there was the models' doing)."""
        for q in policy.lose(self.fleet, self.pool.node_devices(w), w.host):
            self._quarantine(q, interrupted=policy.NODE_LOST)
        if w in self.pool.workers:  # a device of that node that was not in service
            self._interrupted(w, policy.NODE_LOST)

    def _interrupted(self, w: PoolWorker, why: str) -> None:
        """`w` went away for reasons of its own (its node, the network): its model runs again, elsewhere."""
        if w.job is not None:
            policy.interrupt(w.job, w.key, why)
            self.queue.appendleft(w.job)
            w.job = None
        self._replace(w)

    def _settle(self, w: PoolWorker, m: Measurement, phase: str = "") -> None:
        job: policy.Job = w.job
        w.job = None
        if m.error_type == CAP_TOO_SMALL:
            raise ValueError(f"--mem-cap-mb {self.cfg.mem_cap_mb}: too small for the worker's own imports "
                             f"({m.error_message[:300]}); raise it, or 0 for no cap (the run is resumable)")
        others = bool(self.queue) or any(x.busy for x in self.pool.workers if x is not w)
        verdict = policy.settle(self.fleet, job, m, w.key, time.monotonic() - w.clock.started, phase, others)
        if not self.first_failure and policy.evidence(m, phase) in ("fault", "death"):
            self.first_failure = f"{m.error_type}: {m.error_message[:200]}"
        self._apply(job, m, verdict)

    def _apply(self, job: policy.Job, m: Measurement, verdict: policy.Settled) -> None:
        if verdict.retry:
            if verdict.defer:
                self.queue.append(job)
            else:
                self.queue.appendleft(job)
        elif job.probe:
            pass  # a canary run decides its device's streak; it is no row
        elif job in self.samples:
            self._sampled(job, m)
        else:
            self._finish(job, m, verdict.outcome)
            if verdict.pending:
                self.pending += 1
        self.queue.extendleft(verdict.probes)
        for q in verdict.quarantined:
            self._quarantine(q)

    # -- --rerun-flaky ---------------------------------------------------------------------------

    def _queue_reruns(self) -> int:
        """Queue `rerun_flaky` samples of every model whose attempts disagreed; returns how many models."""
        n = self.cfg.rerun_flaky
        models = [mid for mid, (job, _, outcome) in self.finished.items()
                  if mid in self.stage_ids and policy.needs_rerun(job, outcome, self.fleet.quarantined)]
        for mid in models:
            self.samples_left[mid] = n
            self.sampled[mid] = []
            for _ in range(n):
                sample = policy.Job(mid)
                self.samples[sample] = mid
                self.queue.append(sample)
        if models:
            self.progress.total += len(models) * n
            self.progress.write(f"portharness: re-running {len(models)} model(s) whose attempts disagreed, "
                                f"{n} time(s) each", file=sys.stderr)
        return len(models)

    def _sampled(self, sample: policy.Job, m: Measurement) -> None:
        mid = self.samples.pop(sample)
        self.sampled[mid].append((sample, m))
        self.samples_left[mid] -= 1
        self.progress.update(1)
        if self.samples_left[mid] == 0:
            self._conclude(mid)

    def _conclude(self, mid: str) -> None:
        """Every sample of `mid` is in: rewrite its row with the rerun verdict and all its attempts."""
        job, m, recorded = self.finished[mid]
        samples = self.sampled.pop(mid, [])
        self.samples_left.pop(mid, None)
        gone = self.fleet.quarantined
        first = (policy.counted(job, gone) or policy.counted(job))[-1]
        reruns = [o for s, _ in samples for o in policy.counted(s, gone)]
        outcome = policy.rerun_verdict(first, reruns)
        # The row's measurement is one that gave the verdict's outcome (the run's own, if it did).
        final = m if outcome in (first, "flaky") else next((sm for _, sm in samples if sm.outcome == outcome), m)
        self.rerun_from[mid] = len(job.attempts)
        for s, _ in samples:
            job.attempts.extend(s.attempts)
        self.finished[mid] = (job, final, outcome)
        self._write(job, final, outcome)
        self._count(m, recorded, -1)
        self._count(final, outcome, 1)
        self.rerun_stats["models"] += 1
        self.rerun_stats["flaky" if outcome == "flaky" else "stable"] += 1

    # -- stages ------------------------------------------------------------------------------

    def _stage(self, way: str, ids: list[str]) -> bool:
        """Start the stage that runs `ids` as `way` ("" one device each): its slots planned from the devices
        still in service, its own workers (an earlier stage's are gone: `_end_stage`). False when too few
        devices are left for it: its models stay unfinished, for a resume."""
        try:
            self.fleet = stages.fleet_after(self.fleet, way, self.cfg.spare, shared=self.shared)
        except ValueError as e:
            self._say(f"portharness: {len(ids)} model(s) to run {f'as {way}' if way else 'on one device each'} "
                      f"cannot: {e}; they stay unfinished (resume later with --resume)")
            return False
        self.queue = deque(policy.Job(i) for i in ids)
        self.stage_ids = set(ids)
        self.jobs = policy.workers(self.cfg.jobs, len(self.queue), len(self.fleet.active), self.cap)
        self.pool = self.executor.pool(replace(self.pool_spec, jobs=self.jobs),
                                       usable=lambda key: key in self.fleet.active)
        return True

    def _end_stage(self) -> list[policy.Job]:
        """Every worker of the stage gone (a device a process owns alone is free for the next stage's); the jobs
        it could not finish (every device quarantined)."""
        if self.pool is not None:
            self.started_before += self.pool.started
            self.survived = self.survived or bool(self.fleet.canary)
            self.pool.close()
            self.pool = None
        left = [j for j in self.queue if j not in self.samples and not j.probe]
        self.queue.clear()
        return left

    # -- main loop ---------------------------------------------------------------------------

    def _assign(self) -> None:
        workers = self.pool.workers
        if not self.assigning:
            waited = time.monotonic() - self.t_start
            if not policy.ready_to_assign(all(w.ready for w in workers), waited):
                return
            self.assigning = True
        for w in list(workers):
            if not w.ready or w.busy or not self.queue:
                continue
            job = policy.pick_job(self.fleet, w.key, self.queue)
            if job is not None:
                self.queue.remove(job)
                self._send(w, job)
            elif (dest := policy.idle_move(self.fleet, self.queue, self._load())) is not None:
                w.stop()  # nothing here for it: the waiting work can run on a device without a worker
                self.pool.retire(w)
                self.pool.spawn(dest)
        workers = self.pool.workers
        idle = [w for w in workers if w.ready and not w.busy and w.key in self.fleet.active]
        if self.queue and idle and not any(w.busy or not w.ready for w in workers):
            # Safety net: the preferences above must never stall a run; take the first job it may run.
            job = next((j for j in self.queue if j.probe in ("", idle[0].key)), None)
            if job is not None:
                self.queue.remove(job)
                self._send(idle[0], job)

    def _send(self, w: PoolWorker, job: policy.Job) -> None:
        settings = {k: v for k, v in self.cfg.settings.items() if k != "parallel"}
        if self.ways[job.id]:
            settings["parallel"] = self.ways[job.id]
        task = Task(entry=asdict(self.entries[job.id]), target=w.device, settings=settings,
                    seed=self.cfg.seed, localize=self.cfg.localize, repro_dir=self.repro_dir,
                    backends=list(self.cfg.backends), ref_cache=self.cfg.ref_cache or "",
                    perf=self.cfg.perf, perf_budget_s=self.cfg.perf_budget_s, compile_cache=self.compile_cache,
                    quiet_lock=self.quiet_lock, quiet_wait_s=min(30.0, self.cfg.timeout_s / 4),
                    kind=self.kind, variation=dict(self.variations.get(job.id, {})), harvest=self.cfg.harvest,
                    timeout_s=self.cfg.timeout_s, collectives=list(self.cfg.collectives))
        w.send(job, task_payload(task))

    def _on(self, ev: Event) -> None:
        w = ev.worker
        if ev.kind == "result":
            self._settle(w, ev.payload)
            return
        if ev.kind == "ready":
            return
        if ev.kind == "lost":
            self._lost(w)
            return
        if ev.kind == "interrupted":
            self._interrupted(w, policy.UNREACHABLE)
            return
        if ev.kind in ("died", "startup") and not w.ready:
            self.startup_failures += 1
            if self.startup_failures >= 3:
                code, sig = w.death()
                why = (f"were not ready within {self.cfg.startup_timeout_s:.0f}s" if ev.kind == "startup"
                       else f"keep dying at start-up ({w.cause or f'exit code {code}, signal {sig}'})")
                raise WorkerStartupError(
                    f"{w.noun} processes for {w.key} {why}; the run is "
                    "resumable. Run `portharness check` on one model to see the error"
                )
        if w.busy:
            self._settle(w, death(w, self.budgets), phase=w.clock.phase or "start")
        self._replace(w)

    def _drain(self) -> None:
        while (self.queue and self.fleet.active) or any(w.busy for w in self.pool.workers):
            self._assign()
            for ev in self.pool.poll():
                if ev.worker in self.pool.workers or ev.kind not in ("died", "lost", "interrupted"):
                    self._on(ev)
            self.notices.poll(self.pool.workers)

    def run(self) -> RunSummary:
        t0 = time.monotonic()
        left: list[policy.Job] = []  # the models that stay unfinished
        try:
            for way, ids in self.stages:
                if self._stage(way, ids):
                    self._run_stage()
                    left += self._end_stage()
                else:
                    left += [policy.Job(i) for i in ids]
        finally:
            left += self._end_stage()
            self.progress.close()
            if self.quiet_lock:
                for path in (self.quiet_lock, f"{self.quiet_lock}.intent"):
                    with contextlib.suppress(OSError):
                        os.unlink(path)
        self.queue = deque(left)
        # The run is closed only once everything it was started for has its row (a resume runs all of it)
        unfinished = len(self.store.planned(self.run_id) - self.store.finished_ids(self.run_id))
        if unfinished == 0:
            self.store.finish_run(self.run_id)
        rows = self.store.results(self.run_id)
        return RunSummary(
            run_id=self.run_id,
            db_path=str(self.store.path),
            total=len(self.queue) + sum(self.counts.values()) + self.skipped,
            resumed_skipped=self.skipped,
            counts={k: v for k, v in self.counts.items() if v},
            wall_s=time.monotonic() - t0,
            quarantined=list(self.fleet.quarantined),
            faults_seen=self.fleet.faults_seen,
            spares_used=list(self.fleet.spares_used),
            unfinished=unfinished,
            resumed_run=self.resumed_run,
            with_fallback={k: v for k, v in self.with_fallback.items() if v},
            reruns=dict(self.rerun_stats),
            run_counts={str(k): int(v) for k, v in rows["outcome"].value_counts().items()},
            confirmed={str(k): int(v) for k, v in rows["confirm"].value_counts().items() if k},
            never_worked=self._never_worked(),
            workers_started=self.started_before,
        )

    def _run_stage(self) -> None:
        for _ in range(min(self.jobs, max(1, len(self.queue)))):
            self._spawn()
        self._drain()
        if self.cfg.rerun_flaky > 0 and self.fleet.active and self._queue_reruns():
            while len(self.pool.workers) < min(self.jobs, len(self.queue)):
                self._spawn()
            self._drain()
        for mid in list(self.sampled):  # no healthy device left for every sample: decide on those done
            self._conclude(mid)

    def _never_worked(self) -> str:
        if self.survived or not policy.never_worked(self.fleet):
            return ""
        gone = f"quarantined {', '.join(self.fleet.quarantined)}; " if self.fleet.quarantined else ""
        return (f"the target {self.cfg.target} never ran a model: {gone}{self.fleet.faults_seen} device fault(s), "
                f"first: {self.first_failure or '-'}. Check its driver or device server, then rerun with --resume")
