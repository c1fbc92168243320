"""Real PrivateUse1 kernels: the entry points that have no sim tensor to dispatch on.

Factory functions (`torch.empty/ones/randn(..., device="sim")`, `cpu_tensor.to("sim")`) dispatch on
the device argument, reaching these kernels, which allocate host memory and hand back a `SimTensor`.
Everything after that goes through `SimTensor.__torch_dispatch__`.

Host implementations (`register_host_impl`) replace a CPU kernel where the CPU lacks something an
accelerator has: integer `histc`, which MoE routing in transformers uses on every non-CPU device.

`linear` and `matmul` have inference fast paths: PyTorch decomposes them (CompositeImplicit) into
2-6 ops before a backend sees them (t/addmm, view/mm/_unsafe_view, expand/bmm...), which makes them
half of all sim dispatches in a transformer. Without autograd, tracing or faults in play, and with
every op of the decomposition in the profile (learned by running the decomposition once per
operand layout), sim runs the whole composite once on the host tensors. The CPU decomposes it the
same way, so results are bit-identical (at ``default`` the multiplier operands are bf16-rounded
first, which commutes with the views). Otherwise (autograd, faults, a Python dispatch mode above sim)
the composite is decomposed exactly as before, so errors, traces, fault draws and recorders see
every op.

Scaled dot-product attention is special: it is a composite op whose backend choice (fused flash
kernel vs the unfused math path) is made in C++ from the device type, and for an unknown
PrivateUse1 device that choice is always "math". A CPU-emulating backend that took that path would
differ from its own CPU reference by ~1e-7 for reasons that have nothing to do with the backend's
numerics, so sim makes the same choice the CPU would (asking the CPU selector) and runs that kernel.
"""

from __future__ import annotations

import functools
import importlib
import math

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._python_dispatch import _get_current_dispatch_mode as _dispatch_mode

from .facts import register_host_impl
from .tensor import SimTensor, to_sim

_device = importlib.import_module(".device", __package__)
_memory = importlib.import_module(".memory", __package__)
_faults = importlib.import_module(".faults", __package__)
_opset = importlib.import_module(".opset", __package__)
_tensor = importlib.import_module(".tensor", __package__)
_precision = importlib.import_module(".precision", __package__)

aten = torch.ops.aten
_lib = torch.library.Library("aten", "IMPL")


def _index(device: torch.device | None) -> int:
    return _device._index_of(device) if device is not None else _device.current_device()


def _itemsize(dtype: torch.dtype | None) -> int:
    return (dtype or torch.get_default_dtype()).itemsize


def _empty_memory_format(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    idx = _index(device)
    _memory.check_fits(idx, math.prod(size) * _itemsize(dtype))  # refuse before the host allocates
    t = torch.empty(size, dtype=dtype, layout=layout, memory_format=memory_format or torch.contiguous_format)
    return to_sim(t, idx)


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    idx = _index(device)
    extent = 1 + sum((n - 1) * st for n, st in zip(size, stride, strict=True)) if all(size) else 0
    _memory.check_fits(idx, extent * _itemsize(dtype))
    return to_sim(torch.empty_strided(size, stride, dtype=dtype, layout=layout), idx)


def _copy_from(self, dst, non_blocking=False):
    src = self._inner if isinstance(self, SimTensor) else self
    if isinstance(dst, SimTensor):
        _precision.forget(dst._inner)
        dst._inner.copy_(src)
    else:
        dst.copy_(src)
    return dst


def _host_alias(t: torch.Tensor | None, traced: bool) -> torch.Tensor | None:
    if not isinstance(t, SimTensor):
        return t
    x = t._inner
    if traced:  # a placeholder of x's layout (x is fake)
        x = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)
    return x.detach().requires_grad_() if t.requires_grad else x


