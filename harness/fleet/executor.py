"""Where the runner's workers come from: processes on this host (`pool.Pool`) or one Ray actor per
device of a cluster (`raypool.RayPool`), both seen through the same events; and what a worker's
death means as a measurement, whichever kind it was.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections.abc import Callable
from typing import Any

from harness.fleet.pool import PRELOAD, Pool, context
from harness.fleet.worker import WORKER_IMPORTS, worker_main
from harness.results.rows import COMPILE_PHASE, Measurement


def make_pool(executor: str, *, jobs: int, worker_env: dict[str, str], mem_cap_mb: int | None,
              backends: list[str], timeout_s: float, load_timeout_s: float, startup_timeout_s: float,
              fork_workers: bool = False, usable: Callable[[str], bool] = lambda key: True,
              compile_timeout_s: float | None = None) -> Any:
    """The pool of `executor` (local, ray). `usable(key)`: whether a device is in service (the Ray pool
    keeps an out-of-service chip Ray hands it pinned, rather than running models on it)."""
    if executor == "ray":
        from harness.fleet.raypool import RayPool

        return RayPool(mem_cap_mb=mem_cap_mb, env=worker_env, backends=backends, timeout_s=timeout_s,
                       load_timeout_s=load_timeout_s, startup_timeout_s=startup_timeout_s,
                       compile_timeout_s=compile_timeout_s, usable=usable)
    threads = max(1, (os.cpu_count() or 1) // max(1, jobs))
    # One `check` forks its worker from this process, which has imported torch and transformers
    # already (a forkserver would import them a second time); a run starts a forkserver, so that no
    # worker inherits a supervisor's state, nor a backend initialised before its environment was set.
    fork_here = fork_workers and not worker_env
    return Pool(
        mp.get_context("fork") if fork_here else context([*PRELOAD, "harness.fleet.worker", *WORKER_IMPORTS]),
        worker_main,
        # the forkserver's environment is from whenever it started; workers get today's
        lambda device: (device, threads, mem_cap_mb, {**os.environ, **worker_env}, backends),
        timeout_s=timeout_s,
        startup_timeout_s=startup_timeout_s,
        load_timeout_s=load_timeout_s,
        compile_timeout_s=compile_timeout_s,
    )


def death(w: Any, timeout_s: float, load_timeout_s: float, compile_timeout_s: float | None = None) -> Measurement:
    """The measurement of a job whose worker (or Ray actor) died or was killed under it."""
    code, sig = w.death()
    where = {"model_id": w.job.id if w.job is not None else "", "device": w.device, "host": w.host,
             "worker_output": getattr(w, "output", "")}  # a local worker's output during the job (capture.py)
    if w.killed_for == "timeout":
        loading, compiling = w.phase in ("", "load"), w.phase == COMPILE_PHASE
        why = (f"still loading after {load_timeout_s:.0f}s (--load-timeout)" if loading
               else f"still compiling after {compile_timeout_s or 0:.0f}s (--compile-timeout)" if compiling
               else f"no result {timeout_s:.0f}s after loading (--timeout, compiling excluded, in phase {w.phase})")
        return Measurement(**where, outcome="timeout", error_type="CompileTimeout" if compiling else "Timeout",
                           signal=sig, error_message=f"{why} on {w.key}; {w.noun} killed")
    if sig == signal.SIGKILL:
        return Measurement(**where, outcome="oom", error_type="WorkerKilled", signal=sig,
                           error_message=f"{w.noun} on {w.key} was SIGKILLed ({w.cause or 'likely the OOM killer'})")
    name = signal.Signals(sig).name if sig else f"exit code {code}" if code is not None else w.cause or "no exit status"
    return Measurement(**where, outcome="crash", error_type="WorkerDied", signal=sig,
                       exit_code=None if sig else code, error_message=f"{w.noun} process on {w.key} died: {name}",
                       traceback=getattr(w, "fatal", "")[:4000])  # its head: the signal, the crashing thread
