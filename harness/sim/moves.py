"""How tensors and modules move on and off sim with their identity intact, as on a real device.

``Module.to("sim")``: SimTensor is a traceable wrapper subclass, so `Module._apply` swaps each
parameter's contents in place (`torch.utils.swap_tensors`): the Parameter object stays the same,
so weights tied by identity (GPT-2's ``lm_head.weight is transformer.wte.weight``) stay tied.

``Module.cpu()`` / ``.to("cpu")``: `_apply` asks `_has_compatible_shallow_copy_type(param, host)`;
for a sim parameter sim answers yes (registered here), so `_apply` assigns ``param.data = host``,
which `leave_device` turns into the same swap back to a host Parameter. (Otherwise `_apply` would
build a new Parameter per module and untie them on the way back, which it still does for a
parameter that cannot be swapped, see below.)

swap_tensors refuses a tensor that has weakrefs or another C++ holder, typically an autograd graph
still alive (a forward's outputs kept without backward). Moving such a module onto sim (or between
sim devices / dtypes) then fails with torch's "_apply(): Couldn't swap ...", as for any traceable
tensor subclass (DTensor...); run it under no_grad or drop the outputs first.

`deepcopy` copies a sim tensor's host memory once (views of one storage stay views of one copy).
"""

from __future__ import annotations

import copy
import importlib
import weakref
from collections.abc import Callable

import torch

_memory = importlib.import_module(".memory", __package__)
_precision = importlib.import_module(".precision", __package__)
# tensor.py calls into this module, so what this one needs of it is handed over: the wrapper class
# (by `register`) and its constructor (by `deepcopy`'s caller).
_sim_cls: type | None = None

_OWN_ATTRS = ("_inner", "_idx", "_is_param")
_lib = torch.library.Library("aten", "IMPL")


def deepcopy(t: torch.Tensor, memo: dict, new_sim: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """`SimTensor.__deepcopy__`; `new_sim(host, idx)` wraps host memory as a sim tensor."""
    if id(t) in memo:
        return memo[id(t)]
    if not t.is_leaf:
        raise RuntimeError(
            "Only Tensors created explicitly by the user (graph leaves) support the deepcopy protocol at the moment."
        )
    with torch.no_grad():
        inner = copy.deepcopy(t._inner, memo)  # the memo keeps views of one host storage sharing a copy
        _memory.claim(inner, t._idx)
        new = new_sim(inner, t._idx)
        if t.requires_grad:
            new.requires_grad_()
        if t.grad is not None:
            new.grad = copy.deepcopy(t.grad, memo)
        state = {k: v for k, v in t.__dict__.items() if k not in ("_inner", "_idx")}
        new.__dict__.update(copy.deepcopy(state, memo))
    memo[id(t)] = new
    return new


def leave_device(t: torch.Tensor, host: torch.Tensor) -> None:
    """``t.data = host`` for a sim tensor `t` and a host tensor: `t` becomes that host tensor in place
    (a Parameter stays a Parameter, with its attributes)."""
    is_param = bool(t.__dict__.get("_is_param"))
    attrs = {k: v for k, v in t.__dict__.items() if k not in _OWN_ATTRS}
    host = host.detach()
    replacement = torch.nn.Parameter(host, requires_grad=t.requires_grad) if is_param else host
    if not is_param:
        replacement.requires_grad_(t.requires_grad)
    _precision.forget(t._inner)
    torch.utils.swap_tensors(t, replacement)
    t.__dict__.update(attrs)


# References the dispatcher's boxed call adds to an argument's use count (measured in `register`).
_call_refs: int | None = None


def _free_to_swap(t: torch.Tensor) -> bool:
    """Whether torch.utils.swap_tensors would accept `t` (no weakrefs, no other C++ holder such as
    an autograd graph), judged from inside this op's kernel."""
    return not weakref.getweakrefs(t) and t._use_count() - (_call_refs or 0) <= 1


def _shallow_copy_compatible(a: torch.Tensor, b: torch.Tensor) -> bool:
    # sim -> sim (half(), to("sim:1")): as torch decides for one device type. sim -> host: yes if the
    # parameter can be swapped in place (leave_device), else no: _apply then builds new Parameters,
    # as before. host -> sim: no: `param.data = sim_tensor` cannot turn a host Parameter into a wrapper
    # subclass; _apply swaps those instead.
    global _call_refs
    sim = _sim_cls
    if type(a) is not sim:
        return False
    if _call_refs is None:  # the calibration call from register(): `a` has no other holder
        _call_refs = a._use_count() - 1
        return False
    if type(b) is sim:
        return True
    return b.device.type == "cpu" and type(b) in (torch.Tensor, torch.nn.Parameter) and _free_to_swap(a)


def register(sim_cls: type, to_sim: Callable[[torch.Tensor, int], torch.Tensor]) -> None:
    global _sim_cls
    _sim_cls = sim_cls
    # At the autograd key: it outranks the Python key, so no SimTensor dispatch (and no op profile)
    # is involved, and the hot path does not pay for this rarely called op.
    _lib.impl("_has_compatible_shallow_copy_type", _shallow_copy_compatible, "AutogradPrivateUse1")
    torch._has_compatible_shallow_copy_type(to_sim(torch.zeros(0), 0), torch.zeros(0))
