"""`SimTensor`: a tensor whose device is `sim:N` and whose memory is a host-side CPU tensor.

Why a wrapper subclass with `__torch_dispatch__` rather than per-op `torch.library` kernels: one
Python entry point sees every ATen op after autograd and composite decomposition, exactly the view
a real PrivateUse1 backend gets. That single place enforces the op allow-list, the precision mode,
the same-device rule and fault injection for all ~2,000 ATen ops, and runs the CPU kernel for the
math. Factory functions (`torch.ones(..., device="sim")`) carry no tensor to dispatch on, so they
reach the real PrivateUse1 kernels registered in `kernels.py`, which build `SimTensor`s.

The wrapper carries the metadata (sizes, strides, dtype, device) autograd and user code see; the
inner CPU tensor holds the data. Views of a SimTensor wrap views of the inner tensor, so in-place
updates through a view reach the base as on a real device. Ops that change a tensor's metadata in
place (``out=`` resizes, ``resize_``, ``set_``, ``unsqueeze_``, ``as_strided_``...) resync the
wrapper from the inner tensor, and ``param.data = other`` (what ``Module.to/half`` use) rebinds it.

Speed: every op costs one Python call, so `_dispatch` is written for the common case (flat args of
sim tensors and scalars) and everything it needs to know about an op (which args it writes, whether
its outputs alias, whether it takes a generator, whether its operands get bf16-rounded) is read
from the schema once and cached in `facts.Facts`.
"""

from __future__ import annotations

import importlib
from collections import OrderedDict

import torch

_device = importlib.import_module(".device", __package__)
_faults = importlib.import_module(".faults", __package__)
_facts = importlib.import_module(".facts", __package__)
_fallback = importlib.import_module(".fallback", __package__)
_memory = importlib.import_module(".memory", __package__)
_moves = importlib.import_module(".moves", __package__)
_opset = importlib.import_module(".opset", __package__)
_precision = importlib.import_module(".precision", __package__)
_native = importlib.import_module(".native", __package__).ext
_claim = _native.claim  # (tensor._cdata, device, enforce) -> 0, or the bytes that did not fit
_current_device = _native.current_device

aten = torch.ops.aten
_CPU = torch.device("cpu")
_NO_KWARGS: dict = {}
_SIM_DEVICES = _device._PerDevice(lambda i: torch.device("sim", i))
_make_wrapper = torch.Tensor._make_wrapper_subclass
_Tensor = torch.Tensor
_STRIDED = torch.strided
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_set_storage = aten.set_.source_Storage_storage_offset
_TENSOR_DATA = torch._C.TensorBase.data  # the C-level `.data` descriptor SimTensor.data extends
_wrapper_storage = torch._C.TensorBase.untyped_storage  # the wrapper's own (data-less) storage
_storage_from_impl = torch.UntypedStorage._new_with_weak_ptr


