"""A --parallel group's ranks on Ray: one actor per rank, each in its own bundle of the group's placement group.

The group's slot (`raycluster.slot`, `<node>/sim:0+<node>/sim:1`) is a placement group of one bundle per
device, STRICT_PACK on the slot's node (`placement`): Ray reserves the devices as a unit, so a group never
starts with some of its chips held elsewhere. The group's worker actor (`rayactor.DeviceActor`) runs in
bundle 0 holding no device: it computes the CPU reference and supervises. Each run of the parallel step then
starts one `RankActor` per rank in that rank's bundle, holding its device's resource, and runs the rank
(`harness.parallel.rank.main`) in the actor's own process: a fresh process per run, as a local rank's
child process is. `RayRank` is what the worker's `harness.parallel.launch.Parallel` supervises, with
`subprocess.Popen`'s part of the interface: an actor Ray reports dead is a death by the signal its fatal
report names (faulthandler, in the rank's log), SIGKILL when it left none (killed from outside, by us or the
kernel). Rank actors are owned by the group's worker actor, so they die with it (Ray's fate-sharing), as a
local rank dies with its worker; removing the placement group ends them all.

Ranks meet by a file store in the job's directory, on the node's disk: hence one node per group.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

# faulthandler's words for the fatal signals it reports
FATAL = {"Segmentation fault": signal.SIGSEGV, "Aborted": signal.SIGABRT, "Bus error": signal.SIGBUS,
         "Floating-point exception": signal.SIGFPE, "Floating point exception": signal.SIGFPE,
         "Illegal instruction": signal.SIGILL}


def fatal_signal(report: str) -> int | None:
    """The signal a faulthandler report names (None: it names none)."""
    return next((s for words, s in FATAL.items() if f"Fatal Python error: {words}" in report), None)


def death_code(report: str, ray_said: str, killed: bool) -> int:
    """A dead rank actor's `returncode`, as a child process's would read: minus the signal its fatal report
    names; SIGKILL's when we killed it or Ray's memory monitor did; otherwise 1: it died, and Ray's words
    ("exits with a connection error code 2", the same for a SIGSEGV, a SIGKILL and an exit) say nothing
    of how, so nothing is guessed (a crash, not the kernel's OOM killer)."""
    sig = fatal_signal(report)
    if sig is None and (killed or re.search(r"memory monitor|low on memory|OutOfMemory", ray_said)):
        sig = signal.SIGKILL
    return -sig if sig is not None else 1


def _exit_detail(ray_said: str) -> str:
    """Ray's sentence on how the actor's process ended."""
    m = re.search(r"Worker exit detail: ([^.]*\.)", ray_said)
    return m.group(1) if m else (ray_said.strip().splitlines() or [""])[-1][:200]


def placement(resource: str, count: int, node_id: str) -> Any:
    """The placement group of a group's `count` devices of `resource`, all on node `node_id`."""
    from ray.util.placement_group import placement_group

    bundle = {resource: 1}
    return placement_group([dict(bundle) for _ in range(count)], strategy="STRICT_PACK",
                           bundle_label_selector=[{"ray.io/node-id": node_id} for _ in range(count)])


class RankActor:
    """One rank of one run: the process it runs in is the rank's."""

    def run(self, job_dir: str, rank: int, env: dict[str, str]) -> dict[str, Any]:
        import ray

        os.environ.update(env)  # before the rank imports torch and the backend, as a child's environment
        log = os.open(Path(job_dir) / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)  # the rank's output and a fatal signal's report where a local rank's go
        os.dup2(log, 2)
        faulthandler.enable(file=2, all_threads=True)
        from harness.parallel.rank import main

        ctx = ray.get_runtime_context()
        code = main([job_dir])
        return {"code": code, "pid": os.getpid(), "ray_actor": ctx.get_actor_id() or "",
                "placement_group": ctx.get_placement_group_id() or ""}


class RayRank:
    """A started `RankActor`, as `launch.Parallel` supervises a rank (`launch.RankProcess`)."""

    def __init__(self, actor: Any, ref: Any, log: Path, where: dict[str, Any]) -> None:
        self.actor, self.ref, self.log = actor, ref, log
        self.where = where  # the row's: its bundle, then its pid, actor and placement group as the actor reported
        self.returncode: int | None = None
        self.killed = False
        self.why = ""  # how it died, where its returncode cannot say

    def poll(self) -> int | None:
        import ray

        if self.returncode is not None or not ray.wait([self.ref], timeout=0)[0]:
            return self.returncode
        try:
            got = ray.get(self.ref)
        except ray.exceptions.RayError as e:  # the actor died (or was killed)
            try:
                report = self.log.read_text(errors="replace")
            except OSError:
                report = ""
            self.returncode = death_code(report, str(e), self.killed)
            if self.returncode == 1:
                self.why = f"its actor's process ended with no fatal-signal report (Ray: {_exit_detail(str(e))})"
            return self.returncode
        self.where.update(pid=got["pid"], ray_actor=got["ray_actor"], placement_group=got["placement_group"])
        self.returncode = int(got["code"])
        ray.kill(self.actor, no_restart=True)  # its bundle's device free for the next run at once
        return self.returncode

    def kill(self) -> None:
        import ray

        self.killed = True
        ray.kill(self.actor, no_restart=True)

    def wait(self, timeout: float | None = None) -> int | None:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise TimeoutError(f"rank actor still running after {timeout}s")
            time.sleep(0.05)
        return self.returncode


class RayStarter:
    """`launch.Starter` for a group placed as `group` (a placement group of one bundle per rank): rank R's actor
    in bundle R, holding one `resource`, with the run's environment `env` beside the rank's."""

    def __init__(self, group: Any, resource: str, env: dict[str, str]) -> None:
        self.group, self.resource, self.env = group, resource, dict(env)
        self.actor_cls: Any = None

    def __call__(self, job_dir: Path, rank: int, env: dict[str, str]) -> RayRank:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self.actor_cls is None:
            self.actor_cls = ray.remote(RankActor)
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank,
                                                    placement_group_capture_child_tasks=False)
        actor = self.actor_cls.options(num_cpus=0, resources={self.resource: 1}, max_restarts=0,
                                       scheduling_strategy=strategy).remote()
        ref = actor.run.remote(str(job_dir), rank, {**self.env, **env})
        return RayRank(actor, ref, job_dir / f"rank{rank}.log", {"placement_group_bundle": rank})
