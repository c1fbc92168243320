"""Static HTML report built from the result store.

The site must open straight from disk (``file://``), offline, from a CI artifact: so no server,
no CDN, no ``fetch`` (browsers block it on ``file://``). Table data is embedded as JSON in a
``<script type="application/json">`` block, plots are inline SVG drawn here in Python, and the
vanilla JS in ``reports/assets`` only filters and sorts.

Everything that came from a model (ids, error messages, tracebacks) is untrusted text: Jinja2
autoescaping is on for every template, embedded JSON goes through ``|tojson`` (which escapes
``<``, ``>`` and ``&``) and the JS only ever assigns ``textContent``. Model ids contain ``/`` and
other characters, so per-model pages get sanitised names plus a hash (:func:`safe_name`).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import jinja2
import pandas as pd

from harness import __version__
from harness.analysis.diff import DiffResult, diff_runs, previous_comparable
from harness.analysis.matrix import op_coverage, outcome_counts, pass_rates, settings_label, with_config
from harness.outcomes import COLOURS, OUTCOMES, REFERENCE_SIDE
from harness.report.svg import _num, svg_bars, svg_histogram, svg_outcome_bar
from harness.results.store import ResultStore, StoreError, utc_now

PACKAGE_DIR = Path(__file__).resolve().parent
TEMPLATES_DIR = PACKAGE_DIR / "templates"
ASSETS_DIR = PACKAGE_DIR / "assets"
MARKER = ".portharness-report"


# ----------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------


def safe_name(model_id: str) -> str:
    """A portable file stem for ``model_id``: sanitised text plus a hash so 'a/b' and 'a_b' differ."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", model_id).strip("._-")[:80] or "model"
    digest = hashlib.sha1(model_id.encode("utf-8")).hexdigest()[:8]
    return f"{stem}-{digest}"


def _json_num(v: Any) -> float | str | None:
    """Number for embedded JSON: JSON has no NaN/Infinity, so infinities become strings."""
    f = _num(v)
    if f is None or math.isfinite(f):
        return f
    return "Infinity" if f > 0 else "-Infinity"


def fmt(v: Any, digits: int = 3) -> str:
    """Compact number formatting for tables ('-' for missing)."""
    f = _num(v)
    if f is None:
        return "" if v is None or isinstance(v, float) else str(v)
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    if f == 0:
        return "0"
    if abs(f) >= 1e4 or abs(f) < 1e-3:
        return f"{f:.{digits - 1}e}"
    return f"{f:.{digits}g}"


def _text(v: Any) -> str:
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


# ----------------------------------------------------------------------------------------------
# Data shaping
# ----------------------------------------------------------------------------------------------


def _records(df: pd.DataFrame) -> list[dict[str, Any]]:
    return df.to_dict("records") if not df.empty else []


