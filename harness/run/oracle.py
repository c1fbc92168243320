"""The fp64 oracle, with memory bounded by the model's size.

The comparison rule measures everyone's error against an fp64 run of the same model on the CPU. A copy
of the model in fp64 costs twice its fp32 weights, which a real checkpoint cannot afford, so:

- ``fp64-copy`` (models up to `COPY_MAX_PARAMS`): the fp32 model deep-copied and converted to fp64 --
  exactly what the tiny zoo has always been judged by;
- ``fp64-streamed`` (larger, up to the ``--oracle-max-params`` budget): the fp32 model itself runs under a
  dispatch mode that upcasts every floating operand to fp64 on the way into each op, so only one op's
  weights exist in fp64 at a time (activations are fp64 throughout);
- ``none`` (beyond the budget, or the model fails in fp64): no oracle; outputs are judged by the
  allclose/cosine fallback. The row records which rule judged it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

COPY_MAX_PARAMS = 50_000_000
DEFAULT_MAX_PARAMS = 20_000_000_000
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class Upcast(TorchDispatchMode):
    """Every floating operand of every op enters as fp64 (weights included, one op at a time)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        def up(x: Any) -> Any:
            return x.double() if isinstance(x, torch.Tensor) and x.dtype in _FLOATS else x

        return func(*tree_map(up, args), **tree_map(up, kwargs or {}))


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def fp64_outputs(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    forward: Callable[[torch.nn.Module, dict[str, Any]], dict[str, torch.Tensor]],
    *,
    max_params: int = DEFAULT_MAX_PARAMS,
    streamed: bool = True,
) -> tuple[dict[str, torch.Tensor] | None, str, torch.nn.Module | None]:
    """(oracle outputs or None, the rule that judged them, the fp64 model copy for localization or None).
    ``streamed=False``: no streamed form (a training step: gradients and optimizer state take the
    parameters' dtype, so fp32 weights cannot give an fp64 step)."""
    size = n_params(model)
    if size > max_params:
        return None, f"none ({size:,} parameters > --oracle-max-params {max_params:,})", None
    if size > COPY_MAX_PARAMS and not streamed:
        return None, f"none ({size:,} parameters: a training step's fp64 oracle needs an fp64 copy)", None
    as64 = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}
    try:
        if size <= COPY_MAX_PARAMS:
            oracle_model = copy.deepcopy(model).double()
            return forward(oracle_model, as64), "fp64-copy", oracle_model
        with Upcast():
            return forward(model, as64), "fp64-streamed", None
    except Exception as e:  # fp64 unsupported by this model: fall back to cosine/allclose
        return None, f"none (the model fails in fp64: {type(e).__name__})", None
