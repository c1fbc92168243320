"""View models of the collectives pages: the settings benchmark and the fault scenarios' grid."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from harness.report.svg import as_number, svg_bars
from harness.report.views import _size, fmt, records
from harness.report.views import as_text as _text


def _collective_row(r: dict[str, Any]) -> dict[str, Any]:
    ms = {k: fmt((as_number(r.get(f"{k}_s")) or 0) * 1e3) for k in ("median", "p10", "p90")}
    return {
        "setting": _text(r["setting"]),
        "baseline": _text(r.get("baseline_setting")),
        "size": _size(r["size_bytes"]),
        "size_bytes": int(r["size_bytes"]),
        "median_ms": ms["median"],
        "p10_ms": ms["p10"],
        "p90_ms": ms["p90"],
        "repeats": _text(r.get("repeats")),
        "ratio": fmt(r.get("ratio")),
        "ratio_range": f"{fmt(r.get('ratio_p10'))} - {fmt(r.get('ratio_p90'))}",
        "target": _text(r.get("target")),
    }


def collectives_view(coll: pd.DataFrame) -> list[dict[str, Any]]:
    """One group per (op, backend, world size): a ratio bar chart and its table."""
    groups: list[dict[str, Any]] = []
    if coll.empty:
        return groups
    for (op, backend, world), g in coll.groupby(["op", "backend", "world_size"], sort=True):
        rows = g.sort_values(["size_bytes", "setting"]).to_dict("records")
        bars = [
            {
                "label": f"{r['setting']} @ {_size(r['size_bytes'])}",
                "value": r.get("ratio"),
                "lo": r.get("ratio_p10"),
                "hi": r.get("ratio_p90"),
            }
            for r in rows
        ]
        groups.append(
            {
                "op": op,
                "backend": backend,
                "world_size": int(world),
                "svg": svg_bars(bars),
                "rows": [_collective_row(r) for r in rows],
            }
        )
    return groups


# ----------------------------------------------------------------------------------------------
# Collective faults page
# ----------------------------------------------------------------------------------------------

_SCENARIO_ORDER = ("none", "hang", "slow", "nan", "die", "flap")


def _flag(v: Any) -> bool | None:
    """A 1/0/None column (or a bool one) back as True/False/None."""
    f = as_number(v)
    return None if f is None or math.isnan(f) else bool(f)


def _secs(v: Any) -> str:
    f = as_number(v)
    return "" if f is None or math.isnan(f) else f"{f:.2f} s"


def _fault_cell(r: dict[str, Any]) -> dict[str, Any]:
    """One grid cell: detected (and how fast), the rank named, and what else the scenario asks."""
    scenario = _text(r["scenario"])
    lines: list[str] = []
    if scenario == "none":
        ok = not _flag(r.get("detected")) and not int(as_number(r.get("false_flags")) or 0)
        head = "healthy: not flagged" if ok else f"false alarm ({_text(r.get('detected_by')) or 'straggler'})"
        lines.append(f"{int(as_number(r.get('false_flags')) or 0)} false straggler flags")
        return {"ok": ok, "head": head, "lines": lines}
    detected, named = _flag(r.get("detected")), _flag(r.get("rank_named"))
    head = f"detected in {_secs(r.get('detect_s'))} by {_text(r.get('detected_by'))}" if detected else "NOT detected"
    if detected:
        lines.append(f"rank {int(as_number(r['named_rank']))} named" if named else
                     ("wrong rank named" if as_number(r.get("named_rank")) is not None else "rank not named"))
    ok = bool(detected and named)
    for key, yes, no in (("nan_caught", "NaN caught before the optimizer step", "NaN reached the weights"),
                         ("flagged", "flagged as a straggler", "not flagged as a straggler")):
        v = _flag(r.get(key))
        if v is not None:
            lines.append(yes if v else no)
            ok = ok and v
    recovered = _flag(r.get("recovered"))
    if recovered is not None:
        match = _flag(r.get("params_match"))
        lines.append(
            f"recovered, resumed in {_secs(r.get('resume_s'))}" + ("" if match is None else
                                                                   ("; parameters match" if match else "; PARAMETERS DIFFER"))
            if recovered else "not recovered"
        )
        ok = ok and recovered and match is not False
    if not _flag(r.get("clean_exit")):
        lines.append("healthy ranks did not exit cleanly")
    return {"ok": ok, "head": head, "lines": lines}


def collective_faults_view(faults: pd.DataFrame) -> dict[str, Any]:
    """The collective-faults page: a scenario x (backend, world size, setting) grid, then every row."""
    recs = records(faults)
    columns = sorted({(_text(r["backend"]), int(r["world_size"]), _text(r["setting"])) for r in recs})

    def order(s: str) -> tuple[int, str]:
        kind = s.split(":")[0]
        return (_SCENARIO_ORDER.index(kind) if kind in _SCENARIO_ORDER else len(_SCENARIO_ORDER), s)

    scenarios = sorted({_text(r["scenario"]) for r in recs}, key=order)
    by_key = {(_text(r["scenario"]), _text(r["backend"]), int(r["world_size"]), _text(r["setting"])): r for r in recs}
    grid = [
        {"scenario": s, "cells": [_fault_cell(by_key[(s, *c)]) if (s, *c) in by_key else None for c in columns]}
        for s in scenarios
    ]
    rows = []
    for r in sorted(recs, key=lambda r: (_text(r["backend"]), int(r["world_size"]), _text(r["setting"]),
                                         order(_text(r["scenario"])))):
        loss = as_number(r.get("throughput_loss"))
        rows.append({
            "backend": _text(r["backend"]), "world_size": int(r["world_size"]), "setting": _text(r["setting"]),
            "scenario": _text(r["scenario"]), "fault": "-" if int(r["fault_rank"]) < 0 else
            f"{int(r['fault_rank'])} @ {int(r['fault_step'])}",
            "detected": "yes" if _flag(r.get("detected")) else "no", "by": _text(r.get("detected_by")),
            "detect_s": _secs(r.get("detect_s")), "named": _text(r.get("named_by")) if _flag(r.get("rank_named")) else "",
            "backend_error": _secs(r.get("backend_error_s")) if _flag(r.get("backend_error")) else "",
            "clean_exit": "yes" if _flag(r.get("clean_exit")) else "no",
            "false_flags": int(as_number(r.get("false_flags")) or 0),
            "loss": "" if loss is None or math.isnan(loss) else f"{loss:.0%}",
            "resume_s": _secs(r.get("resume_s")), "steps_lost": fmt(r.get("steps_lost")),
            "detail": _text(r.get("detail")), "error": _text(r.get("error")),
        })
    labels = [{"backend": b, "world_size": w, "setting": s} for b, w, s in columns]
    return {"columns": labels, "grid": grid, "rows": rows}


# ----------------------------------------------------------------------------------------------
# What each collective setting costs each sharded model (--parallel --perf --collectives)
# ----------------------------------------------------------------------------------------------


def model_settings_view(df: pd.DataFrame, hrefs: dict[str, str]) -> dict[str, Any]:
    """Per model and setting its step and ratio to the baseline setting (the table); per architecture the
    geometric mean of each setting's ratio (a chart and a table); and which setting is fastest for how many
    models, by how much (the summary's line)."""
    from harness.parallel.timing import fastest
    from harness.speed import geomean

    if df.empty or "collectives" not in df.columns:
        return {"rows": [], "archs": [], "fastest": [], "svg": ""}
    rows, by_arch, best = [], {}, {}
    for r in records(df):
        c = r.get("collectives")
        if not isinstance(c, dict) or not c.get("settings"):
            continue
        arch = _text(r.get("model_id")).split("/")[1] if _text(r.get("model_id")).count("/") >= 2 else ""
        for name, s in c["settings"].items():
            ratio = s.get("ratio") or {}
            rows.append({"model": _text(r["model_id"]), "href": hrefs.get(_text(r["model_id"])), "arch": arch,
                         "spec": _text((r.get("parallel") or {}).get("spec")), "setting": name,
                         "baseline": c.get("baseline"), "step_ms": fmt((s.get("step") or {}).get("median", 0) * 1e3),
                         "ratio": fmt(ratio.get("median")) if ratio else "1",
                         "interval": f"{fmt(ratio.get('lo'))}-{fmt(ratio.get('hi'))}" if ratio else "",
                         "messages": s.get("messages"), "share": fmt(s.get("share"))})
            if ratio:
                by_arch.setdefault((arch, name), []).append(ratio.get("median"))
        won = fastest(c)
        if won is not None:
            best.setdefault(won[0], []).append(won[1])
    archs = [{"arch": a, "setting": n, "models": len(v), "geomean": fmt(geomean(v))} for (a, n), v in sorted(by_arch.items())]
    per_setting: dict[str, list[float]] = {}
    for (_, n), v in by_arch.items():
        per_setting.setdefault(n, []).extend(v)
    bars = [{"label": n, "value": geomean(v)} for n, v in sorted(per_setting.items())]
    wins = [{"setting": n, "models": len(v), "by": fmt(geomean(v))} for n, v in sorted(best.items(), key=lambda kv: -len(kv[1]))]
    return {"rows": rows, "archs": archs, "fastest": wins, "svg": svg_bars(bars) if bars else ""}
