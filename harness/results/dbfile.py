"""Is this file a portharness DB we may use? Decided without writing a byte to it.

A result DB is the one artifact a nightly run leaves behind, so anything that is not clearly ours
(random bytes, another application's SQLite file, a DB written by a newer schema) is refused with a
`StoreError` that names the file and what to do, and is left exactly as it was.
"""

from __future__ import annotations

import errno as errnos
import shutil
import sqlite3
import stat
import tempfile
import weakref
from pathlib import Path

from harness import files

APP_NAME = "portharness"
SCHEMA_VERSION = 1  # bumped only for incompatible changes; new columns are added in place
SQLITE_HEADER = b"SQLite format 3\x00"
BUSY_TIMEOUT_MS = 60_000


class StoreError(RuntimeError):
    """The DB file cannot be used as a portharness store (corrupt, foreign, newer schema, missing)."""


class StoreWriteError(StoreError):
    """A write to an open DB failed (full disk, storage gone read-only): what was committed before stays."""


_SQLITE_ERRNO = {13: errnos.ENOSPC, 8: errnos.EROFS, 14: errnos.EACCES, 10: errnos.EIO}  # FULL, READONLY, CANTOPEN, IOERR


def sqlite_errno(exc: sqlite3.Error) -> int | None:
    """The errno an SQLite error stands for, if any (SQLite reports a full disk as SQLITE_FULL)."""
    code = getattr(exc, "sqlite_errorcode", None)  # Python >= 3.11
    if code is not None:
        return _SQLITE_ERRNO.get(code & 0xFF)
    text = str(exc)
    for needle, value in (("disk is full", errnos.ENOSPC), ("readonly", errnos.EROFS), ("unable to open", errnos.EACCES),
                          ("disk I/O error", errnos.EIO)):
        if needle in text:
            return value
    return None


def write_cause(exc: sqlite3.Error) -> str:
    """An SQLite write error in the words `harness.files` uses for any output ('no space left ... (ENOSPC)')."""
    code = sqlite_errno(exc)
    return files.cause(code, "" if code else str(exc))


class _Connection(sqlite3.Connection):
    """A connection that can own a private copy of a read-only DB (weak references need a subclass)."""


def _connect(path: Path, query: str) -> sqlite3.Connection:
    return sqlite3.connect(
        f"{path.resolve().as_uri()}?{query}", uri=True, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
        check_same_thread=False, factory=_Connection,
    )


def connect_read_only(path: Path) -> sqlite3.Connection:
    """A read-only connection that writes nothing to `path`.

    ``mode=ro`` still needs to create the WAL's shared-memory file next to a WAL database whose -wal
    file holds committed rows, which read-only media (an artifact mount, a CD) refuse. There the file is
    read from a private copy of the DB and its -wal (``immutable`` would ignore the -wal's rows); a DB
    without a -wal is simply opened ``immutable``: nobody can be writing it if nobody may."""
    con = _connect(path, "mode=ro")
    try:
        con.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return con
    except sqlite3.OperationalError as exc:
        con.close()
        if "unable to open" not in str(exc) and "readonly" not in str(exc) and "read-only" not in str(exc):
            raise
    wal = path.with_name(path.name + "-wal")
    if not wal.exists():
        return _connect(path, "mode=ro&immutable=1")
    tmp = Path(tempfile.mkdtemp(prefix="portharness-ro-"))
    shutil.copyfile(path, tmp / path.name)
    shutil.copyfile(wal, tmp / wal.name)
    con = _connect(tmp / path.name, "mode=ro")
    weakref.finalize(con, shutil.rmtree, tmp, True)
    return con


def check_integrity(path: Path) -> None:
    """SQLite's own quick_check over every page, read-only: StoreError if any page is damaged."""
    con = connect_read_only(path)
    try:
        problems = [r[0] for r in con.execute("PRAGMA quick_check(5)").fetchall()]
    except sqlite3.DatabaseError as exc:
        problems = [str(exc)]
    finally:
        con.close()
    if problems != ["ok"]:  # one line: the CLI's error is one line
        raise StoreError(
            f"{path} fails SQLite's integrity check ({' '.join('; '.join(problems).split())[:300]}); it was left "
            "untouched. "
            "Restore it from a backup/artifact or pass another --db path."
        )


def inspect(path: Path) -> str:
    """Classify `path`: 'missing', 'empty' or 'ours'; anything else raises StoreError."""
    if not path.exists():
        return "missing"
    if path.is_dir():
        raise StoreError(f"{path} is a directory, not a portharness DB file; pass a file path with --db.")
    if not stat.S_ISREG(path.stat().st_mode):  # /dev/null, /dev/full, a FIFO: SQLite would put a journal next to it
        raise StoreError(f"{path} is not a regular file (a device, pipe or socket), so it cannot hold a DB; "
                         "pass a file path with --db.")
    if path.stat().st_size == 0:
        return "empty"
    with open(path, "rb") as fh:
        header = fh.read(len(SQLITE_HEADER))
    if header != SQLITE_HEADER:
        raise StoreError(
            f"{path} is not an SQLite database (bad header; the file is corrupt or not a DB). "
            "It was left untouched; move it aside or pass another --db path."
        )
    try:
        con = connect_read_only(path)
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


def usable(path: Path) -> None:
    """An existing file we may add rows to: ours (`inspect`) and with no damaged page (`check_integrity`)."""
    if inspect(path) == "ours":
        check_integrity(path)
