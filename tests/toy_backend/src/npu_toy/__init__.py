"""npu_toy: a minimal out-of-tree PrivateUse1 backend ("toy") in pure Python, for portharness's tests.

It is what a vendor package looks like to the harness: importing it (or ``import torch``, through its
``torch.backends`` entry point) renames PrivateUse1 to ``toy``; a handful of ATen kernels compute on
the CPU; every other op fails the way PyTorch fails for a missing kernel. Tensors are plain
``torch.Tensor`` objects whose storage-less StorageImpl (``torch._C._acc.create_empty_tensor``) carries
the bytes as a flat CPU tensor on the storage's Python object, so views, ``detach`` and Parameters
share them as on a real device.

Deliberate gaps, one per way backends report them: most ops raise the dispatcher's "Could not run
'aten::X' with arguments from the 'toy' backend"; convolution raises PyTorch's ``_overrideable``
message; ``sort`` raises a Python NotImplementedError naming ``aten.sort``; ``index_add`` supports
float32 only. Device death: while the file named by ``TOY_DEAD_FILE`` exists (or after `kill()`),
every kernel and the device module raise ``RuntimeError("toy device lost ...")``.
"""

from __future__ import annotations

import os

import torch
from torch.utils._pytree import tree_map

BACKEND = "toy"
aten = torch.ops.aten
_META = torch._C.DispatchKeySet(torch._C.DispatchKey.Meta)
_killed = False
_registered = False


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


def _is_toy(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == BACKEND


def _payload(t: torch.Tensor) -> torch.Tensor:
    """The CPU view holding a toy tensor's contents (aliases its storage)."""
    return t.untyped_storage()._toy_buf.as_strided(t.shape, t.stride(), t.storage_offset())


def _new(shape, dtype) -> torch.Tensor:
    t = torch._C._acc.create_empty_tensor(tuple(shape), dtype or torch.get_default_dtype())
    t.untyped_storage()._toy_buf = torch.empty(t.numel(), dtype=t.dtype)
    return t


def _wrap(x: object) -> object:
    if not isinstance(x, torch.Tensor):
        return x
    t = torch._C._acc.create_empty_tensor(tuple(x.shape), x.dtype)
    buf = x.contiguous().view(-1)
    t.untyped_storage()._toy_buf = buf if buf.storage_offset() == 0 else buf.clone()
    return t


def _unwrap(x: object) -> object:
    return _payload(x) if _is_toy(x) else x


def _host(op, inplace: bool = False):
    def kernel(*args, **kwargs):
        _check_alive()
        out = op(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        return args[0] if inplace else tree_map(_wrap, out)

    return kernel


def _meta_view(op):
    """View ops: the Meta kernel computes sizes/strides and shares the StorageImpl."""

    def kernel(*args, **kwargs):
        _check_alive()
        return op.redispatch(_META, *args, **kwargs)

    return kernel


def _empty_memory_format(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    _check_alive()
    return _new(size, dtype)


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    _check_alive()
    return _new(size, dtype)


def _copy_from(src, dst, non_blocking=False):
    _check_alive()
    (_payload(dst) if _is_toy(dst) else dst).copy_(_unwrap(src))
    return dst


def _sort(*args, **kwargs):
    raise NotImplementedError("aten.sort.stable is not supported on the toy backend yet")


def _index_add(self, dim, index, source, alpha=1):
    _check_alive()
    if self.dtype != torch.float32:
        raise RuntimeError(f"op aten::index_add supports float32 only, got {str(self.dtype).removeprefix('torch.')}")
    return _wrap(_unwrap(self).index_add(dim, _unwrap(index), _unwrap(source), alpha=alpha))


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
        return _alive()

    @staticmethod
    def device_count() -> int:
        return 1

    is_initialized = staticmethod(lambda: True)
    current_device = staticmethod(lambda: 0)
    set_device = staticmethod(lambda device: None)
    _is_in_bad_fork = staticmethod(lambda: False)
    get_rng_state = staticmethod(lambda device=None: torch.empty(0, dtype=torch.uint8))
    set_rng_state = staticmethod(lambda state, device=None: None)

    @staticmethod
    def synchronize(device=None) -> None:
        _check_alive()

    @staticmethod
    def manual_seed(seed: int) -> None:
        _check_alive()

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        _check_alive()


def _register() -> None:
    global _registered
    if _registered:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(BACKEND, backend_module=_DeviceModule())
    _lib.impl("empty.memory_format", _empty_memory_format, "PrivateUse1")
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
