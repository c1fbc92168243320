"""The kernel worklist's pages: what to fix first (the summary's section, `_worklist.html`), the ranking on
the op coverage page, and one page per op overload with its variations (`op.html`).

Views are plain dicts built from a `harness.analysis.worklist.Worklist`; an op run the site does not show
(no op run of this configuration) gives empty views and the sections say how to make one.
"""

from __future__ import annotations

from typing import Any

from harness.analysis.matrix import column_records
from harness.analysis.worklist import Worklist
from harness.files import safe_name

OP_DIR = "op"
TOP = 5  # the summary's what-to-fix-first


def op_href(op: str) -> str:
    """The op page of `op` (``aten::gelu``), relative to the site's root."""
    return f"{OP_DIR}/{safe_name(op)}.html"


def _models(names: list[str], hrefs: dict[str, str], limit: int = 3) -> dict[str, Any]:
    names = sorted(names)
    return {"shown": [(m, hrefs.get(m, "")) for m in names[:limit]], "more": max(0, len(names) - limit)}


def worklist_view(work: Worklist | None, hrefs: dict[str, str], *, top: int | None = None) -> dict[str, Any]:
    """The ranking (all ops with a failing variation, or the first `top`), each op linked to its page."""
    if work is None or work.op_run is None:
        return {"has_run": False, "ops": [], "counts": {}, "uncovered": []}
    pages = set(work.variations["op"]) if not work.empty else set()
    ranking = work.top(top) if top is not None else work.ranking[work.ranking["failing"] > 0]
    ops = []
    for r in column_records(ranking, ("op", "variations", "failing", "outcomes", "blocks", "explains", "unblocks",
                                      "needs", "models", "suggestion", "example_models")):
        # the op to fix may have no variation of its own (sort.default's variations fail at sort.stable)
        page_op = r["op"] if r["op"] in pages else next(
            (v for v, f in zip(work.variations["op"], work.variations["fix"], strict=True) if f == r["op"]), "")
        examples = [m for m in str(r["example_models"] or "").split(", ") if m]
        ops.append({**r, "href": op_href(page_op) if page_op else "", "examples": _models(examples, hrefs)})
    return {"has_run": True, "op_run": work.op_run, "model_run": work.model_run or "", "config": work.config,
            "counts": dict(sorted(work.counts.items(), key=lambda x: (-x[1], x[0]))),
            "total": sum(work.counts.values()), "ops": ops,
            "more": int((work.ranking["failing"] > 0).sum()) - len(ops) if not work.ranking.empty else 0,
            "uncovered": [{"op": op, "models": _models(ms, hrefs)} for op, ms in work.uncovered.items()]}


def op_pages(work: Worklist | None, hrefs: dict[str, str], repro_links: dict[str, str]) -> list[dict[str, Any]]:
    """One context per op overload (``aten::gelu``, ``aten::sort``): its variations, failing ones first."""
    if work is None or work.empty:
        return []
    pages = []
    for op, g in work.variations.groupby("op", sort=True):
        rows = []
        for r in column_records(g, ("variation_id", "fix", "inputs", "source", "outcome", "models", "calls",
                                    "blocks", "explains", "error", "repro_path")):
            rows.append({**r, "inputs": ", ".join(r["inputs"] or []) or "-", "blocks": _models(list(r["blocks"]), hrefs, 8),
                         "explains": _models(list(r["explains"]), hrefs, 8),
                         "repro": repro_links.get(str(r["repro_path"] or ""), "")})
        counts: dict[str, int] = {}
        for r in rows:
            counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
        pages.append({"op": op, "file": op_href(op), "rows": rows, "counts": dict(sorted(counts.items())),
                      "config": work.config, "op_run": work.op_run})
    return pages
