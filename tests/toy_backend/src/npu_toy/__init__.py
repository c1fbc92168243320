"""npu_toy: a small out-of-tree PrivateUse1 backend ("toy") in pure Python, for portharness's tests.

It is what a vendor package looks like to the harness: importing it (or ``import torch``, through its
``torch.backends`` entry point) renames PrivateUse1 to ``toy``; a handful of ATen kernels compute on
the CPU; every other op fails the way PyTorch fails for a missing kernel. Tensors are plain
``torch.Tensor`` objects whose storage-less StorageImpl (``torch._C._acc.create_empty_tensor``) carries
a handle to a buffer of the device side (`npu_toy.device.Executor`), so views, ``detach`` and
Parameters share them as on a real device. One device.

Deliberate gaps, one per way backends report them: most ops raise the dispatcher's "Could not run
'aten::X' with arguments from the 'toy' backend"; convolution raises PyTorch's ``_overrideable``
message; ``sort`` raises a Python NotImplementedError naming ``aten.sort``; ``index_add`` supports
float32 only.

As rude as real hardware, each behaviour behind an environment variable (read when used):

- ``TOY_SERVER=127.0.0.1:PORT``: tensors live behind the op server (`npu_toy.remote`); a lost server
  raises ConnectionRefusedError / BrokenPipeError / ConnectionResetError / TimeoutError (after
  ``TOY_TIMEOUT`` s) at the next device call (seeding included); the package still imports and
  counts its device without one;
- ``TOY_LATE_ERRORS=1``: a kernel that fails does not raise at launch: it returns uninitialised
  outputs and its error is raised at the next call that waits on the device (``synchronize``, a copy
  to or from the host, ``.item()``), as CUDA does;
- ``TOY_BROKEN_OPS=op:form,...``: kernels that fail, each with one real backend's wording (`FORMS`):
  ``cannot`` ("toy cannot run aten.X.default yet"), ``remote`` (a remote executor relaying "Could not
  run 'aten::X' with arguments from the 'CPU' backend"), ``bare`` ("op add is not implemented"),
  ``dtype`` ("kernel mul does not support dtype 'Int'"), ``kernel`` ("aten::histc: \"histc_cpu\" not
  implemented for 'Int'": the op, then its kernel's words), or ``shape`` (computes, but returns the
  second and later outputs of a multi-output op one dimension short: a wrong-shape kernel); or, rude,
  ``segv`` / ``hang``: that one kernel kills the process with SIGSEGV / sleeps ``TOY_HANG_S`` seconds;
- ``TOY_FAULT=segv`` / ``hang``: every compute kernel kills the process with SIGSEGV / sleeps
  ``TOY_HANG_S`` seconds (an hour by default): a dying or hanging device;
- ``TOY_MEM_MB=N``: the device allocator holds N MiB and says "can't allocate memory" beyond;
- ``TOY_DEAD_FILE=path``: while that file exists (or after `kill()`), every kernel and the device
  module raise ``RuntimeError("toy device lost ...")``;
- ``TOY_RECONNECT_S=N``: the client tries to reach a server it lost for N seconds before it gives up
  with ``ConnectionError("... could not reach the server again ...")`` raised from the last refusal (a
  server back within the window serves on);
- ``TOY_SYNTHETIC_MODULE=1``: the device module is registered as a Python backend may do it through
  `torch.utils.backend_registration`: a module object made at run time (``types.ModuleType``, no
  ``__file__``, nothing to import), holding this package's functions;
- ``TOY_SUBCLASS_PARAMS=1``: a tensor moved to the device is a traceable wrapper subclass
  (`npu_toy.subclass`), so `Module._apply` moves parameters with ``swap_tensors``.

Seeding (``torch.manual_seed`` reaches the device module's ``manual_seed_all``) and moves (``.to``)
talk to the device like kernels do: with the server gone they raise while a model is being built.
"""

from __future__ import annotations

import os
import signal
import time
import types
import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_map

from npu_toy.device import Dev, Executor, New, Ref

BACKEND = "toy"
aten = torch.ops.aten
_META = torch._C.DispatchKeySet(torch._C.DispatchKey.Meta)
_killed = False
_registered = False
_late: list[BaseException] = []  # the first failed kernel's error, raised at the next synchronizing call
_local: Executor | None = None
_client: Any = None
FORMS = ("cannot", "remote", "bare", "dtype", "kernel", "shape", "segv", "hang")
_SCALAR_NAMES = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
                 torch.int32: "Int", torch.int64: "Long", torch.bool: "Bool", torch.int8: "Char", torch.uint8: "Byte"}


def _autoload() -> None:  # the torch.backends entry point: runs inside `import torch`
    _register()


def kill(lost: bool = True) -> None:
    global _killed
    _killed = lost


def _alive() -> bool:
    dead_file = os.environ.get("TOY_DEAD_FILE")
    return not _killed and not (dead_file and os.path.exists(dead_file))


def _check_alive() -> None:
    if not _alive():
        raise RuntimeError("toy device lost: the device stopped responding")


