"""The one supervised process pool: disposable workers, each a child process with a pipe.

A model (or a zoo candidate) may segfault, hang or eat all memory, so it runs in a child process that
costs only itself when it does. The pool starts children, hands them jobs, and turns what happens to
them into events: ready, result, died (exit code / signal), timed out, over its memory budget. What
runs where, and what a failure means, is decided by the caller (`policy.py` for the runner).

Children come from a forkserver that has already imported torch and transformers, so replacing a
dead worker costs a fork, not a multi-second import; the server is started with torch's backend
autoload off, so no accelerator backend is initialised before a child has applied its own
environment.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

from harness.fleet.budgets import Budgets, JobClock
from harness.fleet.capture import fatal_report, read_log, remove_log
from harness.run.memory import rss_mb

PRELOAD = ["torch", "transformers", "harness.fleet.forkserver_guard"]


def _short_socket_dir() -> None:
    """The forkserver listens on a Unix socket in multiprocessing's temp directory, under $TMPDIR; a deep
    one (a CI workspace, a test's tmp_path) would not fit a socket's 107 bytes ("AF_UNIX path too long"),
    so multiprocessing's directory then goes under /tmp (it is made once per process and reused)."""
    from multiprocessing import util

    if len(os.path.join(tempfile.gettempdir(), "pymp-xxxxxxxx", "listener-xxxxxxxx")) < 100:
        return
    prev, tempfile.tempdir = tempfile.tempdir, "/tmp"
    try:
        util.get_temp_dir()
    finally:
        tempfile.tempdir = prev


def context(preload: Iterable[str] = PRELOAD) -> Any:
    """A forkserver context whose server has imported `preload` (started once per process)."""
    _short_socket_dir()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
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


class ExecutorError(RuntimeError):
    """Workers cannot run at all (they cannot start, the cluster is gone): an environment problem, not
    a model's. The run stops; it is resumable."""


class Worker:
    """One child process serving jobs over a pipe, pinned to `key` (a device, or any label)."""

    noun = "worker"

    def __init__(self, ctx: Any, key: str, target: Callable[..., None], args: tuple) -> None:
        self.key = key
        self.device = key
        self.host = socket.gethostname()
        self.cause = ""  # what is known about its death beyond the exit status (Ray actors: the node's word)
        parent, child = ctx.Pipe()
        self.conn = parent
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()
        self.born = time.monotonic()
        self.ready = False
        self.job: Any = None  # the caller's handle for the job in flight
        self.clock = JobClock()  # the job's phase, as the child reported it, and its budget state
        self.found: dict[str, Any] | None = None  # what the job had established when it last said so
        self.done = 0  # jobs finished by this worker
        self.killed_for: str | None = None

    @property
    def busy(self) -> bool:
        return self.job is not None

    def send(self, job: Any, payload: Any) -> None:
        self.job = job
        self.clock = JobClock.start(time.monotonic())
        self.found = None
        self.conn.send(payload)

    def kill(self, reason: str) -> None:
        self.killed_for = reason
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)

    def stop(self) -> None:
        """Ask the child to exit after its current job; kill it if it does not."""
        try:
            self.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        self.proc.join(2)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(2)

    @property
    def output(self) -> str:
        """What the worker printed during its last job (its log file; `harness.fleet.capture`)."""
        return read_log(self.proc.pid)

    @property
    def fatal(self) -> str:
        """The fatal-signal report of a worker that died under a job ("" for any other death)."""
        return fatal_report(self.proc.pid)

    def death(self) -> tuple[int | None, int | None]:
        """(exit code, signal) of a dead worker."""
        code = self.proc.exitcode
        if code is not None and code < 0:
            return None, -code
        return code, None


@dataclass
class Event:
    kind: str  # ready | result | died | timeout | memory | startup
    worker: Worker
    payload: Any = None


