"""Compatibility matrix, pass rates and op-coverage ranking from the result store.

These are plain pandas transforms over ``ResultStore.results()`` so the CLI, the HTML report and
notebooks all compute the same numbers. The op-coverage ranking answers the question a backend team
asks each morning: which single missing op unblocks the most models?
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import pandas as pd

from harness import csvio, files
from harness.outcomes import MATCHED, NOT_THE_MODELS, OUTCOMES, RAN
from harness.results.dbfile import StoreError
from harness.results.store import ResultStore
from harness.results.variations import shown_run

GROUP_KEYS = ("arch", "task", "modality")
UNKNOWN = "(unknown)"
OPINFO_COLUMNS = ("op", "passed", "skipped", "failed")
_OP_SPLIT = re.compile(r"[,;\s|]+")


# ----------------------------------------------------------------------------------------------
# Labels and loading
# ----------------------------------------------------------------------------------------------


def settings_label(target: str, settings: dict | None) -> str:
    """Compact column label, e.g. ``sim ops=young precision=default`` (keys sorted, like the DB)."""
    parts = [str(target)]
    for key in sorted(settings or {}):
        value = settings[key]
        if isinstance(value, (dict, list)):
            value = json.dumps(value, sort_keys=True, separators=(",", ":"))
        parts.append(f"{key}={value}")
    return " ".join(parts)


def with_config(df: pd.DataFrame) -> pd.DataFrame:
    """Return ``df`` with a ``config`` column (target + settings label) if it lacks one."""
    if "config" in df.columns:
        return df
    out = df.copy()
    if out.empty:
        out["config"] = pd.Series(dtype=object)
        return out
    if "settings_json" not in out.columns:
        out["config"] = [settings_label(t, s) for t, s in zip(out["target"], out["settings"], strict=True)]
        return out
    # A night has thousands of rows and a handful of configurations: label each configuration once.
    labels: dict[tuple[str, str], str] = {}
    config = []
    for t, key, s in zip(out["target"].tolist(), out["settings_json"].tolist(), out["settings"].tolist(), strict=True):
        label = labels.get((t, key))
        if label is None:
            label = labels[(t, key)] = settings_label(t, s)
        config.append(label)
    out["config"] = config
    return out


def column_records(df: pd.DataFrame, columns: tuple[str, ...] | list[str]) -> list[dict[str, Any]]:
    """Rows of ``df`` as dicts holding only ``columns`` (those it has). A night's frame carries metrics,
    attempts and tracebacks; ``to_dict("records")`` on all of it is the slow part of most readers."""
    cols = [c for c in columns if c in df.columns]
    # tolist() converts each column in one go; iterating a Series boxes every element on its own
    return [dict(zip(cols, values, strict=True)) for values in zip(*(df[c].tolist() for c in cols), strict=True)]


def latest_per_key(df: pd.DataFrame) -> pd.DataFrame:
    """Keep one row per (model, config): the most recent run's, so several runs can be passed in."""
    df = with_config(df)
    if df.empty:
        return df
    order = [c for c in ("run_started_at", "finished_at") if c in df.columns]
    if order:
        df = df.sort_values(order, kind="stable")
    return df.drop_duplicates(["model_id", "config"], keep="last")


def load_results(db: str | os.PathLike, run_id: str | None = None) -> tuple[str, pd.DataFrame]:
    """Open ``db`` read-side and return (run id, results) for ``run_id`` or the latest run."""
    with ResultStore(db, read_only=True) as st:
        rid = shown_run(st, run_id)  # a model run: op and harvest runs have their own views
        if rid is None:
            raise StoreError(f"{db} contains no model results yet; run `portharness run --db {db}` first.")
        return rid, st.results(rid)


# ----------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------


def matrix(df: pd.DataFrame) -> pd.DataFrame:
    """Models x "(target, settings)" labels, the outcome in each cell ('' where not run)."""
    df = latest_per_key(df)
    if df.empty:
        return pd.DataFrame(index=pd.Index([], name="model_id"))
    pivot = df.pivot(index="model_id", columns="config", values="outcome")
    pivot = pivot.reindex(sorted(pivot.columns), axis=1).fillna("")
    pivot.columns.name = None
    return pivot.sort_index()


