"""View models for the report pages: result-store dataframes and dicts in, template-ready dicts out.

Pure functions, no file IO, so each page's data can be tested without rendering. Numbers are
formatted here (templates stay logic-free) and everything model-supplied stays plain text: escaping
is Jinja's job. Only the embedded matrix JSON keeps raw numbers, so the JS can sort on them.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pandas as pd

from harness.analysis.diff import DiffResult
from harness.analysis.matrix import column_records, settings_label, with_config
from harness.outcomes import JUDGEMENT_OUTCOME, OUTCOMES, output_judgement
from harness.phases import PHASES
from harness.report.decoding import decoding_view

# as_number lives with the SVG code, which sits below this module (views embed charts, never the reverse).
from harness.report.svg import as_number, svg_histogram
from harness.results.rows import compile_summary, round_floats

# ----------------------------------------------------------------------------------------------
# Formatting helpers
# ----------------------------------------------------------------------------------------------


def _json_num(v: Any) -> float | str | None:
    """Number for embedded JSON: JSON has no NaN/Infinity, so infinities become strings."""
    f = as_number(v)
    if f is None or math.isfinite(f):
        return f
    return "Infinity" if f > 0 else "-Infinity"


def op_anchor(op: str) -> str:
    """The id of an op's row on the ops page (`ops.html#op-aten-sort.stable`): a model page links to it."""
    return "op-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", op).strip("-")


def fmt(v: Any, digits: int = 3) -> str:
    """Compact number formatting for tables (empty for missing)."""
    f = as_number(v)
    if f is None:
        return "" if v is None or isinstance(v, float) else str(v)
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    if f == 0:
        return "0"
    if abs(f) >= 1e4 or abs(f) < 1e-3:
        return f"{f:.{digits - 1}e}"
    return f"{f:.{digits}g}"


def as_text(v: Any) -> str:
    """A cell as text: "" for a missing value (None, NaN)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return str(v)


def _size(n: Any) -> str:
    n = int(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Rows of ``df`` as dicts ([] for an empty frame, which may lack the expected columns)."""
    return df.to_dict("records") if not df.empty else []


# ----------------------------------------------------------------------------------------------
# Every page's header, summary and drift pages
# ----------------------------------------------------------------------------------------------

VERSION_KEYS = ("torch_version", "transformers_version", "harness_version")


def run_view(run: dict[str, Any]) -> dict[str, Any]:
    """The selected run as every page's header shows it (settings apart: they are a dict)."""
    settings = run.get("settings") or {}
    return {
        "run": {k: as_text(v) for k, v in run.items() if k != "settings"},
        "run_settings": settings,
        "run_label": settings_label(run["target"], settings),
    }


def _envelope(df: pd.DataFrame, column: str, label: str) -> dict[str, Any]:
    ratios = [x for x in (as_number(v) for v in df[column]) if x is not None] if column in df and not df.empty else []
    return {
        "label": label,
        "svg": svg_histogram(ratios, xlabel=f"rmse(fp64, target) / {label} bound (log scale)"),
        "n_ratios": len(ratios),
        "n_zero": sum(1 for v in ratios if v == 0),
        "n_inf": sum(1 for v in ratios if math.isinf(v)),
        "n_over": sum(1 for v in ratios if v > 1),
    }


