"""The worker process: one long-lived child pinned to one target device, running models one by one.

A model that segfaults, hangs or eats all memory takes down only this process; the runner sees it
die through the pool and replaces it. The worker applies the supervisor's environment as of the
moment it was started (device counts, fault injection), loads the target's backend itself, imports what
running a model needs and starts torch's thread pool, and only then caps how much address space it may
add: a runaway allocation fails here with MemoryError, and the cap is the models' budget, not the
harness's (an import that still finds no room under it stops the run as a configuration error).
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch

from harness.backends import adapter_for, load_backends
from harness.fleet.capture import JobOutput
from harness.fleet.pool import serve
from harness.fleet.quiet import QuietLock
from harness.results.rows import Measurement
from harness.run.attribution import classify_exception
from harness.run.memory import cap_address_space
from harness.run.pipeline import Task, run_one

if TYPE_CHECKING:
    from harness.parallel.launch import Starter


def task_payload(task: Task) -> dict[str, Any]:
    """What crosses the pipe: plain data only."""
    return asdict(task)


# Loading any Hugging Face model imports these (with torch._dynamo, sympy, scipy: ~1400 modules).
WORKER_IMPORTS = ("transformers.modeling_utils", "harness.run.pipeline")


def run_task(payload: dict[str, Any], device: str, phase: Callable[..., None] | None = None,
             host: str = "", start: Starter | None = None) -> Measurement:
    """One model on this worker's device (on `host`: default this machine's name); a harness bug
    becomes a crash row, never a dead worker. `start`: how a --parallel group's ranks start
    (`harness.parallel.launch.Starter`; None: forked from this worker's own forkserver, `rankfork`)."""
    task = Task(**payload)
    task.target = device
    model_id = task.entry["id"]
    current = ["start"]

    quiet = _quiet_lock(task.quiet_lock, task.quiet_wait_s)

    def on_phase(name: str, found: dict[str, Any] | None = None) -> None:
        current[0] = name
        if phase is not None:
            phase(name) if found is None else phase(name, found)
        if quiet is not None:
            quiet.enter(name)

    try:
        m = _dispatch(task, on_phase, start)
    except BaseException as e:  # a bug in the harness itself, or no memory left for it: a row, keep serving
        fields = classify_exception(e, adapter_for(device), stage=current[0])  # a device fault is still the device's
        m = Measurement(model_id=model_id, device=device, **{
            **fields, "outcome": fields["outcome"] if fields["outcome"] in ("oom", "device_error") else "crash"})
    finally:
        alone = quiet.end_job() if quiet is not None else True
    if not alone and m.perf:
        m.perf["ran_alone"] = False  # waited too long for the other workers: timed beside them
    if quiet is not None and m.perf:
        m.perf["quiet_wait_s"] = round(quiet.job_wait_s, 3)  # the price of the host to itself, for perf_rates
    m.host = host or socket.gethostname()
    return m


def _dispatch(task: Task, on_phase: Callable[[str], None], start: Starter | None = None) -> Measurement:
    """The job by its kind: a model's run, a model's harvest, or one op variation (`Task.kind`)."""
    if task.kind == "variation":
        from harness.ops.variation import run_variation

        return run_variation(task, on_phase)
    if task.kind == "harvest":
        from harness.ops.harvest import harvest_model

        return harvest_model(task, on_phase)
    if task.harvest:
        from harness.ops.harvest import Harvest

        return run_one(task, on_phase, recorder=Harvest)
    if task.settings.get("parallel"):
        from harness.fleet.rankfork import start_forked
        from harness.parallel.launch import for_task

        parallel = for_task(task.settings, task.target, task.backends, deadline_s=0.8 * task.timeout_s, env={},
                            collectives=task.collectives, start=start if start is not None else start_forked)
        try:
            return run_one(task, on_phase, parallel=parallel)
        finally:
            if parallel is not None:
                parallel.close()
    return run_one(task, on_phase)


_quiet: dict[str, QuietLock] = {}  # this worker's side of its run's lock, opened once


def _quiet_lock(path: str, wait_s: float) -> QuietLock | None:
    if not path:
        return None
    if path not in _quiet:
        _quiet[path] = QuietLock(path, wait_s)
    return _quiet[path]


def preload() -> None:
    """What every model needs, before the memory cap: imports, and torch's intra-op threads (each
    thread's stack is address space)."""
    for name in WORKER_IMPORTS:
        importlib.import_module(name)
    torch.ones(1 << 18).add_(1).sum()  # large enough to run in parallel


def worker_main(
    conn: Any, device: str, threads: int, mem_cap_mb: int | None, env: dict[str, str], backends: list[str]
) -> None:
    """Child-process entry point (started by the pool from the forkserver)."""
    # Ctrl-C reaches the whole process group: the supervisor stops the workers and says so once, so a
    # worker ignores it (no traceback per worker). Its stdout is the CLI's: what a backend prints while the
    # worker starts goes to stderr, so `--json` output stays JSON (what a model prints goes to its row).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stdout.flush()
    os.dup2(2, 1)
    os.environ.clear()
    os.environ.update(env)
    setup(device, threads, backends)
    cap_address_space(mem_cap_mb)
    # What a model prints (Python warnings, native libraries) goes to its row, not into the supervisor's
    # progress bar; a fatal signal's report goes to the same file, which the supervisor reads back.
    output = JobOutput()
    faulthandler.enable(file=2)  # fd 2 itself (sys.stderr need not be it): the job's file while a job runs

    def job(payload: dict[str, Any], phase: Callable[..., None]) -> Measurement:
        with output:
            m = run_task(payload, device, phase)
        m.worker_output = output.text()
        return m

    serve(conn, job)


def setup(device: str, threads: int, backends: list[str]) -> None:
    """Make this process a worker for `device`, once its environment is set: torch's threads, quiet
    libraries, the target's backend, and what every model needs (a Ray actor does the same)."""
    torch.set_num_threads(max(1, threads))
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        import transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()  # config warnings would drown the progress bar
    except Exception:
        pass
    # The forkserver imported torch with backend autoload off; load the target's backend here, after
    # this worker has its own environment, as the supervisor did: entry points, then --backend modules.
    load_backends(backends, entry_points=True)
    adapter_for(device).load()
    preload()
