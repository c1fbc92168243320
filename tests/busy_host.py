"""Busy neighbours for speed tests and scripts/perf_rates.py: what a shared CI host has beside a nightly.

`busy_neighbours()` starts one process per core (``per_core`` each), of the kinds asked in turn:

- ``cpu``: a pure-Python integer loop: takes a core, touches little memory (the scheduler's kind of load);
- ``mem``: numpy copies between two 128 MiB arrays, far past any cache: takes a core and the memory bus
  (the kind that slows the timed thread's own CPU time, which a busy scheduler does not).

Each neighbour exits by itself after ``lifetime_s`` or when the process that started it is gone, so a
test killed half-way leaves nothing running; the context manager kills them on the way out.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

_PRELUDE = "import os, time\nend = time.monotonic() + {life}\nparent = os.getppid()\n"
_LOOPS = {
    "cpu": "x = 0\nwhile time.monotonic() < end and os.getppid() == parent:\n"
           "    for _ in range(200000):\n        x = (x * 1103515245 + 12345) & 0xFFFFFFFF\n",
    "mem": "import numpy as np\na = np.ones(16 << 20)\nb = np.empty_like(a)\n"
           "while time.monotonic() < end and os.getppid() == parent:\n    np.copyto(b, a)\n    a += 1.0\n",
}
KINDS = tuple(_LOOPS)


def neighbour_count(per_core: int = 1) -> int:
    return (os.cpu_count() or 1) * per_core


@contextmanager
def busy_neighbours(kinds: Sequence[str] = ("cpu", "mem"), *, per_core: int = 1,
                    lifetime_s: float = 900.0) -> Iterator[list[subprocess.Popen]]:
    """One neighbour per core (x ``per_core``), the kinds in turn, for the block; killed after it."""
    for k in kinds:
        if k not in _LOOPS:
            raise ValueError(f"busy neighbour kind {k!r}: expected one of {', '.join(KINDS)}")
    procs: list[subprocess.Popen] = []
    try:
        for i in range(neighbour_count(per_core)):
            code = _PRELUDE.format(life=float(lifetime_s)) + _LOOPS[kinds[i % len(kinds)]]
            procs.append(subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(0.5)  # numpy's import and the arrays' first touch: busy by the time the block starts
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
