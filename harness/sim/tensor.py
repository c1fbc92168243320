"""Host access to sim tensors, without copies (sim memory is host memory).

A sim tensor is a plain `torch.Tensor` on ``sim:N`` (dispatch key PrivateUse1); a parameter on sim is a
plain `nn.Parameter`. These two functions are for code that needs the host memory itself: sim's own
collectives (gloo on the host views), planted-bug kernels, tests.
"""

from __future__ import annotations

import torch

from .native import ext


def inner(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor on `t`'s memory (no copy; writes through it reach `t`). It keeps the memory alive."""
    return ext.host_view(t)


def to_sim(t: torch.Tensor, index: int = 0) -> torch.Tensor:
    """A CPU tensor's memory as a tensor on ``sim:index`` (no copy); it now counts as that device's memory
    (torch.OutOfMemoryError if it does not fit)."""
    return ext.adopt(t, index)
