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

Mixed precision (``--amp``): ``amp-bf16`` / ``amp-fp16`` are the step under
``torch.autocast("cpu", dtype)``: the CPU's own autocast op lists decide which ops run in the low
dtype. A target that also rounds the fp32 matmuls autocast leaves alone (sim's ``default``: RoPE tables
computed with autocast disabled) declares both, ``amp-bf16+bf16-matmul``. A step opens its autocast
region itself (`autocast_region`: around the forward and the loss, not the backward), for whatever
device its inputs are on, when the contract or the target's configuration asks for one (`amp`).

The CPU's op lists are not the target's: CUDA's (and sim's, which copies them) keep softmax,
layer_norm, exp, log, ... in fp32 where the CPU runs them in the low dtype, and the CPU keeps FFTs,
some pooling and linear algebra in fp32 where CUDA does not. The expected reference is therefore a
bound on what autocast's own rounding explains, not a replica of the target's arithmetic.

Nothing here imports a backend: the emulation is plain torch on the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, replace
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
    round_operand: Callable[[torch.Tensor], torch.Tensor] | None  # None: fp32 matmul operands stay fp32
    meaning: str
    amp: torch.dtype | None = None  # the step runs under autocast to this dtype
    rounding: str = ""  # the operand-rounding contract this one applies ("" = none)

    @property
    def exact(self) -> bool:
        return self.round_operand is None and self.amp is None


CONTRACTS: dict[str, Contract] = {
    c.name: c
    for c in (
        Contract("fp32", None, "true fp32"),
        Contract("tf32", round_tf32, "matmul/conv operands rounded to TF32, fp32 accumulate", rounding="tf32"),
        Contract("bf16-matmul", _via(torch.bfloat16), "matmul/conv operands rounded to bf16, fp32 accumulate",
                 rounding="bf16-matmul"),
        Contract("fp16-matmul", _via(torch.float16), "matmul/conv operands rounded to fp16, fp32 accumulate",
                 rounding="fp16-matmul"),
        Contract("amp-bf16", None, "the step under torch.autocast(cpu, bfloat16)", amp=torch.bfloat16),
        Contract("amp-fp16", None, "the step under torch.autocast(cpu, float16)", amp=torch.float16),
    )
}
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def contract(name: str) -> Contract:
    """The contract called `name` (``amp-X+Y``: autocast to X with Y's operand rounding for the fp32
    matmuls left); ValueError listing the known ones."""
    amp, plus, base = name.partition("+")
    if plus and amp in CONTRACTS and CONTRACTS[amp].amp is not None and base in CONTRACTS \
            and CONTRACTS[base].amp is None and not CONTRACTS[base].exact:
        b = CONTRACTS[base]
        return replace(b, name=name, amp=CONTRACTS[amp].amp, meaning=f"{CONTRACTS[amp].meaning}; {b.meaning}")
    if name not in CONTRACTS:
        raise ValueError(f"--declared-precision {name!r}: expected one of {', '.join(CONTRACTS)} "
                         "(or amp-X+Y: autocast with Y's matmul rounding)")
    return CONTRACTS[name]


def with_amp(name: str, amp: str | None) -> str:
    """The contract a target declaring `name` has under ``--amp amp``."""
    if not amp or contract(name).amp is not None:
        return name
    return f"amp-{amp}" if name == "fp32" else f"amp-{amp}+{name}"


_AMP: ContextVar[torch.dtype | None] = ContextVar("portharness_amp", default=None)


@contextlib.contextmanager
def amp(dtype: torch.dtype | None) -> Iterator[None]:
    """Steps run inside open their autocast region (`autocast_region`) with `dtype` (None: none)."""
    token = _AMP.set(dtype)
    try:
        yield
    finally:
        _AMP.reset(token)


def amp_dtype() -> torch.dtype | None:
    return _AMP.get()


def autocast_region(device: torch.device | str) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for `device`'s type when a step runs under `amp`, else nothing."""
    dtype = _AMP.get()
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


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
    """Run CPU ops under a contract: the matmul family sees rounded operands, everything else is fp32;
    under an amp contract, steps run inside open their autocast region."""

    def __init__(self, c: Contract) -> None:
        super().__init__()
        self.contract = c
        self._amp: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> Emulate:
        self._amp = amp(self.contract.amp)
        self._amp.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            return super().__exit__(*exc)
        finally:
            if self._amp is not None:
                self._amp.__exit__(*exc)
                self._amp = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*round_operands(self.contract, func, args), **(kwargs or {}))
