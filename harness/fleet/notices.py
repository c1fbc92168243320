"""A phase that runs long says what it is doing: the supervisor sees each worker's phase (the pipeline
reports every one) and, once a model has been in one for a while, prints one line naming the model and
the phase (a cold Inductor compile, a big checkpoint loading, the fp64 oracle), then again now and then.
`check` (no progress bar) speaks after a few seconds; `run` writes above its progress bar after longer,
since its models usually take a second each. Workers that take long to start say so too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from harness.phases import PHASE_DOING


class PhaseNotices:
    """Call `poll(workers)` in the supervisor's loop; it calls `write(line)` when a phase runs long."""

    def __init__(self, write: Callable[[str], None], *, after_s: float, every_s: float,
                 settings: dict[str, Any] | None = None) -> None:
        self.write = write
        self.after_s = after_s
        self.every_s = every_s
        self.settings = settings or {}
        self._since: dict[int, tuple[Any, str, float, float | None]] = {}  # worker -> (job, phase, since, said)
        self._start = time.monotonic()
        self._said_start = False

    def doing(self, phase: str) -> str:
        text = PHASE_DOING.get(phase, phase)
        return text.format(compile=self.settings.get("compile") or "torch.compile") if "{" in text else text

    def poll(self, workers: Iterable[Any], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        workers = list(workers)
        if not self._said_start and workers and not all(w.ready for w in workers) \
                and now - self._start >= self.after_s:
            self._said_start = True
            self.write(f"portharness: starting {len(workers)} worker(s): each imports torch and transformers and "
                       "loads the target's backend")
        alive = set()
        for w in workers:
            if not w.busy:
                continue
            alive.add(id(w))
            phase = w.clock.phase or ""
            seen = self._since.get(id(w))
            if seen is None or seen[0] is not w.job or seen[1] != phase:
                self._since[id(w)] = (w.job, phase, now, None)
                continue
            job, _, since, said = seen
            if now - since >= self.after_s and (said is None or now - said >= self.every_s):
                model = getattr(job, "id", "") or "a model"
                self.write(f"portharness: {model}: {self.doing(phase)}, {now - since:.0f} s so far")
                self._since[id(w)] = (job, phase, since, now)
        for key in set(self._since) - alive:
            del self._since[key]
