"""Quiet bugs planted from outside the harness, as a backend's own Python code would carry them.

Loaded in every worker with ``--backend planted_bugs`` (this directory on PYTHONPATH); which bug and how
big comes from the environment, so the harness knows nothing of it (unlike sim's ``--numerics-bug``, which
lives in sim's kernels where the op check sees it directly):

- ``PLANTED_BUG=layer_norm:EPS``: `torch.nn.functional.layer_norm` on any non-CPU device returns its
  result scaled by (1 + EPS): a normalization layer slightly off, the size of bf16 rounding or below.
- ``PLANTED_BUG=kv_cache:EPS:STEP``: transformers' KV cache layers, on any non-CPU device, store the
  values of decoding step STEP and later scaled by (1 + EPS) (step 0 is the prompt's forward).
- ``PLANTED_RANK=R`` beside any of them: planted only in the process of rank R (``RANK``) of a parallel step:
  a bug in one chip's shard of the work.
- ``PLANTED_CHIP=I`` beside any of them: planted only in the rank process on device index I (its LOCAL_RANK),
  whichever rank that is: one bad chip.
- ``PLANTED_BUG=at_highest:segv`` / ``at_highest:hang``: `layer_norm` on a sim device at sim's highest
  precision (read through sim's public API, as a vendor's extension would) kills its process with SIGSEGV,
  or never returns: a kernel that fails only at full precision.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import torch


def _plant_layer_norm(off: float) -> Callable[[], None]:
    clean = torch.nn.functional.layer_norm

    def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):  # torch's signature
        out = clean(input, normalized_shape, weight, bias, eps)
        return out * (1 + off) if input.device.type != "cpu" else out

    torch.nn.functional.layer_norm = layer_norm
    return lambda: setattr(torch.nn.functional, "layer_norm", clean)


def _plant_kv_cache(off: float, step: int) -> Callable[[], None]:
    from transformers import cache_utils

    undo = []
    for name in ("DynamicLayer", "StaticLayer", "DynamicSlidingWindowLayer", "StaticSlidingWindowLayer"):
        cls = getattr(cache_utils, name, None)
        if cls is None or "update" not in vars(cls):
            continue
        clean = cls.update

        def update(self, key_states, value_states, *args, _clean=clean, **kwargs):
            calls = self.__dict__.get("_planted_calls", 0)  # one call per forward: the decoding step
            self.__dict__["_planted_calls"] = calls + 1
            if calls >= step and value_states.device.type != "cpu":
                value_states = value_states * (1 + off)
            return _clean(self, key_states, value_states, *args, **kwargs)

        cls.update = update
        undo.append((cls, clean))
    return lambda: [setattr(cls, "update", clean) for cls, clean in undo] and None


def _plant_at_highest(how: str) -> Callable[[], None]:
    clean = torch.nn.functional.layer_norm

    def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):  # torch's signature
        if input.device.type == "sim":
            import harness.sim

            if harness.sim.get_precision() == "highest":
                if how == "segv":
                    os.kill(os.getpid(), signal.SIGSEGV)
                time.sleep(3600)
        return clean(input, normalized_shape, weight, bias, eps)

    torch.nn.functional.layer_norm = layer_norm
    return lambda: setattr(torch.nn.functional, "layer_norm", clean)


def plant(spec: str) -> Callable[[], None]:
    """Plant the bug `spec` names in this process; returns what takes it out again."""
    kind, *args = spec.split(":")
    if kind == "layer_norm":
        return _plant_layer_norm(float(args[0]))
    if kind == "kv_cache":
        return _plant_kv_cache(float(args[0]), int(args[1]))
    if kind == "at_highest" and args and args[0] in ("segv", "hang"):
        return _plant_at_highest(args[0])
    raise ValueError(f"PLANTED_BUG={spec!r}: layer_norm:EPS, kv_cache:EPS:STEP or at_highest:segv|hang")


def _here() -> bool:
    return (os.environ.get("PLANTED_RANK", os.environ.get("RANK")) == os.environ.get("RANK")
            and os.environ.get("PLANTED_CHIP", os.environ.get("LOCAL_RANK")) == os.environ.get("LOCAL_RANK"))


if os.environ.get("PLANTED_BUG") and _here():
    plant(os.environ["PLANTED_BUG"])
