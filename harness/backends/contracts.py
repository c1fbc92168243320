"""Numerics contracts: what a backend declares about its precision, emulated on the CPU.

A chip that multiplies fp32 matrices with bf16 inputs by default (TPUs; sim's ``default``) is not broken:
it does what it declares. To tell that apart from a real numeric bug the worker runs an *expected*
reference: the fp32 CPU model under a dispatch mode that applies the declared contract's rounding, and
derives the allowed error from it (three-way comparison: fp64 oracle, contract-emulating expected, target).

Contracts (the rounding is applied to the multiplier operands of the matmul family -- mm, bmm, addmm,
baddbmm, addbmm, convolution, dot, mv, addmv; what linear/matmul/conv decompose into -- accumulation and
every other op stay fp32):

- ``fp32``: true fp32; the expected reference is the fp32 reference itself.
- ``tf32``: operands rounded to TF32 (10-bit mantissa), NVIDIA's ``allow_tf32`` / precision "high".
- ``bf16-matmul``: operands rounded to bf16 (7-bit mantissa), TPU-style default; ``medium``.
- ``fp16-matmul``: operands rounded to fp16.

Nothing here imports a backend: the emulation is plain torch on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# op -> positions of the operands a reduced-precision multiplier sees (biases and accumulators excluded)
MULTIPLIER_ARGS: dict[Any, tuple[int, ...]] = {
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


def round_tf32(t: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even to TF32's 10-bit mantissa (the low 13 bits of an fp32 cleared)."""
    bits = t.contiguous().view(torch.int32)
    lsb = (bits >> 13) & 1
    rounded = (bits + 0xFFF + lsb) & ~0x1FFF
    finite = torch.isfinite(t)
    return torch.where(finite, rounded.view(torch.float32), t)


def _via(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t.to(dtype).to(torch.float32)


@dataclass(frozen=True)
class Contract:
    name: str
    round_operand: Callable[[torch.Tensor], torch.Tensor] | None  # None: true fp32, nothing to emulate
    meaning: str

    @property
    def exact(self) -> bool:
        return self.round_operand is None


CONTRACTS: dict[str, Contract] = {
    c.name: c
    for c in (
        Contract("fp32", None, "true fp32"),
        Contract("tf32", round_tf32, "matmul/conv operands rounded to TF32, fp32 accumulate"),
        Contract("bf16-matmul", _via(torch.bfloat16), "matmul/conv operands rounded to bf16, fp32 accumulate"),
        Contract("fp16-matmul", _via(torch.float16), "matmul/conv operands rounded to fp16, fp32 accumulate"),
    )
}


def contract(name: str) -> Contract:
    """The contract called `name`; ValueError listing the known ones."""
    if name not in CONTRACTS:
        raise ValueError(f"--declared-precision {name!r}: expected one of {', '.join(CONTRACTS)}")
    return CONTRACTS[name]


def round_operands(c: Contract, func: Any, args: tuple) -> tuple:
    """`args` of `func` with the multiplier operands rounded as `c` declares (fp32 operands only)."""
    positions = MULTIPLIER_ARGS.get(func)
    if positions is None or c.round_operand is None:
        return args
    out = list(args)
    for i in positions:
        if i < len(out) and isinstance(out[i], torch.Tensor) and out[i].dtype is torch.float32:
            out[i] = c.round_operand(out[i])
    return tuple(out)


class Emulate(TorchDispatchMode):
    """Run CPU ops under a contract: the matmul family sees rounded operands, everything else is fp32."""

    def __init__(self, c: Contract) -> None:
        super().__init__()
        self.contract = c

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*round_operands(self.contract, func, args), **(kwargs or {}))