def _device() -> Any:
    """The executor: in this process, or the op server's through a client."""
    global _local, _client
    _check_alive()
    address = os.environ.get("TOY_SERVER")
    if not address:
        if _local is None:
            _local = Executor()
        return _local
    if _client is None or _client.address[1] != int(address.rpartition(":")[2]):
        from npu_toy.remote import Client

        _client = Client(address, float(os.environ.get("TOY_TIMEOUT", "10")),
                         float(os.environ.get("TOY_RECONNECT_S", "0")))
    return _client


def _release(handle: int) -> None:  # a storage died: free its buffer (remote: with the next call)
    if _client is not None and os.environ.get("TOY_SERVER"):
        _client.frees.append(handle)
    elif _local is not None:
        _local.free([handle])


def _sync() -> None:
    """A call that waits on the device: a failure it queued is reported now."""
    if _late:
        raise _late.pop()


def _is_toy(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == BACKEND


def _ref(t: torch.Tensor) -> Ref:
    t = getattr(t, "_t", t)  # a TOY_SUBCLASS_PARAMS wrapper reached a kernel as it is (Python dispatch off)
    return Ref(t.untyped_storage()._toy, tuple(t.shape), tuple(t.stride()), t.storage_offset())


def _enc(x: object) -> object:
    if _is_toy(x):
        return _ref(x)
    return Dev(str(x)) if isinstance(x, torch.device) else x


def _adopt(handle: int, shape, dtype) -> torch.Tensor:
    t = torch._C._acc.create_empty_tensor(tuple(shape), dtype)
    storage = t.untyped_storage()
    storage._toy = handle
    weakref.finalize(storage, _release, handle)
    return t


def _new(shape, dtype) -> torch.Tensor:
    dtype = dtype or torch.get_default_dtype()
    numel = 1
    for s in shape:
        numel *= s
    return _adopt(_device().alloc(numel, dtype), shape, dtype)


def _dec(x: object) -> object:
    return _adopt(x.handle, x.shape, x.dtype) if isinstance(x, New) else x


def _broken(name: str) -> str:
    for item in filter(None, os.environ.get("TOY_BROKEN_OPS", "").split(",")):
        op, _, form = item.strip().partition(":")
        if op == name:
            return form or "cannot"
    return ""


def _broken_error(op, form: str, args) -> Exception:
    name = op._schema.name.removeprefix("aten::")
    if form == "remote":  # what the server's own dispatcher said, passed on by the client
        return RuntimeError(f"Could not run 'aten::{name}' with arguments from the 'CPU' backend. This could be "
                            "because the operator doesn't exist for this backend, or was omitted during the "
                            "selective/custom build process (if using custom build).")
    if form == "bare":
        return NotImplementedError(f"toy runtime: op {name} is not implemented")
    first = next((a.dtype for a in args if isinstance(a, torch.Tensor)), torch.float32)
    dtype = _SCALAR_NAMES.get(first, str(first))
    if form == "dtype":
        return RuntimeError(f"toy: kernel {name} does not support dtype '{dtype}'")
    if form == "kernel":  # the ATen op, then its CPU kernel's own words (a remote executor's AT_DISPATCH)
        return RuntimeError(f"aten::{name}: \"{name}_cpu\" not implemented for '{dtype}'")
    return NotImplementedError(f"toy cannot run aten.{name}.{op._overloadname} yet: planned for a later release")


def _launch() -> None:
    """A compute kernel starts on the device: a dying or hanging device shows here."""
    fault = os.environ.get("TOY_FAULT", "")
    if fault == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif fault == "hang":
        time.sleep(float(os.environ.get("TOY_HANG_S", "3600")))


def _meta(x: object) -> object:
    if _is_toy(x):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return torch.device("meta") if isinstance(x, torch.device) else x


def _queue_failure(op, e: Exception, args, kwargs, inplace: bool):
    """TOY_LATE_ERRORS: remember `e` for the next synchronizing call; outputs of the right shape now."""
    shapes = op(*tree_map(_meta, args), **tree_map(_meta, kwargs))  # raises at once if it cannot
    if not _late:
        _late.append(e)
    if inplace:
        return args[0]
    return tree_map(lambda m: _new(m.shape, m.dtype) if isinstance(m, torch.Tensor) else m, shapes)


def _host(op, inplace: bool = False):
    late_ok = op._schema.name != "aten::_local_scalar_dense"

    def kernel(*args, **kwargs):
        if not late_ok:
            _sync()  # .item() waits on the device
        dev = _device()
        _launch()
        form = _broken(op._schema.name.removeprefix("aten::"))
        if form == "segv":  # this kernel alone kills the process, as a driver bug in one kernel does
            os.kill(os.getpid(), signal.SIGSEGV)
        elif form == "hang":
            time.sleep(float(os.environ.get("TOY_HANG_S", "3600")))
        try:
            if form and form not in ("shape", "hang"):
                raise _broken_error(op, form, args)
            out = dev.run(str(op), tree_map(_enc, args), tree_map(_enc, kwargs), inplace)
        except (OSError, MemoryError):
            raise  # the device is unreachable, or its allocator full: that is known at launch
        except Exception as e:
            if late_ok and os.environ.get("TOY_LATE_ERRORS") == "1":
                return _queue_failure(op, e, args, kwargs, inplace)
            raise
        if inplace:
            return args[0]
        out = tree_map(_dec, out)
        if form == "shape" and isinstance(out, tuple) and len(out) > 1:
            out = (out[0], *(o.squeeze(-1) if isinstance(o, torch.Tensor) and o.dim() else o for o in out[1:]))
        return out

    return kernel


def _meta_view(op):
    """View ops: the Meta kernel computes sizes/strides and shares the StorageImpl."""

    def kernel(*args, **kwargs):
        _check_alive()
        return op.redispatch(_META, *args, **kwargs)

    return kernel


def _empty_memory_format(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return _new(size, dtype)


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return _new(size, dtype)


def _copy_from(src, dst, non_blocking=False):
    dev = _device()
    if _is_toy(src) and _is_toy(dst):  # a copy on the device is queued like any kernel
        dev.copy(_ref(dst), _ref(src))
        return dst
    _sync()  # a copy to or from the host waits for the work queued before it
    if _is_toy(dst):
        dev.write(_ref(dst), src.detach().to(dst.dtype))
    else:
        dst.copy_(dev.read(_ref(src)))
    return dst


def _sort(*args, **kwargs):
    raise NotImplementedError("aten.sort.stable is not supported on the toy backend yet")


def _index_add(self, dim, index, source, alpha=1):
    _check_alive()
    if self.dtype != torch.float32:
        raise RuntimeError(f"op aten::index_add supports float32 only, got {str(self.dtype).removeprefix('torch.')}")
    return _host(aten.index_add.default)(self, dim, index, source, alpha=alpha)


_lib = torch.library.Library("aten", "IMPL")  # keep a reference: registrations die with it
_VIEW_OPS = ["view", "as_strided", "_reshape_alias"]
_HOST_OPS = ["add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor", "mm", "addmm", "bmm", "_local_scalar_dense",
             "sum.dim_IntList", "embedding", "gather", "index_select", "native_layer_norm", "_softmax", "gelu",
             "tanh", "where.self", "eq.Tensor", "masked_fill.Scalar", "clone"]
_INPLACE_OPS = ["add_.Tensor", "mul_.Tensor", "zero_", "fill_.Scalar"]


def _overload(name: str):
    packet, _, overload = name.partition(".")
    return getattr(getattr(aten, packet), overload or "default")


class _DeviceModule:
    """`torch.toy`: what torch and the harness look up on a PrivateUse1 backend's module."""

    @staticmethod
    def is_available() -> bool:
        try:
            return bool(_device().ping())
        except (OSError, RuntimeError):
            return False

    @staticmethod
    def device_count() -> int:
        return 1  # configured, as a driver knows its devices without asking them

    is_initialized = staticmethod(lambda: True)
    current_device = staticmethod(lambda: 0)
    set_device = staticmethod(lambda device: None)
    _is_in_bad_fork = staticmethod(lambda: False)
    get_rng_state = staticmethod(lambda device=None: torch.empty(0, dtype=torch.uint8))
    set_rng_state = staticmethod(lambda state, device=None: None)

    @staticmethod
    def synchronize(device=None) -> None:
        _device().ping()
        _sync()

    @staticmethod
    def manual_seed(seed: int) -> None:
        _device().ping()

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        _device().ping()


def _device_module() -> object:
    """`torch.toy`: an instance of `_DeviceModule`, or (``TOY_SYNTHETIC_MODULE=1``) a module object made
    here, as `torch.utils.backend_registration` lets a Python backend register one: no ``__file__``."""
    if os.environ.get("TOY_SYNTHETIC_MODULE") != "1":
        return _DeviceModule()
    module = types.ModuleType(f"torch.{BACKEND}")
    for name in list(vars(_DeviceModule)):
        if not name.startswith("__"):
            setattr(module, name, getattr(_DeviceModule, name))
    return module


def _register() -> None:
    global _registered
    if _registered:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(BACKEND, backend_module=_device_module())
    _lib.impl("empty.memory_format", _empty_memory_format, "PrivateUse1")
    if os.environ.get("TOY_SUBCLASS_PARAMS") == "1":  # what `_to_copy` allocates: a move's result
        from npu_toy.subclass import wrap

        _lib.impl("empty_strided", lambda *a, **k: wrap(_empty_strided(*a, **k)), "PrivateUse1")
    else:
        _lib.impl("empty_strided", _empty_strided, "PrivateUse1")
    _lib.impl("_copy_from", _copy_from, "PrivateUse1")
    _lib.impl("sort.stable", _sort, "PrivateUse1")
    _lib.impl("index_add", _index_add, "PrivateUse1")
    for name in _VIEW_OPS:
        _lib.impl(name, _meta_view(_overload(name)), "PrivateUse1")
    for name in _HOST_OPS:
        _lib.impl(name, _host(_overload(name)), "PrivateUse1")
    for name in _INPLACE_OPS:
        _lib.impl(name, _host(_overload(name), inplace=True), "PrivateUse1")
    _registered = True


_register()  # importing the package registers the backend, as vendor packages do
