"""Backend modules (``--backend``, ``PORTHARNESS_BACKENDS``) imported without letting them take the CLI down.

A backend module is someone else's code run at import time in the CLI process. One that calls
``sys.exit`` or ``os._exit``, crashes (a segfault in its extension), hangs, or prints to stdout would end
the command with a wrong exit code and no message, hang it for ever, or break ``--json``. So the modules
are first imported in a short-lived child process with a deadline; only after a clean import there are
they imported here, with their stdout sent to stderr. Without backend modules nothing of this runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

DEFAULT_TIMEOUT_S = 120.0
TORCH_S = 300.0  # torch's own import (and its entry-point backends) on a slow, busy host

# The child: imports each module in order, reporting on its own pipe (fd argv[1]) what happened, and how
# many bytes each one printed to stdout (a file, so the count is its size).
_PROBE = r"""
import importlib, json, os, sys
report = os.fdopen(int(sys.argv[1]), "w")
sys.path[:] = json.loads(sys.argv[2])  # the CLI's own import path (-I left out the current directory)
def say(**kw):
    report.write(json.dumps(kw) + "\n")
    report.flush()
for name in ["torch", *sys.argv[3:]]:  # torch first, as in the CLI: its entry-point backends load with it
    say(start=name)
    before = os.fstat(1).st_size
    try:
        importlib.import_module(name)
    except SystemExit as e:
        say(exit=name, code=repr(e.code))
        os._exit(0)
    except BaseException as e:
        say(error=name, type=type(e).__name__, message=" ".join(str(e).split())[:300])
        os._exit(0)
    sys.stdout.flush()
    say(done=name, printed=os.fstat(1).st_size - before)
say(ok=True)
os._exit(0)
"""


class BackendImportError(ValueError):
    """A backend module cannot be imported safely: the module and what it did, in one line (exit 2)."""


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _events(proc: subprocess.Popen, read: int, timeout_s: float) -> tuple[list[dict], bool]:
    """The probe's reports as they come, and whether it ran past its deadline: torch's own import gets
    TORCH_S, the backend modules `timeout_s` from the moment torch is in."""
    events: list[dict] = []
    buf = b""
    deadline = time.monotonic() + max(timeout_s, TORCH_S)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return events, True
        ready, _, _ = select.select([read], [], [], min(left, 0.2))
        chunk = os.read(read, 65536) if ready else b""
        if ready and not chunk or not ready and proc.poll() is not None:
            return events, False  # EOF, or the child is gone (a fork of it may hold the pipe)
        *lines, buf = (buf + chunk).split(b"\n")
        for line in lines:
            events.append(json.loads(line))
            if events[-1].get("done") == "torch":
                deadline = time.monotonic() + timeout_s


def probe(modules: list[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> list[str]:
    """Import `modules` in a child process first: BackendImportError naming the module that exited,
    crashed, raised or hung there; else the modules that printed to stdout while being imported."""
    read, write = os.pipe()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-c", _PROBE, str(write), json.dumps(sys.path), *modules],
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, pass_fds=(write,),
                                    start_new_session=True)
        finally:
            os.close(write)
        try:
            events, late = _events(proc, read, timeout_s)
        finally:  # a hang, Ctrl-C meanwhile, or processes the import started: the probe's session goes
            os.close(read)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
    current = next((e["start"] for e in reversed(events) if "start" in e), "torch")
    flag = f"--backend {current}" if current != "torch" else "torch (with the backends its entry points load)"
    for e in events:
        if "exit" in e:
            raise BackendImportError(f"{flag}: importing it called sys.exit({e['code']}); nothing was run. A backend "
                                     "module must register the device and return")
        if "error" in e and e["type"] == "ModuleNotFoundError":
            raise BackendImportError(f"{flag}: cannot import it ({e['type']}: {e['message']}); install the "
                                     "backend's package or put it on PYTHONPATH")
        if "error" in e:
            raise BackendImportError(f"{flag}: importing it raised {e['type']}: {e['message']}; nothing was run")
    if late:
        budget = timeout_s if current != "torch" else max(timeout_s, TORCH_S)
        raise BackendImportError(f"{flag}: importing it did not finish within {budget:g}s (hung?); nothing was "
                                 "run. Raise --backend-timeout if it is only slow")
    if not any("ok" in e for e in events):
        what = f"killed the process ({_signal_name(-rc)})" if rc < 0 else f"ended the process (exit code {rc}, e.g. os._exit)"
        raise BackendImportError(f"{flag}: importing it {what}; nothing was run")
    return [e["done"] for e in events if e.get("printed") and e["done"] != "torch"]


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Everything written to stdout inside the block (Python's and C's) goes to stderr instead."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        with contextlib.suppress(Exception):
            ctypes.CDLL(None).fflush(None)  # C stdio buffers still aimed at fd 1
        os.dup2(saved, 1)
        os.close(saved)


def load_backends_guarded(given: list[str], timeout_s: float | None = None) -> list[str]:
    """The backend modules to use (``PORTHARNESS_BACKENDS``, then `given`), probed and then imported here;
    BackendImportError (exit 2) naming the module and what it did otherwise."""
    from harness.backends import backend_modules, load_backends

    modules = backend_modules(given)
    timeout = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    if not timeout > 0:
        raise ValueError(f"--backend-timeout {timeout:g}: must be > 0 seconds")
    if not modules:
        if timeout_s is not None:  # as the options that act only beside another (cli/runs.py)
            raise ValueError(f"--backend-timeout {timeout_s:g}: only with --backend MODULE or PORTHARNESS_BACKENDS "
                             "(it is the deadline for importing them)")
        return modules
    for name in probe(modules, timeout):
        print(f"portharness: --backend {name} printed to stdout while being imported; its output goes to stderr",
              file=sys.stderr)
    try:
        with stdout_to_stderr():
            load_backends(modules)
    except SystemExit as e:  # it behaved in the probe but not here
        raise BackendImportError(f"--backend: importing {', '.join(modules)} called sys.exit({e.code!r}); "
                                 "nothing was run") from None
    return modules
