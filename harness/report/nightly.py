"""View models of the nightly pages: the summary page's failure groups and the trend page.

Pure functions like `views.py` (dataframes and history lines in, template-ready dicts out); apart so
each module stays small.
"""

from __future__ import annotations

import math
from typing import Any

from harness.analysis.diff import DiffResult
from harness.analysis.fingerprint import FailureGroup
from harness.analysis.trend import series
from harness.report.svg import as_number, svg_lines
from harness.report.views import fmt


def _text(v: Any) -> str:
    return "" if v is None or (isinstance(v, float) and v != v) else str(v)


def regression_groups_view(res: DiffResult, hrefs: dict[str, str], *, examples: int = 5) -> list[dict[str, Any]]:
    """The diff page's regressions by failure group, biggest first, with a few example models each."""
    return [
        {"group": g, "count": len(items), "more": max(0, len(items) - examples),
         "examples": [(c.model_id, hrefs.get(c.model_id)) for c in items[:examples]]}
        for g, items in res.regression_groups()
    ]

def short_line(message: str, limit: int = 90) -> str:
    """A failure group's normalised line as a table shows it: its first sentence, cut at a word (the whole
    line is the cell's title). PyTorch's missing-kernel message is two sentences of which the first says
    it all; cutting it at a fixed width left "selective/cu" in every row."""
    head = message.split(". ", 1)[0].rstrip(".") if ". " in message else message
    if len(head) <= limit:
        return head
    cut = head[:limit].rsplit(" ", 1)[0]
    return (cut if len(cut) > limit // 2 else head[:limit]).rstrip(",;: ") + "…"


def groups_view(groups: list[FailureGroup], hrefs: dict[str, str], *, limit: int = 25,
                examples: int = 3) -> dict[str, Any]:
    """The summary page's failure groups: the ``limit`` biggest, each with a few example models."""
    return {
        "groups": [
            {
                "id": g.id,
                "count": g.count,
                "outcome": g.outcome,
                "what": g.what,
                "message": g.message,
                "short": short_line(g.message),
                "example": g.example,
                "reference_side": g.reference_side,
                "configs": g.configs,
                "examples": [(m, hrefs.get(m)) for m in g.models[:examples]],
                "more": max(0, g.count - examples),
            }
            for g in groups[:limit]
        ],
        "n_groups": len(groups),
        "n_failing": sum(g.count for g in groups),
    }


_TREND_SERIES = (("pass %", "pass", "pass_pct"), ("ran %", "ran", "ran_pct"), ("matched %", "matched", "matched_pct"))
_SPEED_SERIES = (("target/reference", "ratio", "geomean_ratio"), ("compiled speedup", "speedup", "geomean_speedup"))


def _speed_chart(labels: list[str], nights: list[Any]) -> Any:
    """The geometric means of a configuration's nights timed with --perf (None when none was)."""
    values = [(name, cls, [as_number((n.entry.get("perf") or {}).get(key)) for n in nights])
              for name, cls, key in _SPEED_SERIES]
    values = [v for v in values if any(x is not None for x in v[2])]
    if not values:
        return None
    top = max(x for _, _, xs in values for x in xs if x is not None)
    y_max = 2.0 ** max(0, math.ceil(math.log2(max(top, 1e-9) * 1.1)))  # 1, 2, 4...: quarter ticks read well
    return svg_lines(labels, values, y_max=y_max, unit="x")


def trend_view(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The trend page: per configuration a line chart of pass / ran / matched % per night and a table
    of its nights (newest first) with the failure groups that appeared or disappeared that night."""
    configs = []
    for config, nights in series(entries).items():
        labels = [_text(n.entry.get("date")) or _text(n.entry.get("run_id")) for n in nights]
        seen: dict[str, int] = {}
        for i, label in enumerate(labels):  # several nights on one date (re-runs) stay apart on the axis
            seen[label] = seen.get(label, 0) + 1
            if seen[label] > 1:
                labels[i] = f"{label} #{seen[label]}"
        values = [(name, cls, [as_number(n.entry.get(key)) for n in nights]) for name, cls, key in _TREND_SERIES]
        rows = [
            {
                "label": label,
                "run_id": _text(n.entry.get("run_id")),
                "total": n.entry.get("total", 0),
                "pass": fmt(n.entry.get("pass_pct")),
                "ran": fmt(n.entry.get("ran_pct")),
                "matched": fmt(n.entry.get("matched_pct")),
                "n_groups": len(n.entry.get("groups") or []),
                "ratio": fmt((n.entry.get("perf") or {}).get("geomean_ratio")),
                "timed": (n.entry.get("perf") or {}).get("models", ""),
                "appeared": n.appeared,
                "disappeared": n.disappeared,
            }
            for label, n in zip(labels, nights, strict=True)
        ]
        configs.append({"config": config, "n": len(nights), "svg": svg_lines(labels, values),
                        "speed_svg": _speed_chart(labels, nights), "nights": rows[::-1]})
    return {"configs": configs, "n_entries": len(entries)}
