"""Embedded SQLite result store: one classified row per model x target x settings.

Why SQLite: a nightly run is thousands of short, independent model checks done by several
processes (shards, worker subprocesses, retries). Each result must be durable the moment it is
known, so a crash, an OOM-kill or ``kill -9`` of the runner never loses finished work and a resumed
run can skip what is done. WAL journaling gives that with concurrent readers and a writer at a time
(``busy_timeout`` makes writers queue rather than fail).

The store refuses to touch any file that is not one of ours (random bytes, another application's
SQLite DB, a DB written by a newer schema): it raises :class:`StoreError` naming the file and what to
do, and never truncates or rewrites it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import functools
import importlib.metadata
import json
import math
import os
import secrets
import socket
import sqlite3
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from harness import outcomes


APP_NAME = "portharness"
SCHEMA_VERSION = 1
SQLITE_HEADER = b"SQLite format 3\x00"
BUSY_TIMEOUT_MS = 60_000


class StoreError(RuntimeError):
    """The DB file cannot be used as a portharness store (corrupt, foreign, newer schema, missing)."""


# ----------------------------------------------------------------------------------------------
# Row types
# ----------------------------------------------------------------------------------------------


@dataclass
class RunInfo:
    """One invocation of the runner over a model list for one target and settings."""

    list_name: str
    target: str
    settings: dict
    shard: str = "1/1"
    argv: str = ""
    run_id: str = ""
    started_at: str = ""
    torch_version: str = ""
    transformers_version: str = ""
    harness_version: str = ""
    host: str = ""


@dataclass
class ResultRow:
    """The classified outcome of one model on one target with one settings dict."""

    run_id: str
    model_id: str
    target: str
    settings: dict
    outcome: str
    arch: str = ""
    task: str = ""
    modality: str = ""
    unsupported_op: str = ""
    error_type: str = ""
    error_message: str = ""
    traceback: str = ""
    first_drift_module: str = ""
    first_drift_module_type: str = ""
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    min_cosine: float | None = None
    rmse_ratio: float | None = None
    metrics: dict = field(default_factory=dict)
    device: str = ""
    attempts: list = field(default_factory=list)
    exit_code: int | None = None
    signal: int | None = None
    load_time_s: float | None = None
    ref_time_s: float | None = None
    target_time_s: float | None = None
    wall_time_s: float | None = None
    peak_rss_mb: float | None = None
    torch_version: str = ""
    transformers_version: str = ""
    harness_version: str = ""
    finished_at: str = ""


@dataclass
class CollectiveRow:
    """Timing of one collective op at one size and setting, relative to a baseline setting."""

    run_id: str
    target: str
    backend: str
    world_size: int
    op: str
    size_bytes: int
    setting: str
    settings: dict
    baseline_setting: str
    median_s: float
    p10_s: float
    p90_s: float
    repeats: int
    ratio: float | None
    ratio_p10: float | None
    ratio_p90: float | None
    finished_at: str = ""


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


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


def utc_now() -> str:
    """ISO-8601 UTC timestamp with seconds, sortable as text."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def new_run_id() -> str:
    """UTC timestamp plus a short random suffix: sortable by time and unique across shards."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{secrets.token_hex(3)}"


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


@functools.lru_cache(maxsize=1)
def _versions() -> dict[str, str]:
    """Versions without importing torch/transformers (importing torch costs seconds per process)."""
    from harness import __version__

    return {
        "torch_version": _dist_version("torch"),
        "transformers_version": _dist_version("transformers"),
        "harness_version": __version__,
    }


def _sql_type(f: dataclasses.Field) -> str:
    t = str(f.type)
    if t.startswith("dict") or t.startswith("list"):
        return "TEXT"  # JSON
    if "float" in t:
        return "REAL"
    if "int" in t:
        return "INTEGER"
    return "TEXT"


def _json_fields(cls: type) -> set[str]:
    return {
        f.name
        for f in dataclasses.fields(cls)
        if _sql_type(f) == "TEXT" and str(f.type)[:4] in ("dict", "list")
    }


RUN_FIELDS = [f.name for f in dataclasses.fields(RunInfo)]
RESULT_FIELDS = [f.name for f in dataclasses.fields(ResultRow)]
COLLECTIVE_FIELDS = [f.name for f in dataclasses.fields(CollectiveRow)]
RESULT_KEY = ("run_id", "model_id", "target", "settings")
COLLECTIVE_KEY = ("run_id", "target", "backend", "world_size", "op", "size_bytes", "setting", "settings")
_RESULT_JSON = _json_fields(ResultRow)
_REAL_COLUMNS = {
    f.name for cls in (ResultRow, CollectiveRow) for f in dataclasses.fields(cls) if _sql_type(f) == "REAL"
}
_COLLECTIVE_JSON = _json_fields(CollectiveRow)


def _columns_sql(cls: type, key: Sequence[str]) -> str:
    cols = []
    for f in dataclasses.fields(cls):
        typ = _sql_type(f)
        notnull = " NOT NULL" if f.name in key else ""
        cols.append(f"{f.name} {typ}{notnull}")
    cols.append(f"PRIMARY KEY ({', '.join(key)})")
    return ",\n  ".join(cols)


_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
  run_id TEXT PRIMARY KEY,
  list_name TEXT NOT NULL,
  target TEXT NOT NULL,
  settings TEXT NOT NULL,
  shard TEXT NOT NULL DEFAULT '1/1',
  argv TEXT NOT NULL DEFAULT '',
  started_at TEXT NOT NULL,
  finished_at TEXT NOT NULL DEFAULT '',
  torch_version TEXT NOT NULL DEFAULT '',
  transformers_version TEXT NOT NULL DEFAULT '',
  harness_version TEXT NOT NULL DEFAULT '',
  host TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS results (
  {_columns_sql(ResultRow, RESULT_KEY)}
);
CREATE INDEX IF NOT EXISTS results_model ON results (model_id);
CREATE TABLE IF NOT EXISTS collectives (
  {_columns_sql(CollectiveRow, COLLECTIVE_KEY)}
);
"""


