"""The device side of `toy`: buffers and kernels, in this process or behind the op server.

The front end (`npu_toy`) never touches a buffer; it sends the executor handles and view descriptions
(`Ref`), the executor computes on the CPU and answers with new handles (`New`). In-process this is a
plain object; with ``TOY_SERVER`` set the same object lives in the server process (`npu_toy.remote`),
so tensors really live behind the server and die with it.

Its allocator has a capacity (``TOY_MEM_MB``, unlimited by default) and says so when it is exhausted,
as a device allocator does: ``RuntimeError: toy allocator: can't allocate memory ...``.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map


@dataclass(frozen=True)
class Ref:
    """A view of a device buffer, as a tensor's size/stride/offset describe it."""

    handle: int
    shape: tuple
    stride: tuple
    offset: int


@dataclass(frozen=True)
class New:
    """A fresh contiguous buffer the executor made for a kernel's output."""

    handle: int
    shape: tuple
    dtype: torch.dtype


@dataclass(frozen=True)
class Dev:
    """A device argument (e.g. `device=toy:0`): the CPU on the executor's side."""

    name: str


def _op(name: str) -> Any:
    """'aten.add.Tensor' -> torch.ops.aten.add.Tensor"""
    ns, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), packet), overload)


class Executor:
    """Buffers by handle, and kernels over them. One per client process."""

    def __init__(self, mem_mb: float | None = None) -> None:
        cap = os.environ.get("TOY_MEM_MB") if mem_mb is None else mem_mb
        self.capacity = int(float(cap) * 2**20) if cap else None
        self.used = 0
        self.buffers: dict[int, torch.Tensor] = {}
        self._next = 1
        self._lock = threading.Lock()

    def alloc(self, numel: int, dtype: torch.dtype) -> int:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            if self.capacity is not None and self.used + nbytes > self.capacity:
                raise RuntimeError(f"toy allocator: can't allocate memory: you tried to allocate {nbytes} bytes "
                                   f"({self.used} of {self.capacity} bytes of device memory in use)")
            handle, self._next = self._next, self._next + 1
            self.used += nbytes
        self.buffers[handle] = torch.empty(numel, dtype=dtype)
        return handle

    def free(self, handles: list[int]) -> None:
        for h in handles:
            buf = self.buffers.pop(h, None)
            if buf is not None:
                with self._lock:
                    self.used -= buf.numel() * buf.element_size()

    def view(self, ref: Ref) -> torch.Tensor:
        buf = self.buffers.get(ref.handle)
        if buf is None:
            raise RuntimeError(f"toy device lost: buffer {ref.handle} is gone (the device was reset)")
        return buf.as_strided(ref.shape, ref.stride, ref.offset)

    def write(self, ref: Ref, data: torch.Tensor) -> None:
        self.view(ref).copy_(data)

    def read(self, ref: Ref) -> torch.Tensor:
        return self.view(ref).clone()

    def copy(self, dst: Ref, src: Ref) -> None:
        self.view(dst).copy_(self.view(src))

    def run(self, name: str, args: Any, kwargs: Any, inplace: bool) -> Any:
        def local(x: Any) -> Any:
            if isinstance(x, Ref):
                return self.view(x)
            return torch.device("cpu") if isinstance(x, Dev) else x

        out = _op(name)(*tree_map(local, args), **tree_map(local, kwargs))
        return None if inplace else tree_map(self._adopt, out)

    def _adopt(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        handle = self.alloc(x.numel(), x.dtype)
        self.buffers[handle].copy_(x.reshape(-1))
        return New(handle, tuple(x.shape), x.dtype)

    def ping(self) -> bool:
        return True