def drift_view(df: pd.DataFrame, hrefs: dict[str, str], *, n_worst: int = 25) -> dict[str, Any]:
    """The drift page: both envelopes' histograms (fp32, declared precision) and the worst results."""
    key = "declared_ratio" if "declared_ratio" in df and df["declared_ratio"].notna().any() else "rmse_ratio"
    worst = (
        df.assign(_r=[as_number(v) if as_number(v) is not None else -1 for v in df[key]])
        .sort_values("_r", ascending=False)
        .head(n_worst)
        if not df.empty
        else df
    )
    return {
        "envelopes": [_envelope(df, "rmse_ratio", "fp32 envelope"),
                      _envelope(df, "declared_ratio", "declared-precision envelope")],
        "worst": [
            {
                "model": r["model_id"],
                "href": hrefs[r["model_id"]],
                "config": r["config"],
                "outcome": r["outcome"],
                "rmse_ratio": fmt(r.get("rmse_ratio")),
                "declared_ratio": fmt(r.get("declared_ratio")),
                "contract": as_text(r.get("contract")),
                "op": as_text(r.get("first_drift_op")),
                "module": as_text(r.get("first_drift_module")) or as_text(r.get("first_drift_op_module")),
                "module_type": as_text(r.get("first_drift_module_type")),
            }
            for r in records(worst)
            if as_number(r.get(key)) is not None or as_text(r.get("first_drift_op"))
        ],
    }


# ----------------------------------------------------------------------------------------------
# Model page
# ----------------------------------------------------------------------------------------------

_ATTEMPT_ORDER = ("device", "outcome", "error_type", "exit_code", "signal", "duration_s")
_FIELDS = ("arch", "task", "modality", "device", "host", "error_type", "unsupported_op", "unsupported_dtype", "exit_code",
           "signal", "loss_kind", "first_drift_param", "compile_stage", "compile_node", "eager_outcome",
           "amp_step_skipped", "confirm", "confirm_note")
_NUMBERS = (("rmse_ratio", "fp32 ratio (worst output; <= 1 within fp32)"),
            ("declared_ratio", "declared ratio (worst output; <= 1 within declared)"), ("max_abs_err", "max abs err"),
            ("max_rel_err", "max rel err"), ("min_cosine", "min cosine"), ("grad_worst_ratio", "worst gradient ratio"),
            ("grad_norm_ratio", "gradient norm ratio"), ("loss_delta", "loss delta"))
_TIMINGS = (
    ("load (s)", "load_time_s"),
    ("reference (s)", "ref_time_s"),
    ("target (s)", "target_time_s"),
    ("compile (s)", "compile_s"),
    ("wall (s)", "wall_time_s"),
    ("peak RSS (MB)", "peak_rss_mb"),
)


def _output_view(name: str, m: Any) -> dict[str, Any]:
    """One output's comparison metrics, judged as the row is (`harness.outcomes.output_judgement`: within fp32,
    within declared, beyond); a bare value (older rows) is shown as ``value``."""
    m = m if isinstance(m, dict) else {"value": m}
    shape = m.get("shape")
    judgement = output_judgement(m)
    return {
        "name": name,
        "judgement": judgement,
        "chip": JUDGEMENT_OUTCOME.get(judgement, ""),
        "rmse_target": fmt(m.get("rmse_target")),
        "rmse_ref": fmt(m.get("rmse_ref")),
        "bound": fmt(m.get("bound")),
        "ratio": fmt(m.get("rmse_ratio")),
        "declared_bound": fmt(m.get("declared_bound")),
        "declared_ratio": fmt(m.get("declared_ratio")),
        "beyond": judgement == "beyond",
        "nonfinite": bool(m.get("nonfinite")),
        "note": as_text(m.get("note")),
        "cosine": fmt(m.get("cosine"), 9),
        "max_abs": fmt(m.get("max_abs")),
        "max_rel": fmt(m.get("max_rel")),
        "ok": m.get("ok"),
        "shape": "x".join(str(s) for s in shape) if isinstance(shape, list) else as_text(shape),
        "dtype": as_text(m.get("dtype")),
    }


def _cosine_note(key: str, metrics: Any) -> str:
    """Beside the row's min cosine: the output it is from, and why a near-zero gradient's cosine means nothing."""
    if key != "min_cosine" or not isinstance(metrics, dict):
        return ""
    cosines = {k: c for k, m in metrics.items() if isinstance(m, dict) and (c := as_number(m.get("cosine"))) is not None}
    if not cosines:
        return ""
    name = min(cosines, key=lambda k: cosines[k])
    if cosines[name] >= 0.99:  # nothing to explain
        return ""
    m = metrics[name]
    if m.get("near_zero") and output_judgement(m) != "beyond":
        return (f" ({name}: near zero, below its family's noise floor: its cosine compares rounding noise and "
                f"means nothing; the rmse rule judges it {output_judgement(m)})")
    return f" ({name})"