def _row_view(r: dict[str, Any]) -> dict[str, Any]:
    """Everything one model page needs for one (target, settings) row, with numbers formatted."""
    metrics = r.get("metrics") or {}
    outputs = []
    if isinstance(metrics, dict):
        for name, m in metrics.items():
            m = m if isinstance(m, dict) else {"value": m}
            outputs.append(
                {
                    "name": name,
                    "rmse_target": fmt(m.get("rmse_target")),
                    "rmse_ref": fmt(m.get("rmse_ref")),
                    "bound": fmt(m.get("bound")),
                    "ratio": fmt(m.get("rmse_ratio")),
                    "drifts": (_num(m.get("rmse_ratio")) or 0) > 1,
                    "nonfinite": bool(m.get("nonfinite")),
                    "note": _text(m.get("note")),
                    "cosine": fmt(m.get("cosine"), 9),
                    "max_abs": fmt(m.get("max_abs")),
                    "max_rel": fmt(m.get("max_rel")),
                    "ok": m.get("ok"),
                    "shape": "x".join(str(s) for s in m["shape"])
                    if isinstance(m.get("shape"), list)
                    else _text(m.get("shape")),
                    "dtype": _text(m.get("dtype")),
                }
            )
    attempts = []
    for a in r.get("attempts") or []:
        if isinstance(a, dict):
            attempts.append({k: (fmt(v) if isinstance(v, float) else _text(v)) for k, v in a.items()})
    attempt_cols = sorted(
        {k for a in attempts for k in a},
        key=lambda k: (
            ["device", "outcome", "error_type", "exit_code", "signal", "duration_s"].index(k)
            if k in ("device", "outcome", "error_type", "exit_code", "signal", "duration_s")
            else 99,
            k,
        ),
    )
    timings = [
        (label, fmt(r.get(key)))
        for label, key in (
            ("load (s)", "load_time_s"),
            ("reference (s)", "ref_time_s"),
            ("target (s)", "target_time_s"),
            ("wall (s)", "wall_time_s"),
            ("peak RSS (MB)", "peak_rss_mb"),
        )
        if _num(r.get(key)) is not None
    ]
    return {
        "config": r["config"],
        "outcome": r["outcome"],
        "fields": [
            (k, _text(r.get(k)))
            for k in (
                "arch",
                "task",
                "modality",
                "device",
                "error_type",
                "unsupported_op",
                "exit_code",
                "signal",
            )
            if _text(r.get(k)) not in ("", "nan")
        ],
        "drift_module": _text(r.get("first_drift_module")),
        "drift_module_type": _text(r.get("first_drift_module_type")),
        "numbers": [
            (label, fmt(r.get(key), 9 if key == "min_cosine" else 3))
            for label, key in (
                ("rmse_ratio", "rmse_ratio"),
                ("max_abs_err", "max_abs_err"),
                ("max_rel_err", "max_rel_err"),
                ("min_cosine", "min_cosine"),
            )
            if _num(r.get(key)) is not None
        ],
        "error_message": _text(r.get("error_message")),
        "traceback": _text(r.get("traceback")),
        "outputs": outputs,
        "attempts": attempts,
        "attempt_cols": attempt_cols,
        "timings": timings,
        "versions": [
            (k, _text(r.get(k))) for k in ("torch_version", "transformers_version", "harness_version")
        ],
        "finished_at": _text(r.get("finished_at")),
    }


def _matrix_data(df: pd.DataFrame, configs: list[str], hrefs: dict[str, str]) -> dict[str, Any]:
    """Compact JSON for the matrix page: one entry per model, one outcome per config column."""
    grouped: dict[str, dict[str, dict[str, Any]]] = {}
    for rec in _records(df):
        grouped.setdefault(rec["model_id"], {})[rec["config"]] = rec
    rows = []
    for model in sorted(grouped):
        by_cfg = grouped[model]
        first = next(iter(by_cfg.values()))
        ratios = [_num(r.get("rmse_ratio")) for r in by_cfg.values()]
        ratios = [x for x in ratios if x is not None]
        walls = [_num(r.get("wall_time_s")) for r in by_cfg.values()]
        walls = [x for x in walls if x is not None]
        ops = sorted({_text(r.get("unsupported_op")) for r in by_cfg.values()} - {""})
        errs = sorted({_text(r.get("error_type")) for r in by_cfg.values()} - {""})
        rows.append(
            {
                "model": model,
                "href": hrefs[model],
                "arch": _text(first.get("arch")),
                "task": _text(first.get("task")),
                "modality": _text(first.get("modality")),
                "outcomes": [_text(by_cfg[c]["outcome"]) if c in by_cfg else "" for c in configs],
                "rmse_ratio": _json_num(max(ratios)) if ratios else None,
                "op": ", ".join(ops),
                "error": ", ".join(errs),
                "wall": _json_num(max(walls)) if walls else None,
            }
        )
    return {"configs": configs, "outcomes": list(OUTCOMES), "rows": rows}


