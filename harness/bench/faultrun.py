"""Run fault scenarios: a supervisor process per scenario, hard deadlines, recovery onto a hot spare.

`run_scenarios` starts a *supervisor* process in a new session (its own process group), which forks
the rank processes and any hot spares (`harness.bench.faultjob.proc_main`) from a fork server that
imported torch and the model code once. The caller gives the supervisor a hard deadline and, past it,
kills the whole process group (supervisor, fork server, ranks); the supervisor gives each job its own
deadline, and each rank a self-destruct timer. Nothing a scenario does can hang the caller.

The supervisor waits until every process has imported torch and built its model (ready), then runs
generation 0 and watches it (`harness.bench.watchdog.Watchdog`). When the watchdog names a rank that
hung or died, the supervisor evicts it (SIGKILL: a hung rank never leaves by itself), gives the
backend a moment to fail the peers' collective by itself, then aborts what is still pending. With a
hot spare left, it forms generation g+1 with the spare in the bad rank's place and the lowest healthy
rank as the state source, and the job resumes at the step after the last completed one. A ``none``
scenario with ``restart_step`` re-forms the group the same way at that step without any fault: the
reference a recovered run's final parameters must match bit for bit.

Results are one `ScenarioResult` per scenario, built from the rank events after the run.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from dataclasses import replace
from typing import Any

from harness.bench.faultresult import ScenarioResult, summarize
from harness.bench.faults import FaultConfig, parse_scenario
from harness.bench.watchdog import (
    Detection,
    EventReader,
    Watchdog,
    read_json,
    write_json,
)

POLL_S = 0.02
ABORT_GRACE_S = 0.5  # after evicting a bad rank, the backend's own chance to fail its peers' collective
EXIT_WAIT_S = 10.0  # for processes to leave after the job is over


# ----------------------------------------------------------------------------------------------
# The supervisor (its own process, its own process group)
# ----------------------------------------------------------------------------------------------


class _Supervisor:
    def __init__(self, ctx: Any, cfg: FaultConfig, scenario: str, workdir: str) -> None:
        from harness.bench.faultjob import proc_main

        self.cfg, self.spec, self.workdir = cfg, parse_scenario(scenario), workdir
        self.labels = [f"r{i}" for i in range(cfg.world_size)] + [f"s{j}" for j in range(cfg.spare)]
        self.procs = {
            label: ctx.Process(target=proc_main, args=(label, slot, cfg.as_dict(), scenario, workdir), daemon=True,
                               name=f"portharness-{label}")
            for slot, label in enumerate(self.labels)
        }
        self.reader = EventReader(workdir)
        self.events: list[dict] = []
        # Heartbeats only catch a frozen process (none of the scenarios): a loose bar, never a false eviction.
        self.watchdog = Watchdog(stall_s=cfg.stall_s, heartbeat_s=max(5.0, 2 * cfg.stall_s), excess=cfg.excess)
        self.control: dict[str, Any] = {"gen": -1, "members": [], "abort": [], "stop": False}
        self.killed: set[str] = set()
        self.failed_labels: set[str] = set()  # named as hung/dead: evicted, never a member again
        self.spares = [label for label in self.labels if label.startswith("s")]
        self.reform_log: list[dict] = []

    def _write(self, **changes: Any) -> None:
        self.control.update(changes)
        write_json(os.path.join(self.workdir, "control.json"), self.control)

    def _pump(self) -> list[dict]:
        new = self.reader.poll()
        self.events += new
        return new

    def _exits(self) -> dict[str, int | None]:
        return {label: p.exitcode for label, p in self.procs.items()}

    def _heartbeats(self) -> dict[str, float]:
        out = {}
        for label in self.control["members"]:
            hb = read_json(os.path.join(self.workdir, f"hb-{label}.json"))
            if hb:
                out[label] = hb["t"]
        return out

    def _kill(self, label: str) -> None:
        p = self.procs[label]
        if p.exitcode is None:
            self.killed.add(label)
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def run(self) -> dict:
        t_start = time.time()
        for p in self.procs.values():
            p.start()
        ready: set[str] = set()
        while len(ready) < len(self.labels):
            ready |= {e["label"] for e in self._pump() if e["ev"] == "ready"}
            dead = [label for label, c in self._exits().items() if c is not None]
            if dead or time.time() - t_start > self.cfg.startup_s:
                return self._finish(t_start, None, error=f"startup failed: {dead or 'timed out'} before all were ready")
            time.sleep(POLL_S)
        t_go = time.time()
        members = self.labels[: self.cfg.world_size]
        self._start_gen(0, members, start_step=0, source=None)
        while True:
            now = time.time()
            if now - t_go > self.cfg.deadline_s:
                return self._finish(t_start, t_go, error=f"job deadline ({self.cfg.deadline_s:.0f} s) passed",
                                    timed_out=True)
            exits = self._exits()  # before reading events: a rank that exited wrote its last event first
            for ev in self._pump():
                self.watchdog.feed(ev)
            for d in self.watchdog.check(now, exits, self._heartbeats()):
                if d.by in ("exit", "stall", "heartbeat") and d.rank is not None:
                    self._evict(d)
            state = self._gen_state()
            if state == "done":
                self._write(stop=True)
                return self._finish(t_start, t_go)
            if state == "failed" and not self._reform():
                self._write(stop=True)
                return self._finish(t_start, t_go)
            time.sleep(POLL_S)

    def _start_gen(self, gen: int, members: list[str], start_step: int, source: int | None) -> None:
        self.watchdog.start_gen(gen, dict(enumerate(members)), start_step, time.time())
        self._write(gen=gen, members=members, start_step=start_step, source=source)
        self.gen_members = members

    def _evict(self, d: Detection) -> None:
        """A rank hung or died: kill it, let the backend react, then abort its peers' collective."""
        label = self.gen_members[d.rank]  # type: ignore[index]
        if label in self.failed_labels:
            return
        self.failed_labels.add(label)
        self._kill(label)
        deadline = time.time() + ABORT_GRACE_S
        while time.time() < deadline and not self._all_reported({label}):
            for ev in self._pump():
                self.watchdog.feed(ev)
            time.sleep(POLL_S)
        if not self._all_reported({label}):
            self._write(abort=[*self.control["abort"], self.control["gen"]], reason=d.detail)

    def _gen_events(self, kind: str) -> dict[str, dict]:
        gen = self.control["gen"]
        return {e["label"]: e for e in self.events if e["ev"] == kind and e.get("gen") == gen}

    def _all_reported(self, excluded: set[str]) -> bool:
        """Every other member of this generation has finished or failed its step."""
        seen = set(self._gen_events("failed")) | set(self._gen_events("done"))
        gone = {label for label in self.gen_members if self.procs[label].exitcode is not None}
        return all(m in seen or m in gone or m in excluded for m in self.gen_members)

    def _gen_state(self) -> str:
        done, failed = self._gen_events("done"), self._gen_events("failed")
        if len(done) == len(self.gen_members):
            return "done"
        if (failed or self.failed_labels & set(self.gen_members)) and self._all_reported(self.failed_labels):
            return "failed"
        return "running"

    def _reform(self) -> bool:
        """Form the next generation (spare in for the bad rank) if the job can go on; else False."""
        failed = self._gen_events("failed")
        done = self._gen_events("done")
        # A member that is gone without finishing died (even if the watchdog has not said so yet).
        self.failed_labels |= {m for m in self.gen_members if self.procs[m].exitcode is not None and m not in done}
        healthy = [m for m in self.gen_members if m in failed and m not in self.failed_labels]
        planned = any(e.get("planned") for e in failed.values())
        members = list(self.gen_members)
        for i, label in enumerate(members):
            if label in self.failed_labels:
                alive = [s for s in self.spares if self.procs[s].exitcode is None and s not in members]
                if not alive:
                    return False
                members[i] = alive[0]
        if not healthy:
            return False
        completed = max(failed[m]["completed"] for m in healthy)
        source = min(members.index(m) for m in healthy if failed[m]["completed"] == completed)
        gen = self.control["gen"] + 1
        self.reform_log.append({"gen": gen, "t": time.time(), "start_step": completed + 1, "planned": planned,
                                "failed_step": max(e.get("step", completed + 1) for e in failed.values()),
                                "members": members, "source": source})
        self._start_gen(gen, members, start_step=completed + 1, source=source)
        return True

    def _finish(self, t_start: float, t_go: float | None, *, error: str = "", timed_out: bool = False) -> dict:
        if error:
            self._write(stop=True)
        deadline = time.time() + (0.5 if timed_out else EXIT_WAIT_S)
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.time()))
        forced = [label for label, p in self.procs.items() if p.exitcode is None]
        for label in forced:
            self._kill(label)
        for p in self.procs.values():
            p.join(2.0)
        for ev in self._pump():
            self.watchdog.feed(ev)
        return {
            "events": self.events,
            "detections": [d.as_dict() for d in self.watchdog.detections],
            "flags": self.watchdog.flags,
            "exit_codes": self._exits(),
            "pids": {label: p.pid for label, p in self.procs.items()},
            "killed": sorted(self.killed),
            "forced": forced,
            "failed_labels": sorted(self.failed_labels),
            "reforms": self.reform_log,
            "t_start": t_start,
            "t_go": t_go,
            "t_end": time.time(),
            "error": error,
            "timed_out": timed_out,
        }