def _clean_float(v: Any) -> float | None:
    if v is None:
        return None
    return float(v)


def _clean_int(v: Any) -> int | None:
    if v is None:
        return None
    return int(v)


def _encode(row: Any, json_fields: set[str]) -> dict[str, Any]:
    """Turn a row dataclass into SQL parameters (JSON for dicts/lists, plain floats/ints)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(row):
        v = getattr(row, f.name)
        typ = _sql_type(f)
        if f.name == "settings" or f.name in json_fields:
            if f.name == "settings" and not isinstance(v, dict):
                raise TypeError(f"{type(row).__name__}.settings must be a dict, got {type(v).__name__}")
            out[f.name] = canonical_json(v if v is not None else ({} if "dict" in str(f.type) else []))
        elif typ == "REAL":
            out[f.name] = _clean_float(v)
        elif typ == "INTEGER":
            out[f.name] = _clean_int(v)
        else:
            out[f.name] = "" if v is None else str(v)
    return out


def _decode_json(text: Any) -> Any:
    if text is None or (isinstance(text, float) and math.isnan(text)):
        return None
    return json.loads(text)


# ----------------------------------------------------------------------------------------------
# File validation
# ----------------------------------------------------------------------------------------------


def _inspect_file(path: Path) -> str:
    """Classify ``path`` without writing to it: 'missing', 'empty', 'ours', or raise StoreError."""
    if not path.exists():
        return "missing"
    if path.is_dir():
        raise StoreError(f"{path} is a directory, not a portharness DB file; pass a file path with --db.")
    size = path.stat().st_size
    if size == 0:
        return "empty"
    with open(path, "rb") as fh:
        header = fh.read(len(SQLITE_HEADER))
    if header != SQLITE_HEADER:
        raise StoreError(
            f"{path} is not an SQLite database (bad header; the file is corrupt or not a DB). "
            "It was left untouched; move it aside or pass another --db path."
        )
    try:
        con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_MS / 1000)
    except sqlite3.Error as exc:
        raise StoreError(f"{path} cannot be opened as SQLite ({exc}); it was left untouched.") from exc
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not tables:
            return "empty"
        if "meta" not in tables:
            raise StoreError(
                f"{path} is an SQLite database of another application (tables: {', '.join(sorted(tables))}); "
                "it was left untouched. Pass a new or portharness --db path."
            )
        meta = dict(con.execute("SELECT key, value FROM meta").fetchall())
    except sqlite3.DatabaseError as exc:
        raise StoreError(
            f"{path} is a corrupt SQLite database ({exc}); it was left untouched. "
            "Restore it from a backup/artifact or pass another --db path."
        ) from exc
    finally:
        con.close()
    if meta.get("app") != APP_NAME:
        raise StoreError(
            f"{path} has a 'meta' table but is not a portharness DB (app={meta.get('app')!r}); "
            "it was left untouched. Pass a new or portharness --db path."
        )
    try:
        version = int(meta.get("schema_version", ""))
    except ValueError as exc:
        raise StoreError(f"{path}: unreadable schema_version {meta.get('schema_version')!r}.") from exc
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{path} was written by a newer portharness (schema {version} > {SCHEMA_VERSION} supported); "
            "it was left untouched. Upgrade portharness to read it."
        )
    return "ours"


# ----------------------------------------------------------------------------------------------
# The store
# ----------------------------------------------------------------------------------------------


class ResultStore:
    """A portharness SQLite DB. Safe for several processes; each ``record`` is committed at once."""

    def __init__(self, path: str | os.PathLike, *, create: bool = True) -> None:
        self.path = Path(path)
        state = _inspect_file(self.path)
        if state == "missing" and not create:
            raise StoreError(f"{self.path} does not exist; run `portharness run --db {self.path}` first.")
        if state == "missing" and not self.path.parent.exists():
            raise StoreError(f"directory {self.path.parent} for DB {self.path} does not exist.")
        if state == "empty" and not create:
            raise StoreError(f"{self.path} is empty (no portharness schema); nothing to read.")
        self._lock = threading.RLock()
        # A DB we may not write (read-only artifact, mount or file) is still readable for matrix/report/diff.
        self.read_only = state == "ours" and not (
            os.access(self.path, os.W_OK) and os.access(self.path.parent.resolve(), os.W_OK)
        )
        try:
            if self.read_only:
                self._con = sqlite3.connect(
                    f"{self.path.resolve().as_uri()}?mode=ro",
                    uri=True,
                    timeout=BUSY_TIMEOUT_MS / 1000,
                    isolation_level=None,
                    check_same_thread=False,
                )
                self._con.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
                return
            self._con = sqlite3.connect(
                str(self.path), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False
            )
            self._con.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            if state != "ours":
                self._create_schema()
            self._set_wal()
            self._con.execute("PRAGMA synchronous=NORMAL")
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.path}: cannot open store ({exc}).") from exc

    # -- setup -------------------------------------------------------------------------------

    def _set_wal(self) -> None:
        """WAL lets readers (report, resume) run while a writer records; retry if another opener races."""
        for _ in range(200):
            try:
                mode = self._con.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                if mode.lower() == "wal":
                    return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) and "busy" not in str(exc):
                    raise
            threading.Event().wait(0.05)

    def _create_schema(self) -> None:
        with self._lock:
            self._con.execute("BEGIN IMMEDIATE")
            try:
                # Re-check under the write lock: another process may have created a foreign table meanwhile.
                tables = {
                    r[0] for r in self._con.execute("SELECT name FROM sqlite_master WHERE type='table'")
                }
                if tables and "meta" not in tables:
                    raise StoreError(f"{self.path} became a foreign SQLite DB while opening; left untouched.")
                for stmt in _SCHEMA.split(";"):
                    if stmt.strip():
                        self._con.execute(stmt)
                self._con.execute("INSERT OR IGNORE INTO meta VALUES ('app', ?)", (APP_NAME,))
                self._con.execute(
                    "INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
                )
                self._con.execute("INSERT OR IGNORE INTO meta VALUES ('created_at', ?)", (utc_now(),))
                self._con.execute("COMMIT")
            except BaseException:
                if self._con.in_transaction:
                    self._con.execute("ROLLBACK")
                raise

    def _write(self, sql: str, params: Any = (), many: bool = False) -> None:
        if self.read_only:
            raise StoreError(
                f"{self.path} is read-only (no write permission); copy it elsewhere to add results."
            )
        with self._lock:
            try:
                if many:
                    self._con.execute("BEGIN IMMEDIATE")
                    try:
                        self._con.executemany(sql, params)
                        self._con.execute("COMMIT")
                    except BaseException:
                        self._con.execute("ROLLBACK")
                        raise
                else:
                    self._con.execute(sql, params)  # autocommit: durable when this returns
            except sqlite3.DatabaseError as exc:
                raise StoreError(f"{self.path}: write failed ({exc}).") from exc

    def _query(self, sql: str, params: Any = ()) -> list[dict[str, Any]]:
        with self._lock:
            try:
                cur = self._con.execute(sql, params)
                cols = [d[0] for d in cur.description or ()]
                return [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]
            except sqlite3.DatabaseError as exc:
                raise StoreError(f"{self.path}: read failed ({exc}).") from exc

    # -- runs --------------------------------------------------------------------------------

    def begin_run(self, info: RunInfo) -> str:
        """Record the start of a run (filling id, time, versions, host) and return its run id."""
        if not info.run_id:
            info.run_id = new_run_id()
        if not info.started_at:
            info.started_at = utc_now()
        for key, value in _versions().items():
            if not getattr(info, key):
                setattr(info, key, value)
        if not info.host:
            info.host = socket.gethostname()
        p = _encode(info, set())
        cols = ", ".join(p)
        # Atomic: several shards/workers may begin (or resume) the same run id at once. A resumed run keeps
        # its original start and metadata and is marked unfinished again.
        self._write(
            f"INSERT INTO runs ({cols}) VALUES ({', '.join('?' * len(p))}) "
            "ON CONFLICT (run_id) DO UPDATE SET finished_at=''",
            list(p.values()),
        )
        return info.run_id

    def finish_run(self, run_id: str) -> None:
        """Mark a run complete; unfinished runs are what ``latest_run(unfinished_only=True)`` resumes."""
        self._require_run(run_id)
        self._write("UPDATE runs SET finished_at=? WHERE run_id=?", (utc_now(), run_id))

    def _require_run(self, run_id: str) -> None:
        if not self._query("SELECT 1 AS x FROM runs WHERE run_id=?", (run_id,)):
            known = [
                r["run_id"] for r in self._query("SELECT run_id FROM runs ORDER BY started_at DESC LIMIT 5")
            ]
            hint = f" Recent runs: {', '.join(known)}." if known else " The DB has no runs."
            raise StoreError(f"{self.path}: unknown run id {run_id!r}.{hint}")

    def has_run(self, run_id: str) -> bool:
        """Whether ``run_id`` exists in this DB."""
        return bool(self._query("SELECT 1 AS x FROM runs WHERE run_id=?", (run_id,)))

    def latest_run(
        self,
        *,
        list_name: str | None = None,
        target: str | None = None,
        settings: dict | None = None,
        unfinished_only: bool = False,
        has_results: bool = False,
        has_collectives: bool = False,
    ) -> str | None:
        """Most recently started run matching the filters, or None.

        ``has_results`` skips runs without model rows (e.g. a collectives-only benchmark run), which is
        what matrix/report/diff want by default; ``has_collectives`` finds the latest benchmark run.
        """
        where, params = [], []
        if list_name is not None:
            where.append("list_name=?")
            params.append(list_name)
        if target is not None:
            where.append("target=?")
            params.append(target)
        if settings is not None:
            where.append("settings=?")
            params.append(canonical_json(settings))
        if unfinished_only:
            where.append("finished_at=''")
        if has_results:
            where.append("EXISTS (SELECT 1 FROM results x WHERE x.run_id=runs.run_id)")
        if has_collectives:
            where.append("EXISTS (SELECT 1 FROM collectives c WHERE c.run_id=runs.run_id)")
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        rows = self._query(
            f"SELECT run_id FROM runs {clause} ORDER BY started_at DESC, rowid DESC LIMIT 1", params
        )
        return rows[0]["run_id"] if rows else None

    # -- results -----------------------------------------------------------------------------

    def record(self, row: ResultRow) -> None:
        """Upsert one result; it is committed (survives kill -9) when this returns."""
        outcomes.check(row.outcome)
        if not row.model_id:
            raise ValueError("ResultRow.model_id is empty")
        self._require_run(row.run_id)
        if not row.finished_at:
            row.finished_at = utc_now()
        for key, value in _versions().items():
            if not getattr(row, key):
                setattr(row, key, value)
        p = _encode(row, _RESULT_JSON)
        cols = ", ".join(p)
        updates = ", ".join(f"{c}=excluded.{c}" for c in p if c not in RESULT_KEY)
        self._write(
            f"INSERT INTO results ({cols}) VALUES ({', '.join('?' * len(p))}) "
            f"ON CONFLICT ({', '.join(RESULT_KEY)}) DO UPDATE SET {updates}",
            list(p.values()),
        )

    def finished_ids(self, run_id: str) -> set[str]:
        """Model ids that already have a row in ``run_id`` (any outcome): what a resumed run skips."""
        return {r["model_id"] for r in self._query("SELECT model_id FROM results WHERE run_id=?", (run_id,))}

    def record_collective(self, row: CollectiveRow) -> None:
        """Upsert one collective benchmark row; committed when this returns."""
        self._require_run(row.run_id)
        if not row.finished_at:
            row.finished_at = utc_now()
        p = _encode(row, _COLLECTIVE_JSON)
        cols = ", ".join(p)
        updates = ", ".join(f"{c}=excluded.{c}" for c in p if c not in COLLECTIVE_KEY)
        self._write(
            f"INSERT INTO collectives ({cols}) VALUES ({', '.join('?' * len(p))}) "
            f"ON CONFLICT ({', '.join(COLLECTIVE_KEY)}) DO UPDATE SET {updates}",
            list(p.values()),
        )

    # -- frames ------------------------------------------------------------------------------

    def runs(self) -> pd.DataFrame:
        """All runs, newest first, with decoded settings and result / collective-row counts."""
        rows = self._query(
            "SELECT r.*, (SELECT COUNT(*) FROM results x WHERE x.run_id=r.run_id) AS n_results, "
            "(SELECT COUNT(*) FROM collectives c WHERE c.run_id=r.run_id) AS n_collectives "
            "FROM runs r ORDER BY r.started_at DESC, r.rowid DESC"
        )
        return _frame(rows, [*RUN_FIELDS, "finished_at", "n_results", "n_collectives"], set())

    def results(self, run_id: str | None = None) -> pd.DataFrame:
        """Result rows (all runs if ``run_id`` is None) with dict/list columns decoded.

        Adds ``settings_json`` (canonical text, hashable: use it to group/pivot) and ``run_started_at``.
        """
        if run_id is not None:
            self._require_run(run_id)
            rows = self._query(
                "SELECT x.*, r.started_at AS run_started_at FROM results x JOIN runs r USING (run_id) "
                "WHERE x.run_id=? ORDER BY x.model_id",
                (run_id,),
            )
        else:
            rows = self._query(
                "SELECT x.*, r.started_at AS run_started_at FROM results x JOIN runs r USING (run_id) "
                "ORDER BY r.started_at, x.model_id"
            )
        return _frame(rows, [*RESULT_FIELDS, "run_started_at"], _RESULT_JSON)

    def history(self, model_id: str | None = None) -> pd.DataFrame:
        """Light per-run outcome history (no tracebacks/metrics), oldest run first: cheap across many nights."""
        cols = "x.run_id, x.model_id, x.target, x.settings, x.outcome, x.rmse_ratio, x.error_type, x.unsupported_op"
        sql = f"SELECT {cols}, r.started_at AS run_started_at, r.list_name FROM results x JOIN runs r USING (run_id)"
        params: tuple = ()
        if model_id is not None:
            sql += " WHERE x.model_id=?"
            params = (model_id,)
        rows = self._query(sql + " ORDER BY r.started_at, x.run_id", params)
        names = [
            "run_id",
            "model_id",
            "target",
            "settings",
            "outcome",
            "rmse_ratio",
            "error_type",
            "unsupported_op",
        ]
        return _frame(rows, [*names, "run_started_at", "list_name"], set())

    def collectives(self, run_id: str | None = None) -> pd.DataFrame:
        """Collective benchmark rows (all runs if ``run_id`` is None), settings decoded."""
        if run_id is not None:
            self._require_run(run_id)
            rows = self._query(
                "SELECT * FROM collectives WHERE run_id=? ORDER BY op, size_bytes, setting", (run_id,)
            )
        else:
            rows = self._query("SELECT * FROM collectives ORDER BY run_id, op, size_bytes, setting")
        return _frame(rows, COLLECTIVE_FIELDS, _COLLECTIVE_JSON)

    # -- raw access for merge ------------------------------------------------------------------

    def _raw(self, table: str) -> list[dict[str, Any]]:
        return self._query(f"SELECT * FROM {table}")

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with self._lock:
            con = getattr(self, "_con", None)
            if con is not None:
                con.close()
                self._con = None  # type: ignore[assignment]

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ResultStore({str(self.path)!r})"


def _frame(rows: list[dict[str, Any]], columns: list[str], json_fields: set[str]) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=columns if not rows else None)
    if df.empty:
        df = pd.DataFrame({c: pd.Series(dtype=object) for c in columns})
        df["settings_json"] = pd.Series(dtype=object)
        return df
    df["settings_json"] = df["settings"]
    df["settings"] = df["settings"].map(_decode_json)
    for col in json_fields - {"settings"}:
        if col in df:
            df[col] = df[col].map(_decode_json)
    for col in _REAL_COLUMNS & set(df.columns):
        df[col] = pd.to_numeric(df[col], errors="coerce").astype("float64")
    return df


# ----------------------------------------------------------------------------------------------
# Merge
# ----------------------------------------------------------------------------------------------


def _parse_shard(shard: str) -> tuple[int, int] | None:
    try:
        i, n = shard.split("/")
        return int(i), int(n)
    except (ValueError, AttributeError):
        return None


def _combine_run_ids(runs: list[dict[str, Any]]) -> dict[str, str]:
    """Map shard run ids onto one run id per (list, target, settings, N) when the shards are distinct.

    Each nightly shard starts its own run; merged, they form one night. Shards of the same group
    are combined only when every shard index appears once, so two nights are never mixed up.
    """
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in runs:
        parsed = _parse_shard(r["shard"])
        if parsed is None or parsed[1] <= 1:
            continue
        groups.setdefault((r["list_name"], r["target"], r["settings"], parsed[1]), []).append(r)
    mapping: dict[str, str] = {}
    for members in groups.values():
        ids = {m["run_id"] for m in members}
        if len(ids) < 2:
            continue
        indices = [_parse_shard(m["shard"])[0] for m in members]  # type: ignore[index]
        if len(indices) != len(set(indices)):
            continue
        first = min(members, key=lambda m: (m["started_at"], m["run_id"]))
        for m in members:
            mapping[m["run_id"]] = first["run_id"]
    return mapping


def _merged_run(rows: list[dict[str, Any]], run_id: str) -> dict[str, Any]:
    base = dict(min(rows, key=lambda r: (r["started_at"], r["run_id"])))
    base["run_id"] = run_id
    parsed = [_parse_shard(r["shard"]) for r in rows]
    if all(parsed) and len({p[1] for p in parsed}) == 1 and len(rows) > 1:  # type: ignore[index]
        n = parsed[0][1]  # type: ignore[index]
        idx = sorted({p[0] for p in parsed})  # type: ignore[index]
        base["shard"] = "1/1" if idx == list(range(1, n + 1)) else f"{','.join(map(str, idx))}/{n}"
    finished = [r["finished_at"] for r in rows]
    base["finished_at"] = "" if any(not f for f in finished) else max(finished)
    return base


def merge_stores(
    dst: str | os.PathLike, srcs: Iterable[str | os.PathLike], *, combine_shards: bool = True
) -> int:
    """Merge shard DBs into ``dst`` (created if needed); returns result + collective rows merged.

    Every source is validated first (missing, corrupt, foreign -> StoreError, nothing written).
    With ``combine_shards`` the per-shard runs of one night become one run, so the matrix, report and
    diff see the whole night; rows of the same key are upserted (later sources win).
    """
    dst_path = Path(dst)
    src_paths = [Path(s) for s in srcs]
    if not src_paths:
        raise StoreError("merge: no source DBs given.")
    for s in src_paths:
        if s.exists() and dst_path.exists() and s.resolve() == dst_path.resolve():
            raise StoreError(f"merge: source {s} is also the destination; pass a different --out.")
    opened = []
    try:
        for s in src_paths:
            opened.append(ResultStore(s, create=False))
        runs = [r for st in opened for r in st._raw("runs")]
        mapping = _combine_run_ids(runs) if combine_shards else {}
        with ResultStore(dst_path, create=True) as out:
            existing = {r["run_id"]: r for r in out._raw("runs")}
            by_id: dict[str, list[dict[str, Any]]] = {}
            for r in runs:
                by_id.setdefault(mapping.get(r["run_id"], r["run_id"]), []).append(r)
            for rid, rows in by_id.items():
                if rid in existing:
                    rows = [existing[rid], *rows]
                merged = _merged_run(rows, rid)
                cols = list(merged)
                out._write(
                    f"INSERT OR REPLACE INTO runs ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                    [merged[c] for c in cols],
                )
            n = 0
            for st in opened:
                for table, fields in (("results", RESULT_FIELDS), ("collectives", COLLECTIVE_FIELDS)):
                    rows = st._raw(table)
                    for r in rows:
                        r["run_id"] = mapping.get(r["run_id"], r["run_id"])
                    if not rows:
                        continue
                    out._write(
                        f"INSERT OR REPLACE INTO {table} ({', '.join(fields)}) VALUES ({', '.join('?' * len(fields))})",
                        [[r.get(c) for c in fields] for r in rows],
                        many=True,
                    )
                    n += len(rows)
        return n
    finally:
        for st in opened:
            st.close()


def main_merge(args: argparse.Namespace) -> int:
    """CLI: ``portharness merge --out merged.db a.db b.db``. Returns 0, or 2 on a bad DB."""
    try:
        n = merge_stores(args.out, args.dbs, combine_shards=not getattr(args, "no_combine", False))
    except StoreError as exc:
        print(f"portharness merge: error: {exc}", file=sys.stderr)
        return 2
    print(f"merged {n} rows from {len(args.dbs)} DB(s) into {args.out}")
    return 0


def add_merge_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments for ``portharness merge`` (for harness/cli.py to reuse)."""
    parser.add_argument("--out", required=True, help="destination DB (created if missing)")
    parser.add_argument("dbs", nargs="+", help="shard DBs to merge")
    parser.add_argument("--no-combine", action="store_true", help="keep per-shard runs separate")


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.results.store", description="merge portharness DBs")
    add_merge_arguments(parser)
    return main_merge(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(_main())
