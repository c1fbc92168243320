"""What sim's dispatcher knows about each ATen op, read from its schema once and cached per profile.

Which arguments an op writes (in-place, ``out=``), whether its outputs alias an input (never
fault-fill those: that would corrupt weights), whether it takes a generator (sim passes the device's
own RNG), whether its operands get bf16-rounded at ``default`` precision, and whether the op profile
allows it. Also the few host implementations that replace a CPU kernel the CPU lacks.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

_numerics = importlib.import_module(".numerics", __package__)
_opset = importlib.import_module(".opset", __package__)
_precision = importlib.import_module(".precision", __package__)

aten = torch.ops.aten

# Ops that legitimately mix devices (they are how data moves between host and device).
CROSS_DEVICE_OK = frozenset(
    {
        aten.copy_.default,
        aten._to_copy.default,
        aten._copy_from.default,
        aten._copy_from_and_resize.default,
        aten.copy.default,
    }
)

# Ops whose index tensors may stay on the host, as CUDA allows (``x_cuda[cpu_long_tensor]``).
CPU_INDICES_OK = frozenset(
    {
        aten.index.Tensor,
        aten.index.Tensor_out,
        aten.index_put.default,
        aten.index_put_.default,
        aten._index_put_impl_.default,
        aten._unsafe_index.Tensor,
        aten._unsafe_index_put.default,
    }
)

# op -> replacement host implementation, for ops whose CPU kernel lacks something a real
# accelerator has (see kernels.py); called with the inner tensors instead of the CPU kernel.
HOST_IMPLS: dict[torch._ops.OpOverload, Callable] = {}


class Facts:
    """What `_dispatch` needs to know about one OpOverload, read from its schema once."""

    __slots__ = ("call", "written", "written_kw", "aliases", "generator", "reduced", "cross_ok", "allowed")

    def __init__(self, func: torch._ops.OpOverload, allowed: bool) -> None:
        self.allowed = allowed
        schema = func._schema
        host = _numerics.impl_for(func) or HOST_IMPLS.get(func)
        self.call = host if host is not None else func._op
        written, written_kw = [], []
        pos = 0
        self.generator: int | str | None = None
        for arg in schema.arguments:
            is_write = arg.alias_info is not None and arg.alias_info.is_write
            if arg.kwarg_only:
                if is_write:
                    written_kw.append(arg.name)
                if arg.name == "generator":
                    self.generator = arg.name
            else:
                if is_write:
                    written.append(pos)
                if arg.name == "generator":
                    self.generator = pos
                pos += 1
        self.written = tuple(written)
        self.written_kw = tuple(written_kw)
        # Outputs that alias an input must never get fault-filled: that would corrupt the input (weights).
        self.aliases = any(r.alias_info is not None for r in schema.returns)
        self.reduced = _precision.REDUCED_ARGS.get(func)
        self.cross_ok = func in CROSS_DEVICE_OK


def facts_for(func: torch._ops.OpOverload) -> Facts:
    """Facts for `func` under the current profile, cached on the profile (keyed by the op's id:
    OpOverloads live as long as the process, and an int key skips OpOverload.__hash__)."""
    profile = _opset._profile
    facts = profile._facts[id(func)] = Facts(func, profile.allows(func))
    return facts


def register_host_impl(func: torch._ops.OpOverload, impl: Callable) -> None:
    """Run `impl` (on host tensors) instead of `func`'s CPU kernel whenever `func` runs on sim."""
    HOST_IMPLS[func] = impl
    for profile in _opset.resolved_profiles():
        profile._facts.pop(id(func), None)


def _forget_all() -> None:
    for profile in _opset.resolved_profiles():
        profile._facts.clear()


_numerics._listeners.append(_forget_all)  # a planted bug changes which kernel an op runs
