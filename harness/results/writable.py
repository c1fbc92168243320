"""Whether rows can be added at a DB path, before anything is written; making a new DB whole, and removing
one (with its WAL files)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path

from harness import files
from harness.results import schema
from harness.results.dbfile import StoreError, check_integrity, connect_read_only, inspect, sqlite_errno


def may_write(path: Path) -> bool:
    """Rows can be added: the file and its directory (for the -wal and -shm files) are writable."""
    return os.access(path, os.W_OK) and os.access(path.parent.resolve(), os.W_OK | os.X_OK)


def remove_db(path: Path) -> None:
    for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        with contextlib.suppress(OSError):
            p.unlink()


def create_db(path: Path) -> bool:
    """Create the DB with its schema in a temporary file next to `path`, then link it into place: a full
    disk never leaves a 0-byte or half-made DB. False when another process created it first."""
    try:
        with files.atomic_path(path, exclusive=True) as tmp:
            con = sqlite3.connect(str(tmp), isolation_level=None)
            try:
                schema.create(con, path)
            finally:
                con.close()
    except FileExistsError:
        return False
    except sqlite3.DatabaseError as exc:
        code = sqlite_errno(exc)
        raise files.OutputError(path, code, "" if code else str(exc)) from None
    return True


def check_writable(path: str | os.PathLike, *, create_parents: bool = True) -> None:
    """Before a command prints or writes anything: rows can be added at `path` (StoreError or
    OutputError otherwise, the file untouched): a new file that can be created, or an existing regular
    file that is ours, undamaged, with a schema we can bring up to date, on writable storage."""
    p = Path(path)
    state = inspect(p)
    if state == "missing":
        files.check_writable(p, create_parents=create_parents)
        return
    if state == "ours":
        check_integrity(p)
        con = connect_read_only(p)
        try:
            bad = schema.unrepairable(con)
        finally:
            con.close()
        if bad:
            raise StoreError(f"{p} lacks {', '.join(bad)}, which cannot be added (not a portharness schema "
                             "we can update); it was left untouched. Pass another --db path.")
    if not may_write(p):
        raise StoreError(f"{p} is read-only ({files.denied_cause(p)}); it was left untouched. Copy it somewhere "
                         "writable or pass another --db path.")
