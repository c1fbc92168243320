"""View model of the summary page (index.html). Its first screen answers "what do I fix first": the
headline cards, then the missing ops that unblock the most models and the largest failure groups side by
side, then the outcomes that occurred (a labelled bar, no rows of zeros). Everything below is detail:
every failure group, speed, ran % / matched % per architecture, task and modality, the run, the DB's runs.

Pure functions like `views.py` (frames in, template-ready dicts out); apart so each module stays small.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from harness.analysis.diff import DiffResult
from harness.analysis.fingerprint import FailureGroup
from harness.analysis.matrix import confirm_counts, outcome_counts, pass_rates
from harness.outcomes import NOT_THE_MODELS, OUTCOMES, headline
from harness.report.collectives import model_settings_view
from harness.report.nightly import groups_view
from harness.report.svg import svg_outcome_bar
from harness.report.views import VERSION_KEYS, as_text, op_anchor, records

TOP = 5  # ops and failure groups on the first screen (the rest: the ops page, the full groups table below)
GROUPS_SHOWN = 25  # failure groups in the full table


def top_ops_view(cov: pd.DataFrame, hrefs: dict[str, str], *, limit: int = TOP, examples: int = 2) -> dict[str, Any]:
    """The missing ops that unblock the most models (op coverage's ranking), each with a few examples and
    its row on the ops page."""
    rows = []
    for o in records(cov.head(limit)) if not cov.empty else []:
        models = [m for m in str(o.get("example_models") or "").split(", ") if m]
        rows.append({"op": o["op"], "href": f"ops.html#{op_anchor(o['op'])}", "unblocked": int(o["models_unblocked"]),
                     "listing": int(o["models_listing"]),
                     "examples": [(m, hrefs.get(m)) for m in models[:examples]],
                     "more": max(0, int(o["models_listing"]) - min(len(models), examples))})
    return {"ops": rows, "n_ops": len(cov)}


def _rates(df: pd.DataFrame, by: str) -> dict[str, Any]:
    """Ran % / matched % per group, with only the outcome columns that occurred (fourteen columns of
    mostly zeros would push the ones that did off the screen)."""
    if df.empty:
        return {"rows": [], "outcomes": []}
    rates = pass_rates(df, by)
    shown = [o for o in rates.columns if o in OUTCOMES and rates[o].any()]
    return {"rows": records(rates), "outcomes": shown}


def summary_view(
    df: pd.DataFrame, runs: pd.DataFrame, configs: list[str], res: DiffResult | None, *,
    cov: pd.DataFrame, groups: list[FailureGroup], hrefs: dict[str, str],
) -> dict[str, Any]:
    """The index page: the headline, what to fix first (ops, failure groups), the outcomes that occurred,
    rates per architecture / task / modality, all runs in the DB, the diff headline."""
    counts = outcome_counts(df)
    total = sum(counts.values())
    # Load/reference failures say nothing about the target, so the target pass rate leaves them out.
    not_ref = total - sum(counts[o] for o in NOT_THE_MODELS)
    occurred = [o for o in OUTCOMES[::-1] if counts[o]]  # what works first
    return {
        "counts": counts,
        "total": total,
        "n_models": len(df["model_id"].unique()) if not df.empty else 0,
        "headline": headline(counts),
        "target_pass_rate": (counts["pass"] / not_ref) if not_ref else None,
        "outcome_bar": svg_outcome_bar(counts),
        "confirmed": confirm_counts(df),
        "occurred": occurred,
        "absent": [o for o in OUTCOMES if not counts[o]],
        "top_ops": top_ops_view(cov, hrefs),
        # the target's own failures first: a model that cannot load or a reference that fails is not the
        # backend engineer's to fix (those groups still show, after, and in the full table)
        "top_groups": groups_view(sorted(groups, key=lambda g: g.reference_side), hrefs, limit=TOP, examples=2),
        "groups": groups_view(groups, hrefs, limit=GROUPS_SHOWN),
        "row_versions": {
            k: sorted({as_text(v) for v in df[k]} - {""}) if not df.empty else [] for k in VERSION_KEYS
        },
        "rates": {by: _rates(df, by) for by in ("arch", "task", "modality")},
        "settings_fastest": model_settings_view(df, hrefs)["fastest"],  # --parallel --perf --collectives
        "runs": [{k: as_text(v) for k, v in r.items() if k != "settings"} for r in records(runs)],
        "configs": configs,
        "diff": None
        if res is None
        else {"base_run": res.base_run, "n": len(res.regressions), "fixes": len(res.fixes)},
    }
