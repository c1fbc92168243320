"""Precision mode: what a young accelerator does to fp32 matmuls by default.

TPUs (and TF32 on NVIDIA) run fp32 matmul/conv with reduced-precision multiplies by default: inputs are
rounded to bf16, products are accumulated in fp32. Models "run" but drift. `sim` copies that:

- ``default`` (the default): inputs of the matmul family (mm, addmm, bmm, baddbmm, convolution, and
  linear/matmul, which PyTorch decomposes into those before a backend sees them) are rounded to bf16,
  then computed and accumulated in fp32. Biases and every other op stay fp32.
- ``highest``: true fp32, bit-identical to the CPU reference.

Switch: env ``PORTHARNESS_SIM_PRECISION``, `set_precision()`, or the `precision()` context manager.

Rounding a weight costs two kernel launches per matmul, as much as the matmul itself for small
models, and a parameter does not change between calls. So the rounded copy of a parameter (or of
a view of one, such as ``weight.t()`` in ``linear``) is cached per storage and view geometry while
that parameter lives, and dropped whenever anything writes that storage: every in-place/out= op
the dispatcher runs, host copies into it, ``param.data = ...``, and `tensor.inner()` (the raw
host access collectives use). Activations are rounded afresh every call. The cache costs one fp32
copy of each matmul weight.
"""

from __future__ import annotations

import os
import weakref
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


class _Rounded:
    """The rounded copies of views of one parameter's storage, alive while the parameter's host
    tensor is (a weakref to the host tensor, not to the parameter: `torch.utils.swap_tensors`, how
    Module.to/half move sim parameters, refuses tensors that have weakrefs)."""

    __slots__ = ("owner", "views")

    def __init__(self, owner: torch.Tensor, ptr: int) -> None:
        self.owner = weakref.ref(owner, lambda _ref: _drop(ptr, self))
        self.views: dict[tuple, torch.Tensor] = {}


# host storage data_ptr -> rounded copies; only ever holds parameters' storages.
_cache: dict[int, _Rounded] = {}
# The cache is an fp32 copy of every matmul weight: free for a tiny model, a second copy of a real
# checkpoint (memory a real device does not spend: its multiplier rounds in the datapath). Past this
# many bytes weights are rounded afresh on each call (same bits, two more launches); a 355M model
# checked with a 512 MiB cache peaked 400 MiB higher and ran no faster than with 128 MiB.
CACHE_BYTES = int(float(os.environ.get("PORTHARNESS_SIM_ROUND_CACHE_MB", "128")) * 2**20)
_cached_bytes = 0


def _free(entry: _Rounded) -> None:
    global _cached_bytes
    _cached_bytes -= sum(v.nbytes for v in entry.views.values())
    entry.views.clear()


def _drop(ptr: int, entry: _Rounded) -> None:
    if _cache.get(ptr) is entry:
        _free(_cache.pop(ptr))


def forget(t: object) -> None:
    """Drop cached rounded copies of `t`'s host storage (call before/after writing it)."""
    if not _cache:
        return
    if isinstance(t, (list, tuple)):
        for x in t:
            forget(x)
    elif type(t) is torch.Tensor:  # a fake/functional tensor (torch.compile tracing) has no data pointer
        entry = _cache.pop(t.untyped_storage().data_ptr(), None)
        if entry is not None:
            _free(entry)


def clear_cache() -> None:
    """Drop every cached rounded copy (frees their memory)."""
    global _cached_bytes
    _cache.clear()
    _cached_bytes = 0


def _rounded_operand(wrapper: object, x: torch.Tensor) -> torch.Tensor:
    """`x` rounded to bf16, from the cache when `wrapper` is (a view of) a live parameter."""
    base = getattr(wrapper, "_base", None)
    owner = wrapper if base is None else base
    if not getattr(owner, "_is_param", False) or not x.numel() or type(x) is not torch.Tensor:
        return x.to(torch.bfloat16).to(torch.float32)  # not a parameter, or traced (torch.compile)
    owner = owner._inner
    ptr = x.untyped_storage().data_ptr()
    entry = _cache.get(ptr)
    if entry is None or entry.owner() is not owner:
        entry = _cache[ptr] = _Rounded(owner, ptr)
    key = (x.storage_offset(), x.shape, x.stride())
    r = entry.views.get(key)
    if r is None:
        global _cached_bytes
        r = x.to(torch.bfloat16).to(torch.float32)
        if _cached_bytes + r.nbytes <= CACHE_BYTES:
            entry.views[key] = r
            _cached_bytes += r.nbytes
    return r


def reduce_operands(inner: list, positions: tuple[int, ...], wrappers: tuple) -> None:
    """In ``default`` mode, replace the multiplier operands in `inner` (host tensors) by their bf16
    roundings; `wrappers` are the sim tensors they came from (used to recognise parameters)."""
    if _mode == "highest":
        return
    for i in positions:
        if i < len(inner):
            x = inner[i]
            if isinstance(x, torch.Tensor) and x.dtype is torch.float32:
                inner[i] = _rounded_operand(wrappers[i], x)


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
