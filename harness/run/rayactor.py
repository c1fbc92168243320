"""The node side of a run on a Ray cluster: one long-lived actor per device, a worker like worker.py's.

An actor holds one device (its Ray resource), loads the backend once and runs models one by one
through the same `run_task` as a local worker, so its rows are the same; on its main thread, as a
local worker does, so that a fatal signal the process sends itself (a driver's abort, sim's crash
fault) stops the model where it is. Each phase a model enters is posted to the run's `PhaseBoard`
(the driver's budget for loading differs from the rest). What the driver needs to judge a death it
did not see, the actor leaves where the death cannot erase it: the phase is also written to a small
file on its node, and a fatal signal's report next to it by `faulthandler`; when the actor dies under
a model, the driver reads both with `autopsy`, a task on the same node.

This module is imported on every node before the actor's constructor runs: it imports no torch.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

STATE_DIR = Path(tempfile.gettempdir()) / "portharness-ray"
_WIDTH = 32  # bytes of the phase file: a phase name, space-padded


def _paths(pid: int) -> tuple[Path, Path]:
    return STATE_DIR / f"{pid}.phase", STATE_DIR / f"{pid}.fatal"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep() -> None:
    """Remove the files of actors that died and were never autopsied (killed on purpose, or their
    driver went away)."""
    for f in STATE_DIR.glob("*.*"):
        if f.stem.isdigit() and not _alive(int(f.stem)):
            f.unlink(missing_ok=True)


def autopsy(pid: int) -> tuple[str, str]:
    """(phase, fatal-signal report) that actor `pid`, dead, left on this node; both files removed."""
    out = []
    for path in _paths(pid):
        try:
            out.append(path.read_text(errors="replace").strip())
        except OSError:
            out.append("")
        path.unlink(missing_ok=True)
    return out[0], out[1]


def repro_files(script: str) -> dict[str, bytes]:
    """A first-diverging-op repro (its script and saved inputs) as bytes, for the driver to keep: the
    node's disk may not be the driver's."""
    if not script:
        return {}
    out = {}
    for path in (Path(script), Path(script).with_suffix(".pt")):
        try:
            out[str(path)] = path.read_bytes()
        except OSError:
            pass
    return out


class PhaseBoard:
    """Where the actors of a run post the phase their model entered, and the driver waits for news."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._version = 0
        self._posts: dict[str, tuple[int, list[str]]] = {}  # actor token -> (job seq, its phases so far)
        self._changed: dict[str, int] = {}  # actor token -> version of its last post

    def post(self, token: str, seq: int, phase: str) -> None:
        with self._cv:
            seen = self._posts.get(token)
            phases = seen[1] if seen is not None and seen[0] == seq else []
            self._posts[token] = (seq, [*phases, phase])
            self._version += 1
            self._changed[token] = self._version
            self._cv.notify_all()

    def wait(self, version: int, wait_s: float = 5.0) -> tuple[int, dict[str, tuple[int, list[str]]]]:
        """(the board's version, each actor's posts since `version`): as soon as there is news, else
        after `wait_s` (a long poll)."""
        with self._cv:
            self._cv.wait_for(lambda: self._version > version, timeout=wait_s)
            return self._version, {t: self._posts[t] for t, v in self._changed.items() if v > version}


class DeviceActor:
    """One device of one node: a worker process that Ray placed, serving models until it is killed."""

    def __init__(self, device: str, host: str, threads: int, mem_cap_mb: int | None, env: dict[str, str],
                 backends: list[str], board: Any, token: str) -> None:
        os.environ.update(env)  # the run's backend switches; the node's own environment stays
        # torch is imported with backend autoload off, and the backend loaded in `setup`, after the
        # environment is set: as in a local worker
        autoload = os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD")
        os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
        import torch  # noqa: F401

        if autoload is None:
            os.environ.pop("TORCH_DEVICE_BACKEND_AUTOLOAD")
        else:
            os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = autoload
        from harness.backends import adapter_for
        from harness.run import worker
        from harness.run.memory import cap_address_space

        STATE_DIR.mkdir(parents=True, exist_ok=True)
        _sweep()
        phase_path, fatal_path = _paths(os.getpid())
        self._phase_fd = os.open(phase_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._fatal = open(fatal_path, "w")  # open for the actor's life: faulthandler writes here
        faulthandler.enable(file=self._fatal)
        worker.setup(device, threads, backends)
        adapter_for(device).devices(device)  # a device this node does not have: a clear error, now
        cap_address_space(mem_cap_mb)
        self.device = device
        self.host = host
        self._token = token
        self._board = board
        self._run_task = worker.run_task

    def hello(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "hostname": socket.gethostname(), "node_id": ctx.get_node_id(),
                "accelerators": {k: list(v) for k, v in ctx.get_accelerator_ids().items() if v}}

    def run(self, seq: int, payload: dict[str, Any]) -> tuple[Any, dict[str, bytes]]:
        """Job `seq`: one model, its Measurement and its repro files."""
        def phase(name: str) -> None:
            os.pwrite(self._phase_fd, name.encode()[:_WIDTH].ljust(_WIDTH), 0)  # survives a crash right after
            self._board.post.remote(self._token, seq, name)

        try:
            m = self._run_task(payload, self.device, phase, host=self.host)
            while os.fstat(self._fatal.fileno()).st_size:  # a fatal signal is being handled: this process
                time.sleep(1)  # is going, and its death, not this result, is the model's last word
        finally:
            os.pwrite(self._phase_fd, b" " * _WIDTH, 0)
        return m, repro_files(m.repro_path)

    def bye(self) -> None:
        """Before a deliberate kill: nothing of this actor stays on its node."""
        for path in _paths(os.getpid()):
            path.unlink(missing_ok=True)
