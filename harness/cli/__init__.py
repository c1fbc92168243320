"""`portharness` command line. Options live in `options.py` (each once); each command calls a stage's API.

One exit-code policy for all commands: 0 = success (for `check`: the model passed, within fp32 or the
declared precision), 1 = the check, diff or run found a problem (or a run's DB stopped taking rows after
some were saved: --resume), 2 = bad input or an output that cannot be written (one line on stderr, nothing
written, no old file touched), 130 = Ctrl-C, 143 = SIGTERM, 141 = the reader of stdout went away (`| head`).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from typing import Any

from harness.cli.collectives import collectives_config
from harness.cli.options import build_parser

__all__ = ["build_parser", "collectives_config", "main"]


def _is_input_error(e: Exception) -> bool:
    """Bad input the user can fix (list, id, DB, settings, file, hub, an output that cannot be written): a
    message, not a traceback.

    Classes are looked up only once something failed: `report` or `diff` shouldn't pay for importing
    torch (via harness.models.load) at start-up."""
    from harness.files import OutputError
    from harness.models.model_list import ModelListError, UnknownModelError
    from harness.results.dbfile import StoreError

    if isinstance(e, ModelListError | UnknownModelError | StoreError | OutputError | ValueError | FileNotFoundError):
        return True
    load = sys.modules.get("harness.models.load")
    return load is not None and isinstance(e, load.LoadError)


def _stdout_gone() -> bool:
    """Whether stdout is a pipe nobody reads any more (poll reports an error on its write end)."""
    import select

    try:
        p = select.poll()
        p.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in p.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C: every `finally` runs (workers are stopped), then exit 143."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


def _error(command: str, e: Exception) -> None:
    """The one line an error is: whatever of the user's or a DB's it quotes cannot act on the terminal."""
    from harness.console import terminal_text

    print(terminal_text(f"portharness {command}: error: {e}", one_line=True), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    if hasattr(signal, "SIGUSR1") and threading_main():
        # `kill -USR1 <pid>` prints every thread's stack to stderr and the run goes on: what a stuck run
        # is doing, without a debugger (not where stderr is no file, e.g. captured in-process)
        try:
            faulthandler.register(signal.SIGUSR1, file=sys.stderr.fileno(), all_threads=True)
        except (AttributeError, OSError, ValueError, RuntimeError):
            pass
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        if not _stdout_gone():  # another pipe (a worker's): a real error
            raise
        # the reader went away (`portharness matrix | head`): no traceback, nor one at the last flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # what a shell reports for a process ended by SIGPIPE
    except KeyboardInterrupt as e:
        name = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
        print(f"portharness: {name}; finished rows are saved (use --resume)", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    except Exception as e:
        pool = sys.modules.get("harness.fleet.pool")
        if pool is not None and isinstance(e, pool.ExecutorError):  # workers cannot start, a cluster went away
            _error(args.command, e)
            return 1
        if not _is_input_error(e):
            raise
        _error(args.command, e)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)

