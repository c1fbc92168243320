"""The adapter contract: what the harness asks of a backend, answered for any PyTorch device type.

`Adapter` is the generic answer for an accelerator that plugs into PyTorch as its own device type
(cuda, xpu, mps, hpu, or an out-of-tree PrivateUse1 backend): the device count comes from the
backend's device module, the precision knob is `torch.set_float32_matmul_precision`, and nothing is
known about its errors beyond PyTorch's own messages. Backends with more to say (`sim`, the CPU, a
vendor's) subclass it and override only what differs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

# --precision values every backend accepts: torch's float32 matmul precision knob
MATMUL_PRECISIONS = ("default", "highest", "high", "medium")


class Adapter:
    """Everything the runner, worker, CLI and benchmarks need to know about one device type."""

    options: tuple[str, ...] = ()  # backend-specific settings keys it accepts beyond precision/attn
    precisions: tuple[str, ...] = MATMUL_PRECISIONS

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kind!r})"

    # -- process setup -----------------------------------------------------------------------

    def load(self) -> None:
        """Make the device type usable in this process (import/register the backend). Idempotent."""

    def device_count(self) -> int:
        import torch

        module = getattr(torch, self.kind, None)
        count = getattr(module, "device_count", None)
        return int(count()) if callable(count) else 0

    def devices(self, target: str) -> list[str]:
        """The devices a run on `target` uses: the one it names (`cuda:1`), or every device of its type."""
        import torch

        dev = torch.device(target)
        count = self.device_count()
        if count < 1:
            raise ValueError(f"target {target!r}: no {dev.type} devices visible in this process")
        if dev.index is not None:
            if dev.index >= count:
                raise ValueError(
                    f"target {target!r}: device index {dev.index} out of range ({count} {dev.type} device(s))"
                )
            return [str(dev)]
        return [f"{dev.type}:{i}" for i in range(count)]

    # -- settings ----------------------------------------------------------------------------

    def check_settings(self, settings: dict[str, Any]) -> dict[str, Any]:
        """Validated settings to record with each row; ValueError names the bad value and the choices."""
        out = dict(settings)
        precision = out.setdefault("precision", "default")
        if precision not in self.precisions:
            raise ValueError(
                f"--precision {precision!r}: {self.kind} supports {', '.join(self.precisions)}"
            )
        for key in out:
            if key not in ("precision", "attn", *self.options):
                raise ValueError(f"--{key} is not an option of the {self.kind} backend")
        return out

    def worker_env(self, settings: dict[str, Any]) -> dict[str, str]:
        """Environment a worker needs for `settings` (switches a backend reads when it loads)."""
        return {}

    @contextlib.contextmanager
    def apply(self, settings: dict[str, Any]) -> Iterator[None]:
        """Run the target side of a model under `settings` (restored afterwards)."""
        import torch

        prev = torch.get_float32_matmul_precision()
        precision = settings.get("precision", "default")
        if precision != "default":
            torch.set_float32_matmul_precision(precision)
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(prev)

    # -- errors ------------------------------------------------------------------------------

    def is_device_fault(self, exc: BaseException) -> bool:
        """True when `exc` says the device, not the model, is at fault (counts toward quarantine)."""
        return False
