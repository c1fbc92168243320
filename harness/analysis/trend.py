"""Night-over-night history: one small JSON line per night per configuration, and the trend it draws.

A merged nightly DB holds one night; artifacts that hold older DBs expire. What a person wants to see
over weeks (did ran % / matched % move, on which night did a failure group appear or go away) fits in
a few hundred bytes per night, so each night appends its summary to a history file (kept as a CI
artifact or on a branch) and the report draws the trend from that file alone.

A line: ``date``, ``run_id``, ``started_at``, ``list``, ``target``, ``settings``, ``config`` (the
label the report uses), ``counts`` per outcome, ``total``, ``pass_pct``, and the headline ``ran_pct`` /
``matched_pct`` (:func:`harness.outcomes.headline`), plus ``groups``: ``[id, label, count]`` per
failure fingerprint, and ``perf`` when the run was timed (``--perf``): the models timed and the geometric
means of target latency (ms), target/reference ratio and compiled speedup. Appending the same run again
replaces its line, so a re-run CI job does not count a night twice.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from harness import files
from harness.analysis.baseline import list_key
from harness.analysis.fingerprint import group_failures
from harness.analysis.matrix import outcome_counts, perf_summary, settings_label
from harness.analysis.nights import night_runs
from harness.outcomes import headline
from harness.results.store import ResultStore

LABEL_CHARS = 140  # group labels are cut to this in the history: it stays small over years of nights


def summarize(run: dict[str, Any], df: pd.DataFrame, *, date: str | None = None) -> dict[str, Any]:
    """The history line of one run: ``run`` is its row of ``ResultStore.runs()``, ``df`` its results."""
    counts = {o: n for o, n in outcome_counts(df).items() if n}
    total = sum(counts.values())
    head = headline(counts)
    settings = run.get("settings") or {}
    return {
        "date": date or str(run.get("started_at") or "")[:10],
        "run_id": str(run["run_id"]),
        "started_at": str(run.get("started_at") or ""),
        "list": list_key(str(run.get("list_name") or "")),
        "target": str(run["target"]),
        "settings": settings,
        "config": settings_label(run["target"], settings),
        "counts": counts,
        "total": total,
        "pass_pct": _pct(counts.get("pass", 0), total),
        "ran_pct": _round(head["ran_pct"]),
        "matched_pct": _round(head["matched_pct"]),
        "groups": [[g.id, g.label[:LABEL_CHARS], g.count] for g in group_failures(df)],
        **_perf(df),
    }


def _perf(df: pd.DataFrame) -> dict[str, Any]:
    """The night's speed, for a run timed with --perf (one configuration: one line of `perf_summary`)."""
    speed = perf_summary(df)
    if speed.empty:
        return {}
    r = speed.iloc[0]
    return {"perf": {"models": int(r["models"]), "geomean_target_ms": _num(r["geomean_target_ms"]),
                     "geomean_ratio": _num(r["geomean_ratio"]), "geomean_speedup": _num(r["geomean_speedup"])}}


def _num(v: Any) -> float | None:
    return None if v is None or v != v else float(v)


def _pct(n: int, d: int) -> float | None:
    return round(100.0 * n / d, 2) if d else None


def _round(v: Any) -> float | None:
    return None if v is None else round(float(v), 2)


def summarize_db(db: str | os.PathLike, *, date: str | None = None) -> list[dict[str, Any]]:
    """History lines for the night in ``db``: the latest run of each configuration."""
    with ResultStore(db, read_only=True) as store:
        return [summarize(run, store.results(run["run_id"]), date=date) for run in night_runs(store)]


def read_history(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every line of a history file ([] when it does not exist yet: the first night)."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for n, line in enumerate(files.read_text(p, "--history").splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{n}: not a JSON line ({e})") from None
        if not isinstance(entry, dict) or not {"run_id", "config", "counts"} <= entry.keys():
            raise ValueError(f"{p}:{n}: not a portharness history line (needs run_id, config, counts)")
        out.append(entry)
    return out


def append_history(path: str | os.PathLike, entries: list[dict[str, Any]]) -> int:
    """Add ``entries`` to the history file, replacing lines of the same (run, config); returns the
    number of lines in the file. Written atomically: the file is the only copy of older nights."""
    p = Path(path)
    if p.parent and not p.parent.exists():
        raise FileNotFoundError(f"directory {p.parent} for the history file does not exist")
    new = {(e["run_id"], e["config"]) for e in entries}
    kept = [e for e in read_history(p) if (e["run_id"], e["config"]) not in new]
    lines = kept + list(entries)
    files.write_text(p, "".join(json.dumps(e, sort_keys=True, separators=(",", ":")) + "\n" for e in lines))
    return len(lines)