def _history(hist: pd.DataFrame) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    if hist.empty:
        return out
    hist = with_config(hist)
    for r in hist.to_dict("records"):
        out.setdefault(r["model_id"], []).append(
            {
                "run_id": r["run_id"],
                "started_at": _text(r.get("run_started_at")),
                "list_name": _text(r.get("list_name")),
                "config": r["config"],
                "outcome": r["outcome"],
                "rmse_ratio": fmt(r.get("rmse_ratio")),
                "detail": _text(r.get("unsupported_op")) or _text(r.get("error_type")),
            }
        )
    return out


def _diff_view(res: DiffResult, hrefs: dict[str, str]) -> dict[str, Any]:
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
        ("Reference / load changes (not target regressions)", "", res.ref_changes),
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


def _collectives_view(coll: pd.DataFrame) -> list[dict[str, Any]]:
    groups = []
    if coll.empty:
        return groups
    for (op, backend, world), g in coll.groupby(["op", "backend", "world_size"], sort=True):
        g = g.sort_values(["size_bytes", "setting"])
        items, table = [], []
        for r in g.to_dict("records"):
            label = f"{r['setting']} @ {_size(r['size_bytes'])}"
            items.append(
                {"label": label, "value": r.get("ratio"), "lo": r.get("ratio_p10"), "hi": r.get("ratio_p90")}
            )
            table.append(
                {
                    "setting": _text(r["setting"]),
                    "baseline": _text(r.get("baseline_setting")),
                    "size": _size(r["size_bytes"]),
                    "size_bytes": int(r["size_bytes"]),
                    "median_ms": fmt((_num(r.get("median_s")) or 0) * 1e3),
                    "p10_ms": fmt((_num(r.get("p10_s")) or 0) * 1e3),
                    "p90_ms": fmt((_num(r.get("p90_s")) or 0) * 1e3),
                    "repeats": _text(r.get("repeats")),
                    "ratio": fmt(r.get("ratio")),
                    "ratio_range": f"{fmt(r.get('ratio_p10'))} - {fmt(r.get('ratio_p90'))}",
                    "target": _text(r.get("target")),
                }
            )
        groups.append(
            {"op": op, "backend": backend, "world_size": int(world), "svg": svg_bars(items), "rows": table}
        )
    return groups


# ----------------------------------------------------------------------------------------------
# Build
# ----------------------------------------------------------------------------------------------


def _env() -> jinja2.Environment:
    if not TEMPLATES_DIR.is_dir():
        raise FileNotFoundError(f"report templates not found in {TEMPLATES_DIR} (a broken install: reinstall portharness)")
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
        autoescape=True,  # every template: model-supplied text must never become markup
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["fmt"] = fmt
    env.globals["OUTCOMES"] = OUTCOMES
    env.globals["OUTCOME_COLORS"] = COLOURS
    return env


