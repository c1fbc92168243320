"""Every file portharness writes goes through here: atomically, with one-line errors.

A file is built in a temporary file next to its destination (same directory, so the final rename is
atomic), flushed to disk, then renamed over the destination. Whatever fails on the way (a full disk, a
read-only mount, a directory the user may not write, a parent that is a file) removes the temporary
file, leaves the old file exactly as it was, and raises `OutputError`: one line naming the path and
the cause, which the CLI prints with exit 2. A directory of pages (the report) is built the same way
in a staging directory inside it (`replaced_dir`); a directory that must appear whole or not at all (a
reference-cache entry) is filled beside its destination and renamed into place (`atomic_dir`), and one
is removed by renaming it out of the way first (`remove_dir`). Pre-flight checks (`check_writable`) let a command
refuse an output path before it does any work; `read_text` reads a text file the user named, with the
same one-line errors.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

STAGE_PREFIX = ".portharness-new-"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
OLD_PREFIX = ".portharness-old-"

def safe_name(text: str, limit: int = 80) -> str:
    """A portable file stem for `text` (a model id, an op, a variation id), unique per text whatever its
    alphabet: its ASCII letters, digits and ``._-`` for the eye, plus a hash of the whole text, so 'a/b' and
    'a_b', or two ids in another script that leave nothing readable, never share a file."""
    stem = _UNSAFE.sub("_", text).strip("._-")[:limit] or "id"
    return f"{stem}-{hashlib.sha1(text.encode('utf-8', 'surrogatepass')).hexdigest()[:12]}"


_CAUSES = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "a parent is not a directory",
    errno.ENOENT: "its directory does not exist",
    errno.EISDIR: "it is a directory",
    errno.EFBIG: "file too large",
    errno.ENAMETOOLONG: "name too long",
    errno.EIO: "input/output error",
}


def cause(code: int | None, detail: str = "") -> str:
    """'no space left on the device (ENOSPC)': an errno in words (or `detail`, when it says more than
    the errno's own text), with its name."""
    name = f" ({errno.errorcode[code]})" if code in errno.errorcode else ""
    if detail and code and detail != os.strerror(code):
        return f"{detail}{name}"
    return f"{_CAUSES.get(code or 0) or detail or 'unknown error'}{name}"


class OutputError(Exception):
    """An output that cannot be written (the path and the cause, in one line); nothing was left behind."""

    def __init__(self, path: str | os.PathLike, code: int | None, detail: str = "") -> None:
        self.path = str(path)
        self.errno = code
        super().__init__(f"cannot write {self.path}: {cause(code, detail)}; nothing was written")


def output_error(path: str | os.PathLike, exc: OSError) -> OutputError:
    """`exc` (an OSError while writing `path`) as an OutputError naming `path`."""
    return OutputError(path, exc.errno, exc.strerror or str(exc))


def read_text(path: str | os.PathLike, what: str) -> str:
    """The text of a file the user named (`what`: its option, e.g. ``--perf-allowlist``; a byte-order mark
    is dropped); in one line naming the option, the file and why: FileNotFoundError when there is none,
    else ValueError."""
    p = Path(path)
    try:
        if p.is_dir():
            raise IsADirectoryError
        if not stat.S_ISREG(p.stat().st_mode):  # a FIFO or a device would block or never end
            raise ValueError(f"{what} {p}: not a regular file")
        data = p.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {p}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{what} {p}: a directory, not a file") from None
    except OSError as e:
        raise ValueError(f"{what} {p}: cannot be read: {cause(e.errno, e.strerror or '')}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {p}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}: {e.reason}); "
                         "save it as UTF-8") from None


def _read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def denied_cause(path: Path) -> str:
    """Why `path` (which exists) may not be written: a read-only file system, or permissions."""
    return cause(errno.EROFS if _read_only_fs(path) else errno.EACCES)


def check_writable(path: str | os.PathLike, *, create_parents: bool = False, directory: bool = False) -> None:
    """OutputError unless `path` can be written: its nearest existing ancestor is a directory we may
    write into (with ``create_parents``; else its parent must exist), and `path` itself is not a
    directory (or, with ``directory``, not a file). Writes nothing."""
    p = Path(os.path.abspath(path))
    if p.exists():
        if directory and not p.is_dir():
            raise OutputError(p, errno.ENOTDIR, "exists and is not a directory")
        if not directory and p.is_dir():
            raise OutputError(p, errno.EISDIR)
    parent = p if directory and p.is_dir() else p.parent
    while not parent.exists():
        if not create_parents and parent == p.parent:
            raise OutputError(p, errno.ENOENT, f"directory {parent} does not exist")
        if parent.is_symlink():  # a dangling link in the way
            raise OutputError(p, errno.ENOENT, f"{parent} is a dangling link")
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(p, errno.ENOTDIR, f"{parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(p, errno.EROFS if _read_only_fs(parent) else errno.EACCES)


def probe_writable(path: str | os.PathLike) -> None:
    """OutputError unless a file can really be made in `path` (a directory) or, where it does not exist yet,
    in its nearest existing ancestor: access() says yes to root on file systems that refuse every write
    (procfs, sysfs). The probe file is removed at once; nothing else is made."""
    p = Path(os.path.abspath(path))
    where = p
    while not where.exists():
        where = where.parent
    try:
        fd, name = tempfile.mkstemp(dir=where, prefix=STAGE_PREFIX + "probe-")
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise OutputError(p, e.errno, f"{where} refuses new files ({e.strerror or e})") from None


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mode_for(dest: Path) -> int:
    """The mode the new file gets: the old file's, else what the umask allows (mkstemp makes 0600)."""
    try:
        return stat.S_IMODE(dest.stat().st_mode)
    except OSError:
        return 0o666 & ~_umask()


def _link(tmp: Path, dest: Path) -> None:
    """`tmp` becomes `dest` unless `dest` exists (FileExistsError): a hard link is atomic and never
    clobbers what another process created meanwhile; where the file system has none, a rename after a
    look (a narrow race, on such file systems only)."""
    try:
        os.link(tmp, dest)
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS):
            raise
        if dest.exists():
            raise FileExistsError(errno.EEXIST, "exists", str(dest)) from None
        os.rename(tmp, dest)


def _remove(*paths: Path) -> None:
    for p in paths:
        with contextlib.suppress(OSError):
            p.unlink()


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, exclusive: bool = False) -> Iterator[Path]:
    """A temporary path next to `path` for the caller to write; when the block ends it is flushed and
    renamed onto `path` (with ``exclusive``: linked, so an existing `path` is never replaced:
    FileExistsError). On any error the temporary file (and an SQLite journal of it) is removed and an
    OSError becomes OutputError naming `path`."""
    dest = Path(path)
    try:
        fd, name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
        os.close(fd)
    except OSError as e:
        raise output_error(dest, e) from None
    tmp = Path(name)
    leftovers = [tmp, *(tmp.with_name(tmp.name + s) for s in ("-journal", "-wal", "-shm"))]
    try:
        yield tmp
        os.chmod(tmp, _mode_for(dest))
        _fsync(tmp)
        if exclusive:
            _link(tmp, dest)
        else:
            os.replace(tmp, dest)
        _fsync_dir(dest.parent)
    except FileExistsError:
        raise
    except OSError as e:
        raise output_error(dest, e) from None
    finally:
        _remove(*leftovers)


