"""Model pages written by forked processes: a night has thousands, and they are independent."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

PAGES_PER_WORKER = 1000  # below this a forked worker costs more than it saves
_ERRNO_EXIT = 100  # a page worker's exit status 100 + errno: it could not write


def page_workers(n_pages: int) -> int:
    """Processes for the model pages: one per PAGES_PER_WORKER pages, at most the CPUs this process may
    use (and 4); 1 where there is no fork."""
    if not hasattr(os, "fork") or n_pages < 2 * PAGES_PER_WORKER:
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cpus, n_pages // PAGES_PER_WORKER))


def in_parallel(
    items: list[Any], work: Callable[[list[Any]], None], procs: int, also: Callable[[], None] | None = None
) -> None:
    """``work`` over ``procs`` slices of ``items``, all but one in forked children, and ``also()`` in this
    process meanwhile, before its own slice, which is half a child's (the site's other pages cost
    about a third of the model pages).

    Model pages are independent and everything they need is already in memory, so forking shares it
    copy-on-write: nothing is pickled. A child that fails prints its traceback and fails the build; one
    that cannot write (a full disk) passes the errno up in its exit status instead, so the build fails
    with the one-line OutputError of any other write."""
    if procs <= 1:
        if also is not None:
            also()
        work(items)
        return
    own = len(items) // (2 * procs - 1)
    rest = items[own:]
    pids = []
    for k in range(procs - 1):
        pid = os.fork()
        if pid == 0:  # the child: never return into the caller's stack
            code = 0
            try:
                work(rest[k::procs - 1])
            except OSError as e:
                code = _ERRNO_EXIT + e.errno if e.errno and 0 < e.errno < 256 - _ERRNO_EXIT else 1
                if code == 1:
                    traceback.print_exc()
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        pids.append(pid)
    try:
        if also is not None:
            also()
        work(items[:own])
    finally:
        statuses = [os.waitpid(pid, 0)[1] for pid in pids]
    codes = [os.waitstatus_to_exitcode(st) for st in statuses]
    for code in codes:
        if code > _ERRNO_EXIT:
            raise OSError(code - _ERRNO_EXIT, os.strerror(code - _ERRNO_EXIT))
    if any(codes):
        raise RuntimeError("a model-page worker process failed (its traceback is above)")
