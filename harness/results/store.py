"""Embedded SQLite result store: one classified row per model x target x settings.

Why SQLite: a nightly run is thousands of short, independent model checks done by several
processes (shards, worker subprocesses, retries). Each result must be durable the moment it is
known, so a crash, an OOM-kill or ``kill -9`` of the runner never loses finished work and a resumed
run can skip what is done. WAL journaling gives that with concurrent readers and a writer at a time
(``busy_timeout`` makes writers queue rather than fail).

Columns come from the row dataclasses in `rows.py` (their real types, not guesses; tables in
`schema.py`). A new DB is built in a temporary file and linked into place, so no 0-byte or half-made
DB is ever left; a DB written before a column existed gets it added, in one transaction, when opened
for writing; readers of older or read-only DBs see the missing columns as empty. Files that are not
ours are refused by `dbfile.inspect`, and `writable.check_writable` says, before a command writes anything,
whether rows can be added at a path.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from harness import outcomes
from harness.results import schema
from harness.results.codec import canonical_json, encode, frame
from harness.results.dbfile import (
    BUSY_TIMEOUT_MS,
    StoreError,
    StoreWriteError,
    check_integrity,
    connect_read_only,
    inspect,
    write_cause,
)
from harness.results.rows import (
    CollectiveFaultRow,
    CollectiveRow,
    PlacementRow,
    PlannedRow,
    ResultRow,
    RunInfo,
    new_run_id,
    utc_now,
    versions,
)
from harness.results.schema import (
    COLLECTIVE_FAULTS,
    COLLECTIVES,
    PLACEMENTS,
    PLAN,
    RESULTS,
    RUN_COLUMNS,
    TABLES,
    Table,
)
from harness.results.writable import create_db, may_write, remove_db

__all__ = ["ResultStore", "StoreError", "StoreWriteError", "canonical_json", "TABLES"]


class ResultStore:
    """A portharness SQLite DB. Safe for several processes; each ``record`` is committed at once."""

    def __init__(self, path: str | os.PathLike, *, create: bool = True, read_only: bool = False) -> None:
        """Open the DB at `path`: for writing (created if `create`; its pages checked first), or
        `read_only` (readers: nothing is written, not even a missing column, and read-only media work)."""
        self.path = Path(path)
        state = inspect(self.path)
        if read_only and state != "ours":
            create = False
        if state == "missing" and not create:
            raise StoreError(f"{self.path} does not exist; run `portharness run --db {self.path}` first.")
        if state == "missing" and not self.path.parent.exists():
            raise StoreError(f"directory {self.path.parent} for DB {self.path} does not exist.")
        if state == "empty" and not create:
            raise StoreError(f"{self.path} is empty (no portharness schema); nothing to read.")
        self._lock = threading.RLock()
        self._tx = False  # inside `transaction()`: writes join it instead of committing one by one
        # A DB we may not write (read-only artifact, mount or file) is still readable for matrix/report/diff.
        self.read_only = read_only or (state == "ours" and not may_write(self.path))
        if state == "ours" and not read_only:
            check_integrity(self.path)  # never add rows to a DB with damaged pages
        made = False
        if state == "missing" and not self.read_only:
            made = create_db(self.path)
            state = "ours"
        try:
            if self.read_only:
                self._con = connect_read_only(self.path)
                self._con.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
                return
            self._con = sqlite3.connect(
                str(self.path), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False
            )
            self._con.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            if state != "ours":
                schema.create(self._con, self.path)  # an empty file given as --db
            else:
                schema.migrate(self._con, self.path)
            self._set_wal()
            self._con.execute("PRAGMA synchronous=NORMAL")
        except sqlite3.DatabaseError as exc:
            self.close()
            if made:  # no half-made DB left behind
                remove_db(self.path)
            raise StoreError(f"{self.path}: cannot open store ({write_cause(exc)}).") from exc
        except BaseException:
            self.close()
            if made:
                remove_db(self.path)
            raise

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

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Every write inside the block commits together or not at all (merge: a full disk midway leaves
        the destination as it was)."""
        with self._lock:
            self._write_check()
            try:
                self._con.execute("BEGIN IMMEDIATE")
                self._tx = True
                yield
                self._con.execute("COMMIT")
            except sqlite3.DatabaseError as exc:
                raise StoreWriteError(f"{self.path}: write failed ({write_cause(exc)}); nothing of it was kept.") from exc
            finally:
                self._tx = False
                if self._con.in_transaction:
                    self._con.execute("ROLLBACK")

    def _write_check(self) -> None:
        if self.read_only:
            raise StoreError(
                f"{self.path} is read-only (no write permission); copy it elsewhere to add results."
            )

    def _write(self, sql: str, params: Any = (), many: bool = False) -> None:
        self._write_check()
        with self._lock:
            try:
                if many and self._tx:
                    self._con.executemany(sql, params)
                elif many:
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
                raise StoreWriteError(f"{self.path}: write failed ({write_cause(exc)}).") from exc

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
        for key, value in versions().items():
            if not getattr(info, key):
                setattr(info, key, value)
        if not info.host:
            info.host = socket.gethostname()
        p = encode(info)
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
        shard: str | None = None,
        unfinished_only: bool = False,
        has_results: bool = False,
        has_collectives: bool = False,
        has_collective_faults: bool = False,
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
        if shard is not None:
            where.append("shard=?")
            params.append(shard)
        if unfinished_only:
            where.append("finished_at=''")
        if has_results:
            where.append("EXISTS (SELECT 1 FROM results x WHERE x.run_id=runs.run_id)")
        if has_collectives:
            where.append("EXISTS (SELECT 1 FROM collectives c WHERE c.run_id=runs.run_id)")
        if has_collective_faults:
            if not self._has_table(COLLECTIVE_FAULTS.name):
                return None
            where.append("EXISTS (SELECT 1 FROM collective_faults f WHERE f.run_id=runs.run_id)")
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        # To resume, a run with rows beats an empty one (an aborted start must not hide real work).
        first = "EXISTS (SELECT 1 FROM results x WHERE x.run_id=runs.run_id) DESC, " if unfinished_only else ""
        rows = self._query(
            f"SELECT run_id FROM runs {clause} ORDER BY {first}started_at DESC, rowid DESC LIMIT 1", params
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
        for key, value in versions().items():
            if not getattr(row, key):
                setattr(row, key, value)
        self._upsert(RESULTS, [encode(row, RESULTS.types)])

    def finished_ids(self, run_id: str) -> set[str]:
        """Model ids with a final row in ``run_id``: what a resumed run skips. A device-side outcome is
        not the model's result (its device failed), so such models run again."""
        side = sorted(outcomes.DEVICE_SIDE)
        rows = self._query(
            f"SELECT model_id FROM results WHERE run_id=? AND outcome NOT IN ({', '.join('?' * len(side))})",
            (run_id, *side),
        )
        return {r["model_id"] for r in rows}

    def plan(self, run_id: str, ids: Iterable[str]) -> None:
        """Add `ids` to what `run_id` was started to finish (`planned`); committed when this returns."""
        now = utc_now()
        self._upsert(PLAN, [encode(PlannedRow(run_id=run_id, model_id=i, planned_at=now), PLAN.types) for i in ids])

    def planned(self, run_id: str) -> set[str]:
        """The ids `run_id` was started to finish (empty for a run recorded before plans were kept)."""
        if not self._has_table(PLAN.name):
            return set()
        return {r["model_id"] for r in self._query(f"SELECT model_id FROM {PLAN.name} WHERE run_id=?", (run_id,))}

    def record_collective(self, row: CollectiveRow) -> None:
        """Upsert one collective benchmark row; committed when this returns."""
        self._require_run(row.run_id)
        if not row.finished_at:
            row.finished_at = utc_now()
        self._upsert(COLLECTIVES, [encode(row, COLLECTIVES.types)])

    def record_collective_fault(self, row: CollectiveFaultRow) -> None:
        """Upsert one fault-scenario row; committed when this returns."""
        self._require_run(row.run_id)
        if not row.finished_at:
            row.finished_at = utc_now()
        self._upsert(COLLECTIVE_FAULTS, [encode(row, COLLECTIVE_FAULTS.types)])

    def record_placement(self, row: PlacementRow) -> None:
        """Upsert one placement-scenario row; committed when this returns."""
        self._require_run(row.run_id)
        row.finished_at = row.finished_at or utc_now()
        self._upsert(PLACEMENTS, [encode(row, PLACEMENTS.types)])

    def placements(self, run_id: str | None = None) -> pd.DataFrame:
        """Placement-scenario rows (all runs if ``run_id`` is None), JSON columns decoded."""
        t = PLACEMENTS
        if run_id is not None:
            self._require_run(run_id)
        if not self._has_table(t.name):
            return frame([], t.columns, t.types)
        where, params = ("WHERE run_id=? ", (run_id,)) if run_id is not None else ("", ())
        return frame(self._query(f"SELECT * FROM {t.name} {where}ORDER BY run_id, target, scenario", params),
                     t.columns, t.types, t.name)

    def _has_table(self, name: str) -> bool:
        """Whether the DB has table ``name`` (a read-only DB from before it was added does not)."""
        return bool(self._query("SELECT 1 AS x FROM sqlite_master WHERE type='table' AND name=?", (name,)))

    def _upsert(self, t: Table, rows: list[dict[str, Any]]) -> None:
        """Insert encoded rows, replacing rows with the same key; all-or-nothing, committed on return."""
        if not rows:
            return
        cols = t.columns
        updates = ", ".join(f"{c}=excluded.{c}" for c in cols if c not in t.key)
        sql = (
            f"INSERT INTO {t.name} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))}) "
            f"ON CONFLICT ({', '.join(t.key)}) DO UPDATE SET {updates}"
        )
        params = [[r.get(c) for c in cols] for r in rows]
        if len(params) == 1:
            self._write(sql, params[0])
        else:
            self._write(sql, params, many=True)

    # -- frames ------------------------------------------------------------------------------

    def runs(self) -> pd.DataFrame:
        """All runs, newest first, with decoded settings and result / collective-row counts."""
        rows = self._query(
            "SELECT r.*, (SELECT COUNT(*) FROM results x WHERE x.run_id=r.run_id) AS n_results, "
            "(SELECT COUNT(*) FROM collectives c WHERE c.run_id=r.run_id) AS n_collectives "
            "FROM runs r ORDER BY r.started_at DESC, r.rowid DESC"
        )
        return frame(rows, [*RUN_COLUMNS, "n_results", "n_collectives"], {}, "runs")

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
        return frame(rows, [*RESULTS.columns, "run_started_at"], RESULTS.types, RESULTS.name)

    def _result_columns(self) -> set[str]:
        """The results table's columns (a read-only DB from before a column was added lacks it)."""
        return {r["name"] for r in self._query("SELECT name FROM pragma_table_info('results')")}

    def history(self, model_id: str | None = None) -> pd.DataFrame:
        """Light per-run outcome history (no tracebacks/metrics), oldest run first: cheap across many nights."""
        perf = "x.perf_ratio" if "perf_ratio" in self._result_columns() else "NULL AS perf_ratio"
        cols = f"x.run_id, x.model_id, x.target, x.settings, x.outcome, x.rmse_ratio, x.error_type, x.unsupported_op, {perf}"
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
            "perf_ratio",
        ]
        return frame(rows, [*names, "run_started_at", "list_name"], {}, RESULTS.name)

    def perf(self, run_ids: list[str]) -> pd.DataFrame:
        """The ``perf`` measurements of these runs' rows (run_id, model_id, target, settings, perf): what the
        speed gate compares, without the rest of the rows."""
        cols = ["run_id", "model_id", "target", "settings", "perf"]
        if not run_ids or "perf" not in self._result_columns():
            return frame([], cols, {"perf": dict})
        marks = ", ".join("?" * len(run_ids))
        rows = self._query(f"SELECT {', '.join(cols)} FROM results WHERE run_id IN ({marks}) AND perf IS NOT NULL "
                           "AND perf NOT IN ('', '{}')", tuple(run_ids))
        return frame(rows, cols, {"perf": dict}, RESULTS.name)

    def collectives(self, run_id: str | None = None) -> pd.DataFrame:
        """Collective benchmark rows (all runs if ``run_id`` is None), settings decoded."""
        if run_id is not None:
            self._require_run(run_id)
            rows = self._query(
                "SELECT * FROM collectives WHERE run_id=? ORDER BY op, size_bytes, setting", (run_id,)
            )
        else:
            rows = self._query("SELECT * FROM collectives ORDER BY run_id, op, size_bytes, setting")
        return frame(rows, COLLECTIVES.columns, COLLECTIVES.types, COLLECTIVES.name)

    def collective_faults(self, run_id: str | None = None) -> pd.DataFrame:
        """Fault-scenario rows (all runs if ``run_id`` is None), settings decoded."""
        t = COLLECTIVE_FAULTS
        if run_id is not None:
            self._require_run(run_id)
        if not self._has_table(t.name):
            return frame([], t.columns, t.types)
        order = "ORDER BY backend, world_size, setting, scenario"
        if run_id is not None:
            rows = self._query(f"SELECT * FROM {t.name} WHERE run_id=? {order}", (run_id,))
        else:
            rows = self._query(f"SELECT * FROM {t.name} ORDER BY run_id, backend, world_size, setting, scenario")
        return frame(rows, t.columns, t.types, t.name)

    # -- whole tables, as stored (for merge) -----------------------------------------------------

    def raw_runs(self) -> list[dict[str, Any]]:
        """Every `runs` row as stored (settings as canonical JSON text)."""
        return [{c: r.get(c) for c in RUN_COLUMNS} for r in self._query("SELECT * FROM runs")]

    def raw_rows(self, table: str) -> list[dict[str, Any]]:
        """Every row of a table in `TABLES` as stored; columns (or a table) this DB predates are None (empty)."""
        t = TABLES[table]
        if not self._has_table(t.name):
            return []
        return [{c: r.get(c) for c in t.columns} for r in self._query(f"SELECT * FROM {t.name}")]

    def put_raw_runs(self, runs: list[dict[str, Any]]) -> None:
        """Insert or replace stored-form `runs` rows (merge writes combined shard runs this way)."""
        if runs:
            sql = f"INSERT OR REPLACE INTO runs ({', '.join(RUN_COLUMNS)}) VALUES ({', '.join('?' * len(RUN_COLUMNS))})"
            self._write(sql, [[r.get(c) for c in RUN_COLUMNS] for r in runs], many=True)

    def put_raw_rows(self, table: str, rows: list[dict[str, Any]]) -> None:
        """Upsert stored-form rows into `results` or `collectives` in one transaction."""
        self._upsert(TABLES[table], rows)

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
