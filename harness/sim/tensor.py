"""`SimTensor`: a tensor whose device is `sim:N` and whose memory is a host-side CPU tensor.

Why a wrapper subclass with `__torch_dispatch__` rather than per-op `torch.library` kernels: one
Python entry point sees every ATen op after autograd and composite decomposition, exactly the view
a real PrivateUse1 backend gets. That single place enforces the op allow-list, the precision mode,
the same-device rule and fault injection for all ~2,000 ATen ops, and runs the CPU kernel for the
math. Factory functions (`torch.ones(..., device="sim")`) carry no tensor to dispatch on, so they
reach the real PrivateUse1 kernels registered in `kernels.py`, which build `SimTensor`s.

The wrapper carries the metadata (sizes, strides, dtype, device) autograd and user code see; the
inner CPU tensor holds the data. Views of a SimTensor wrap views of the inner tensor, so in-place
updates through a view reach the base as on a real device.
"""

from __future__ import annotations

import importlib

import torch

_device = importlib.import_module(".device", __package__)
_faults = importlib.import_module(".faults", __package__)
_opset = importlib.import_module(".opset", __package__)
_precision = importlib.import_module(".precision", __package__)

aten = torch.ops.aten
_CPU = torch.device("cpu")
_NO_KWARGS: dict = {}
_SIM_DEVICES = [torch.device("sim", i) for i in range(_device.device_count())]

# Ops that legitimately mix devices (they are how data moves between host and device).
_CROSS_DEVICE_OK = frozenset(
    {
        aten.copy_.default,
        aten._to_copy.default,
        aten._copy_from.default,
        aten._copy_from_and_resize.default,
        aten.copy.default,
    }
)


class SimTensor(torch.Tensor):
    """A tensor on a simulated accelerator. Use `.cpu()` / `.to("cpu")` to get host data back."""

    _inner: torch.Tensor
    _idx: int
    __slots__ = ("_inner", "_idx")

    # Skips the Python-level __torch_function__ hop on every call: a large share of the overhead.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, inner: torch.Tensor, idx: int) -> SimTensor:
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            inner.size(),
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            layout=inner.layout,
            device=_SIM_DEVICES[idx],
            requires_grad=False,
        )
        r._inner = inner
        r._idx = idx
        return r

    def __repr__(self, *, tensor_contents: object = None) -> str:
        body = repr(self._inner)
        suffix = f", device='sim:{self._idx}'"
        if body.endswith(")"):
            return body[:-1] + suffix + ")"
        return body + suffix

    def __reduce_ex__(self, proto: int):  # pickling moves host data, like torch.save of a cuda tensor
        return (_rebuild, (self._inner, self._idx))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or _NO_KWARGS)


def _rebuild(inner: torch.Tensor, idx: int) -> SimTensor:
    return SimTensor(inner, idx)


def _mixed(func, a: str, b: str) -> RuntimeError:
    return RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, "
        f"{a} and {b}! (when running '{_opset.op_name(func)}' on the sim backend)"
    )


def _unwrap_seq(xs, state: list, wrappers: dict, func):
    """Slow path for nested arguments (lists of tensors for cat/stack, device kwargs)."""
    out = []
    for x in xs:
        if isinstance(x, SimTensor):
            if state[0] < 0:
                state[0] = x._idx
            elif state[0] != x._idx and func not in _CROSS_DEVICE_OK:
                raise _mixed(func, f"sim:{state[0]}", f"sim:{x._idx}")
            wrappers[id(x._inner)] = x
            out.append(x._inner)
        elif isinstance(x, torch.Tensor):
            if x.dim() > 0:
                state[1] = True  # a non-scalar CPU tensor; 0-dim ones act as scalars, as on CUDA
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out.append(type(x)(_unwrap_seq(x, state, wrappers, func)) if x else x)
        elif isinstance(x, torch.device) and x.type == "sim":
            out.append(_CPU)
        else:
            out.append(x)
    return out


def _wrap(x, idx: int, wrappers: dict, fresh: list):
    if isinstance(x, torch.Tensor):
        w = wrappers.get(id(x))
        if w is not None:
            return w  # in-place / out= op: hand back the caller's own wrapper
        fresh.append(x)
        return SimTensor(x, idx)
    if isinstance(x, (list, tuple)):
        return type(x)(_wrap(y, idx, wrappers, fresh) for y in x)
    return x