def write_text(path: str | os.PathLike, text: str, *, encoding: str = "utf-8") -> Path:
    """Write `text` to `path` atomically (OutputError on failure, the old file untouched)."""
    return write_bytes(path, text.encode(encoding))


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` atomically (OutputError on failure, the old file untouched)."""
    dest = Path(path)
    with atomic_path(dest) as tmp:
        tmp.write_bytes(data)
    return dest


def _swap_in(stage: Path, out: Path, stale: Iterable[str]) -> None:
    """Move the staged entries into `out`: files by rename, directories swapped whole; then drop the
    `stale` names the new contents lack."""
    old = Path(tempfile.mkdtemp(prefix=f"{OLD_PREFIX}{os.getpid()}-", dir=out))
    new = {e.name for e in stage.iterdir()}
    for entry in stage.iterdir():
        dest = out / entry.name
        if entry.is_dir() and not entry.is_symlink():
            if dest.is_dir() and not dest.is_symlink():
                os.rename(dest, old / entry.name)
            elif dest.exists() or dest.is_symlink():
                dest.unlink()
            os.rename(entry, dest)
        else:
            if dest.is_dir() and not dest.is_symlink():
                os.rename(dest, old / entry.name)
            os.replace(entry, dest)
    for name in set(stale) - new:
        gone = out / name
        if gone.exists() or gone.is_symlink():
            os.rename(gone, old / name)
    shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(out)


def _alive(name: str) -> bool:
    """Whether the process named in a staging directory's name (``<prefix><pid>-...``) still runs."""
    pid = name.removeprefix(STAGE_PREFIX).removeprefix(OLD_PREFIX).partition("-")[0]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def replaced_dir(out: str | os.PathLike, *, stale: Iterable[str] = ()) -> Iterator[Path]:
    """A staging directory inside `out` (created if missing) for the caller to fill with `out`'s new
    contents; when the block ends they replace the old ones (entries named in `stale` that the new
    contents lack are removed). On any error the staging directory goes, `out` keeps its old contents
    (or is removed again if this call created it), and an OSError becomes OutputError naming `out`."""
    out = Path(out)
    created = not out.exists()
    stage: Path | None = None
    ok = False
    try:
        out.mkdir(parents=True, exist_ok=True)
        for left in [*out.glob(STAGE_PREFIX + "*"), *out.glob(OLD_PREFIX + "*")]:
            if not _alive(left.name):  # from a killed build, not one running now
                shutil.rmtree(left, ignore_errors=True)
        stage = Path(tempfile.mkdtemp(prefix=f"{STAGE_PREFIX}{os.getpid()}-", dir=out))
        os.chmod(stage, 0o777 & ~_umask())
        yield stage
        _swap_in(stage, out, stale)
        ok = True
    except OSError as e:
        raise output_error(out, e) from None
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
        if created and not ok:
            shutil.rmtree(out, ignore_errors=True)


TMP_SUFFIX = ".tmp"


def _writer() -> str:
    """'<pid>-<host digest>': who is writing, in a file name (host names may hold dots and dashes)."""
    return f"{os.getpid()}-{hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]}"


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """A new directory beside `path` for the caller to fill; when the block ends its files are flushed and
    it is renamed onto `path` in one step, so a reader sees all of it or nothing, and a process killed
    meanwhile leaves only a ``.<name>.<pid>-<host>-*.tmp`` directory that no reader looks at
    (`stale_partial` tells when its writer is gone). An existing `path` is never replaced:
    FileExistsError (another writer finished first; this one's copy is dropped). On any error the new
    directory is removed and an OSError becomes OutputError naming `path`."""
    dest = Path(path)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{dest.name}.{_writer()}-", suffix=TMP_SUFFIX, dir=dest.parent))
        os.chmod(stage, 0o777 & ~_umask())  # mkdtemp makes 0700: others sharing the directory read it too
    except OSError as e:
        raise output_error(dest, e) from None
    try:
        yield stage
        for f in stage.iterdir():
            if f.is_file():
                os.chmod(f, 0o666 & ~_umask())  # what the umask allows, as for every file written here
                _fsync(f)
        _fsync_dir(stage)
        if dest.exists():
            raise FileExistsError(errno.EEXIST, "exists", str(dest))
        try:
            os.rename(stage, dest)  # onto a non-empty directory it fails: the first writer's copy stays
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise FileExistsError(errno.EEXIST, "exists", str(dest)) from None
            raise
        _fsync_dir(dest.parent)
    except FileExistsError:
        raise
    except OSError as e:
        raise output_error(dest, e) from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)  # gone already once renamed


def stale_partial(path: Path, older_than_s: float) -> bool:
    """Whether `path`, a directory `atomic_dir` or `remove_dir` left, belongs to a writer that is gone: one
    on this host whose process has ended, or any untouched for `older_than_s` (another host's processes
    cannot be asked)."""
    pid, _, rest = path.name.removesuffix(TMP_SUFFIX).rpartition(".")[2].partition("-")
    host = rest.partition("-")[0]
    if host == _writer().partition("-")[2] and pid.isdigit() and int(pid) != os.getpid():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
    try:
        newest = max([path.stat().st_mtime, *(f.stat().st_mtime for f in path.iterdir())])
    except OSError:
        return True  # removed meanwhile
    return time.time() - newest > older_than_s


def remove_dir(path: str | os.PathLike) -> bool:
    """Remove the directory `path` in one step as readers see it: renamed to a ``.tmp`` name beside it,
    then deleted. False if it was gone already (another process removed it)."""
    p = Path(path)
    gone = p.with_name(f".{p.name}.{_writer()}-{secrets.token_hex(4)}{TMP_SUFFIX}")
    try:
        os.rename(p, gone)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise output_error(p, e) from None
    shutil.rmtree(gone, ignore_errors=True)
    return True


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask
