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

from harness.results.dbfile import StoreError
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


def decode_json(text: Any, where: str = "", kind: type | None = None) -> Any:
    """A stored JSON value (None for an empty cell). A cell that does not parse, or is not a `kind` (a dict
    column holding ``[1,2,3]``), is a damaged or foreign DB: StoreError naming `where` (table, row, column)."""
    if text is None or (isinstance(text, float) and math.isnan(text)) or text == "":
        return None
    try:
        value = json.loads(text)
    except (TypeError, ValueError) as e:
        raise StoreError(f"{where or 'a JSON column'}: not JSON ({e}); the DB was damaged or written by another "
                         "program: rerun what wrote it into a fresh DB") from None
    if kind is not None and value is not None and not isinstance(value, kind):
        raise StoreError(f"{where or 'a JSON column'}: holds a JSON {type(value).__name__}, a "
                         f"{'JSON object' if kind is dict else kind.__name__} was written; the DB was damaged or written "
                         "by another program: rerun what wrote it into a fresh DB")
    return value


def _decoded(df: pd.DataFrame, col: str, table: str, kind: type | None) -> list[Any]:
    """Column `col` of `df` decoded; a cell's error names the table, the row (its keys) and the column."""
    out = []
    for i, v in enumerate(df[col]):
        try:
            out.append(decode_json(v, kind=kind))
        except StoreError:
            keys = [c for c in ("run_id", "model_id", "variation_id", "op", "scenario") if c in df.columns]
            row = ", ".join(f"{k} {df[k].iloc[i]!r}" for k in keys)
            decode_json(v, f"table {table or '?'}, row {row}, column {col}", kind)  # raises, saying where
    return out


def frame(rows: list[dict[str, Any]], columns: list[str], types: dict[str, type], table: str = "") -> pd.DataFrame:
    """Rows as a frame with every expected column (None where an older DB lacks it), JSON decoded (`table`
    names where a cell that is not JSON came from)."""
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
    df["settings"] = _decoded(df, "settings", table or "runs", dict)
    for col, typ in types.items():
        if col == "settings" or col not in df:
            continue
        if typ in (dict, list):
            df[col] = _decoded(df, col, table, typ)
        elif typ is float:
            df[col] = pd.to_numeric(df[col], errors="coerce").astype("float64")
        elif typ is bool:
            df[col] = df[col].map(lambda v: bool(v) if v is not None and v == v else False)
    return df
