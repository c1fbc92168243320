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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from harness.fleet.budgets import Budgets, JobClock
from harness.fleet.pool import PRELOAD, Event, Pool, context
from harness.results.rows import PHASE_DOING, REFERENCE_PHASES, Measurement


class PoolWorker(Protocol):
    """One worker of a pool: a process or an actor pinned to one device (`key`), one job at a time."""

    noun: str  # what to call it in messages: "worker", "actor"
    key: str  # the fleet's name for its device ("sim:1"; on a cluster "<node>/<device>")
    device: str  # the device as its own process names it
    host: str
    ready: bool
    job: Any  # the runner's job in flight (None: idle)
    clock: JobClock  # that job's phase and budget state
    killed_for: str | None  # why the pool or the runner killed it ("timeout", "quarantine", ...)
    cause: str  # what is known of its death beyond the exit status

    @property
    def busy(self) -> bool: ...

    def send(self, job: Any, payload: Any) -> None: ...

    def kill(self, reason: str) -> None: ...

    def stop(self) -> None: ...

    def death(self) -> tuple[int | None, int | None]: ...


class WorkerPool(Protocol):
    """Workers for devices; `poll` turns their lives into `pool.Event`s (ready, result, died, timeout,
    memory, startup; on a cluster also lost: its node left, and interrupted: it could not be reached)."""

    per_device: int | None  # workers one device may hold (None: any number)
    workers: list[Any]  # its `PoolWorker`s
    started: int  # workers started, replacements included

    def spawn(self, key: str) -> Any: ...

    def retire(self, w: Any) -> None: ...

    def poll(self, max_wait: float = 1.0) -> list[Event]: ...

    def node_devices(self, w: Any) -> list[str]: ...

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
    """The measurement of a job whose worker (or Ray actor) died or was killed under it."""
    code, sig = w.death()
    where = {"model_id": w.job.id if w.job is not None else "", "device": w.device, "host": w.host,
             "worker_output": getattr(w, "output", "")}  # a local worker's output during the job (capture.py)
    if w.killed_for == "timeout":
        error_type, why = budgets.why(w.clock, w.key)
        phase = w.clock.phase
        if phase in REFERENCE_PHASES:  # the host's side ran out of time: nothing is known of the target
            flag = "--load-timeout" if phase == "load" else "--timeout"
            return Measurement(**where, outcome="ref_timeout", error_type=error_type, signal=sig, error_message=(
                f"{why}; {w.noun} killed while {PHASE_DOING.get(phase, phase)}, before the target ran: the reference "
                f"side's time, not the target's (raise {flag} for this model)"))
        return Measurement(**where, outcome="timeout", error_type=error_type, signal=sig,
                           error_message=f"{why}; {w.noun} killed")
    if sig == signal.SIGKILL:
        return Measurement(**where, outcome="oom", error_type="WorkerKilled", signal=sig,
                           error_message=f"{w.noun} on {w.key} was SIGKILLed ({w.cause or 'likely the OOM killer'})")
    name = signal.Signals(sig).name if sig else f"exit code {code}" if code is not None else w.cause or "no exit status"
    return Measurement(**where, outcome="crash", error_type="WorkerDied", signal=sig,
                       exit_code=None if sig else code, error_message=f"{w.noun} process on {w.key} died: {name}",
                       traceback=getattr(w, "fatal", "")[:4000])  # its head: the signal, the crashing thread
