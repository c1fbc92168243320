"""Where the runner's workers come from, as one contract: processes on this host (`pool.Pool`) or one Ray
actor per device of a cluster (`raypool.RayPool`), seen through the same events; and what a worker's death
means as a measurement, whichever kind it was.

`executor_for(name)` is the only place that tells executors apart: the runner, the run's checks and the
CLI ask the `Executor` it returns (which devices, which pool, what its `--jobs 0` means).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from harness import verdict
from harness.fleet.budgets import Budgets, JobClock
from harness.fleet.policy import Job
from harness.fleet.pool import PRELOAD, Event, Pool, context
from harness.phases import PHASE_DOING
from harness.results.rows import Measurement


class PoolWorker(Protocol):
    """One worker of a pool: a process or an actor pinned to one device (`key`), one job at a time."""

    noun: str  # what to call it in messages: "worker", "actor"
    key: str  # the fleet's name for its device ("sim:1"; on a cluster "<node>/<device>")
    device: str  # the device as its own process names it
    host: str
    ready: bool
    job: Job | None  # the runner's job in flight (None: idle)
    clock: JobClock  # that job's phase and budget state
    found: dict[str, Any] | None  # what that job had established when it last said so (its first verdict)
    killed_for: str | None  # why the pool or the runner killed it ("timeout", "quarantine", ...)
    cause: str  # what is known of its death beyond the exit status

    @property
    def busy(self) -> bool: ...

    def send(self, job: Job, payload: dict[str, Any]) -> None: ...

    def kill(self, reason: str) -> None: ...

    def stop(self) -> None: ...

    def death(self) -> tuple[int | None, int | None]: ...


class WorkerPool(Protocol):
    """Workers for devices; `poll` turns their lives into `pool.Event`s (ready, result, died, timeout,
    memory, startup; on a cluster also lost: its node left, and interrupted: it could not be reached)."""

    per_device: int | None  # workers one device may hold (None: any number)
    workers: list[PoolWorker]
    started: int  # workers started, replacements included

    def spawn(self, key: str) -> PoolWorker: ...

    def retire(self, w: PoolWorker) -> None: ...

    def poll(self, max_wait: float = 1.0) -> list[Event]: ...

    def node_devices(self, w: PoolWorker) -> list[str]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class PoolSpec:
    """What every pool is made from (the run's settings that reach its workers)."""

    jobs: int
    worker_env: dict[str, str]
    mem_cap_mb: int | None
    backends: list[str]
    budgets: Budgets
    startup_timeout_s: float
    fork_workers: bool = False  # one `check`: fork from this process instead of a forkserver


class Executor(Protocol):
    name: str
    one_host: bool  # its workers share this host (a timed step can have it to itself: `quiet`)
    address_option: bool  # it joins a cluster at an address (--ray-address)
    all_devices_by_default: bool  # --jobs 0 (the default) means one worker per device
    per_device: int | None  # workers one device may hold (None: any number)

    def check(self) -> None:
        """ValueError when it cannot run here (its library missing)."""

    def devices(self, target: str, address: str | None) -> list[str]:
        """The devices it offers for `target`, as fleet keys; ValueError if none."""

    def pool(self, spec: PoolSpec, usable: Callable[[str], bool]) -> WorkerPool:
        """A pool for `spec` (`usable(key)`: whether a device is in service)."""

    def release(self) -> None:
        """What `devices` took (a cluster connection), given back at the end of the run."""


class LocalExecutor:
    """Worker processes on this host, from a forkserver that has imported torch and transformers."""

    name = "local"
    one_host = True
    address_option = False
    all_devices_by_default = False
    per_device = None

    def check(self) -> None:
        pass

    def devices(self, target: str, address: str | None) -> list[str]:
        from harness.backends import resolve_target

        return resolve_target(target)[1]

    def pool(self, spec: PoolSpec, usable: Callable[[str], bool]) -> WorkerPool:
        from harness.fleet.worker import WORKER_IMPORTS, worker_main  # torch: only once a pool is made

        threads = max(1, (os.cpu_count() or 1) // max(1, spec.jobs))
        # One `check` forks its worker from this process, which has imported torch and transformers
        # already (a forkserver would import them a second time); a run starts a forkserver, so that no
        # worker inherits a supervisor's state, nor a backend initialised before its environment was set.
        fork_here = spec.fork_workers and not spec.worker_env
        return Pool(
            mp.get_context("fork") if fork_here else context([*PRELOAD, "harness.fleet.worker", *WORKER_IMPORTS]),
            worker_main,
            # the forkserver's environment is from whenever it started; workers get today's
            lambda device: (device, threads, spec.mem_cap_mb, {**os.environ, **spec.worker_env}, spec.backends),
            budgets=spec.budgets,
            startup_timeout_s=spec.startup_timeout_s,
        )

    def release(self) -> None:
        pass


class RayExecutor:
    """One long-lived actor per device of a Ray cluster (`raypool`)."""

    name = "ray"
    one_host = False
    address_option = True
    all_devices_by_default = True
    per_device = 1  # Ray hands a device to one actor at a time

    def check(self) -> None:
        from harness.fleet.raycluster import ray_module

        ray_module()

    def devices(self, target: str, address: str | None) -> list[str]:
        from harness.fleet import raycluster

        return raycluster.devices(target, address)

    def pool(self, spec: PoolSpec, usable: Callable[[str], bool]) -> WorkerPool:
        from harness.fleet.raypool import RayPool

        return RayPool(mem_cap_mb=spec.mem_cap_mb, env=spec.worker_env, backends=spec.backends,
                       budgets=spec.budgets, startup_timeout_s=spec.startup_timeout_s, usable=usable)

    def release(self) -> None:
        from harness.fleet import raycluster

        raycluster.disconnect()


EXECUTORS: dict[str, type[LocalExecutor] | type[RayExecutor]] = {"local": LocalExecutor, "ray": RayExecutor}


def device_cap(executor: Executor, adapter: Any) -> int | None:
    """Workers one device may hold: one where the backend's devices refuse a second process (the adapter
    says so, `Adapter.exclusive`), else what the executor allows (None: any number)."""
    return 1 if adapter.exclusive else executor.per_device


def executor_for(name: str) -> Executor:
    """The executor called `name` (ValueError naming the choices)."""
    if name not in EXECUTORS:
        raise ValueError(f"--executor {name!r}: expected one of {', '.join(EXECUTORS)}")
    return EXECUTORS[name]()


def death(w: PoolWorker, budgets: Budgets) -> Measurement:
    """The measurement of a job whose worker (or Ray actor) died or was killed under it: the outcome is
    `harness.verdict.death`'s, and what the job had established before (`PoolWorker.found`) stays in the row."""
    code, sig = w.death()
    phase = w.clock.phase
    outcome = verdict.death(verdict.DeathEvidence(phase, w.killed_for, sig))
    where = {"model_id": w.job.id if w.job is not None else "", "device": w.device, "host": w.host,
             "worker_output": getattr(w, "output", "")}  # a local worker's output during the job (capture.py)
    extra: dict[str, Any] = {"signal": sig}
    if outcome in ("timeout", "ref_timeout"):
        error_type, message = budgets.why(w.clock, w.key)
        message += f"; {w.noun} killed"
        if outcome == "ref_timeout":  # the host's side ran out of time: nothing is known of the target
            flag = "--load-timeout" if phase == "load" else "--timeout"
            message += (f" while {PHASE_DOING.get(phase, phase)}, before the target ran: the reference side's time, "
                        f"not the target's (raise {flag} for this model)")
    elif outcome == "oom":
        error_type = "WorkerKilled"
        message = f"{w.noun} on {w.key} was SIGKILLed ({w.cause or 'likely the OOM killer'})"
    else:
        error_type = "WorkerDied"
        name = signal.Signals(sig).name if sig else f"exit code {code}" if code is not None else w.cause or "no exit status"
        message = f"{w.noun} process on {w.key} died: {name}" + (f" in phase {phase} ({PHASE_DOING.get(phase, phase)})"
                                                                  if phase else "")
        extra.update(exit_code=None if sig else code, traceback=getattr(w, "fatal", "")[:4000])  # the crashing thread
    fields = verdict.after_death(outcome, message, phase, w.found)
    if w.found is not None:
        fields["phases"] = {**w.found.get("phases", {}),
                            phase: {"s": round(max(0.0, time.monotonic() - w.clock.phase_started), 3), "ended": outcome}}
    return Measurement(**where, error_type=error_type, **extra, **fields)