class SimTensor(torch.Tensor):
    """A tensor on a simulated accelerator. Use `.cpu()` / `.to("cpu")` to get host data back."""

    # No __slots__: `torch.utils.swap_tensors` (how Module.to moves parameters onto a traceable
    # subclass, keeping tied weights tied) needs the same slots as a plain Parameter.
    _inner: torch.Tensor
    _idx: int

    # Skips the Python-level __torch_function__ hop on every call: a large share of the overhead.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, inner: torch.Tensor, idx: int) -> SimTensor:
        return _new(inner, idx)

    def __repr__(self, *, tensor_contents: object = None) -> str:
        body = repr(self._inner)
        suffix = f", device='sim:{self._idx}'"
        if body.endswith(")"):
            return body[:-1] + suffix + ")"
        return body + suffix

    def __reduce_ex__(self, proto: int):
        # What a real device tensor pickles to (storage + geometry, the storage saved with its "sim:N"
        # location), so torch.load maps it like a cuda tensor and weights_only loading accepts it.
        hooks: dict = OrderedDict()
        if self.__dict__.get("_is_param"):
            return (torch._utils._rebuild_parameter, (self.detach(), self.requires_grad, hooks))
        return (torch._utils._rebuild_tensor_v2, (self._typed_storage(), self.storage_offset(), tuple(self.size()),
                                                   self.stride(), self.requires_grad, hooks))

    def __deepcopy__(self, memo: dict) -> SimTensor:
        return _moves.deepcopy(self, memo, _new)

    def __format__(self, spec: str) -> str:
        # torch formats 0-dim tensors as their value only for exact `Tensor`s (f"expert_{idx}").
        if self.dim() == 0:
            return self.item().__format__(spec)
        return object.__format__(self, spec)

    def tolist(self) -> list | int | float | bool:
        """Host copy as (nested) Python lists, as on any accelerator."""
        return _Tensor.cpu(self).tolist()

    def numpy(self, *, force: bool = False):
        if not force:
            raise TypeError(
                f"can't convert sim:{self._idx} device type tensor to numpy. Use Tensor.cpu() to copy the "
                "tensor to host memory first."
            )
        return _Tensor.cpu(self).numpy()

    def __tensor_flatten__(self) -> tuple[list[str], int]:
        # Makes SimTensor a traceable wrapper subclass: torch.compile (eager/aot_eager) traces it, and
        # Module._apply moves parameters onto it with swap_tensors.
        return ["_inner"], self._idx

    @staticmethod
    def __tensor_unflatten__(inner_tensors: dict, idx: int, outer_size: object, outer_stride: object) -> SimTensor:
        inner = inner_tensors["_inner"]
        if type(inner) is not _Tensor:  # torch.compile is tracing
            _device.refuse_inductor()
        return _new(inner, idx)

    def untyped_storage(self) -> torch.UntypedStorage:
        """The device storage: a sim-typed alias of the host memory, shared by all views of it."""
        ptr = _native.alias(self._inner._cdata, self._idx)
        return _storage_from_impl(ptr) if ptr else _wrapper_storage(self)

    def data_ptr(self) -> int:
        return self._inner.data_ptr()

    @property
    def data(self) -> torch.Tensor:
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        if type(new) is not SimTensor:  # `param.data = host_tensor` (Module.cpu()): off the device
            _moves.leave_device(self, new)
            return
        # torch copies the wrapper's metadata from `new`; the host memory must follow it.
        _TENSOR_DATA.__set__(self, new)
        _precision.forget(self._inner)
        self._inner = new._inner
        self._idx = new._idx

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # replaced by _dispatch below
        return _dispatch(cls, func, types, args, kwargs)


def _new(inner: torch.Tensor, idx: int) -> SimTensor:
    if inner.layout is _STRIDED:
        r = _make_wrapper(
            SimTensor, inner.size(), strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, device=_SIM_DEVICES[idx],
        )
    else:
        r = _make_wrapper(
            SimTensor, inner.size(), dtype=inner.dtype, layout=inner.layout, device=_SIM_DEVICES[idx]
        )
    r._inner = inner
    r._idx = idx
    return r


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


def _mixed(func, a: str, b: str) -> RuntimeError:
    return RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, "
        f"{a} and {b}! (when running '{_opset.op_name(func)}' on the sim backend)"
    )


class _Seen:
    """Device bookkeeping while unwrapping nested arguments (the slow path)."""

    __slots__ = ("idx", "cpu", "dev")

    def __init__(self, idx: int) -> None:
        self.idx = idx
        self.cpu = False  # a non-scalar CPU tensor was passed
        self.dev: torch.device | None = None  # a sim device argument


def _unwrap(x, seen: _Seen, func, cross_ok: bool):
    t = type(x)
    if t is SimTensor:
        j = x._idx
        if seen.idx != j:
            if seen.idx < 0:
                seen.idx = j
            elif not cross_ok:
                raise _mixed(func, f"sim:{seen.idx}", f"sim:{j}")
        return x._inner
    if t is list or t is tuple:
        if not x or type(x[0]) is int:
            return x
        if func in _facts.CPU_INDICES_OK:
            cpu = seen.cpu
            out = t(_unwrap(y, seen, func, cross_ok) for y in x)
            seen.cpu = cpu
            return out
        return t(_unwrap(y, seen, func, cross_ok) for y in x)
    if isinstance(x, torch.Tensor):
        dev = x.device
        if dev.type == "sim":
            # A plain (fake) tensor on sim: a factory call traced by torch.compile, where fake mode
            # makes factories itself. Its host equivalent is a copy to the CPU (in a traced graph too).
            j = dev.index or 0
            if seen.idx != j:
                if seen.idx < 0:
                    seen.idx = j
                elif not cross_ok:
                    raise _mixed(func, f"sim:{seen.idx}", f"sim:{j}")
            return x.to("cpu")
        if x.dim() > 0:
            seen.cpu = True  # a non-scalar CPU tensor; 0-dim ones act as scalars, as on CUDA
        return x
    if t is torch.device and x.type == "sim":
        seen.dev = x
        return _CPU
    if t is torch.UntypedStorage and x.device.type == "sim":  # set_(storage): the host memory behind it
        seen.dev = x.device
        return _host_storage(x)
    return x