def outcome_counts(df: pd.DataFrame) -> dict[str, int]:
    """Count per outcome in the canonical OUTCOMES order (zeros included)."""
    counts = df["outcome"].value_counts() if not df.empty else pd.Series(dtype=int)
    return {o: int(counts.get(o, 0)) for o in OUTCOMES}


CONFIRM_KINDS = ("confirmed", "unconfirmed", "hidden drift")  # harness.run.variants.Confirmation's words


def confirm_counts(df: pd.DataFrame) -> dict[str, int]:
    """Rows confirmed at the device's highest precision (pass_declared that held), not confirmed (the
    device has no such mode: the declared precision may hide a bug), and drifts it found (hidden drift)."""
    if df.empty or "confirm" not in df.columns:
        return {}
    counts = latest_per_key(df)["confirm"].fillna("").value_counts()
    return {k: int(counts[k]) for k in CONFIRM_KINDS if counts.get(k, 0)}


def pass_rates(df: pd.DataFrame, by: str = "arch") -> pd.DataFrame:
    """Per group (grouped by config too if there are several): the headline of the summary's cards, then
    how many rows of each outcome, most matched first.

    ``ran_pct`` is the share of the models the target was asked to run (reference- and device-side
    outcomes left out) that ran to the end, ``matched_pct`` the share of those whose numerics matched
    (pass, pass_declared, flaky): an architecture that is all pass_declared is 100% / 100%. ``pass_pct``
    is the fp32-exact pass share of the same denominator as ``ran_pct``. Percentages (0-100), NaN where
    the denominator is empty.
    """
    if by not in GROUP_KEYS:
        raise ValueError(f"by must be one of {', '.join(GROUP_KEYS)}, got {by!r}")
    df = latest_per_key(df)
    keys = ["config", by] if df["config"].nunique() > 1 else [by]
    order = list(OUTCOMES[::-1])  # pass first: the table reads from what works to what does not
    if df.empty:
        return pd.DataFrame(columns=[*keys, "n", "ran_pct", "matched_pct", "pass_pct", *order])
    df = df.assign(**{by: df[by].fillna("").replace("", UNKNOWN)})
    counts = pd.crosstab([df[k] for k in keys], df["outcome"]).reindex(columns=order, fill_value=0)
    counts.columns.name = None
    n = counts.sum(axis=1)
    tested = n - counts[sorted(NOT_THE_MODELS)].sum(axis=1)
    tested = tested.where(tested > 0)
    ran = counts[sorted(RAN)].sum(axis=1)
    out = pd.DataFrame({"n": n})
    out["ran_pct"] = (100 * ran / tested).round(1)  # TorchTPU's "ran"
    out["matched_pct"] = (100 * counts[sorted(MATCHED)].sum(axis=1) / ran.where(ran > 0)).round(1)  # "matched"
    out["pass_pct"] = (100 * counts["pass"] / tested).round(1)
    out = pd.concat([out, counts], axis=1).reset_index()
    return out.sort_values(["n", *keys], ascending=[False, *([True] * len(keys))], kind="stable").reset_index(
        drop=True
    )


