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
from collections.abc import Iterator
from contextlib import contextmanager

from .native import ext

FALLBACK_ENV = "PORTHARNESS_SIM_FALLBACK"
MODES = ("off", "cpu")


def _validate(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown sim fallback mode {mode!r}; expected one of {', '.join(MODES)}")
    return mode


def _apply(mode: str) -> str:
    ext.set_fallback_cpu(mode == "cpu")
    return mode


_mode = _apply(_validate(os.environ.get(FALLBACK_ENV, "off") or "off"))


def get_fallback() -> str:
    return _mode


def set_fallback(mode: str) -> None:
    global _mode
    _mode = _apply(_validate(mode))


@contextmanager
def fallback(mode: str) -> Iterator[None]:
    """Run the block with another fallback mode."""
    global _mode
    prev, _mode = _mode, _apply(_validate(mode))
    try:
        yield
    finally:
        _mode = _apply(prev)


def fallback_counts() -> dict[str, int]:
    """Calls per op that fell back since the last reset, e.g. ``{"aten::sort": 3}`` (counted natively)."""
    return dict(ext.fallback_counts())


def reset_fallback_counts() -> None:
    ext.reset_fallback_counts()
