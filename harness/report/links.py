"""Where a model page leads: the command that reproduces its row, its failure group on the summary, its
missing op's row on the ops page (and how many other models need that op), and the speed gate's word on
it. A model page that answers "what now" needs what only the whole run knows, so these are computed once
per build and looked up per row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pandas as pd

from harness.analysis.diff import DiffResult
from harness.analysis.fingerprint import FailureGroup, group_key, is_failure, key_id
from harness.analysis.matrix import split_ops
from harness.report.nightly import short_line
from harness.report.summary import GROUPS_SHOWN
from harness.report.views import as_text, op_anchor, records

# `portharness check <id> --target ... <its settings>` from (model id, target, settings): the CLI spells its own
# options (`harness.cli.options.check_command`) and hands it to the report, which comes before the CLI.
Command = Callable[[str, str, dict[str, Any]], str]


def reproduce(row: dict[str, Any], command: Command | None) -> str:
    """The command that reproduces one row ("" when the caller gave no way to spell one)."""
    if command is None:
        return ""
    settings = row.get("settings") if isinstance(row.get("settings"), dict) else {}
    return command(as_text(row.get("model_id")), as_text(row.get("target")) or "sim", settings)


def row_links(groups: list[FailureGroup], cov: pd.DataFrame, res: DiffResult | None, command: Command | None = None
              ) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A function from a result row to its model page's links (paths relative to the models/ directory)."""
    by_id = {g.id: g for g in groups}
    listed = {g.id for g in groups[:GROUPS_SHOWN]}  # the summary's table has a row (an anchor) for these
    ops = {o["op"]: o for o in records(cov)} if not cov.empty else {}
    flagged: dict[tuple[str, str], str] = {}
    if res is not None:
        for c in res.perf.regressions:
            flagged[(c.model_id, c.config)] = f"perf regression vs {res.base_run}: {c.detail}"
        for k in res.perf.kernels:
            flagged.setdefault((k.model_id, k.config), f"kernel regression vs {res.base_run}: {k.detail}")
        for c in res.perf.allowlisted:
            flagged.setdefault((c.model_id, c.config), f"slower vs {res.base_run} (allowlisted: {c.note}): {c.detail}")

    def links(r: dict[str, Any]) -> dict[str, Any]:
        group = None
        if is_failure(as_text(r.get("outcome"))):
            g = by_id.get(key_id(group_key(r)))
            if g is not None:
                label = " · ".join(p for p in (g.outcome, g.what, short_line(g.message)) if p)
                group = {"href": f"../index.html#{'group-' + g.id if g.id in listed else 'groups'}",
                         "count": g.count, "label": label}
        coverage = []
        for op in split_ops(r.get("unsupported_op")):
            o = ops.get(op)
            if o is not None:
                coverage.append({"op": op, "href": f"../ops.html#{op_anchor(op)}", "others": int(o["models_listing"]) - 1,
                                 "unblocked": int(o["models_unblocked"])})
        return {"command": reproduce(r, command), "group": group, "coverage": coverage,
                "perf_flag": flagged.get((as_text(r.get("model_id")), as_text(r.get("config"))), "")}

    return links
