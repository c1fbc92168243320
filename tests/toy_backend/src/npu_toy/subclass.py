"""``TOY_SUBCLASS_PARAMS=1``: toy tensors made by a move (``.to("toy")``) are a tensor subclass.

Backends written in Python often hand out their tensors as a traceable wrapper subclass (an outer
tensor on the device that holds the real one). PyTorch moves such parameters with
`torch.utils.swap_tensors` (`Module._apply`: ``is_traceable_wrapper_subclass``), which refuses a tensor
that something still holds (a weak reference, a saved tensor): moving a model that was compiled, or run
with its outputs alive, a second time fails ("_apply(): Couldn't swap Embedding.weight"). `ToyParam`
wraps a plain toy tensor; every op runs on the inner one and returns plain toy tensors, except
``detach``/``alias`` (a Parameter must stay a `ToyParam`) and in-place ops (they return their input).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

_KEEP = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


class ToyParam(torch.Tensor):
    _t: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> ToyParam:
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                                   device=inner.device, storage_offset=inner.storage_offset(),
                                                   requires_grad=inner.requires_grad)

    def __init__(self, inner: torch.Tensor) -> None:
        self._t = inner

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_t"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: Any, outer_size: Any, outer_stride: Any) -> ToyParam:
        return ToyParam(inner["_t"])

    def __repr__(self) -> str:  # type: ignore[override]
        return f"ToyParam({self._t!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = kwargs or {}

        def inner(x: object) -> object:
            return x._t if isinstance(x, ToyParam) else x

        out = func(*tree_map(inner, args), **tree_map(inner, kwargs))
        if func in _KEEP:
            return ToyParam(out)
        if func._schema.is_mutable and func._schema.returns:  # in place / out=: the tensor it wrote
            return kwargs.get("out", args[0] if args else out)
        return out


def wrap(t: torch.Tensor) -> ToyParam:
    return ToyParam(t)