_VIEW_OPS: dict[torch._ops.OpOverload, bool] = {}


def _is_view(func) -> bool:
    # Outputs that alias an input must never get fault-filled: that would corrupt the input (weights).
    hit = _VIEW_OPS.get(func)
    if hit is None:
        hit = any(r.alias_info is not None for r in func._schema.returns)
        _VIEW_OPS[func] = hit
    return hit


_GENERATOR_OPS: dict[torch._ops.OpOverload, bool] = {}


def _takes_generator(func) -> bool:
    hit = _GENERATOR_OPS.get(func)
    if hit is None:
        hit = any(a.name == "generator" for a in func._schema.arguments)
        _GENERATOR_OPS[func] = hit
    return hit


_trace: set | None = None


def start_trace() -> None:
    """Record every op dispatched to sim from now on (see `stop_trace`)."""
    global _trace
    _trace = set()


def stop_trace() -> set[str]:
    """Stop recording; returns the op names seen (``aten::name.overload``)."""
    global _trace
    seen, _trace = _trace or set(), None
    return {_opset.op_name(f) for f in seen}


def _dispatch(func, args: tuple, kwargs: dict):
    if _trace is not None:
        _trace.add(func)
    profile = _opset._profile
    allowed = profile._cache.get(func)
    if allowed is None:
        allowed = profile.allows(func)
    if not allowed:
        raise _opset.unsupported_error(func)

    # Hot path, hand-inlined: most calls are flat tuples of sim tensors and Python scalars.
    idx = -1
    wrappers: dict[int, SimTensor] = {}
    a = []
    slow = False
    for x in args:
        if isinstance(x, SimTensor):
            if idx != x._idx:
                if idx < 0:
                    idx = x._idx
                elif func not in _CROSS_DEVICE_OK:
                    raise _mixed(func, f"sim:{idx}", f"sim:{x._idx}")
            inner = x._inner
            wrappers[id(inner)] = x
            a.append(inner)
        elif isinstance(x, (torch.Tensor, list, tuple, torch.device)):
            slow = True
            break
        else:
            a.append(x)
    state = [idx, False]
    if slow:
        wrappers.clear()
        a = _unwrap_seq(args, state, wrappers, func)
    k = kwargs
    if k:
        k = dict(zip(k, _unwrap_seq(k.values(), state, wrappers, func), strict=True))
    idx = state[0]
    if state[1] and func not in _CROSS_DEVICE_OK:
        raise _mixed(func, f"sim:{max(idx, 0)}", "cpu")

    if func is aten._to_copy.default:
        dev = kwargs.get("device")
        if dev is not None:
            dev = torch.device(dev)
            if dev.type != "sim":
                return func(*a, **k)  # leaving the device: plain CPU result
            if dev.index is not None:
                idx = dev.index
    elif idx < 0:
        dev = kwargs.get("device")
        idx = (
            _device._index_of(dev)
            if dev is not None and torch.device(dev).type == "sim"
            else _device._current
        )

    if _takes_generator(func) and k.get("generator") is None:
        k = dict(k)
        k["generator"] = _device._generators[idx]

    if func in _precision.REDUCED_ARGS:
        a = _precision.reduce_args(func, tuple(a))
    out = func(*a, **k)

    fresh: list[torch.Tensor] = []
    if isinstance(out, torch.Tensor):
        w = wrappers.get(id(out))
        if w is not None:
            return w  # in-place / out= op: hand back the caller's own wrapper
        result = SimTensor(out, idx)
        fresh.append(out)
    else:
        result = _wrap(out, idx, wrappers, fresh)
    if _faults._active and fresh and not _is_view(func):
        _faults.on_launch(idx, fresh)
    return result


def to_sim(t: torch.Tensor, index: int = 0) -> SimTensor:
    """Wrap a CPU tensor's data as a sim tensor without a copy (for kernels in this package)."""
    return SimTensor(t, index)


def inner(t: SimTensor) -> torch.Tensor:
    """The host tensor backing a sim tensor (no copy): for collectives and debugging."""
    return t._inner
