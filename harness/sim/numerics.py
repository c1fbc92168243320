"""Planted numeric bugs: quiet, deterministic kernel errors of the kinds young backends ship.

Not a NaN storm: each bug changes one op family's results by about what a real kernel bug does
(1e-3 relative, or a precision shortcut), so only a verdict that knows what the backend's declared
precision explains can tell it from rounding. Each bug is scoped to its ops; a model that never calls
them is bit-for-bit unaffected.

======================= ==================================================================== ============
kind                    what the kernel does wrong                                           ops
======================= ==================================================================== ============
``bf16-accumulate``     a reduction accumulates in bf16 (pairwise, each partial sum rounded) sum, mean
``softmax-no-max``      softmax in bf16 without subtracting the row max first               _softmax
``approx-exp``          exp and rsqrt from an approximation with ~1e-3 relative error        exp, rsqrt
``gelu-mixup``          GELU computed with the tanh formula where erf was asked (and back)   gelu
``grad-scale``          LayerNorm's backward kernel scales its weight gradient by 1+1e-3    native_layer_norm_backward
``cache-off-by-one``    from decoding step 2 on, a KV-cache write lands one slot early       index_copy_, cat
======================= ==================================================================== ============

``cache-off-by-one`` is the decoding bug a single forward never meets. A KV-cache write is recognised by
its shape: a 4-D float tensor (batch, heads, sequence, head dim) receiving positions along dim 2, by
``index_copy_`` into a preallocated cache (transformers' StaticCache) or by ``cat`` onto a growing one
(DynamicCache). Each cache is followed by its memory: a write at position 0 or of several positions (a
prompt's), or a ``cat`` onto an empty tensor, starts it at step 0; each one-position write into it (or
``cat`` onto the tensor its last write made, a sliding window's view of it included) is the next step.
From step `CACHE_BUG_STEP` on, the new token's key/value overwrites the previous token's slot and its own
slot holds zeros (what a preallocated cache holds before its first write; a growing cache gets the same
zeros appended, so both caches end up alike). Everything else, the prompt's forward and the steps before
`CACHE_BUG_STEP` included, is bit-identical. (Swapping the two slots would not do: attention over a set of
key/value pairs does not see their order.)

Switch: env ``PORTHARNESS_SIM_NUMERICS`` (comma-separated kinds), `set_numerics_bugs()`, or the
`numerics_bugs()` context manager. A planted bug is a Python kernel registered for its ops on sim's
device key while the switch is on (over the native one, which comes back when it is off); it runs on
host views of the sim tensors and hands its results to the device without copies. `numerics_hits()` counts, per op, the calls where the planted bug
changed the result beyond fp32 rounding (4 ulp of its magnitude): a model whose sums are all over
integers, or whose GELU inputs are all tiny, calls the op without exercising the bug.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch.utils._pytree import tree_leaves, tree_map

from .native import ext
from .switch import Switch

NUMERICS_ENV = "PORTHARNESS_SIM_NUMERICS"
aten = torch.ops.aten


def _tree_sum_bf16(x: torch.Tensor, dims: list[int] | None, keepdim: bool) -> torch.Tensor:
    """Sum over `dims` with a bf16 accumulator: pairwise, every partial sum rounded to bf16."""
    nd = x.dim()
    dims = sorted({d % nd for d in dims}) if dims else list(range(nd))
    keep = [d for d in range(nd) if d not in dims]
    y = x.permute(*keep, *dims).reshape(*[x.shape[d] for d in keep], -1).to(torch.bfloat16)
    while y.shape[-1] > 1:
        if y.shape[-1] % 2:
            y = torch.cat([y, torch.zeros_like(y[..., :1])], dim=-1)
        y = (y[..., 0::2].float() + y[..., 1::2].float()).to(torch.bfloat16)
    out = y[..., 0].float()
    if keepdim:
        for d in dims:
            out = out.unsqueeze(d)
    return out


def _reduced(x: torch.Tensor, dims) -> int:
    return math.prod(x.shape[d] for d in dims) if dims else x.numel()


def _sum(self, dim=None, keepdim=False, *, dtype=None):
    if self.dtype is not torch.float32 or dtype not in (None, torch.float32) or self.numel() == 0:
        return aten.sum.dim_IntList(self, dim, keepdim, dtype=dtype)
    return _tree_sum_bf16(self, list(dim) if dim else None, keepdim)


def _sum_all(self, *, dtype=None):
    return _sum(self, None, False, dtype=dtype)


def _mean(self, dim=None, keepdim=False, *, dtype=None):
    if self.dtype is not torch.float32 or dtype not in (None, torch.float32) or self.numel() == 0:
        return aten.mean.dim(self, dim, keepdim, dtype=dtype)
    n = _reduced(self, list(dim) if dim else None)
    return (_tree_sum_bf16(self, list(dim) if dim else None, keepdim) / n).to(torch.bfloat16).float()


def _mean_all(self, *, dtype=None):
    return _mean(self, None, False, dtype=dtype)


def _softmax(self, dim, half_to_float):
    if self.dtype is not torch.float32:
        return aten._softmax.default(self, dim, half_to_float)
    e = torch.exp(self.to(torch.bfloat16))  # no max subtraction, bf16 throughout
    return (e / e.sum(dim, keepdim=True)).float()


def _wobble(x: torch.Tensor, k: float, phase: float) -> torch.Tensor:
    """1 + 1e-3 * cos(k x + phase): a deterministic ~1e-3 relative error, as a cheap approximation has."""
    return 1.0 + 1e-3 * torch.cos(x * k + phase)


def _exp(self):
    return torch.exp(self) * _wobble(self, 3.7, 1.3) if self.is_floating_point() else torch.exp(self)


def _rsqrt(self):
    return torch.rsqrt(self) * _wobble(self, 7.3, 0.5) if self.is_floating_point() else torch.rsqrt(self)


def _gelu(self, *, approximate="none"):
    return aten.gelu.default(self, approximate="tanh" if approximate == "none" else "none")


def _layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask):
    grads = aten.native_layer_norm_backward.default(
        grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask
    )
    return (grads[0], grads[1] * (1 + 1e-3) if grads[1] is not None else None, grads[2])


CACHE_BUG_STEP = 2
_steps: dict[int, int] = {}  # a cache's memory -> the decoding step of its last write


def _memory(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()  # the device memory: host views and adopted results share it


def _kv(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_floating_point()


def _index_copy_(self, dim, index, source):
    if _kv(self) and _kv(source) and dim % 4 == 2 and index.numel() >= 1:
        if int(index.min()) == 0 or index.numel() > 1:  # a sequence's first write (its prompt's, or position 0)
            _steps[_memory(self)] = 0
        elif _memory(self) in _steps:
            step = _steps[_memory(self)] = _steps[_memory(self)] + 1
            if step >= CACHE_BUG_STEP:
                return aten.index_copy_.default(self, dim, index - 1, source)  # one slot early
    return aten.index_copy_.default(self, dim, index, source)


def _cat(tensors, dim=0):
    if len(tensors) == 2 and _kv(tensors[1]) and dim % 4 == 2:
        old, new = tensors
        if old.numel() == 0:  # a growing cache's first write
            out = aten.cat.default(tensors, dim)
            _steps[_memory(out)] = 0
            return out
        step = _steps.pop(_memory(old), None) if _kv(old) and new.shape[2] == 1 else None
        if step is not None and old.shape[:2] == new.shape[:2] and old.shape[3] == new.shape[3]:
            step += 1
            out = (aten.cat.default([old[:, :, :-1], new, torch.zeros_like(new)], 2)  # one slot early, its own zeros
                   if step >= CACHE_BUG_STEP else aten.cat.default(tensors, dim))
            _steps[_memory(out)] = step
            return out
    return aten.cat.default(tensors, dim)


BUGS: dict[str, dict[torch._ops.OpOverload, Callable]] = {
    "bf16-accumulate": {
        aten.sum.dim_IntList: _sum,
        aten.sum.default: _sum_all,
        aten.mean.dim: _mean,
        aten.mean.default: _mean_all,
    },
    "softmax-no-max": {aten._softmax.default: _softmax},
    "approx-exp": {aten.exp.default: _exp, aten.rsqrt.default: _rsqrt},
    "gelu-mixup": {aten.gelu.default: _gelu},
    "grad-scale": {aten.native_layer_norm_backward.default: _layer_norm_backward},
    "cache-off-by-one": {aten.index_copy_.default: _index_copy_, aten.cat.default: _cat},
}
KINDS = tuple(BUGS)


def _validate(kinds: tuple[str, ...]) -> tuple[str, ...]:
    bad = [k for k in kinds if k not in BUGS]
    if bad:
        raise ValueError(f"unknown sim numerics bug(s) {', '.join(bad)}; expected some of {', '.join(KINDS)}")
    return kinds


def _parse(spec: str) -> tuple[str, ...]:
    return _validate(tuple(k.strip() for k in spec.split(",") if k.strip()))


_lib: torch.library.Library | None = None  # the kernels of the planted bugs, while any is on


_hits: dict[str, int] = {}


def _changed(bugged: object, right: object) -> bool:
    """Beyond fp32 rounding: rms(bugged - right) > 4 ulp of rms(right)."""
    pairs = list(zip(bugged, right, strict=False)) if isinstance(bugged, (tuple, list)) else [(bugged, right)]
    for b, r in pairs:
        if isinstance(b, torch.Tensor) and b.is_floating_point() and b.numel() and b.shape == r.shape:
            fin = torch.isfinite(r) & torch.isfinite(b)
            if not torch.equal(torch.isfinite(r), torch.isfinite(b)):
                return True
            d, rr = (b.double() - r.double())[fin], r.double()[fin]
            if d.numel() and d.square().mean().sqrt() > 4 * torch.finfo(r.dtype).eps * rr.square().mean().sqrt():
                return True
    return False


def _op_name(func: torch._ops.OpOverload) -> str:
    ov = func._overloadname
    return func._schema.name if ov == "default" else f"{func._schema.name}.{ov}"


def _counted(func: torch._ops.OpOverload, impl: Callable) -> Callable:
    name = _op_name(func)
    inplace = func._schema.is_mutable

    def run(*args, **kwargs):
        before = args[0].clone() if inplace else None
        out = impl(*args, **kwargs)
        right = func(before, *args[1:], **kwargs) if inplace else func(*args, **kwargs)  # for the record only
        if _changed(out, right):
            _hits[name] = _hits.get(name, 0) + 1
        return out

    return run


def _device_kernel(func: torch._ops.OpOverload, impl: Callable) -> Callable:
    """`impl` (on host tensors) as func's kernel on sim: entered like a native kernel (trace, profile),
    run on host views, its results adopted by the first argument's device, faults drawn as for any launch."""
    from . import fault_injection as faults
    name, overload = func._schema.name, func._overloadname
    run = _counted(func, impl)
    inplace = func._schema.is_mutable

    def kernel(*args, **kwargs):
        ext.enter_op(name, "" if overload == "default" else overload)
        devices = [x.device.index for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]  # cat: a list
        idx = devices[0] if devices else ext.current_device()
        host = tree_map(lambda x: ext.host_view(x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
        out = run(*host[0], **host[1])
        if inplace:  # it wrote through its first argument's host view: that tensor is the result (no fresh
            return args[0]  # output for a fault to land in, as on the native path)
        fresh: list[torch.Tensor] = []

        def adopt(x):
            if isinstance(x, torch.Tensor):
                fresh.append(ext.adopt(x, idx))
                return fresh[-1]
            return x

        result = tree_map(adopt, out)
        if idx in faults.active_faults() and fresh:
            faults.on_launch(idx, fresh)
        return result

    return kernel


def _register(kinds: tuple[str, ...]) -> None:
    global _lib
    if _lib is not None:
        _lib._destroy()
        _lib = None
    if not kinds:
        return
    _lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        for kind in kinds:
            for func, impl in BUGS[kind].items():
                _lib.impl(func, _device_kernel(func, impl), "PrivateUse1")


_switch: Switch[tuple[str, ...]] = Switch(_register, ())


def numerics_hits() -> dict[str, int]:
    """Calls per op whose result the planted bugs changed beyond fp32 rounding, since the last reset."""
    return dict(_hits)


def reset_numerics_hits() -> None:
    _hits.clear()


def get_numerics_bugs() -> tuple[str, ...]:
    return _switch.get()


def set_numerics_bugs(*kinds: str) -> None:
    """Plant these bugs (none: every kernel correct again)."""
    _switch.set(_validate(tuple(kinds)))


def numerics_bugs(*kinds: str) -> AbstractContextManager[None]:
    """Run the block with these bugs planted."""
    return _switch.scoped(_validate(tuple(kinds)))


def plant_from_env() -> None:
    """Plant the bugs ``PORTHARNESS_SIM_NUMERICS`` names (once sim's native kernels are registered: the
    bugs' kernels must go on top of them)."""
    set_numerics_bugs(*_parse(os.environ.get(NUMERICS_ENV, "")))
