"""A --parallel group's ranks on the local pool: forked from a server that has imported torch and transformers.

A rank started as a fresh interpreter (`harness.parallel.launch.start_local`) spends most of its launch
importing torch and transformers: `check tiny/llama/causal-lm --target cpu --parallel tp:2` took 7.0 s a
model, its ranks 3-4 s loading, against 0.6 s for the load itself in a process that had imported them. The
worker's ranks come instead from a forkserver of its own (`pool.context`, started once per worker with
torch's backend autoload off, as the pool's own): each rank is a fork that applies its environment, then
loads the backend (entry points first, as a fresh interpreter's autoload would) and runs
`harness.parallel.rank.main`. Its output goes to its log; it dies with the server, which dies with the
worker (`forkserver_guard`), as a local rank dies with its worker. `Forked` is the `launch.RankProcess`
the worker supervises.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from pathlib import Path
from typing import Any

# what every rank imports beyond the pool's preload: the distributed stack and the rank's own modules
RANK_PRELOAD = ["torch.distributed.fsdp", "torch.distributed.tensor.parallel", "transformers.modeling_utils",
                "harness.parallel.rank", "harness.parallel.wrap", "harness.run.modes"]

_ctx: Any = None


def _rank(job_dir: str, rank: int, env: dict[str, str]) -> None:
    """The forked rank: its environment, its log, the backend, then the rank's main."""
    log = os.open(Path(job_dir) / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    from harness.fleet.pool import die_with_parent

    die_with_parent()  # the server's death (the worker's) ends it
    os.environ.clear()
    os.environ.update(env)
    from harness.backends import load_backends
    from harness.parallel.rank import main

    load_backends([], entry_points=True)  # the server imported torch with autoload off
    sys.exit(main([job_dir]))


class Forked:
    """A forked rank, as `launch.Parallel` supervises one (`launch.RankProcess`)."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc
        self.where = {"pid": proc.pid}
        self.returncode: int | None = None  # minus the signal that killed it, as Popen's

    def poll(self) -> int | None:
        if self.returncode is None and self.proc.exitcode is not None:
            self.returncode = self.proc.exitcode
            self.proc.close()  # its sentinel: a worker forks a rank process per launch, thousands a night
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            self.proc.kill()

    def wait(self, timeout: float | None = None) -> int | None:
        if self.returncode is None:
            self.proc.join(timeout)
        if self.poll() is None:
            raise TimeoutError(f"rank process {self.proc.pid} still running after {timeout}s")
        return self.returncode


def start_forked(job_dir: Path, rank: int, env: dict[str, str]) -> Forked:
    """`launch.Starter`: rank `rank` of the job in `job_dir`, forked with this worker's environment and `env`."""
    global _ctx
    if _ctx is None:
        from harness.fleet.pool import PRELOAD, context

        _ctx = context([*PRELOAD, *RANK_PRELOAD])
    proc = _ctx.Process(target=_rank, args=(str(job_dir), rank, {**os.environ, **env}), daemon=False)
    # The pool's workers are daemonic, and multiprocessing refuses a daemonic process children (so that none
    # outlives it); a rank cannot outlive its worker anyway: it dies with the server, the server with the worker
    me = mp.current_process()
    daemonic = me._config.get("daemon")
    me._config["daemon"] = False
    try:
        proc.start()
    finally:
        me._config["daemon"] = daemonic
    return Forked(proc)