@dataclass
class Night:
    """One point of a configuration's trend, with the failure groups that changed since the point before."""

    entry: dict[str, Any]
    appeared: list[tuple[str, int]] = field(default_factory=list)  # (label, count) new tonight
    disappeared: list[tuple[str, int]] = field(default_factory=list)  # (label, count last time) gone tonight


def series(entries: list[dict[str, Any]]) -> dict[str, list[Night]]:
    """Per configuration (sorted by label), its nights in order (date, then start time), each with
    the groups that appeared or disappeared compared with that configuration's previous night."""
    by_config: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        by_config.setdefault(e["config"], []).append(e)
    out: dict[str, list[Night]] = {}
    for config in sorted(by_config):
        nights = sorted(by_config[config], key=lambda e: (e.get("date", ""), e.get("started_at", ""), e["run_id"]))
        points: list[Night] = []
        prev: dict[str, tuple[str, int]] = {}
        for i, e in enumerate(nights):
            now = {g[0]: (g[1], int(g[2])) for g in e.get("groups") or []}
            night = Night(e)
            if i:  # the first night has nothing to compare with: every group would "appear"
                night.appeared = sorted((now[k] for k in now.keys() - prev.keys()), key=lambda x: (-x[1], x[0]))
                night.disappeared = sorted((prev[k] for k in prev.keys() - now.keys()), key=lambda x: (-x[1], x[0]))
            points.append(night)
            prev = now
        out[config] = points
    return out


def format_history(entries: list[dict[str, Any]]) -> str:
    """A plain-text trend: per configuration, one line per night with the headline and group changes."""
    if not entries:
        return "history is empty"
    lines = []
    for config, nights in series(entries).items():
        lines.append(f"{config}")
        for n in nights:
            e = n.entry
            perf = e.get("perf") or {}
            speed = f"  target/reference {perf['geomean_ratio']:.3g}x ({perf['models']} timed)" if perf.get("geomean_ratio") else ""
            lines.append(f"  {e.get('date', '')}  {e['run_id']:<28} total {e.get('total', 0):>5}  "
                         f"pass {_fmt(e.get('pass_pct'))}  ran {_fmt(e.get('ran_pct'))}  "
                         f"matched {_fmt(e.get('matched_pct'))}  groups {len(e.get('groups') or [])}{speed}")
            for label, count in n.appeared:
                lines.append(f"      + {count} x {label}")
            for label, count in n.disappeared:
                lines.append(f"      - {count} x {label}")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    return "   -  " if v is None else f"{v:5.1f}%"


def append_night(db: str | os.PathLike, history: str | os.PathLike, *, date: str | None = None,
                 summary: str | os.PathLike | None = None) -> str:
    """`trend append`: add the night in ``db`` to ``history`` (and its headline as Markdown to
    ``summary``); returns what was added, one line per configuration."""
    entries = summarize_db(db, date=date)
    if not entries:
        raise ValueError(f"{db} contains no model results")
    for path in (history, summary):  # both refused before either is written
        if path is not None:
            files.check_writable(path)
    n = append_history(history, entries)
    if summary is not None:
        files.write_text(summary, format_markdown(entries))
    lines = [f"{e['date']} {e['config']}: ran {e['ran_pct']}%, matched {e['matched_pct']}% "
             f"({e['total']} models, {len(e['groups'])} failure groups)" for e in entries]
    return "\n".join([*lines, f"history {history}: {n} line(s)"])


def format_markdown(entries: list[dict[str, Any]]) -> str:
    """A night's headline as a Markdown table (a CI job summary leads with it): ran % and numerics
    matched % per configuration, then pass % and the size of the night."""
    timed = any(e.get("perf") for e in entries)
    lines = ["| configuration | ran % | matched % | pass % | models | failure groups |"
             + (" target/reference (geomean) |" if timed else ""),
             "|---|---:|---:|---:|---:|---:|" + ("---:|" if timed else "")]
    for e in entries:
        perf = e.get("perf") or {}
        speed = (f" {perf['geomean_ratio']:.3g}x ({perf['models']} timed) |" if perf.get("geomean_ratio") else " - |"
                 ) if timed else ""
        lines.append(f"| `{e['config']}` | {_md(e.get('ran_pct'))} | {_md(e.get('matched_pct'))} | "
                     f"{_md(e.get('pass_pct'))} | {e.get('total', 0)} | {len(e.get('groups') or [])} |{speed}")
    return "\n".join(lines) + "\n"


def _md(v: Any) -> str:
    return "-" if v is None else f"**{v:.1f}**"