def _preload(target: str) -> list[str]:
    """What the fork server imports once, so each rank starts in a fraction of a second."""
    mods = ["torch", "torch.distributed", "harness.comms.shaped", "harness.bench.faultjob", "harness.models.tiny",
            "transformers.models.gpt2.modeling_gpt2"]
    return mods + (["harness.sim", "harness.sim.distributed"] if target == "sim" else [])


Job = tuple[str, str, int | None]  # scenario, collective setting, restart step (a `none` reference)


def _job_config(cfg: FaultConfig, job: Job) -> FaultConfig:
    scenario, setting, restart = job
    return replace(cfg, settings=[setting], scenarios=[scenario], restart_step=restart)


def _supervisor_main(cfg_dict: dict, jobs: list[Job], workdir: str) -> None:
    """Run ``jobs`` in turn; each one's record lands in ``workdir/<i>/supervisor.json``."""
    from harness.fleet.pool import die_with_parent

    die_with_parent()  # a killed supervisor / CLI leaves nothing behind
    import multiprocessing as mp

    os.setsid()  # our own process group: the caller can kill us, the fork server and every rank in one call
    cfg = FaultConfig(**cfg_dict)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_preload(cfg.target))
    for i, job in enumerate(jobs):
        d = os.path.join(workdir, str(i))
        os.makedirs(d, exist_ok=True)
        raw = _Supervisor(ctx, _job_config(cfg, job), job[0], d).run()
        write_json(os.path.join(d, "supervisor.json"), raw)


