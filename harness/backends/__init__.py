"""Backend adapters: the one place that knows how to drive each kind of device.

The runner, worker, CLI and benchmarks ask `adapter_for(target)` how to load the backend, which
devices it has, which settings it accepts and how to apply them, and which errors are the device's
fault; they never branch on a device name. `base.Adapter` answers for any accelerator PyTorch knows
(cuda, xpu, mps, hpu, an out-of-tree PrivateUse1 backend); `sim` and `cpu` add what is specific to them.
"""

from __future__ import annotations

from harness.backends.base import Adapter
from harness.backends.cpu import CpuAdapter
from harness.backends.sim import SimAdapter

_SPECIFIC: dict[str, type[Adapter]] = {"sim": SimAdapter, "cpu": CpuAdapter}


def device_type(target: str) -> str:
    """`cuda:1` -> `cuda` (no torch import: the CLI validates before paying for one)."""
    return target.split(":", 1)[0].strip()


def adapter_for(target: str) -> Adapter:
    """The adapter for the device type `target` names."""
    kind = device_type(target)
    return _SPECIFIC.get(kind, Adapter)(kind)


__all__ = ["Adapter", "adapter_for", "device_type"]