def _attempts_view(attempts: Any) -> tuple[list[dict[str, str]], list[str]]:
    """Attempt rows as text and their columns: the usual ones first, anything else after, by name."""
    rows = [
        {k: (fmt(v) if isinstance(v, float) else as_text(v)) for k, v in a.items()}
        for a in attempts or []
        if isinstance(a, dict)
    ]
    cols = sorted(
        {k for a in rows for k in a},
        key=lambda k: (_ATTEMPT_ORDER.index(k) if k in _ATTEMPT_ORDER else 99, k),
    )
    return rows, cols


def _phases_view(phases: Any) -> list[dict[str, str]]:
    """Per-phase seconds and peak RSS, in the order the pipeline ran them."""
    if not isinstance(phases, dict):
        return []
    order = sorted(phases, key=lambda n: (PHASES.index(n) if n in PHASES else len(PHASES), n))
    return [{"phase": n, "s": "cached" if phases[n].get("cached") else fmt(phases[n].get("s")),
             "peak_rss_mb": fmt(phases[n].get("peak_rss_mb"))} for n in order if isinstance(phases[n], dict)]


def _judged_by(r: dict[str, Any]) -> list[tuple[str, str]]:
    """Which rules judged the row: the fp64 oracle's form and the op check's coverage."""
    out = []
    if as_text(r.get("oracle")) not in ("", "nan"):
        out.append(("fp64 oracle", as_text(r.get("oracle"))))
    if as_text(r.get("ref_cache")) not in ("", "nan"):
        out.append(("reference", as_text(r.get("ref_cache"))))
    checked = as_number(r.get("ops_checked"))
    if checked is not None:
        sampled = as_number(r.get("ops_sampled_out"))
        compiled = isinstance(r.get("settings"), dict) and bool(r["settings"].get("compile"))
        out.append(("graph check" if compiled else "op check",
                    f"{int(checked)} {'compiled graph nodes' if compiled else 'op calls'} judged"
                    + (f", {int(sampled)} repeats of a judged signature sampled out" if sampled else "")))
    return out


def _count(v: Any) -> str:
    n = as_number(v)
    return "" if n is None else str(int(n))


_RANK_COLS = (("rank", "rank"), ("device", "device"), ("phase", "phase"), ("load_s", "load (s)"),
              ("step_s", "step (s)"), ("sharded_params", "sharded parameters"))


def parallel_view(par: Any) -> dict[str, Any] | None:
    """A row spread over several devices (--parallel, or its list's `parallel` column): the spec, the mesh, the
    rank at fault and each rank's device, phase and times; None for one device."""
    if not isinstance(par, dict) or not par.get("spec"):
        return None
    ranks = [r for r in par.get("ranks") or [] if isinstance(r, dict)]
    cols = [(k, label) for k, label in _RANK_COLS if any(r.get(k) is not None for r in ranks)]
    mesh = par.get("mesh") if isinstance(par.get("mesh"), dict) else {}
    culprit = par.get("culprit") if isinstance(par.get("culprit"), dict) else {}
    return {"spec": as_text(par["spec"]), "mesh": " x ".join(f"{k}={v}" for k, v in mesh.items()),
            "culprit": (f"rank {culprit.get('rank')} ({culprit.get('device')}, {culprit.get('kind')} in phase "
                        f"{culprit.get('phase')})") if culprit else "",
            "cols": [label for _, label in cols],
            "ranks": [[fmt(r.get(k)) if k.endswith("_s") else as_text(r.get(k)) for k, _ in cols] for r in ranks]}