# ----------------------------------------------------------------------------------------------
# The caller
# ----------------------------------------------------------------------------------------------


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_scenarios(cfg: FaultConfig, jobs: list[Job], *, keep: str | None = None) -> list[ScenarioResult]:
    """Run each (scenario, setting, restart step) of ``jobs`` in turn under one supervised process group.

    One supervisor process (and one fork server that has imported torch once) serves all of them;
    every scenario still gets fresh rank processes. The whole list has a hard deadline, past which the
    process group is killed and the scenarios not finished come back ``timed_out``. ``keep``: copy the
    scenarios' directories (events, rank logs) there, for a post-mortem.
    """
    import multiprocessing as mp

    jobs = [tuple(j) + (None,) * (3 - len(j)) for j in jobs]  # type: ignore[misc]
    for job in jobs:
        _job_config(cfg, job).validate()
    workdir = tempfile.mkdtemp(prefix="portharness-faults-")
    per = cfg.deadline_s + 2 * EXIT_WAIT_S + 5
    hard_s = cfg.startup_s + per * len(jobs)
    sup = mp.get_context("spawn").Process(target=_supervisor_main, args=(cfg.as_dict(), jobs, workdir),
                                          name="portharness-fault-supervisor")
    results = []
    try:
        sup.start()
        sup.join(hard_s)
        _killpg(sup.pid)  # past the deadline; or, after a normal end, anything the supervisor left behind
        sup.join(5)
        for i, job in enumerate(jobs):
            d = os.path.join(workdir, str(i))
            raw = read_json(os.path.join(d, "supervisor.json"))
            events = raw["events"] if raw else (EventReader(d).poll() if os.path.isdir(d) else [])
            res = summarize(_job_config(cfg, job), parse_scenario(job[0]), job[1], raw, events)
            if raw is None:
                res.timed_out = True
                res.error = f"killed: the scenario list passed its hard deadline ({hard_s:.0f} s)"
            else:
                res.wall_s = raw["t_end"] - raw["t_start"]
            results.append(res)
        return results
    finally:
        if keep:
            shutil.copytree(workdir, keep, dirs_exist_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)


def run_scenario(cfg: FaultConfig, scenario: str, setting: str | None = None, *, keep: str | None = None) -> ScenarioResult:
    """One scenario under one collective setting (default: the config's first)."""
    return run_scenarios(cfg, [(scenario, setting or cfg.settings[0], cfg.restart_step)], keep=keep)[0]
