"""CPU fallback: ops outside the op profile run on the host instead of failing, and are counted.

Young backends send the ops they lack to the CPU (TorchNeuron marks each op Y / CPU_FALLBACK / N;
torch_xla counts them in its metrics). With ``cpu`` an op outside sim's profile runs (on the host, as
sim's kernels always do) and is counted per op; with ``off`` (the default) it raises the backend's
missing-kernel error. Ops the host itself has no kernel for still fail either way.

Switch: env ``PORTHARNESS_SIM_FALLBACK`` (``off`` | ``cpu``), `set_fallback()`, or the `fallback()`
context manager; `fallback_counts()` / `reset_fallback_counts()` read and clear the counters.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch

FALLBACK_ENV = "PORTHARNESS_SIM_FALLBACK"
MODES = ("off", "cpu")


def _validate(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown sim fallback mode {mode!r}; expected one of {', '.join(MODES)}")
    return mode


_mode = _validate(os.environ.get(FALLBACK_ENV, "off") or "off")
_counts: Counter[str] = Counter()


def get_fallback() -> str:
    return _mode


def set_fallback(mode: str) -> None:
    global _mode
    _mode = _validate(mode)


@contextmanager
def fallback(mode: str) -> Iterator[None]:
    """Run the block with another fallback mode."""
    global _mode
    prev, _mode = _mode, _validate(mode)
    try:
        yield
    finally:
        _mode = prev


def count(func: torch._ops.OpOverload) -> None:
    """One call of `func` fell back to the host (called by the dispatcher)."""
    ov = func._overloadname
    _counts[func._schema.name if ov == "default" else f"{func._schema.name}.{ov}"] += 1


def fallback_counts() -> dict[str, int]:
    """Calls per op that fell back since the last reset, e.g. ``{"aten::sort": 3}``."""
    return dict(_counts)


def reset_fallback_counts() -> None:
    _counts.clear()
