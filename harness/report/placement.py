"""View model of the placement page: each scenario's latest row per target and mode (`portharness placement`)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from harness.report.svg import as_number
from harness.report.views import as_text as _text
from harness.report.views import fmt, records
from harness.results.store import ResultStore

PAGE = "placement.html"
_ORDER = ("per-chip", "host", "shared", "rl")


def latest(store: ResultStore) -> pd.DataFrame:
    """The latest row of each (target, backend, mode, scenario) over every placement run in the DB."""
    every = store.placements()
    if every.empty:
        return every
    key = ["target", "backend", "mode", "scenario"]
    return every.sort_values("finished_at", kind="stable").drop_duplicates(key, keep="last")


def _tri(v: Any) -> str:
    n = as_number(v)
    return "-" if n is None else ("yes" if n else "NO")


def _times(v: Any, lo: Any = None, hi: Any = None) -> str:
    x, a, b = as_number(v), as_number(lo), as_number(hi)
    if x is None:
        return ""
    return f"{x:.2f}x" + (f" [{a:.2f}-{b:.2f}]" if a is not None and b is not None and b != float("inf") else "")


def _process(p: dict[str, Any]) -> dict[str, Any]:
    return {"role": _text(p.get("role")), "pid": _text(p.get("pid")), "devices": ", ".join(map(str, p.get("devices") or [])),
            "sees": _text(p.get("sees")), "peak_mb": fmt(p.get("peak_mb")),
            "alone_ms": fmt(p.get("alone_ms")), "together_ms": fmt(p.get("together_ms")),
            "slowdown": _times(p.get("slowdown"), p.get("lo"), p.get("hi")), "identical": _tri(p.get("identical"))}


def placement_view(rows: pd.DataFrame) -> dict[str, Any]:
    """Rows by target and mode, scenarios in their order, each with its processes."""
    def order(r: dict[str, Any]) -> tuple:
        kind = _text(r["scenario"]).split(":")[0]
        return (_text(r["target"]), _text(r["mode"]), _ORDER.index(kind) if kind in _ORDER else 9, _text(r["scenario"]))

    out = []
    for r in sorted(records(rows), key=order):
        ok = _text(r["result"]) in ("allowed", "refused") and as_number(r.get("identical")) != 0 \
            and as_number(r.get("latest_weights")) != 0
        out.append({
            "target": _text(r["target"]), "mode": _text(r["mode"]), "scenario": _text(r["scenario"]),
            "result": _text(r["result"]), "ok": ok, "processes": _text(r.get("processes")),
            "peak_mb": fmt(r.get("peak_mb")), "slowdown": _times(r.get("slowdown"), r.get("slowdown_lo"), r.get("slowdown_hi")),
            "identical": _tri(r.get("identical")), "latest_weights": _tri(r.get("latest_weights")),
            "handoff_ms": fmt(r.get("handoff_ms")), "refusal": _text(r.get("refusal")),
            "detail": "; ".join(filter(None, [_text(r.get("detail")), _text(r.get("visibility")), _text(r.get("error"))])),
            "run_id": _text(r.get("run_id")), "per_process": [_process(p) for p in r.get("per_process") or []],
        })
    return {"placements": out}
