"""Backend adapters: the one place that knows how to drive each kind of device.

The runner, worker, CLI and benchmarks ask `adapter_for(target)` how to load the backend, which
devices it has, which settings it accepts and how to apply them, which errors are the device's fault
and which name a missing op; they never branch on a device name. `base.Adapter` answers for any
accelerator PyTorch knows (cuda, xpu, mps, hpu, an out-of-tree PrivateUse1 backend); `sim` and `cpu`
add what is specific to them. A vendor registers a richer adapter for its device type with
`register_adapter` (from the module it passes with ``--backend``).

Backends are loaded the way their users load them: by importing their module (``--backend MODULE``
or ``PORTHARNESS_BACKENDS=mod1,mod2``) and through torch's ``torch.backends`` entry points when
``TORCH_DEVICE_BACKEND_AUTOLOAD`` is on, in the supervisor and again in every worker process.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable

from harness.backends import owner
from harness.backends.base import Adapter
from harness.backends.cpu import CpuAdapter
from harness.backends.sim import SimAdapter

BACKENDS_ENV = "PORTHARNESS_BACKENDS"
_ADAPTERS: dict[str, type[Adapter]] = {"sim": SimAdapter, "cpu": CpuAdapter}
_entry_points_loaded = False


def device_type(target: str) -> str:
    """`cuda:1` -> `cuda`, and a --parallel group `sim:0+sim:1` -> `sim` (no torch import: the CLI validates
    before paying for one)."""
    return target.split("+", 1)[0].split(":", 1)[0].strip()


def register_adapter(kind: str, adapter: type[Adapter]) -> None:
    """Use `adapter` (a subclass of `Adapter`) for targets of device type `kind`."""
    _ADAPTERS[kind] = adapter


def adapter_for(target: str) -> Adapter:
    """The adapter for the device type `target` names."""
    kind = device_type(target)
    return _ADAPTERS.get(kind, Adapter)(kind)


def backend_modules(given: Iterable[str] = ()) -> list[str]:
    """Modules to import: ``PORTHARNESS_BACKENDS`` (comma-separated) then `given`, without repeats."""
    names = [n.strip() for n in os.environ.get(BACKENDS_ENV, "").split(",")] + [n.strip() for n in given]
    return list(dict.fromkeys(n for n in names if n))


def load_backends(modules: Iterable[str], *, entry_points: bool = False) -> None:
    """Import each backend module (and, in a fresh worker, run torch's entry-point autoload first).

    A module that cannot be imported is bad input: ValueError naming it and the fix."""
    global _entry_points_loaded
    import torch

    if entry_points and not _entry_points_loaded and torch._is_device_backend_autoload_enabled():
        torch._import_device_backends()
        _entry_points_loaded = True
    modules = list(modules)
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # ImportError, or the backend's own registration failing
            raise ValueError(
                f"--backend {name}: cannot import it ({type(e).__name__}: {str(e)[:300]}); install the backend's "
                "package or put it on PYTHONPATH"
            ) from e
    owner.note_given(modules)  # their code is the backend's (a traceback through it is the backend's)


def resolve_target(target: str) -> tuple[Adapter, list[str]]:
    """The adapter and devices of `target`, or ValueError saying what is wrong and how to fix it."""
    import torch

    if not target.strip():
        raise ValueError("--target is empty; give a device such as sim, sim:1, cuda, cuda:0 or cpu")
    adapter_for(target).load()  # a backend the harness itself provides (sim) registers here
    try:
        dev = torch.device(target)
    except (RuntimeError, ValueError):
        raise ValueError(
            f"--target {target!r}: torch knows no device {target!r} in this process. If it is an out-of-tree "
            "backend, load it with --backend MODULE (or PORTHARNESS_BACKENDS=MODULE), or install its package "
            "with a torch.backends entry point"
        ) from None
    if dev.type == "meta":
        raise ValueError("--target meta: the meta device holds no data, so there is nothing to compare; "
                         "pick a real device")
    adapter = adapter_for(str(dev))
    return adapter, adapter.devices(str(dev))


__all__ = ["Adapter", "adapter_for", "backend_modules", "device_type", "load_backends", "register_adapter",
           "resolve_target"]
