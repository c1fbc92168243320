"""View models of the speed parts of the report (``--perf`` runs): the summary's geometric means and
per-model table, a model page's spread and op profile, the diff page's perf regressions.

Pure functions like `views.py` (frames and rows in, template-ready dicts out); apart so each module
stays small.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from harness import speed
from harness.analysis.matrix import perf_summary, perf_table
from harness.analysis.perfgate import PerfChange, PerfGate, disturbance, quantity_label
from harness.report.svg import as_number, svg_spread
from harness.report.views import fmt, records

_STEPS = (("target", "target"), ("eager", "target, eager"), ("reference", "CPU reference"))


def speed_view(df: pd.DataFrame, hrefs: dict[str, str]) -> dict[str, Any]:
    """The summary page's speed section: the geometric means per configuration and every timed model
    (empty lists when nothing was timed)."""
    if df.empty:
        return {"configs": [], "models": []}
    models = records(perf_table(df))
    for m in models:
        m["href"] = hrefs.get(m["model_id"])
        for k in ("target_ms", "reference_ms", "ratio", "speedup", "device_peak_mb"):
            m[k] = fmt(m.get(k))
        m["rounds"] = "" if pd.isna(m.get("rounds")) else int(m["rounds"])
    configs = [{k: (fmt(v) if k.startswith("geomean") else v) for k, v in r.items()} for r in records(perf_summary(df))]
    return {"configs": configs, "models": models}


def perf_row_view(perf: Any) -> dict[str, Any] | None:
    """A model page's speed for one row: each step's spread (a box plot in ms), the ratio and speedup with
    their intervals, the op profile's top ops with their share; None when the row was not timed."""
    if not isinstance(perf, dict) or not perf:
        return None
    if perf.get("error"):
        return {"error": str(perf["error"]), "steps": [], "svg": "", "numbers": [], "ops": [], "note": ""}
    steps = []
    for key, label in _STEPS:
        s = perf.get(key)
        if isinstance(s, dict):
            ms = {k: (as_number(s.get(k)) or 0) * 1e3 for k in ("min", "q1", "median", "q3", "max", "lo", "hi")}
            steps.append({"label": label, **ms, "n": s.get("n", "")})
    numbers = []
    for key, label in (("ratio", "target / reference"), ("speedup", "compiled speedup (eager / compiled)")):
        s = perf.get(key)
        if isinstance(s, dict):
            numbers.append((label, f"{fmt(s.get('median'))}x (95% interval of the median {fmt(s.get('lo'))}-"
                                   f"{fmt(s.get('hi'))}, {s.get('n', '')} rounds)"))
    prof = perf.get("profile") or {}
    total = as_number(prof.get("total_us")) or 0
    ops = [{"op": op, "us": fmt(us), "share": f"{us / total:.1%}" if total else ""} for op, us in prof.get("ops") or []]
    disturbed = disturbance(perf)
    return {
        "error": "",
        "steps": [{k: (fmt(v) if isinstance(v, float) else v) for k, v in s.items()} for s in steps],
        "svg": svg_spread(steps),
        "numbers": numbers,
        "ops": ops,
        "profile": "; ".join(x for x in (
            f"{fmt(total / 1e3)} ms of {prof.get('clock', 'host')} self time per step, over {prof.get('rounds', '')} "
            "profiled steps", str(prof.get("note") or "")) if x) if ops else perf.get("profile_error", ""),
        "note": "; ".join(x for x in (str(perf.get("note") or ""),
                                       "host disturbed while timed: " + ", ".join(disturbed) if disturbed else "",
                                       f"{perf.get('budget_s', '')} s budget, {perf.get('warmup', '')} warm-up rounds, "
                                       f"{perf.get('threads', '')} intra-op thread(s), {fmt(perf.get('wall_s'))} s in all")
                          if x),
    }


def perf_diff_view(res: PerfGate, hrefs: dict[str, str]) -> dict[str, Any]:
    """The diff page's speed sections: perf regressions (gating), allowlisted, faster."""

    def rows(items: list[PerfChange]) -> list[dict[str, Any]]:
        return [{"model": c.model_id, "href": hrefs.get(c.model_id), "config": c.config,
                 "quantity": quantity_label(c.quantity), "base": fmt(c.base), "head": fmt(c.head),
                 "slowdown": fmt(c.slowdown), "op": c.op, "detail": c.detail,
                 "note": "; ".join(x for x in (c.note, c.why) if x)} for c in items]

    kernels = [{"model": k.model_id, "href": hrefs.get(k.model_id), "config": k.config, "quantity": "kernel self time (µs)",
                "base": fmt(k.base_us), "head": fmt(k.head_us), "slowdown": fmt(k.slowdown), "op": k.op,
                "detail": k.detail, "note": k.why} for k in res.kernels]
    return {
        "threshold": f"{res.threshold:g}",
        "compared": res.compared,
        "geomean": fmt(res.geomean),
        "n_regressions": len(res.regressions),
        "n_kernels": len(res.kernels),
        "n_inconclusive": len(res.inconclusive),
        "sections": [{"title": t, "kind": k, "rows": r} for t, k, r in (
            (f"Perf regressions (at least {res.threshold:g}x slower, beyond both runs' noise)", "regression",
             rows(res.regressions)),
            (f"Kernel regressions (an op at least {speed.KERNEL_THRESHOLD:g}x slower beyond both runs' noise; the step "
             "as a whole not a regression)", "regression", kernels),
            (f"Collective settings costing more (a setting's ratio to the baseline setting at least {res.threshold:g}x "
             "higher, beyond both runs' noise)", "regression", rows(res.settings)),
            ("Perf allowlist: slower, known-noisy (not counted)", "", rows(res.allowlisted)),
            ("Perf inconclusive: the host was too disturbed to tell (not counted; rerun on a quieter host)",
             "inconclusive", rows(res.inconclusive)),
            ("Faster", "fix", rows(res.faster)),
        )],
    }