def row_view(r: dict[str, Any]) -> dict[str, Any]:
    """Everything one model page needs for one (target, settings) row, with numbers formatted."""
    metrics = r.get("metrics") or {}
    outputs = [_output_view(name, m) for name, m in metrics.items()] if isinstance(metrics, dict) else []
    attempts, attempt_cols = _attempts_view(r.get("attempts"))
    decoding = decoding_view(r)
    return {
        "config": r["config"],
        "outcome": r["outcome"],
        "fields": [(k, as_text(r.get(k))) for k in _FIELDS if as_text(r.get(k)) not in ("", "nan")]
        + ([("cpu fallback", _fallback_text(r.get("fallback_ops")) or "none")] if r.get("op_census") else [])
        + ([("missing gradients", ", ".join(map(str, r["missing_grads"])))] if r.get("missing_grads") else []),
        "worst_ratio": fmt(r.get("rmse_ratio")),
        "grad_ratio": fmt(r.get("grad_worst_ratio")),
        "where": as_text(r.get("first_drift_param")) or as_text(r.get("first_drift_module"))
        or (decoding["where"] if decoding else "") or as_text(r.get("first_drift_op_module"))
        or as_text(r.get("compile_node")) or as_text(r.get("unsupported_op")) or as_text(r.get("error_type")),
        "decoding": decoding,
        "parallel": parallel_view(r.get("parallel")),
        "drift_module": as_text(r.get("first_drift_module")),
        "drift_op": as_text(r.get("first_drift_op")),
        "drift_op_module": as_text(r.get("first_drift_op_module")),
        "drift_op_inputs": ", ".join(r.get("first_drift_op_inputs") or []),
        "repro_link": as_text(r.get("repro_link")),
        "contract": as_text(r.get("contract")),
        "drift_module_type": as_text(r.get("first_drift_module_type")),
        "numbers": [
            (label, fmt(r.get(key), 9 if key == "min_cosine" else 3) + _cosine_note(key, metrics))
            for key, label in _NUMBERS
            if as_number(r.get(key)) is not None
        ],
        "error_message": round_floats(as_text(r.get("error_message"))),
        "traceback": as_text(r.get("traceback")),
        "worker_output": as_text(r.get("worker_output")),
        "outputs": outputs,
        "attempts": attempts,
        "attempt_cols": attempt_cols,
        "timings": [(label, fmt(r.get(key))) for label, key in _TIMINGS if as_number(r.get(key)) is not None],
        "compiled": compile_summary(r),
        "graph_breaks": _count(r.get("graph_breaks")),
        "break_reasons": [as_text(x) for x in (r.get("graph_break_reasons") or []) if isinstance(r.get("graph_break_reasons"), list)],
        "phases": _phases_view(r.get("phases")),
        "judged_by": _judged_by(r),
        "versions": [(k, as_text(r.get(k))) for k in VERSION_KEYS],
        "finished_at": as_text(r.get("finished_at")),
    }


def history_view(hist: pd.DataFrame) -> dict[str, list[dict[str, Any]]]:
    """Per model, its rows across every run in the DB (for the model pages' history table)."""
    out: dict[str, list[dict[str, Any]]] = {}
    if hist.empty:
        return out
    cols = ("run_id", "model_id", "run_started_at", "list_name", "config", "outcome", "rmse_ratio", "unsupported_op",
            "error_type")
    for r in column_records(with_config(hist), cols):
        out.setdefault(r["model_id"], []).append(
            {
                "run_id": r["run_id"],
                "started_at": as_text(r.get("run_started_at")),
                "list_name": as_text(r.get("list_name")),
                "config": r["config"],
                "outcome": r["outcome"],
                "rmse_ratio": fmt(r.get("rmse_ratio")),
                "detail": as_text(r.get("unsupported_op")) or as_text(r.get("error_type")),
            }
        )
    return out


# ----------------------------------------------------------------------------------------------
# Matrix and diff pages
# ----------------------------------------------------------------------------------------------


