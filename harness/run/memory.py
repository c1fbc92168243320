"""Process memory: resident size, a peak sampler, and a cap on what a worker may add."""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from harness.phases import Phase

_PAGE = os.sysconf("SC_PAGE_SIZE")
_capped = False  # whether this process capped its own address space
# What a library load (dlopen) says when the address space has no room for it.
_MAP_FAILED = ("failed to map segment from shared object", "cannot allocate memory", "cannot map zero-fill pages")


def _statm(pid: int | str = "self") -> tuple[int, int]:
    """(virtual size, resident size) in bytes from /proc; (0, 0) if the process is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            vsz, rss = f.read().split()[:2]
        return int(vsz) * _PAGE, int(rss) * _PAGE
    except (OSError, ValueError):
        return 0, 0


def rss_mb(pid: int | str = "self") -> float:
    """Resident set size of `pid` in MiB (0 if it is gone)."""
    return _statm(pid)[1] / 2**20


def cap_address_space(extra_mb: int | None) -> None:
    """Let this process grow its address space by at most `extra_mb` beyond what it has now.

    A runaway allocation then fails inside the process with MemoryError ("can't allocate memory")
    instead of dragging the host into the OOM killer."""
    global _capped
    if not extra_mb:
        return
    limit = _statm()[0] + extra_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    _capped = True


def capped() -> bool:
    """Whether `cap_address_space` capped this process."""
    return _capped


def import_failure(exc: BaseException) -> bool:
    """Whether `exc` (or what it was raised from) is the worker's own machinery finding no room: a shared
    library that could not be mapped, memory exhausted while a module was being imported, a thread that
    could not start (under a cap, that is the cap's fault, not the model's)."""
    from harness.backends.errors import chain

    for e in chain(exc):
        if isinstance(e, ImportError) and any(m in str(e) for m in _MAP_FAILED):
            return True
        if isinstance(e, OSError) and _MAP_FAILED[0] in str(e):
            return True
        if isinstance(e, MemoryError) and _in_module_body(e):
            return True
        if isinstance(e, RuntimeError) and "can't start new thread" in str(e):
            return True  # a thread's stack is address space too
    return False


def _in_module_body(exc: BaseException) -> bool:
    """Raised while a module's top level ran, i.e. while it was being imported (importlib drops its own
    frames from the traceback, so look for the module body's)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "<module>":
            return True
        tb = tb.tb_next
    return False


class PeakRss:
    """Samples this process's resident set size while a block runs (ru_maxrss never goes down)."""

    def __init__(self, interval_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self.peak_mb = 0.0
        self._stop = threading.Event()

    def _now(self) -> float:
        mb = rss_mb()
        return mb if mb else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_mb = max(self.peak_mb, self._now())

    def __enter__(self) -> PeakRss:
        self.peak_mb = self._now()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self.peak_mb, self._now())


class PhaseClock:
    """Wall time and peak resident memory per pipeline phase (load, reference, oracle, ...).

    One sampler for the whole model; each phase reads the peak since it began, so a phase that holds a
    second copy of the weights shows it."""

    def __init__(self, on_phase: Callable[..., None] | None = None) -> None:
        self.rss = PeakRss()
        self.phases: dict[str, dict[str, float]] = {}
        self._on_phase = on_phase  # on_phase(name), or on_phase(name, found) with what the job established
        self._stack: list[str] = []
        self._found: dict[str, Any] | None = None  # not yet sent to the supervisor

    def __enter__(self) -> PhaseClock:
        self.rss.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.rss.__exit__(*exc)

    @property
    def current(self) -> str:
        """The phase running now ("" before the first)."""
        return self._stack[-1] if self._stack else ""

    def announce(self, name: str) -> None:
        """Tell the supervisor the job is in `name` now, without timing it (the compiler running inside a
        phase: its deadline is another); with it, once, what the job has established (`establish`)."""
        if self._on_phase is None:
            return
        if self._found is not None:
            found, self._found = self._found, None
            self._on_phase(name, found)
        else:
            self._on_phase(name)

    def establish(self, fields: Mapping[str, Any]) -> None:
        """What the job has established so far (the first run's verdict, before a follow-up runs the target
        again): the supervisor hears it with the next phase, and a worker that dies in a later phase keeps
        it in its row (`harness.verdict.after_death`)."""
        self._found = {**fields, "phases": dict(self.phases)}

    @contextlib.contextmanager
    def phase(self, phase: Phase) -> Iterator[None]:
        """Time `phase` (one of `harness.phases`': a phase no table knows cannot be timed, nor told apart)."""
        name = phase.name
        self.announce(name)
        self._stack.append(name)
        start, t0 = self.rss.peak_mb, time.perf_counter()
        self.rss.peak_mb = self.rss._now()  # the phase's own peak, not the model's so far
        try:
            yield
        finally:
            self._stack.pop()
            peak = max(self.rss.peak_mb, self.rss._now())
            self.phases[name] = {"s": round(time.perf_counter() - t0, 4), "peak_rss_mb": round(peak, 1)}
            self.rss.peak_mb = max(start, peak)

    def cached(self, name: str) -> None:
        """Record phase `name` as taken from the reference cache: it ran for no time at all."""
        self.phases[name] = {"s": 0.0, "peak_rss_mb": round(self.rss._now(), 1), "cached": True}

    def seconds(self, name: str) -> float | None:
        return self.phases[name]["s"] if name in self.phases else None
