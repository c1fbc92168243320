"""The result DB's schema: tables made from the row dataclasses, created in one transaction, and the
columns an older DB lacks added in one transaction (a failure adds none).

A column can be added to an existing DB only if it may be empty; a table that lacks one of its key
columns (or a `runs` table without its required ones) cannot be repaired and is refused before any
write (`unrepairable`).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

from harness.results.dbfile import APP_NAME, SCHEMA_VERSION, StoreError
from harness.results.rows import (
    CollectiveFaultRow,
    CollectiveRow,
    OpUseRow,
    PlacementRow,
    PlannedRow,
    ResultRow,
    RunInfo,
    VariationRow,
    column_types,
    field_names,
    utc_now,
)


@dataclass(frozen=True)
class Table:
    name: str
    row: type
    key: tuple[str, ...]

    @property
    def types(self) -> dict[str, type]:
        return column_types(self.row)

    @property
    def columns(self) -> list[str]:
        return field_names(self.row)


RESULTS = Table("results", ResultRow, ("run_id", "model_id", "target", "settings"))
COLLECTIVES = Table(
    "collectives", CollectiveRow, ("run_id", "target", "backend", "world_size", "op", "size_bytes", "setting", "settings")
)
COLLECTIVE_FAULTS = Table(
    "collective_faults",
    CollectiveFaultRow,
    ("run_id", "target", "backend", "world_size", "setting", "scenario"),
)
PLACEMENTS = Table("placements", PlacementRow, ("run_id", "target", "scenario"))
VARIATIONS = Table("variations", VariationRow, ("run_id", "variation_id"))
OP_USES = Table("op_uses", OpUseRow, ("run_id", "model_id"))
PLAN = Table("run_plan", PlannedRow, ("run_id", "model_id"))
TABLES = {t.name: t for t in (RESULTS, COLLECTIVES, COLLECTIVE_FAULTS, PLACEMENTS, VARIATIONS, OP_USES, PLAN)}
SQL_TYPES = {bool: "INTEGER", int: "INTEGER", float: "REAL", str: "TEXT", dict: "TEXT", list: "TEXT"}
RUN_COLUMNS = [*field_names(RunInfo), "finished_at"]
RUN_REQUIRED = ("run_id", "list_name", "target", "settings", "started_at")  # NOT NULL without a default


def create_sql(t: Table) -> str:
    cols = [f"{c} {SQL_TYPES[typ]}{' NOT NULL' if c in t.key else ''}" for c, typ in t.types.items()]
    cols.append(f"PRIMARY KEY ({', '.join(t.key)})")
    return f"CREATE TABLE IF NOT EXISTS {t.name} (\n  " + ",\n  ".join(cols) + "\n)"


_RUNS_SQL = """CREATE TABLE IF NOT EXISTS runs (
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
)"""
_SCHEMA = [
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    _RUNS_SQL,
    create_sql(RESULTS),
    "CREATE INDEX IF NOT EXISTS results_model ON results (model_id)",
    create_sql(COLLECTIVES),
    create_sql(COLLECTIVE_FAULTS),
    create_sql(PLACEMENTS),
    create_sql(VARIATIONS),
    create_sql(OP_USES),
    create_sql(PLAN),
]


def _columns(con: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in con.execute(f"PRAGMA table_info({table})")}


def unrepairable(con: sqlite3.Connection) -> list[str]:
    """What an existing table needs and cannot be given (read-only check): 'table.column' for a missing
    required column, 'table primary key' when its key is not the one rows are upserted on."""
    required = {"runs": (RUN_REQUIRED, ("run_id",)), **{t.name: (t.key, t.key) for t in TABLES.values()}}
    out = []
    for table, (cols, key) in required.items():
        info = con.execute(f"PRAGMA table_info({table})").fetchall()
        if not info:  # a missing table is simply created
            continue
        have = {r[1] for r in info}
        out += [f"{table}.{c}" for c in cols if c not in have]
        if {r[1] for r in info if r[5]} != set(key):
            out.append(f"{table} primary key")
    return out


def _migrations(con: sqlite3.Connection) -> list[str]:
    stmts = []
    for t in TABLES.values():
        have = _columns(con, t.name)
        if not have:
            stmts.append(create_sql(t))
            continue
        stmts += [f"ALTER TABLE {t.name} ADD COLUMN {c} {SQL_TYPES[typ]}" for c, typ in t.types.items() if c not in have]
    have = _columns(con, "runs")
    stmts += [f"ALTER TABLE runs ADD COLUMN {c} TEXT NOT NULL DEFAULT ''" for c in RUN_COLUMNS if c not in have]
    return stmts


def _in_transaction(con: sqlite3.Connection, work) -> None:
    con.execute("BEGIN IMMEDIATE")
    try:
        work()
        con.execute("COMMIT")
    except BaseException:
        if con.in_transaction:
            con.execute("ROLLBACK")
        raise


def create(con: sqlite3.Connection, path: object) -> None:
    """Every table and the `meta` rows that make the file a portharness DB, in one transaction."""

    def work() -> None:
        # Re-checked under the write lock: another process may have created a foreign table meanwhile.
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if tables and "meta" not in tables:
            raise StoreError(f"{path} became a foreign SQLite DB while opening; left untouched.")
        for stmt in _SCHEMA:
            con.execute(stmt)
        con.execute("INSERT OR IGNORE INTO meta VALUES ('app', ?)", (APP_NAME,))
        con.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        con.execute("INSERT OR IGNORE INTO meta VALUES ('created_at', ?)", (utc_now(),))

    _in_transaction(con, work)


def migrate(con: sqlite3.Connection, path: object) -> None:
    """Add the tables and columns the DB predates (existing rows stay as they are), all or none."""
    if not _migrations(con):
        return

    def work() -> None:
        bad = unrepairable(con)
        if bad:
            raise StoreError(f"{path} lacks {', '.join(bad)}, which cannot be added; it was left untouched. "
                             "Pass another --db path.")
        for stmt in _migrations(con):  # again under the write lock: another process may have added some
            con.execute(stmt)

    _in_transaction(con, work)