def _fallback_text(ops: Any) -> str:
    """'aten::sort x3, aten::cumsum x1' for a row's CPU-fallback counts ('' when none or unknown)."""
    if not isinstance(ops, dict) or not ops:
        return ""
    return ", ".join(f"{op} x{n}" for op, n in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0])))


# Every column matrix_data reads (only these are turned into dicts: a night's frame is large).
_MATRIX_COLUMNS = ("model_id", "config", "arch", "task", "modality", "outcome", "fallback_ops", "rmse_ratio",
                   "wall_time_s", "unsupported_op", "error_type")


def matrix_data(df: pd.DataFrame, configs: list[str], hrefs: dict[str, str]) -> dict[str, Any]:
    """Compact JSON for the matrix page: one entry per model, one outcome per config column."""
    grouped: dict[str, dict[str, dict[str, Any]]] = {}
    for rec in column_records(df, _MATRIX_COLUMNS) if not df.empty else []:
        grouped.setdefault(rec["model_id"], {})[rec["config"]] = rec
    rows = []
    for model in sorted(grouped):
        by_cfg = grouped[model]
        first = next(iter(by_cfg.values()))
        ratios = [x for x in (as_number(r.get("rmse_ratio")) for r in by_cfg.values()) if x is not None]
        walls = [x for x in (as_number(r.get("wall_time_s")) for r in by_cfg.values()) if x is not None]
        ops = sorted({as_text(r.get("unsupported_op")) for r in by_cfg.values()} - {""})
        errs = sorted({as_text(r.get("error_type")) for r in by_cfg.values()} - {""})
        rows.append(
            {
                "model": model,
                "href": hrefs[model],
                "arch": as_text(first.get("arch")),
                "task": as_text(first.get("task")),
                "modality": as_text(first.get("modality")),
                "outcomes": [as_text(by_cfg[c]["outcome"]) if c in by_cfg else "" for c in configs],
                # ops that ran on the CPU instead of the target, per column: "" for a native result
                "fallback": [_fallback_text(by_cfg[c].get("fallback_ops")) if c in by_cfg else "" for c in configs],
                "rmse_ratio": _json_num(max(ratios)) if ratios else None,
                "op": ", ".join(ops),
                "error": ", ".join(errs),
                "wall": _json_num(max(walls)) if walls else None,
            }
        )
    return {"configs": configs, "outcomes": list(OUTCOMES), "rows": rows}


def diff_view(res: DiffResult, hrefs: dict[str, str]) -> dict[str, Any]:
    """The diff page: one section per kind of change, regressions first."""

    def rows(items: list) -> list[dict[str, Any]]:
        return [
            {
                "model": c.model_id,
                "href": hrefs.get(c.model_id),
                "config": c.config,
                "base": c.base_outcome or "-",
                "head": c.head_outcome or "-",
                "base_ratio": fmt(c.base_rmse_ratio),
                "head_ratio": fmt(c.head_rmse_ratio),
                "detail": c.detail,
            }
            for c in items
        ]

    worse = [c for c in res.outcome_changes if c.direction == "worse"]
    other = [c for c in res.outcome_changes if c.direction != "worse"]
    sections = [
        ("New failures", "regression", res.new_failures),
        ("Worse outcomes", "regression", worse),
        (f"Drift grew more than {res.drift_factor:g}x", "regression", res.drift_grew),
        ("Fixes", "fix", res.fixes),
        ("Other outcome changes", "", other),
        ("Drift grew among passing models (not gating)", "", res.drift_warnings),
        ("Reference / load / device changes (not target regressions)", "", res.ref_changes),
        ("Flaky", "", res.flaky),
        ("Known-flaky allowlist (not counted)", "", res.allowlisted),
        ("Added", "", res.added),
        ("Removed", "", res.removed),
    ]
    return {
        "base_run": res.base_run,
        "head_run": res.head_run,
        "n_regressions": len(res.regressions),
        "unchanged": res.unchanged,
        "sections": [{"title": t, "kind": k, "rows": rows(items)} for t, k, items in sections],
    }