def split_ops(value: Any) -> list[str]:
    """The ops listed in an ``unsupported_op`` cell (comma/semicolon/space separated), de-duplicated."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return []
    seen: dict[str, None] = {}
    for op in _OP_SPLIT.split(str(value)):
        if op:
            seen.setdefault(op, None)
    return list(seen)


def _op_key(op: str) -> str:
    """Join key between aten names (``aten::add.Tensor``) and OpInfo names (``add``, ``nn.functional.gelu``).

    Overloads are folded (``add.Tensor`` -> ``add``) because OpInfo tests ops, not overloads.
    """
    op = op.strip()
    if op.startswith("aten::"):
        return op[len("aten::") :].split(".", 1)[0]
    for prefix in ("nn.functional.", "torch."):
        if op.startswith(prefix):
            return op[len(prefix) :]
    return op


def read_opinfo(source: pd.DataFrame | str | os.PathLike) -> pd.DataFrame:
    """Load and validate an OpInfo conformance table (columns op, passed, skipped, failed)."""
    if isinstance(source, pd.DataFrame):
        table = source.copy()
    else:
        path = Path(source)
        csvio.read_text(path, "--opinfo")  # a missing, unreadable or non-UTF-8 file: one line naming it
        table = csvio.read_frame(path)
    missing = [c for c in OPINFO_COLUMNS if c not in table.columns]
    if missing:
        raise ValueError(
            f"OpInfo table lacks column(s) {', '.join(missing)}; expected {', '.join(OPINFO_COLUMNS)}"
        )
    for col in OPINFO_COLUMNS[1:]:
        table[col] = pd.to_numeric(table[col], errors="coerce").fillna(0).astype(int)
    return table


def op_coverage(
    df: pd.DataFrame, opinfo_table: pd.DataFrame | str | os.PathLike | None = None, *, examples: int = 3
) -> pd.DataFrame:
    """Rank missing ops: ``implement aten::X -> +N models`` (N = models blocked by that op alone).

    ``models_listing`` counts every model that lists the op, blocked alone or with others. With an
    OpInfo table the op's conformance counts are joined in (by base op name, overloads folded).
    """
    df = latest_per_key(df)
    columns = ["op", "models_unblocked", "models_listing", "suggestion", "example_models"]
    rows = df[df["outcome"] == "unsupported_op"] if not df.empty else df
    only: dict[str, set[str]] = {}
    listing: dict[str, set[str]] = {}
    for model, cell in zip(rows.get("model_id", []), rows.get("unsupported_op", []), strict=True):
        ops = split_ops(cell) or ["(unnamed)"]
        for op in ops:
            listing.setdefault(op, set()).add(model)
        if len(ops) == 1:
            only.setdefault(ops[0], set()).add(model)
    records = []
    for op, models in listing.items():
        n_only = len(only.get(op, ()))
        records.append(
            {
                "op": op,
                "models_unblocked": n_only,
                "models_listing": len(models),
                "suggestion": f"implement {op} -> +{n_only} model{'s' if n_only != 1 else ''}",
                "example_models": ", ".join(sorted(models)[:examples]),
            }
        )
    out = pd.DataFrame(records, columns=columns)
    if not out.empty:
        out = out.sort_values(
            ["models_unblocked", "models_listing", "op"], ascending=[False, False, True], kind="stable"
        ).reset_index(drop=True)
    if opinfo_table is not None:
        table = read_opinfo(opinfo_table)
        table = table.assign(key=table["op"].astype(str).map(_op_key))
        agg = table.groupby("key", as_index=False)[list(OPINFO_COLUMNS[1:])].sum()
        agg = agg.rename(
            columns={"passed": "opinfo_passed", "skipped": "opinfo_skipped", "failed": "opinfo_failed"}
        )
        out = (
            out.assign(key=out["op"].astype(str).map(_op_key))
            .merge(agg, on="key", how="left")
            .drop(columns="key")
        )
        for col in ("opinfo_passed", "opinfo_skipped", "opinfo_failed"):
            out[col] = out[col].astype("Int64")
    return out


PERF_COLUMNS = ("target_ms", "reference_ms", "ratio", "speedup", "device_peak_mb", "rounds")


def perf_table(df: pd.DataFrame) -> pd.DataFrame:
    """One line per (model, config) timed with ``--perf``: the median latency on target and reference (ms),
    target / reference, the compiled speedup (eager / compiled), the device's peak memory, the rounds timed."""
    df = latest_per_key(df)
    cols = ["model_id", "config", *PERF_COLUMNS]
    if df.empty or "perf_target_s" not in df.columns:
        return pd.DataFrame(columns=cols)
    t = df[df["perf_target_s"].notna()]

    def num(col: str, scale: float = 1.0) -> pd.Series:
        v = pd.to_numeric(t[col], errors="coerce") if col in t.columns else pd.Series(float("nan"), index=t.index)
        return (v * scale).map(lambda x: float(f"{x:.4g}") if x == x else None)

    out = pd.DataFrame({"model_id": t["model_id"], "config": t["config"], "target_ms": num("perf_target_s", 1e3),
                        "reference_ms": num("perf_ref_s", 1e3), "ratio": num("perf_ratio"),
                        "speedup": num("perf_speedup"), "device_peak_mb": num("perf_peak_mem_mb"),
                        "rounds": pd.to_numeric(t.get("perf_rounds"), errors="coerce").astype("Int64")})
    return out.sort_values(["config", "model_id"], kind="stable").reset_index(drop=True)


