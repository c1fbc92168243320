"""The node side of a run on a Ray cluster: one long-lived actor per device, a worker like worker.py's.

An actor holds one device (its Ray resource), loads the backend once and runs models one by one
through the same `run_task` as a local worker, so its rows are the same. What the driver needs to
judge a death it did not see (which phase the model was in, which signal killed the process), the
actor leaves where the death cannot erase it: each phase is written to a small file on its node as
it starts, and a fatal signal's report is written next to it by `faulthandler`. When the actor dies
under a model, the driver reads both with `autopsy`, a task on the same node.

This module is imported on every node before the actor's constructor runs: it imports no torch.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import tempfile
import threading
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


class DeviceActor:
    """One device of one node: a worker process that Ray placed, serving models until it is killed."""

    def __init__(self, device: str, host: str, threads: int, mem_cap_mb: int | None, env: dict[str, str],
                 backends: list[str]) -> None:
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
        self._run_task = worker.run_task
        self._cv = threading.Condition()
        self._seq = 0
        self._phases: list[str] = []
        self._done = True

    def hello(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "hostname": socket.gethostname(), "node_id": ctx.get_node_id(),
                "accelerators": {k: list(v) for k, v in ctx.get_accelerator_ids().items() if v}}

    def _phase(self, name: str) -> None:
        os.pwrite(self._phase_fd, name.encode()[:_WIDTH].ljust(_WIDTH), 0)  # survives a crash right after
        with self._cv:
            self._phases.append(name)
            self._cv.notify_all()

    def run(self, seq: int, payload: dict[str, Any]) -> tuple[Any, dict[str, bytes]]:
        """Job `seq`: one model, its Measurement and its repro files."""
        with self._cv:
            self._seq, self._phases, self._done = seq, [], False
            self._cv.notify_all()
        try:
            m = self._run_task(payload, self.device, self._phase, host=self.host)
        finally:
            os.pwrite(self._phase_fd, b" " * _WIDTH, 0)
            with self._cv:
                self._done = True
                self._cv.notify_all()
        return m, repro_files(m.repro_path)

    def watch(self, seq: int, seen: int, wait_s: float = 5.0) -> list[str]:
        """The phases job `seq` entered after the first `seen`: as soon as there is one (or the job
        ended), else after `wait_s` (a long poll: the driver's budget for loading differs)."""
        def news() -> bool:
            return self._seq > seq or (self._seq == seq and (self._done or len(self._phases) > seen))

        with self._cv:
            self._cv.wait_for(news, timeout=wait_s)
            return list(self._phases[seen:]) if self._seq == seq else []

    def bye(self) -> None:
        """Before a deliberate kill: nothing of this actor stays on its node."""
        for path in _paths(os.getpid()):
            path.unlink(missing_ok=True)