class Pool:
    """Workers for `target(conn, *args_for(key))`; `poll` turns their lives into events."""

    per_device: int | None = None  # workers a device may hold (any number: they share it)

    def __init__(
        self,
        ctx: Any,
        target: Callable[..., None],
        args_for: Callable[[str], tuple],
        *,
        budgets: Budgets,
        max_rss_mb: float | None = None,
        startup_timeout_s: float | None = None,
    ) -> None:
        self.ctx = ctx
        self.target = target
        self.args_for = args_for
        self.budgets = budgets
        self.max_rss_mb = max_rss_mb
        self.startup_timeout_s = startup_timeout_s
        self.workers: list[Worker] = []
        self.started = 0  # workers started, replacements included

    def spawn(self, key: str) -> Worker:
        w = Worker(self.ctx, key, self.target, self.args_for(key))
        self.workers.append(w)
        self.started += 1
        return w

    def retire(self, w: Worker) -> None:
        """Forget a dead or killed worker."""
        remove_log(w.proc.pid)
        if w in self.workers:
            self.workers.remove(w)
        try:
            w.conn.close()
        except OSError:
            pass

    def poll(self, max_wait: float = 1.0) -> list[Event]:
        """Wait up to `max_wait` s (less if a deadline is nearer); every event that happened meanwhile."""
        now = time.monotonic()
        deadlines = [self._deadline(w) - now for w in self.workers if w.busy]
        handles: dict[Any, Worker] = {}
        for w in self.workers:
            handles[w.conn] = w
            handles[w.proc.sentinel] = w
        events: list[Event] = []
        seen: set[int] = set()
        for h in wait(list(handles), timeout=max(0.0, min([max_wait, *deadlines]))):
            w = handles[h]
            if id(w) in seen:
                continue
            seen.add(id(w))
            events.extend(self._read(w))
        events.extend(self._deadlines())
        return events

    def _read(self, w: Worker) -> list[Event]:
        out = []
        while True:
            try:
                if not w.conn.poll():
                    break
                msg = w.conn.recv()
            except (EOFError, OSError):
                break
            if msg.get("type") == "ready":
                w.ready = True
                out.append(Event("ready", w, msg))
            elif msg.get("type") == "phase":
                w.clock.enter(msg["name"], time.monotonic())
                if "found" in msg:
                    w.found = msg["found"]
            elif msg.get("type") == "result":
                out.append(Event("result", w, msg["result"]))
                w.done += 1
        if not out and not w.proc.is_alive():
            w.proc.join()
            out.append(Event("died", w))
        return out

    def _deadline(self, w: Worker) -> float:
        return self.budgets.deadline(w.clock)

    def _deadlines(self) -> list[Event]:
        now = time.monotonic()
        events = []
        for w in list(self.workers):
            if w.busy and now > self._deadline(w):
                w.kill("timeout")
                events.append(Event("timeout", w))
            elif w.busy and self.max_rss_mb and rss_mb(w.proc.pid) > self.max_rss_mb:
                w.kill("memory")
                events.append(Event("memory", w))
            elif not w.ready and self.startup_timeout_s and now - w.born > self.startup_timeout_s:
                w.kill("startup")
                events.append(Event("startup", w))
        return events

    def node_devices(self, w: Worker) -> list[str]:
        """The devices that leave with `w`'s host: only its own (a local pool has one host, never lost)."""
        return [w.key]

    def close(self) -> None:
        for w in self.workers:
            w.stop()
            remove_log(w.proc.pid)
        self.workers.clear()


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux), so a `kill -9` of the
    supervisor (whose death ends the forkserver, these workers' parent) leaves no worker behind, even
    one stuck in a hung kernel."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def serve(conn: Any, handle: Callable[[Any, Callable[..., None]], Any]) -> None:
    """Child side: announce readiness, then answer each job with `handle(job, phase)` until told to stop;
    `phase(name)` tells the supervisor which phase the job is in (its time budget may differ), `phase(name,
    found)` also what the job has established (kept should the worker die later). Ctrl-C is
    the supervisor's to handle (it stops every child): a child ignores it rather than print a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    try:
        conn.send({"type": "ready", "pid": os.getpid()})
    except OSError:  # the supervisor stopped (SIGTERM, Ctrl-C) while this child started: no traceback
        return

    def phase(name: str, found: dict[str, Any] | None = None) -> None:
        conn.send({"type": "phase", "name": name, **({"found": found} if found is not None else {})})

    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        conn.send({"type": "result", "result": handle(job, phase)})