def perf_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per configuration, over its models timed with ``--perf``: how many, and the geometric means of the
    target latency, the target/reference ratio and the compiled speedup (the dashboards' per-night number)."""
    from harness.speed import geomean

    table = perf_table(df)
    rows = []
    for config, g in table.groupby("config", sort=True):
        rows.append({"config": config, "models": len(g),
                     "geomean_target_ms": _r(geomean(g["target_ms"])),
                     "geomean_ratio": _r(geomean(g["ratio"])),
                     "geomean_speedup": _r(geomean(g["speedup"]))})
    return pd.DataFrame(rows, columns=["config", "models", "geomean_target_ms", "geomean_ratio", "geomean_speedup"])


def _r(v: float | None) -> float | None:
    return None if v is None else float(f"{v:.4g}")


SUPPORT = ("N", "CPU_FALLBACK", "Y")  # TorchNeuron's per-op marks, worst first


def op_support(df: pd.DataFrame) -> pd.DataFrame:
    """Per op over a run: Y (ran natively everywhere it ran), CPU_FALLBACK (fell back to the CPU in some
    model), N (the target lacks it: it blocked a model). Native ops are known only for backends that
    report them; fallbacks only for backends with counters."""
    df = latest_per_key(df)
    native: dict[str, set[str]] = {}
    fell: dict[str, set[str]] = {}
    calls: dict[str, int] = {}
    blocked: dict[str, set[str]] = {}
    cols = ("model_id", "native_ops", "fallback_ops", "outcome", "unsupported_op")
    for rec in column_records(df, cols) if not df.empty else []:
        model = rec["model_id"]
        for op in rec.get("native_ops") or []:
            native.setdefault(op, set()).add(model)
        for op, n in (rec.get("fallback_ops") or {}).items():
            fell.setdefault(op, set()).add(model)
            calls[op] = calls.get(op, 0) + int(n)
        if rec.get("outcome") == "unsupported_op":
            for op in split_ops(rec.get("unsupported_op")):
                blocked.setdefault(op, set()).add(model)
    records = []
    for op in sorted(native.keys() | fell.keys() | blocked.keys()):
        status = "N" if op in blocked else "CPU_FALLBACK" if op in fell else "Y"
        records.append({
            "op": op, "status": status, "native_models": len(native.get(op, ())),
            "fallback_models": len(fell.get(op, ())), "fallback_calls": calls.get(op, 0),
            "blocked_models": len(blocked.get(op, ())),
        })
    columns = ["op", "status", "native_models", "fallback_models", "fallback_calls", "blocked_models"]
    out = pd.DataFrame(records, columns=columns)
    if not out.empty:
        out["_rank"] = out["status"].map(SUPPORT.index)
        out = out.sort_values(["_rank", "blocked_models", "fallback_models", "op"],
                              ascending=[True, False, False, True], kind="stable").drop(columns="_rank")
    return out.reset_index(drop=True)


# ----------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------


def _jsonable_cells(df: pd.DataFrame) -> pd.DataFrame:
    out = df.copy()
    for col in out.columns:
        if out[col].dtype == object and out[col].map(lambda v: isinstance(v, (dict, list))).any():
            out[col] = out[col].map(
                lambda v: json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v
            )
    return out


def export(df: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Write ``df`` as .csv (`harness.csvio`: formula-looking cells defused), .json (records) or .parquet
    (needs pyarrow), chosen by extension; atomically (`harness.files`: OutputError, nothing left behind)."""
    path = Path(path)
    ext = _export_kind(path)
    keep_index = not isinstance(df.index, pd.RangeIndex)
    frame = df.reset_index() if keep_index else df
    if ext == ".csv":
        return csvio.write_frame(_jsonable_cells(frame), path)
    with files.atomic_path(path) as tmp:
        if ext == ".json":
            frame.to_json(tmp, orient="records", indent=1, default_handler=str)
        else:
            _jsonable_cells(frame).to_parquet(tmp, index=False)
    return path


def _export_kind(path: Path) -> str:
    ext = path.suffix.lower()
    if ext not in (".csv", ".json", ".parquet"):
        raise ValueError(f"cannot export to {path}: unknown extension {ext!r}; use .csv, .json or .parquet")
    if ext == ".parquet" and importlib.util.find_spec("pyarrow") is None:
        raise ValueError(f"cannot write {path}: parquet export needs pyarrow (pip install pyarrow); use .csv or .json")
    return ext


def check_export_path(path: str | os.PathLike) -> None:
    """Refuse an export path before anything is printed: its extension, and that it can be written."""
    _export_kind(Path(path))
    files.check_writable(path)
