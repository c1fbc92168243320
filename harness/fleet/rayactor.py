"""The node side of a run on a Ray cluster: one long-lived actor per device, a worker like worker.py's.

An actor holds one device (its Ray resource; a --parallel group's actor holds none, its ranks' actors
hold them: `rayranks.py`), loads the backend once and runs models one by one
through the same `run_task` as a local worker, so its rows are the same; on its main thread, as a
local worker does, so that a fatal signal the process sends itself (a driver's abort, sim's crash
fault) stops the model where it is. What the driver needs to know about a job in flight, the actor
keeps in a small file on its node, where no death can erase it: the job's phase and its time budget
(`budgets.JobClock`, on the node's clock), and a fatal signal's report next to it (`faulthandler`).
The driver reads them with a task on the same node: `peek` when a job has run as long as its
shortest budget, `autopsy` when the actor died under it. A message per phase to the driver instead
cost the tiny zoo 1.1x its wall on a 2-core host (the RPC threads of the actors and of the actor
collecting the messages woke 70,000 times in 300 models, preempting the models).

This module is imported on every node before the actor's constructor runs: it imports no torch.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.fleet.budgets import JobClock

STATE_DIR = Path(tempfile.gettempdir()) / "portharness-ray"
_WIDTH = 128  # bytes of the phase file: "<phase> <started> <window start> <spent>", space-padded


def _paths(pid: int) -> tuple[Path, Path, Path]:
    """The phase file, the fatal-signal report and what the job has established (`found`, JSON) of actor `pid`."""
    return STATE_DIR / f"{pid}.phase", STATE_DIR / f"{pid}.fatal", STATE_DIR / f"{pid}.found"


def _found(path: Path) -> dict[str, Any] | None:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


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


def _budget(text: str) -> tuple[str, float, float] | None:
    """(phase, seconds since its budget window began, seconds spent before the window) from a phase
    file's text; None when no job is in flight."""
    clock = JobClock.parse(text)
    if clock is None:
        return None
    return clock.phase, time.monotonic() - clock.phase_started, clock.spent  # the node's clock, as the actor's


def peek(pid: int) -> tuple[str, float, float, dict[str, Any] | None] | None:
    """The job actor `pid` (alive) is running: `_budget` of its phase file, and what the job has established."""
    try:
        budget = _budget(_paths(pid)[0].read_text(errors="replace"))
    except (OSError, ValueError):
        return None
    return None if budget is None else (*budget, _found(_paths(pid)[2]))


def autopsy(pid: int) -> tuple[str, str, dict[str, Any] | None]:
    """(phase, fatal-signal report, what the job had established) that actor `pid`, dead, left on this node;
    its files removed."""
    phase_path, fatal_path, found_path = _paths(pid)
    out = []
    for path in (phase_path, fatal_path):
        try:
            out.append(path.read_text(errors="replace").strip())
        except OSError:
            out.append("")
    found = _found(found_path)
    for path in _paths(pid):
        path.unlink(missing_ok=True)
    return out[0].split(" ")[0], out[1], found


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
                 backends: list[str], group: Any = None, resource: str = "") -> None:
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
        from harness.fleet import worker
        from harness.run.memory import cap_address_space

        STATE_DIR.mkdir(parents=True, exist_ok=True)
        _sweep()
        phase_path, fatal_path, self._found_path = _paths(os.getpid())
        self._phase_fd = os.open(phase_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._fatal = open(fatal_path, "w")  # open for the actor's life: faulthandler writes here
        faulthandler.enable(file=self._fatal)
        worker.setup(device, threads, backends)
        for member in device.split("+"):  # a --parallel group's devices, each its rank's
            adapter_for(member).devices(member)  # a device this node does not have: a clear error, now
        cap_address_space(mem_cap_mb)
        self.device = device
        self.host = host
        self._run_task = worker.run_task
        self._start = None  # a --parallel group's: its ranks as actors in the group's placement group
        if group is not None:
            from harness.fleet.rayranks import RayStarter

            self._start = RayStarter(group, resource, env)

    def hello(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "hostname": socket.gethostname(), "node_id": ctx.get_node_id(),
                "accelerators": {k: list(v) for k, v in ctx.get_accelerator_ids().items() if v}}

    def run(self, payload: dict[str, Any]) -> tuple[Any, dict[str, bytes]]:
        """One model: its Measurement and its repro files."""
        clock = JobClock.start(time.monotonic())  # as a local pool keeps its worker's

        def phase(name: str, found: dict[str, Any] | None = None) -> None:
            if found is not None:  # whole or not at all, before the phase that could lose it begins
                tmp = self._found_path.with_suffix(".tmp")
                tmp.write_text(json.dumps(found, default=str))
                os.replace(tmp, self._found_path)
            clock.enter(name, time.monotonic())
            line = clock.line()
            os.pwrite(self._phase_fd, line.encode()[:_WIDTH].ljust(_WIDTH), 0)  # survives a crash right after

        try:
            m = self._run_task(payload, self.device, phase, host=self.host, start=self._start)
            while os.fstat(self._fatal.fileno()).st_size:  # a fatal signal is being handled: this process
                time.sleep(1)  # is going, and its death, not this result, is the model's last word
        finally:
            os.pwrite(self._phase_fd, b" " * _WIDTH, 0)
            self._found_path.unlink(missing_ok=True)
        return m, repro_files(m.repro_path)

    def bye(self) -> None:
        """Before a deliberate kill: nothing of this actor stays on its node."""
        for path in _paths(os.getpid()):
            path.unlink(missing_ok=True)
