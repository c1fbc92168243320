"""CPU fallback: ops outside the op profile run on the host instead of failing, and are counted.

Young backends send the ops they lack to the CPU (TorchNeuron marks each op Y / CPU_FALLBACK / N;
torch_xla counts them in its metrics). With ``cpu`` an op outside sim's profile runs (on the host, as
sim's kernels always do) and is counted per op; with ``off`` (the default) it raises the backend's
missing-kernel error. Ops the host itself has no kernel for still fail either way.

Switch: env ``PORTHARNESS_SIM_FALLBACK`` (``off`` | ``cpu``), `set_fallback()`, or the `fallback()`
context manager; `fallback_counts()` / `reset_fallback_counts()` read and clear the counters (all
re-exported by ``harness.sim``).
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager

from .native import ext
from .switch import Switch

FALLBACK_ENV = "PORTHARNESS_SIM_FALLBACK"
MODES = ("off", "cpu")


def _validate(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown sim fallback mode {mode!r}; expected one of {', '.join(MODES)}")
    return mode


_switch = Switch(lambda mode: ext.set_fallback_cpu(mode == "cpu"),
                 _validate(os.environ.get(FALLBACK_ENV, "off") or "off"))


def get_fallback() -> str:
    return _switch.get()


def set_fallback(mode: str) -> None:
    _switch.set(_validate(mode))


def fallback(mode: str) -> AbstractContextManager[None]:
    """Run the block with another fallback mode."""
    return _switch.scoped(_validate(mode))


def fallback_counts() -> dict[str, int]:
    """Calls per op that fell back since the last reset, e.g. ``{"aten::sort": 3}`` (counted natively)."""
    return dict(ext.fallback_counts())


def reset_fallback_counts() -> None:
    ext.reset_fallback_counts()