def _host_storage(s: torch.UntypedStorage) -> torch.UntypedStorage:
    ptr = _native.host(s._cdata)
    if not ptr:
        raise RuntimeError(f"this {s.device} storage has no memory (its tensors were freed, or sim did not make it)")
    return _storage_from_impl(ptr)


def _wrap(x, idx: int, fresh: list):
    if isinstance(x, _Tensor) and type(x) is not SimTensor:  # also fake/functional ones (torch.compile)
        fresh.append(x)
        return _new(x, idx)
    if isinstance(x, (list, tuple)):
        return type(x)(_wrap(y, idx, fresh) for y in x)
    return x


def _resync(w: SimTensor) -> None:
    """Make the wrapper's sizes/strides/offset match its inner tensor again after an in-place change."""
    x = w._inner
    _set_storage.redispatch(_CPU_KEYS, w, _wrapper_storage(w), x.storage_offset(), x.size(), x.stride())
    _memory.claim(x, w._idx)  # a resize gave the host tensor new memory


def _pair(back: dict[int, object], orig, inn) -> None:
    if isinstance(orig, (list, tuple)):
        for o, i in zip(orig, inn, strict=True):
            back[id(i)] = o
    elif orig is not None:
        back[id(inn)] = orig


def _rewrap(o, back: dict[int, object], idx: int, fresh: list):
    # Module level, not a closure: a recursive closure is a reference cycle, which would keep every
    # written tensor (and its device memory) alive until the garbage collector runs.
    if isinstance(o, torch.Tensor):
        hit = back.get(id(o))
        if hit is not None:
            return hit
        fresh.append(o)
        return _new(o, idx)
    if isinstance(o, (list, tuple)):
        return type(o)(_rewrap(y, back, idx, fresh) for y in o)
    return o


def _finish_writes(facts: _facts.Facts, args: tuple, kwargs: dict, a: list, k: dict, out, idx: int):
    """After an op that writes an argument (in-place, out=, running stats): resync wrappers whose
    metadata changed, hand back the caller's own objects for outputs that are written arguments,
    and wrap the rest as fresh sim tensors."""
    back: dict[int, object] = {}
    for i in facts.written:
        if i < len(args):
            _pair(back, args[i], a[i])
    for name in facts.written_kw:
        if name in kwargs:
            _pair(back, kwargs[name], k[name])
    for w in back.values():
        if type(w) is SimTensor:
            x = w._inner
            if x.shape != w.shape or x.stride() != w.stride() or x.storage_offset() != w.storage_offset():
                _resync(w)
    fresh: list[torch.Tensor] = []
    result = _rewrap(out, back, idx, fresh)
    for t in fresh:
        _memory.claim(t, idx)
    if fresh and _faults._active:
        _faults.on_launch(idx, fresh)
    return result


