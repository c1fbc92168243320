"""Flattening a model's outputs into named tensors, the unit every comparison works on."""

from __future__ import annotations

from typing import Any

import torch


def output_tensors(outputs: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Flatten a ModelOutput / tuple / dict / nested structure into ``{name: tensor}``.

    Names are dotted paths (``logits``, ``last_hidden_state``, ``hidden_states.0``).  None and
    non-tensor leaves (caches, ints, strings) are skipped.  Integer and bool tensors are kept as
    they are; ``needs_exact(t)`` tells the comparator to compare those exactly.
    """
    flat: dict[str, torch.Tensor] = {}
    _flatten(outputs, prefix, flat)
    return flat


def on_host(t: torch.Tensor) -> torch.Tensor:
    """`t` detached on the CPU, whole: a DTensor (a sharded model's parameter, gradient or output under
    --parallel) is gathered first, on every rank alike (a collective)."""
    full = getattr(t, "full_tensor", None)
    return (full() if callable(full) else t).detach().cpu()


def needs_exact(tensor: torch.Tensor) -> bool:
    """True for integer/bool tensors, which must match bit-for-bit rather than within tolerance."""
    return not (tensor.is_floating_point() or tensor.is_complex())


def _flatten(obj: Any, name: str, flat: dict[str, torch.Tensor]) -> None:
    if obj is None:
        return
    if isinstance(obj, torch.Tensor):
        flat[name or "output"] = obj
        return
    join = (lambda k: f"{name}.{k}") if name else str
    if isinstance(obj, dict):  # ModelOutput is an OrderedDict of its non-None fields
        for key, value in obj.items():
            _flatten(value, join(key), flat)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _flatten(value, join(i), flat)
