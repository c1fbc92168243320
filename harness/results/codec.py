"""How rows look inside SQLite and how they come back out as pandas frames.

Dicts and lists are stored as canonical JSON (sorted keys, so equal settings give equal text and can
key a row), booleans as 0/1; reading back decodes JSON, makes float columns float64 (missing -> NaN)
and gives every expected column, also those a DB written by an older portharness lacks.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pandas as pd

from harness.results.rows import column_types


def _json_default(obj: Any) -> Any:
    """Encode numpy scalars, torch dtypes/sizes, sets and anything else readable as JSON."""
    item = getattr(obj, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError):
            pass
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        return tolist()
    return str(obj)


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no whitespace, so equal settings dicts give equal strings."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=_json_default)


def encode(row: Any, types: dict[str, type] | None = None) -> dict[str, Any]:
    """A row dataclass as SQL parameters: JSON for dicts/lists, 0/1 for bools, plain numbers."""
    types = types or column_types(type(row))
    out: dict[str, Any] = {}
    for name, typ in types.items():
        v = getattr(row, name)
        if name == "settings" and not isinstance(v, dict):
            raise TypeError(f"{type(row).__name__}.settings must be a dict, got {type(v).__name__}")
        if typ in (dict, list):
            out[name] = canonical_json(v if v is not None else typ())
        elif v is None:
            out[name] = None if typ in (int, float) else ("" if typ is str else 0)
        elif typ is bool:
            out[name] = int(bool(v))
        else:
            out[name] = typ(v)
    return out


def decode_json(text: Any) -> Any:
    if text is None or (isinstance(text, float) and math.isnan(text)):
        return None
    return json.loads(text)


def frame(rows: list[dict[str, Any]], columns: list[str], types: dict[str, type]) -> pd.DataFrame:
    """Rows as a frame with every expected column (None where an older DB lacks it), JSON decoded."""
    df = pd.DataFrame(rows)
    for c in columns:
        if c not in df.columns:
            df[c] = pd.Series([None] * len(df), dtype=object)
    df = df[columns + [c for c in df.columns if c not in columns]]
    if df.empty:
        df = pd.DataFrame({c: pd.Series(dtype=object) for c in df.columns})
        df["settings_json"] = pd.Series(dtype=object)
        return df
    df["settings_json"] = df["settings"]
    df["settings"] = df["settings"].map(decode_json)
    for col, typ in types.items():
        if col == "settings" or col not in df:
            continue
        if typ in (dict, list):
            df[col] = df[col].map(decode_json)
        elif typ is float:
            df[col] = pd.to_numeric(df[col], errors="coerce").astype("float64")
        elif typ is bool:
            df[col] = df[col].map(lambda v: bool(v) if v is not None and v == v else False)
    return df
