"""Summary of compiled / mixed-precision runs, for a closing note or a nightly summary.

For each run in each DB: its configuration (target and settings), outcome counts, compile seconds
(median and max, cold and warm apart: Inductor's FX graph cache served a warm row), graph breaks, and
every row that did not pass with whose failure it is: a compile_fail or a compiled drift whose eager
run on the same device passes is the compiler's ("compiled only"); where eager fails too, the eager
outcome names the device's or the model's share (the row's message says which op).

    python scripts/config_summary.py smoke-sim-inductor.db smoke-cpu-inductor.db
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
from collections import Counter

from harness.analysis.matrix import settings_label
from harness.outcomes import PASSING


def _rows(db: str) -> list[dict]:
    with sqlite3.connect(db) as c:
        c.row_factory = sqlite3.Row
        return [dict(r) for r in c.execute("SELECT * FROM results ORDER BY run_id, model_id")]


def _seconds(values: list[float]) -> str:
    if not values:
        return "-"
    return f"median {statistics.median(values):.1f} s, max {max(values):.1f} s (n={len(values)})"


def whose(r: dict) -> str:
    """Whose failure a row is, by the eager run on the same device (compiled rows) or its outcome."""
    eager = r.get("eager_outcome") or ""
    if eager in PASSING:
        return "the compiler's (compiled only; eager passes)"
    if eager:
        return f"not the compiler's alone (eager: {eager})"
    if r["outcome"] == "compile_fail":
        return "the compiler's"
    if r["outcome"] == "unsupported_op":
        return f"the device's (lacks {r.get('unsupported_op') or 'an op'})"
    return "see message"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dbs", nargs="+")
    args = ap.parse_args()
    for db in args.dbs:
        by_run: dict[str, list[dict]] = {}
        for r in _rows(db):
            by_run.setdefault(r["run_id"], []).append(r)
        for rows in by_run.values():
            settings = json.loads(rows[0]["settings"] or "{}")
            print(f"== {db}: {settings_label(rows[0]['device'] or '', settings)} ({len(rows)} models)")
            print("outcomes:", ", ".join(f"{k} {v}" for k, v in Counter(r["outcome"] for r in rows).most_common()))
            for cache in ("cold", "warm", "mixed"):
                secs = [r["compile_s"] for r in rows if r.get("compile_cache") == cache and r.get("compile_s") is not None]
                if secs:
                    print(f"compile seconds, {cache}: {_seconds(secs)}")
            breaks = [r for r in rows if r.get("graph_breaks")]
            if breaks:
                print(f"graph breaks in {len(breaks)} models:",
                      "; ".join(f"{r['model_id']} {r['graph_breaks']}" for r in breaks))
            for r in rows:
                if r["outcome"] not in PASSING:
                    print(f"  {r['model_id']}: {r['outcome']} -- {whose(r)}: {(r.get('error_message') or '')[:160]}")


if __name__ == "__main__":
    main()