def _dispatch(cls, func, types, args: tuple = (), kwargs: dict | None = None):
    """`SimTensor.__torch_dispatch__`: every ATen op on a sim tensor lands here."""
    if _trace is not None:
        _trace.add(func)
    # One int-keyed lookup per op (OpOverload.__hash__ is a Python method): facts + profile verdict.
    facts = _opset._profile._facts.get(id(func))
    if facts is None:
        facts = _facts.facts_for(func)
    if not facts.allowed:
        if _fallback._mode != "cpu":
            raise _opset.unsupported_error(func)
        _fallback.count(func)

    # Hot path, hand-inlined: most calls are flat tuples of sim tensors, int lists and Python scalars.
    idx = -1
    a = []
    seen = None
    for x in args:
        t = type(x)
        if t is SimTensor:
            j = x._idx
            if idx != j:
                if idx < 0:
                    idx = j
                elif not facts.cross_ok:
                    raise _mixed(func, f"sim:{idx}", f"sim:{j}")
            a.append(x._inner)
        elif (t is int or t is float or t is bool or x is None
              or ((t is list or t is tuple) and (not x or type(x[0]) is int))):
            a.append(x)
        else:
            if seen is None:
                seen = _Seen(idx)
            seen.idx = idx
            a.append(_unwrap(x, seen, func, facts.cross_ok))
            idx = seen.idx
    k = kwargs
    if k:
        if seen is None:
            seen = _Seen(idx)
        seen.idx = idx
        k = {n: _unwrap(v, seen, func, facts.cross_ok) for n, v in k.items()}
        idx = seen.idx
    else:
        k = _NO_KWARGS
    if seen is not None:
        if seen.cpu and not facts.cross_ok:
            raise _mixed(func, f"sim:{max(idx, 0)}", "cpu")
        dev = seen.dev
        if func is aten._to_copy.default:
            target = kwargs.get("device")
            if target is not None and target.type != "sim":
                return func._op(*a, **k)  # leaving the device: plain CPU result
            if dev is not None and dev.index is not None:
                idx = _device._check_index(dev.index)
        elif idx < 0 and dev is not None:
            idx = _device._index_of(dev)
    if idx < 0:
        idx = _current_device()

    g = facts.generator
    if g is not None:
        if type(g) is str:
            if k.get(g) is None:
                k = dict(k)
                k[g] = _device._generators[idx]
        elif g < len(a):
            if a[g] is None:
                a[g] = _device._generators[idx]
        elif k.get("generator") is None:
            k = dict(k)
            k["generator"] = _device._generators[idx]

    red = facts.reduced
    if red is not None and _precision._mode != "highest":
        _precision.reduce_operands(a, red, args)
    written = facts.written or facts.written_kw
    if written and _precision._cache:
        for i in facts.written:
            if i < len(a):
                _precision.forget(a[i])
        for n in facts.written_kw:
            _precision.forget(k.get(n))

    try:
        out = facts.call(*a, **k)
    except NotImplementedError as e:
        if "from the 'CPU' backend" in str(e):
            raise _opset.unsupported_error(func, missing_host_kernel=True) from None
        raise

    if written:
        return _finish_writes(facts, args, kwargs or _NO_KWARGS, a, k, out, idx)
    if type(out) is _Tensor:
        if out.layout is _STRIDED:  # _new, inlined
            result = _make_wrapper(SimTensor, out.size(), strides=out.stride(),
                                   storage_offset=out.storage_offset(), dtype=out.dtype,
                                   device=_SIM_DEVICES[idx])
            result._inner = out
            result._idx = idx
        else:
            result = _new(out, idx)
        if not facts.aliases:
            short = _claim(out._cdata, idx, True)  # count the new memory on the device
            if short:
                raise _memory.out_of_memory(idx, short)
            if _faults._active:
                _faults.on_launch(idx, [out])
        return result
    if isinstance(out, _Tensor):  # a fake/functional tensor: torch.compile is tracing
        return _new(out, idx)
    if out is None or not isinstance(out, (list, tuple)):
        return out
    fresh: list[torch.Tensor] = []
    result = _wrap(out, idx, fresh)
    if not facts.aliases:
        for t in fresh:
            _memory.claim(t, idx)
        if _faults._active and fresh:
            _faults.on_launch(idx, fresh)
    return result


SimTensor.__torch_dispatch__ = classmethod(_dispatch)  # one Python frame less per op


def to_sim(t: torch.Tensor, index: int = 0) -> SimTensor:
    """Wrap a CPU tensor's data as a sim tensor without a copy (for kernels in this package); its
    storage now counts as memory of ``sim:index`` (OOM if it does not fit)."""
    _memory.claim(t, index)
    return _new(t, index)


def inner(t: SimTensor) -> torch.Tensor:
    """The host tensor backing a sim tensor (no copy): for collectives and debugging.

    Whoever writes through it bypasses the dispatcher, so the call also drops sim's cached bf16
    copies of that memory (see `precision`); re-fetch it rather than keeping it across model steps.
    """
    _precision.forget(t._inner)
    return t._inner


def mark_written(t: torch.Tensor) -> None:
    """Tell sim that `t`'s memory was changed behind the dispatcher's back (drops cached copies)."""
    if isinstance(t, SimTensor):
        _precision.forget(t._inner)
