"""The speed gate: which models got slower beyond noise, between two runs (`diff`) or against a committed
perf baseline (`baseline check`), and which ops added the time.

Each row measured with ``--perf`` holds summaries (`harness.speed.summarize`) of its timed step. What is
compared is the **target/reference ratio** when both rows have one (interleaved rounds: the machine's
load cancels), else the target's latency. A model is a perf regression when `harness.speed.compare` says
so: slower by at least the threshold, with the interval of the slowdown (both runs' own noise) above 1.
Models on the perf allowlist (known-noisy ones: ``model-id-or-pattern  # why`` per line) are reported
but do not gate. Only models whose step ran in both rows are compared: an outcome change is the other
gate's business.

Pure functions over row dicts; which rows is the caller's.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from harness import speed

QUANTITIES = {"ratio": "target/reference", "target": "target latency"}


@dataclass
class PerfChange:
    """One (model, configuration) whose speed moved beyond noise."""

    model_id: str
    config: str
    quantity: str  # what was compared: "ratio" (target/reference) or "target" (latency, seconds)
    base: float  # the base's median
    head: float
    slowdown: float  # head / base (> 1: slower)
    lo: float
    hi: float
    op: str = ""  # the op that added the most time (from the two runs' op profiles), if any
    op_factor: float | None = None
    op_share: float | None = None  # of the added time
    detail: str = ""  # "1.62x slower [1.55-1.70]; aten::_softmax self time 4.1x (62% of the added time)"
    note: str = ""  # why it is allowlisted


@dataclass
class PerfGate:
    """The outcome of comparing every model's speed."""

    threshold: float = speed.DEFAULT_THRESHOLD
    regressions: list[PerfChange] = field(default_factory=list)  # gating
    allowlisted: list[PerfChange] = field(default_factory=list)  # slower beyond noise, but known-noisy
    faster: list[PerfChange] = field(default_factory=list)  # informational
    compared: int = 0  # models with a speed on both sides
    geomean: float | None = None  # of every compared model's slowdown (head / base)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        return {k: _finite(v) for k, v in out.items()}


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def perf_of(row: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A row's ``perf`` when its step was timed (None: not measured, or the measurement failed)."""
    perf = None if row is None else row.get("perf")
    if not isinstance(perf, Mapping) or not perf or perf.get("error"):
        return None
    return dict(perf) if "target" in perf or "ratio" in perf else None


def quantity(base: Mapping[str, Any], head: Mapping[str, Any]) -> str | None:
    """What two measurements can be compared on: the ratio when both have it, else the latency."""
    for q in QUANTITIES:
        if isinstance(base.get(q), Mapping) and isinstance(head.get(q), Mapping):
            return q
    return None


def _median(perf: Mapping[str, Any], key: str) -> float | None:
    s = perf.get(key)
    v = s.get("median") if isinstance(s, Mapping) else None
    return float(v) if v else None


def compare_perf(model_id: str, config: str, base: Mapping[str, Any], head: Mapping[str, Any], *,
                 threshold: float = speed.DEFAULT_THRESHOLD) -> tuple[PerfChange, speed.Shift] | None:
    """Two measurements of one model compared (None when they share no quantity)."""
    q = quantity(base, head)
    if q is None:
        return None
    shift = speed.compare(base[q], head[q], threshold=threshold)
    if shift is None:
        return None
    b_ref, h_ref = _median(base, "reference"), _median(head, "reference")
    scale = h_ref / b_ref if q == "ratio" and b_ref and h_ref else 1.0  # the head machine's speed vs the base's
    ops = speed.op_shifts(base.get("profile"), head.get("profile"), scale=scale)
    if not ops and scale != 1.0:
        # the reference's drift is the machine's, the profiled steps' can differ (a few rounds each): an op
        # that grew shows unscaled; ops that all grew alike are said to be so (`speed.explain`)
        scale = 1.0
        ops = speed.op_shifts(base.get("profile"), head.get("profile"))
    change = PerfChange(model_id, config, q, float(base[q]["median"]), float(head[q]["median"]), shift.slowdown,
                        shift.lo, shift.hi,
                        detail=speed.explain(shift, ops, scale=scale, base=base.get("profile"), head=head.get("profile")))
    if ops:
        change.op, change.op_factor, change.op_share = ops[0].op, ops[0].factor, round(ops[0].share, 4)
    return change, shift


def allowed(model_id: str, allowlist: Mapping[str, str]) -> str | None:
    """The reason ``model_id`` is on the perf allowlist (exact id or fnmatch pattern), else None."""
    for pattern, reason in allowlist.items():
        if model_id == pattern or fnmatch.fnmatchcase(model_id, pattern):
            return reason or "on the perf allowlist"
    return None


def gate(pairs: list[tuple[str, str, Mapping[str, Any] | None, Mapping[str, Any] | None]], *,
         threshold: float = speed.DEFAULT_THRESHOLD, allowlist: Mapping[str, str] | None = None) -> PerfGate:
    """Compare ``(model, config, base row, head row)`` pairs; rows without a speed on either side are skipped."""
    if not threshold > 1:
        raise ValueError(f"--perf-regression {threshold}: must be > 1 (1.2 = 20% slower)")
    res = PerfGate(threshold=threshold)
    slowdowns = []
    for model, config, b_row, h_row in pairs:
        b, h = perf_of(b_row), perf_of(h_row)
        if b is None or h is None:
            continue
        compared = compare_perf(model, config, b, h, threshold=threshold)
        if compared is None:
            continue
        change, shift = compared
        res.compared += 1
        slowdowns.append(shift.slowdown)
        if shift.regressed:
            reason = allowed(model, allowlist or {})
            if reason is not None:
                change.note = reason
                res.allowlisted.append(change)
            else:
                res.regressions.append(change)
        elif shift.faster:
            res.faster.append(change)
    res.geomean = speed.geomean(slowdowns)
    for items in (res.regressions, res.allowlisted):
        items.sort(key=lambda c: (-c.slowdown, c.model_id))
    res.faster.sort(key=lambda c: (c.slowdown, c.model_id))
    return res


def format_gate(res: PerfGate, *, limit: int = 50) -> list[str]:
    """Text lines for a summary: the perf regressions (gating), the allowlisted and the faster ones."""
    if not res.compared:
        return []
    gm = f"; geometric mean head/base {res.geomean:.3f}" if res.geomean else ""
    lines = [f"\nspeed: {res.compared} model(s) compared{gm}; regression = >= {res.threshold:g}x slower with the "
             "slowdown's 95% interval above 1"]

    def section(title: str, items: list[PerfChange]) -> None:
        if not items:
            return
        lines.append(f"\n{title} ({len(items)}):")
        for c in items[:limit]:
            what = QUANTITIES[c.quantity]
            note = f"  [{c.note}]" if c.note else ""
            lines.append(f"  {c.model_id}  [{c.config}]  {what} {c.base:.4g} -> {c.head:.4g}: {c.detail}{note}")
        if len(items) > limit:
            lines.append(f"  ... and {len(items) - limit} more")

    section(f"PERF REGRESSIONS > {res.threshold:g}x", res.regressions)
    section("perf allowlist (slower, not counted)", res.allowlisted)
    section("faster (not gating)", res.faster)
    return lines


def read_allowlist(path: str | None) -> dict[str, str]:
    """The perf allowlist: ``model-id-or-pattern  # why`` per line (the reason may be left out)."""
    if path is None:
        return {}
    from harness.files import read_text

    out: dict[str, str] = {}
    for line in read_text(path, "--perf-allowlist").splitlines():
        entry, _, reason = line.partition("#")
        if entry.strip():
            out[entry.strip()] = reason.strip()
    return out
