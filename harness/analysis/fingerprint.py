"""Failure fingerprints: group a night's failures by what went wrong, not by model.

A young backend missing ``aten::sort`` fails 157 models with the same message; read model by model
that is 157 lines, read by fingerprint it is one line saying "157 models: unsupported_op aten::sort".
The key of a group is ``(outcome, op or first-drift module type, normalised first error line)``:

* the op (``unsupported_op``) or the first drifting module's type (``drift``) is the part a backend
  engineer fixes, so it splits groups;
* the first error line is normalised (numbers, addresses, shapes, paths and quoted values replaced by
  placeholders) so two models failing the same way with different tensor sizes or file paths land in
  the same group, while a different message (a different failure) gets its own.

Only outcomes whose numerics did not match (``harness.outcomes.MATCHED``) are grouped: matched rows
have nothing to fix. Everything here is a pure function over rows or frames.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import pandas as pd

from harness.analysis.matrix import column_records
from harness.outcomes import MATCHED, NOT_THE_MODELS, severity

# Order matters: paths and addresses before bare numbers, shapes before numbers (their digits would
# otherwise become "[<n>, <n>]", which still groups but reads worse).
# A quote opens only where no letter precedes it and closes only where none follows: "doesn't" is no quote.
_QUOTED = re.compile(r"(?<!\w)(?:'[^'\n]*'|\"[^\"\n]*\"|`[^`\n]*`)(?!\w)")
_ADDR = re.compile(r"\b0x[0-9a-fA-F]+\b")
_HEX = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{8,}\b")  # hashes, run ids (digits and letters)
# A path has at least two components ("/tmp/x.py", "C:\\a\\b"): a lone "/word" is more often prose or markup.
_PATH = re.compile(r"(?<![\w:/])(?:[A-Za-z]:\\|~?/)(?:[\w.+@-]+[/\\])+[\w.+@-]+")
_SHAPE = re.compile(r"(?:torch\.Size\()?[\[(]\s*-?\d+(?:\s*,\s*-?\d+)+\s*,?\s*[\])]\)?|\b\d+(?:x\d+)+\b")
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?![\w])")
_SPACE = re.compile(r"\s+")
MAX_MESSAGE = 160  # a normalised line longer than this is cut: the head says what failed


def normalise(line: str) -> str:
    """``line`` with the parts that differ between equal failures replaced by placeholders.

    >>> normalise("Could not run 'aten::sort' on sim:1 at 0x7f3a, shape [2, 16]")
    'Could not run <q> on sim:<n> at <addr>, shape <shape>'
    """
    s = _QUOTED.sub("<q>", line)
    s = _ADDR.sub("<addr>", s)
    s = _PATH.sub("<path>", s)
    s = _SHAPE.sub("<shape>", s)
    s = _HEX.sub("<hex>", s)
    s = _NUMBER.sub("<n>", s)
    s = _SPACE.sub(" ", s).strip()
    return s[:MAX_MESSAGE]


def _text(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return str(v)


def first_line(row: Mapping[str, Any]) -> str:
    """The first non-empty line of the row's error message, else its error type ('' for none)."""
    for line in _text(row.get("error_message")).splitlines():
        if line.strip():
            return line.strip()
    return _text(row.get("error_type")).strip()


def what(row: Mapping[str, Any]) -> str:
    """The part a backend engineer fixes: the missing op, or the type of the first drifting module."""
    op = _text(row.get("unsupported_op")).strip()
    if op:
        return op
    return _text(row.get("first_drift_module_type")).strip()


def is_failure(outcome: str) -> bool:
    """Whether rows with this outcome are grouped (their numerics did not match)."""
    return outcome not in MATCHED


def group_key(row: Mapping[str, Any]) -> tuple[str, str, str]:
    """``(outcome, op or first-drift module type, normalised first error line)``."""
    return _text(row.get("outcome")), what(row), normalise(first_line(row))


def key_id(key: tuple[str, str, str]) -> str:
    """A short stable id for a group key (the history file and the report refer to groups by it)."""
    return hashlib.sha1("\x1f".join(key).encode("utf-8")).hexdigest()[:10]


def key_label(key: tuple[str, str, str]) -> str:
    """``unsupported_op · aten::sort · Could not run <q> with ...`` (empty parts left out)."""
    return " · ".join(p for p in key if p)


@dataclass
class FailureGroup:
    """Every failing (model, config) that shares one fingerprint."""

    outcome: str
    what: str
    message: str  # normalised first error line
    models: list[str] = field(default_factory=list)
    configs: list[str] = field(default_factory=list)
    example: str = ""  # one raw first line, for the reader

    @property
    def key(self) -> tuple[str, str, str]:
        return self.outcome, self.what, self.message

    @property
    def id(self) -> str:
        return key_id(self.key)

    @property
    def label(self) -> str:
        return key_label(self.key)

    @property
    def count(self) -> int:
        return len(self.models)

    @property
    def reference_side(self) -> bool:
        """The failure says nothing about the target (the model or the CPU reference, or the device)."""
        return self.outcome in NOT_THE_MODELS

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "id": self.id, "label": self.label, "count": self.count,
                "reference_side": self.reference_side}


def group_rows(rows: Iterable[Mapping[str, Any]]) -> list[FailureGroup]:
    """Failing rows grouped by fingerprint, biggest group first (ties: worse outcome, then label).

    Rows need ``model_id`` and ``outcome``; ``unsupported_op``, ``first_drift_module_type``,
    ``error_message``, ``error_type`` and ``config`` are used when present.
    """
    groups: dict[tuple[str, str, str], FailureGroup] = {}
    for row in rows:
        outcome = _text(row.get("outcome"))
        if not is_failure(outcome):
            continue
        key = group_key(row)
        g = groups.get(key)
        if g is None:
            g = groups[key] = FailureGroup(*key, example=first_line(row)[:MAX_MESSAGE])
        g.models.append(_text(row.get("model_id")))
        config = _text(row.get("config"))
        if config and config not in g.configs:
            g.configs.append(config)
    for g in groups.values():
        g.models.sort()
        g.configs.sort()
    return sorted(groups.values(), key=lambda g: (-g.count, -severity(g.outcome), g.label))


_COLUMNS = ("model_id", "outcome", "unsupported_op", "first_drift_module_type", "error_message", "error_type",
            "config")


def group_failures(df: pd.DataFrame) -> list[FailureGroup]:
    """:func:`group_rows` over a result frame (reads only the columns it needs: nights are large)."""
    if df.empty:
        return []
    return group_rows(column_records(df[~df["outcome"].isin(MATCHED)], _COLUMNS))


def format_groups(groups: list[FailureGroup], *, limit: int = 30, examples: int = 3) -> str:
    """One line per group (``157 x unsupported_op · aten::sort · ...``) with a few example models."""
    if not groups:
        return "no failures"
    total = sum(g.count for g in groups)
    lines = [f"{total} failing result(s) in {len(groups)} group(s):"]
    for g in groups[:limit]:
        side = "  [not the target's: reference/load/device]" if g.reference_side else ""
        label = g.label if len(g.label) <= 140 else g.label[:139] + "…"
        lines.append(f"  {g.count:>5} x {label}{side}")
        more = f" ... +{g.count - examples}" if g.count > examples else ""
        lines.append(f"          e.g. {', '.join(g.models[:examples])}{more}")
    if len(groups) > limit:
        lines.append(f"  ... and {len(groups) - limit} more group(s)")
    return "\n".join(lines)
