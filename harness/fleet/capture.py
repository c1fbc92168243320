"""What a worker prints while it runs a model belongs to that model's row, not to the terminal.

Libraries print from Python (PyTorch's UserWarnings) and from native code (the profiler's `USDT: ...`
lines during `--perf`), so the worker points its file descriptors 1 and 2 at one file per worker for the
length of each job (`JobOutput`) and the job's text goes into the row (`Measurement.worker_output`, its
tail). A fatal signal's report (`faulthandler`, enabled in the worker on fd 2) lands in the same file;
when the worker dies under a model, the supervisor reads it back (`read_log`) for the crash row. Output
outside a job (the worker starting up, loading its backend) stays on the terminal, where a worker that
cannot start has to say why.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

KEEP_CHARS = 8000  # the tail kept in a row: the last warnings and the fatal report are at the end


def log_path(pid: int) -> Path:
    """Worker `pid`'s output file (the supervisor reads it when the worker dies under a model)."""
    return Path(tempfile.gettempdir()) / f"portharness-worker-{pid}.log"


def read_log(pid: int | None, keep: int = KEEP_CHARS) -> str:
    """The tail of worker `pid`'s output file ("" when there is none)."""
    if pid is None:
        return ""
    try:
        fd = os.open(log_path(pid), os.O_RDONLY)
    except OSError:
        return ""
    try:
        return _read_tail(fd, keep)
    finally:
        os.close(fd)


FATAL = "Fatal Python error"  # how faulthandler's report of a fatal signal starts


def fatal_report(pid: int | None, keep: int = 4000) -> str:
    """The fatal-signal report worker `pid` left in its output file, from its head (the signal, then the
    crashing thread's stack: the tail of a long report is other threads), "" when there is none."""
    if pid is None:
        return ""
    try:
        with open(log_path(pid), "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - (1 << 18)))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    at = text.rfind(FATAL)
    return text[at:at + keep] if at >= 0 else ""


def remove_log(pid: int | None) -> None:
    if pid is not None:
        with contextlib.suppress(OSError):
            log_path(pid).unlink()


def _read_tail(fd: int, keep: int) -> str:
    """The last `keep` characters of the file at `fd` (at most 4 bytes each: a model may print megabytes),
    starting at a line where one starts near the cut, with how much was left out."""
    size = os.fstat(fd).st_size
    start = max(0, size - 4 * keep)
    text = os.pread(fd, size - start, start).decode("utf-8", "replace")
    if start == 0 and len(text) <= keep:
        return text
    cut = text[-keep:]
    newline = cut.find("\n", 0, 200)
    cut = cut[newline + 1:] if newline >= 0 else cut
    return f"[... {size - len(cut.encode('utf-8', 'replace'))} bytes before]\n" + cut


class JobOutput:
    """This process's stdout and stderr (the file descriptors, so native code's output too) into its log
    file while a job runs; `text` is what the job printed. Created once per worker process."""

    def __init__(self) -> None:
        self.fd = os.open(log_path(os.getpid()), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        # Python's own streams too: sys.stdout / sys.stderr need not write to fds 1 and 2 (a test runner's
        # capture, a library that replaced them)
        self.stream = open(self.fd, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
        self._saved: tuple[int, int] | None = None
        self._streams: tuple[Any, Any] = (None, None)

    def __enter__(self) -> JobOutput:
        _flush()
        os.ftruncate(self.fd, 0)
        os.lseek(self.fd, 0, os.SEEK_SET)
        self._saved = (os.dup(1), os.dup(2))
        os.dup2(self.fd, 1)
        os.dup2(self.fd, 2)
        self._streams = (sys.stdout, sys.stderr)
        sys.stdout = sys.stderr = self.stream
        return self

    def __exit__(self, *exc: Any) -> None:
        _flush()
        sys.stdout, sys.stderr = self._streams
        assert self._saved is not None
        for fd, saved in zip((1, 2), self._saved, strict=True):
            os.dup2(saved, fd)
            os.close(saved)
        self._saved = None

    def text(self, keep: int = KEEP_CHARS) -> str:
        return _read_tail(self.fd, keep)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