def _sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> int:
    """The kernel the CPU would pick. The selector reads requires_grad (a mask that needs grad rules
    out the fused kernel), which the inner host tensors never carry, so it gets aliases flagged like
    the sim tensors. While torch.compile traces, the inner tensors are fake and the fake selector
    always answers "math", so the real one is asked about placeholders, outside the tracing modes."""
    args = [query, key, value, attn_mask]
    inner = [a._inner for a in args if isinstance(a, SimTensor)]
    if all(type(x) is torch.Tensor for x in inner):
        hosts = [_host_alias(a, False) for a in args]
        return torch._fused_sdp_choice(*hosts, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if not all(type(n) is int for x in inner for n in (*x.shape, *x.stride())):
        return _MATH  # symbolic shapes: keep the traced answer
    with _disable_current_modes():
        hosts = [_host_alias(a, True) for a in args]
        return torch._fused_sdp_choice(*hosts, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


_MATH = 0  # sdp::SDPBackend::math
_FLASH = 1  # sdp::SDPBackend::flash_attention


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # As the CPU composite does first: boolean keep-mask -> additive mask in the query dtype.
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(
            attn_mask.logical_not(), float("-inf")
        )
    choice = _sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if choice == _FLASH:
        return aten._scaled_dot_product_flash_attention_for_cpu.default(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )[0]
    return aten._scaled_dot_product_attention_math.default(
        query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
    )[0]


def _layout_key(x: torch.Tensor) -> tuple:
    """What the CPU's linear/matmul decomposition branches on for one operand."""
    shape, strides = x.shape, x.stride()
    foldable = all(strides[i] == strides[i + 1] * shape[i + 1] for i in range(x.dim() - 2))
    return (x.dim(), x.is_contiguous(), foldable, x.numel() == 0, x.requires_grad)


def _fast_composite(op: torch._ops.OpOverload, host: object):
    """A kernel for `op` at AutogradPrivateUse1 that runs `host` on the inner tensors when it may.

    The first call for an operand layout runs the real decomposition and records the ops it
    dispatched; later calls take the fast path only if the current profile allows all of them."""
    reduce = _precision.reduce_operands
    parts: dict[tuple, frozenset] = {}
    # The C++ CompositeImplicitAutograd kernel, exactly what runs without this registration
    # (`op.decompose` would prefer a Python decomposition where one exists, as for matmul).
    composite = functools.partial(op._op_dk, torch._C.DispatchKey.CompositeImplicitAutograd)

    def decompose(key, args):
        outer = _tensor._trace
        _tensor._trace = set()
        try:
            out = composite(*args)
            if key is not None:
                parts[key] = frozenset(_tensor._trace)
            return out
        finally:
            seen, _tensor._trace = _tensor._trace, outer
            if outer is not None:
                outer |= seen

    def kernel(*args):
        tensors = [x for x in args if x is not None]
        if (
            _faults._active
            or _dispatch_mode() is not None  # a mode above sim (a recorder, a judge) must see every op
            or (torch.is_grad_enabled() and any(x.requires_grad for x in tensors))
            or any(type(x) is not SimTensor for x in tensors)
            or len({x._idx for x in tensors}) != 1
        ):
            return composite(*args)
        key = tuple(_layout_key(x) for x in tensors) + (len(args),)
        needed = parts.get(key)
        profile = _opset._profile
        if needed is None:
            return decompose(key, args)
        if not all(profile.allows(f) for f in needed):
            return composite(*args)  # raises the error the backend would (or falls back op by op)
        if _tensor._trace is not None:
            _tensor._trace |= needed
        inner = [None if x is None else x._inner for x in args]
        if _precision._mode != "highest":
            reduce(inner, (0, 1), args)
        # The CPU's decomposition reads requires_grad (matmul folds to mm when the weight needs grad),
        # so the host tensors carry the sim tensors' flags; grad mode is off or nothing needs grad.
        for i, x in enumerate(args):
            if x is not None and x.requires_grad:
                inner[i] = inner[i].detach().requires_grad_()
        return to_sim(host(*inner), tensors[0]._idx)

    return kernel


def register() -> None:
    _lib.impl("empty.memory_format", _empty_memory_format, "PrivateUse1")
    _lib.impl("empty_strided", _empty_strided, "PrivateUse1")
    _lib.impl("_copy_from", _copy_from, "PrivateUse1")
    # Registered at the autograd key so the kernels it calls record their own backward formulas.
    _lib.impl("scaled_dot_product_attention", _sdpa, "AutogradPrivateUse1")
    _lib.impl("linear", _fast_composite(aten.linear.default, torch._C._nn.linear), "AutogradPrivateUse1")
    _lib.impl("matmul", _fast_composite(aten.matmul.default, torch.matmul), "AutogradPrivateUse1")
    importlib.import_module(".moves", __package__).register(_tensor.SimTensor, _tensor.to_sim)
    importlib.import_module(".autocast", __package__).register()


def _histc(self, bins=100, min=0, max=0):
    # The CPU kernel has no integer histc; CUDA (what transformers' MoE routing targets on any
    # non-CPU device) has, with an output of the input's dtype.
    if self.is_floating_point():
        return aten.histc.default(self, bins, min, max)
    return aten.histc.default(self.double(), bins, min, max).to(self.dtype)


register_host_impl(aten.histc.default, _histc)