def _prepare_out(out: Path) -> None:
    """Create/clean the output dir; refuse a non-empty dir that is not a previous report."""
    if out.exists() and not out.is_dir():
        raise StoreError(f"report output {out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists():
        raise StoreError(
            f"report output {out} is a non-empty directory that is not a portharness report; "
            "refusing to write into it. Pass an empty or new --out directory."
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("generated by portharness report; this directory is rebuilt on each run\n")
    models = out / "models"
    if models.is_dir():
        for stale in models.glob("*.html"):
            stale.unlink()
    models.mkdir(exist_ok=True)
    assets = out / "assets"
    assets.mkdir(exist_ok=True)
    if not ASSETS_DIR.is_dir():
        raise FileNotFoundError(f"report assets not found in {ASSETS_DIR} (a broken install: reinstall portharness)")
    for f in ASSETS_DIR.iterdir():
        if f.is_file():
            shutil.copyfile(f, assets / f.name)


def _resolve_base(
    store: ResultStore, run_id: str, base_run: str | None, base_db: str | os.PathLike | None
) -> tuple[str, pd.DataFrame, str] | None:
    """(base run id, its results, where from), or None when there is nothing to compare with."""
    if base_db is not None:
        with ResultStore(base_db, create=False) as bs:
            rid = base_run or bs.latest_run(has_results=True)
            if rid is None:
                raise StoreError(f"base DB {base_db} contains no runs")
            return rid, bs.results(rid), str(base_db)
    rid = base_run or previous_comparable(store, run_id)
    if rid is None:
        return None
    return rid, store.results(rid), "this DB"


def build_report(
    db_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    run_id: str | None = None,
    base_run: str | None = None,
    base_db: str | os.PathLike | None = None,
    opinfo_csv: str | os.PathLike | None = None,
) -> Path:
    """Render the static site for ``run_id`` (default latest) into ``out_dir``; returns index.html.

    The diff page compares with ``base_run`` (same DB), the latest run of ``base_db``, or by default
    the previous comparable run in the DB when there is one.
    """
    out = Path(out_dir)
    env = _env()
    with ResultStore(db_path, create=False) as store:
        rid = run_id or store.latest_run(has_results=True) or store.latest_run()
        if rid is None:
            raise StoreError(f"{db_path} contains no runs yet; nothing to report.")
        df = with_config(store.results(rid))  # raises StoreError for an unknown run id
        runs = store.runs()
        run = runs[runs.run_id == rid].iloc[0].to_dict()
        hist = store.history()
        # Collective benchmarks are usually their own run (list "collectives"): show the selected run's,
        # else the latest benchmark run in the DB.
        coll_run = rid if store.collectives(rid).shape[0] else store.latest_run(has_collectives=True)
        coll = store.collectives(coll_run) if coll_run else store.collectives(rid)
        base = _resolve_base(store, rid, base_run, base_db)
    _prepare_out(out)

    configs = sorted(df["config"].unique()) if not df.empty else []
    models = sorted(df["model_id"].unique()) if not df.empty else []
    hrefs = {m: f"models/{safe_name(m)}.html" for m in models}
    counts = outcome_counts(df)
    total = sum(counts.values())
    not_ref = total - sum(counts[o] for o in REFERENCE_SIDE)
    res = None
    if base is not None:
        res = diff_runs(base[1], df, base_run=base[0], head_run=rid)

    nav = [
        ("index.html", "Summary"),
        ("matrix.html", "Matrix"),
        ("ops.html", "Op coverage"),
        ("drift.html", "Drift"),
        ("collectives.html", "Collectives"),
    ]
    if res is not None:
        nav.append(("diff.html", "Diff"))
    row_versions = {
        k: sorted({_text(v) for v in df[k]} - {""}) if not df.empty else []
        for k in ("torch_version", "transformers_version", "harness_version")
    }
    common = {
        "run": {k: _text(v) for k, v in run.items() if k != "settings"},
        "run_settings": run.get("settings") or {},
        "run_label": settings_label(run["target"], run.get("settings") or {}),
        "nav": nav,
        "generated_at": utc_now(),
        "harness_version": __version__,
        "db_name": Path(db_path).name,
    }

    def render(name: str, dest: Path, root: str = "", **ctx: Any) -> None:
        dest.write_text(
            env.get_template(name).render(**common, root=root, active=dest.name, **ctx), encoding="utf-8"
        )

    rates = {by: _records(pass_rates(df, by)) if not df.empty else [] for by in ("arch", "task", "modality")}
    render(
        "index.html",
        out / "index.html",
        counts=counts,
        total=total,
        n_models=len(models),
        pass_rate=(counts["pass"] / total) if total else None,
        target_pass_rate=(counts["pass"] / not_ref) if not_ref else None,
        outcome_bar=svg_outcome_bar(counts),
        row_versions=row_versions,
        rates=rates,
        runs=[{k: _text(v) for k, v in r.items() if k != "settings"} for r in _records(runs)],
        configs=configs,
        diff=None
        if res is None
        else {"base_run": res.base_run, "n": len(res.regressions), "fixes": len(res.fixes)},
    )
    render(
        "matrix.html",
        out / "matrix.html",
        data=_matrix_data(df, configs, hrefs)
        if total
        else {"configs": [], "outcomes": list(OUTCOMES), "rows": []},
        total=total,
    )

    cov = op_coverage(df, opinfo_csv) if not df.empty else pd.DataFrame()
    render(
        "ops.html",
        out / "ops.html",
        ops=_records(cov),
        has_opinfo=opinfo_csv is not None,
        opinfo_name=Path(opinfo_csv).name if opinfo_csv is not None else "",
        hrefs=hrefs,
    )

    ratios = [_num(v) for v in df["rmse_ratio"]] if not df.empty else []
    finite = [v for v in ratios if v is not None]
    worst = (
        df.assign(_r=[_num(v) if _num(v) is not None else -1 for v in df["rmse_ratio"]])
        .sort_values("_r", ascending=False)
        .head(25)
        if not df.empty
        else df
    )
    render(
        "drift.html",
        out / "drift.html",
        svg=svg_histogram(finite),
        n_ratios=len(finite),
        n_zero=sum(1 for v in finite if v == 0),
        n_inf=sum(1 for v in finite if math.isinf(v)),
        n_over=sum(1 for v in finite if v > 1),
        worst=[
            {
                "model": r["model_id"],
                "href": hrefs[r["model_id"]],
                "config": r["config"],
                "outcome": r["outcome"],
                "rmse_ratio": fmt(r.get("rmse_ratio")),
                "module": _text(r.get("first_drift_module")),
                "module_type": _text(r.get("first_drift_module_type")),
            }
            for r in _records(worst)
            if _num(r.get("rmse_ratio")) is not None
        ],
    )
    render(
        "collectives.html",
        out / "collectives.html",
        groups=_collectives_view(coll),
        coll_run=coll_run if coll_run and coll_run != rid else "",
    )
    if res is not None:
        render("diff.html", out / "diff.html", diff=_diff_view(res, hrefs), base_from=base[2] if base else "")

    history = _history(hist)
    model_tpl = env.get_template("model.html")
    by_model: dict[str, list[dict[str, Any]]] = {}
    for r in _records(df):
        by_model.setdefault(r["model_id"], []).append(r)
    for model, rows in by_model.items():
        (out / hrefs[model]).write_text(
            model_tpl.render(
                **common,
                root="../",
                active="",
                model_id=model,
                rows=[_row_view(r) for r in sorted(rows, key=lambda r: r["config"])],
                history=history.get(model, []),
            ),
            encoding="utf-8",
        )
    return out / "index.html"


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments for ``portharness report`` (for harness/cli.py to reuse)."""
    parser.add_argument("--db", required=True, help="portharness SQLite DB")
    parser.add_argument("--out", default="reports/site", help="output directory (default reports/site)")
    parser.add_argument("--run", default=None, help="run id (default: latest run)")
    parser.add_argument("--base", default=None, help="base run id in the same DB for the diff page")
    parser.add_argument(
        "--base-db", dest="base_db", default=None, help="DB whose latest run is the diff base"
    )
    parser.add_argument("--opinfo", default=None, help="OpInfo conformance CSV (op,passed,skipped,failed)")


def main_report(args: argparse.Namespace) -> int:
    """CLI: build the site and print where it is; 0 on success, 2 on bad input."""
    t0 = time.perf_counter()
    try:
        index = build_report(
            args.db,
            getattr(args, "out", None) or "reports/site",
            run_id=getattr(args, "run", None),
            base_run=getattr(args, "base", None),
            base_db=getattr(args, "base_db", None),
            opinfo_csv=getattr(args, "opinfo", None),
        )
    except (StoreError, FileNotFoundError, ValueError) as exc:
        print(f"portharness report: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"report written to {index} in {time.perf_counter() - t0:.2f}s (open it from disk: file://{index.resolve()})"
    )
    return 0
