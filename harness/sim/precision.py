"""Precision mode: what a young accelerator does to fp32 matmuls by default.

TPUs (and TF32 on NVIDIA) run fp32 matmul/conv with reduced-precision multiplies by default: inputs are
rounded to bf16, products are accumulated in fp32. Models "run" but drift. `sim` copies that:

- ``default`` (the default): inputs of the matmul family (mm, addmm, bmm, baddbmm, convolution, and
  linear/matmul, which PyTorch decomposes into those before a backend sees them) are rounded to bf16,
  then computed and accumulated in fp32. Biases and every other op stay fp32.
- ``highest``: true fp32, bit-identical to the CPU reference.

Switch: env ``PORTHARNESS_SIM_PRECISION``, `set_precision()`, or the `precision()` context manager.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

PRECISION_ENV = "PORTHARNESS_SIM_PRECISION"
MODES = ("default", "highest")

aten = torch.ops.aten

# op -> positions of the arguments that the reduced-precision multiplier sees (biases excluded).
REDUCED_ARGS: dict[torch._ops.OpOverload, tuple[int, ...]] = {
    aten.mm.default: (0, 1),
    aten.bmm.default: (0, 1),
    aten.addmm.default: (1, 2),
    aten.baddbmm.default: (1, 2),
    aten.addbmm.default: (1, 2),
    aten.convolution.default: (0, 1),
    aten.dot.default: (0, 1),
    aten.mv.default: (0, 1),
    aten.addmv.default: (1, 2),
}


def _validate(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown sim precision {mode!r}; expected one of {', '.join(MODES)}")
    return mode


_mode = _validate(os.environ.get(PRECISION_ENV, "default"))


def get_precision() -> str:
    return _mode


def set_precision(mode: str) -> None:
    global _mode
    _mode = _validate(mode)


@contextmanager
def precision(mode: str) -> Iterator[None]:
    """Run the block with the given sim precision mode, restoring the previous one after."""
    global _mode
    prev, _mode = _mode, _validate(mode)
    try:
        yield
    finally:
        _mode = prev


def round_to_bf16(t: torch.Tensor) -> torch.Tensor:
    """What a bf16 multiplier sees of an fp32 operand (round-to-nearest-even, then back to fp32)."""
    if t.dtype is torch.float32:
        return t.to(torch.bfloat16).to(torch.float32)
    return t


def reduce_args(func: torch._ops.OpOverload, args: tuple) -> tuple:
    """Round the multiplier operands of `func` when in ``default`` mode; identity otherwise."""
    positions = REDUCED_ARGS.get(func)
    if positions is None or _mode == "highest":
        return args
    out = list(args)
    for i in positions:
        if i < len(out) and isinstance(out[i], torch.Tensor):
            out[i] = round_to_bf16(out[i])
    return tuple(out)
