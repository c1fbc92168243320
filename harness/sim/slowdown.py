"""Planted slowdowns: one op's kernel N times slower, for testing speed verdicts.

A speed regression on real hardware is usually one kernel that got slower (a lost fusion, a fallback
to a slow path). ``aten::_softmax:3`` makes every softmax on sim take three times as long, measured over
the whole op as sim runs it (its arguments' host views, the kernel, adopting the outputs: what a profiler
attributes to the op): the extra time is spent busy on the host (sim's device), so wall clocks and
profilers (self time by op) both see it. Names are as sim's op census spells them (``aten::_softmax``, ``aten::addmm``,
``aten::add.Tensor``); ``aten::softmax`` also names ``aten::_softmax``, the kernel under the composite
a model calls.

Switch: env ``PORTHARNESS_SIM_SLOW_OPS`` (``aten::_softmax:3,aten::gelu:1.5``), `set_slow_ops()`, or the
`slow_ops()` context manager.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager

from .native import ext
from .switch import Switch

SLOW_OPS_ENV = "PORTHARNESS_SIM_SLOW_OPS"


MAX_FACTOR = 1000.0  # beyond it the busy-wait overflows (inf, 1e308) or outlasts any budget (1e9)


def parse_slow_ops(spec: str) -> dict[str, float]:
    """``aten::_softmax:3,aten::gelu:1.5`` -> {"aten::_softmax": 3.0, "aten::gelu": 1.5}; ValueError
    naming the bad entry (a malformed one, a factor outside 1..MAX_FACTOR, an op torch does not have)."""
    out: dict[str, float] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, sep, factor = item.rpartition(":")
        try:
            value = float(factor)
        except ValueError:
            value = float("nan")
        if not sep or "::" not in name or not 1.0 <= value <= MAX_FACTOR:
            raise ValueError(f"{SLOW_OPS_ENV}: bad entry {item!r}; expected 'aten::op:FACTOR' with FACTOR from 1 to "
                             f"{MAX_FACTOR:g}, e.g. 'aten::_softmax:3'")
        if not _known_op(name):
            raise ValueError(f"{SLOW_OPS_ENV}: no such op {name!r} (names as sim's op census spells them: "
                             "'aten::_softmax', 'aten::add.Tensor'); nothing would be slowed")
        out[name] = value
    return out


def canonical_slow_ops(spec: str) -> str:
    """One spelling per meaning of a --slow-ops spec: ops sorted, factors as Python writes floats."""
    return ",".join(f"{op}:{f!r}" for op, f in sorted(parse_slow_ops(spec).items()))


def _known_op(name: str) -> bool:
    """Whether torch has the op `name` (``ns::op`` or ``ns::op.overload``)."""
    import torch

    ns, _, rest = name.partition("::")
    op, _, overload = rest.partition(".")
    schemas = torch._C._jit_get_schemas_for_operator(f"{ns}::{op}")
    return bool(schemas) and (not overload or any(s.overload_name == overload for s in schemas)
                              or overload == "default" and any(not s.overload_name for s in schemas))


_switch: Switch[dict[str, float]] = Switch(ext.set_slow_ops, parse_slow_ops(os.environ.get(SLOW_OPS_ENV, "")))


def _parsed(ops: dict[str, float] | str) -> dict[str, float]:
    return parse_slow_ops(ops) if isinstance(ops, str) else dict(ops)


def get_slow_ops() -> dict[str, float]:
    return dict(_switch.get())


def set_slow_ops(ops: dict[str, float] | str) -> None:
    """Plant these slowdowns (a dict or a spec string; empty: every kernel at its own speed)."""
    _switch.set(_parsed(ops))


def slow_ops(ops: dict[str, float] | str) -> AbstractContextManager[None]:
    """Run the block with these slowdowns planted."""
    return _switch.scoped(_parsed(ops))
