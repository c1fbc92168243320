"""Precision mode: what a young accelerator does to fp32 matmuls by default.

TPUs (and TF32 on NVIDIA) run fp32 matmul/conv with reduced-precision multiplies by default: inputs are
rounded to bf16, products are accumulated in fp32. Models "run" but drift. `sim` copies that:

- ``default`` (the default): inputs of the matmul family (mm, addmm, bmm, baddbmm, addbmm, convolution,
  dot, mv, addmv; linear and matmul reach sim as these) are rounded to bf16 (round to nearest even),
  then computed and accumulated in fp32. Biases and every other op stay fp32.
- ``highest``: true fp32, bit-identical to the CPU reference.

The rounding happens in sim's native dispatch path (``csrc/rounding.cpp``). A parameter's rounded copy
(and its views', such as ``weight.t()``) is kept until anything writes the parameter's storage or it
dies, bounded by ``PORTHARNESS_SIM_ROUND_CACHE_MB`` (default 128); `torch.sim.empty_cache()` drops it.

Switch: env ``PORTHARNESS_SIM_PRECISION``, `set_precision()`, or the `precision()` context manager (all
re-exported by ``harness.sim``; this module is ``precision_mode`` so that the name ``precision`` is the
context manager's alone).
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager

import torch

from .native import ext
from .switch import Switch

PRECISION_ENV = "PORTHARNESS_SIM_PRECISION"
MODES = ("default", "highest")


def _validate(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown sim precision {mode!r}; expected one of {', '.join(MODES)}")
    return mode


_switch = Switch(lambda mode: ext.set_reduced_precision(mode != "highest"),
                 _validate(os.environ.get(PRECISION_ENV, "default")))


def get_precision() -> str:
    return _switch.get()


def set_precision(mode: str) -> None:
    _switch.set(_validate(mode))


def precision(mode: str) -> AbstractContextManager[None]:
    """Run the block with the given sim precision mode, restoring the previous one after."""
    return _switch.scoped(_validate(mode))


def round_to_bf16(t: torch.Tensor) -> torch.Tensor:
    """What a bf16 multiplier sees of an fp32 operand (round-to-nearest-even, then back to fp32)."""
    if t.dtype is torch.float32:
        return t.to(torch.bfloat16).to(torch.float32)
    return t
