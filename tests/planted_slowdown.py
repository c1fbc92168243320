"""A slow kernel planted from outside the harness, as a backend's own Python code would carry it.

Loaded in every worker with ``--backend planted_slowdown`` (this directory on PYTHONPATH); the harness knows
nothing of it (unlike sim's ``--slow-ops``, which lives in sim's kernels):

- ``PLANTED_SLOWDOWN=layer_norm:N``: `torch.nn.functional.layer_norm` on any non-CPU device does its work N
  times (N - 1 results thrown away): a normalization kernel N times slower, as the device runs it
  (``aten::native_layer_norm`` N times the calls, N times the time).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

ENV = "PLANTED_SLOWDOWN"


def _plant_layer_norm(times: int) -> Callable[[], None]:
    clean = torch.nn.functional.layer_norm

    def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):  # torch's signature
        if input.device.type != "cpu":
            for _ in range(times - 1):
                clean(input, normalized_shape, weight, bias, eps)
        return clean(input, normalized_shape, weight, bias, eps)

    torch.nn.functional.layer_norm = layer_norm
    return lambda: setattr(torch.nn.functional, "layer_norm", clean)


def plant(spec: str) -> Callable[[], None]:
    """Plant the slowdown ``spec`` names in this process; returns what takes it out again."""
    kind, _, times = spec.partition(":")
    if kind == "layer_norm" and times.isdigit() and int(times) >= 1:
        return _plant_layer_norm(int(times))
    raise ValueError(f"{ENV}={spec!r}: expected layer_norm:N (N >= 1)")


if os.environ.get(ENV):
    plant(os.environ[ENV])
