"""The harness's own watchdog for collective jobs: who is late, who is dead, who is a straggler.

Backends detect a bad rank late and anonymously: gloo raises "Connection closed by peer
[127.0.0.1]:PORT" or a timeout that names no rank, and a rank that hangs in a kernel keeps every
peer waiting until the collective timeout. So each rank reports its progress and the supervisor
watches it, naming the bad rank by:

- **exit**: the rank's process ended before finishing (its exit code / signal);
- **stall**: its peers arrived at a step's gradient all_reduce and it did not, ``stall_s`` after the
  first arrival (the rank that never arrived at the collective's barrier);
- **heartbeat**: its heartbeat thread stopped while the process lives (a frozen process);
- **straggler**: its compute time before the collective is high (`straggler_flags`, Megatron's rule);
- **finite check**: it contributed non-finite gradients (each rank checks its own bucket before the
  all_reduce, and the ranks share the flags after it, so the NaN never reaches the weights).

The statistics are pure functions (unit-tested without processes); `Watchdog` turns rank events
into `Detection`s; `EventLog`/`EventReader` are the wire (append-only JSON lines per rank process,
in the scenario's directory: no sockets, and a line written before a SIGKILL survives it).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

STRAGGLER_STD = 1.0  # flag a rank more than this many std above the mean...
STRAGGLER_EXCESS = 0.10  # ...and more than 10% above it (Megatron-LM's straggler rule)
STRAGGLER_WINDOW = 8  # trailing steps per rank the rule looks at
STRAGGLER_MIN_STEPS = 3  # a rank's statistics need this many steps in the window
WARM_STEPS = 2  # the first steps of each generation (DDP's first iterations, a spare's first) are slow for all

_RANK_IN_TEXT = re.compile(r"\brank[\s_:=#]*(\d+)", re.IGNORECASE)


# ----------------------------------------------------------------------------------------------
# Pure statistics
# ----------------------------------------------------------------------------------------------


def straggler_flags(
    samples: Mapping[int, Sequence[float]], *, k_std: float = STRAGGLER_STD, excess: float = STRAGGLER_EXCESS
) -> set[int]:
    """Ranks whose mean step time is > ``k_std`` std and > ``excess`` above the others' mean.

    ``samples`` maps each rank to its per-step compute times (the window). The mean and std a rank is
    compared with are its peers' (all their samples pooled), not everyone's: with the rank itself
    included, the slower of two ranks is always exactly one population std above their mean, so a
    world of two could never flag anyone; and a straggler would inflate the very std it must exceed.
    """
    flagged: set[int] = set()
    ranks = [r for r, xs in samples.items() if xs]
    if len(ranks) < 2:
        return flagged
    for r in ranks:
        peers = [x for p in ranks if p != r for x in samples[p]]
        mu = statistics.fmean(peers)
        sd = statistics.pstdev(peers) if len(peers) > 1 else 0.0
        mine = statistics.fmean(samples[r])
        if mine > mu + k_std * sd and mine > (1.0 + excess) * mu:
            flagged.add(r)
    return flagged


def window_samples(
    compute: Mapping[int, Mapping[int, float]],
    step: int,
    *,
    window: int = STRAGGLER_WINDOW,
    skip: Iterable[int] = (),
) -> dict[int, list[float]]:
    """Each rank's compute times of the ``window`` steps up to ``step`` (warm-up steps in ``skip`` left out)."""
    skipped = set(skip)
    out = {}
    for rank, by_step in compute.items():
        steps = sorted(s for s in by_step if s <= step and s not in skipped)[-window:]
        out[rank] = [by_step[s] for s in steps]
    return out


def stalled_ranks(arrivals: Mapping[int, float], members: Iterable[int], now: float, stall_s: float) -> list[int]:
    """Ranks that have not arrived at a collective ``stall_s`` after the first one that did."""
    if not arrivals:
        return []
    if now - min(arrivals.values()) < stall_s:
        return []
    return sorted(r for r in members if r not in arrivals)


def step_rate(step_end: Mapping[int, float], first: int, last: int, skipped: int = 0) -> float | None:
    """Productive steps per second from the end of step ``first`` to the end of step ``last``.

    ``step_end`` maps a step to the wall time it completed (the last time, if it was redone after a
    recovery), so a recovery's pause counts against the rate; ``skipped`` steps (a NaN step the finite
    check skipped) completed but did not train. None when either end is missing (the job stopped).
    """
    if first not in step_end or last not in step_end or last <= first:
        return None
    return (last - first - skipped) / max(step_end[last] - step_end[first], 1e-9)


def rank_in_text(text: str) -> int | None:
    """A rank an error message names ('rank 3', 'Rank:3'), if any: what the backend itself told us."""
    m = _RANK_IN_TEXT.search(text or "")
    return int(m.group(1)) if m else None


# ----------------------------------------------------------------------------------------------
# Events: the wire between ranks and supervisor
# ----------------------------------------------------------------------------------------------


class EventLog:
    """Append-only JSON lines for one rank process; each line is one ``os.write`` (kept by a SIGKILL)."""

    def __init__(self, workdir: str, label: str) -> None:
        self.label = label
        self.fields: dict[str, Any] = {}  # stamped on every event (gen, rank once known)
        self._fd = os.open(os.path.join(workdir, f"events-{label}.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        self._lock = threading.Lock()

    def emit(self, ev: str, **data: Any) -> None:
        rec = {"t": time.time(), "ev": ev, "label": self.label, **self.fields, **data}
        line = (json.dumps(rec, default=str) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)


class EventReader:
    """Reads the new complete lines of every rank's event file (the supervisor's side)."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self._offsets: dict[str, int] = {}

    def poll(self) -> list[dict]:
        out = []
        for name in sorted(os.listdir(self.workdir)):
            if not (name.startswith("events-") and name.endswith(".jsonl")):
                continue
            path = os.path.join(self.workdir, name)
            off = self._offsets.get(name, 0)
            with open(path, "rb") as fh:
                fh.seek(off)
                data = fh.read()
            end = data.rfind(b"\n") + 1
            self._offsets[name] = off + end
            for line in data[:end].splitlines():
                if line.strip():
                    out.append(json.loads(line))
        out.sort(key=lambda e: e["t"])
        return out


def write_json(path: str, obj: Any) -> None:
    """Atomically replace ``path`` (readers never see half a file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(obj, fh)
    os.replace(tmp, path)


def read_json(path: str) -> Any:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


# ----------------------------------------------------------------------------------------------
# The watchdog
# ----------------------------------------------------------------------------------------------


@dataclass
class Detection:
    """The harness noticed something: when, how, and which rank it blames (None: it cannot tell)."""

    t: float
    by: str  # exit | stall | heartbeat | straggler | finite_check | backend
    rank: int | None
    gen: int
    step: int | None
    detail: str

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Gen:
    members: dict[int, str]  # rank -> process label
    started: float
    first_step: int
    arrivals: dict[int, dict[int, float]] = field(default_factory=dict)  # step -> rank -> t
    compute: dict[int, dict[int, float]] = field(default_factory=dict)  # rank -> step -> compute s
    evaluated: set[int] = field(default_factory=set)
    failed: bool = False


class Watchdog:
    """Turns rank events, process exits and heartbeats into `Detection`s (each reported once)."""

    def __init__(
        self, stall_s: float, heartbeat_s: float, *, excess: float = STRAGGLER_EXCESS, window: int = STRAGGLER_WINDOW
    ) -> None:
        self.stall_s = stall_s
        self.heartbeat_s = heartbeat_s
        self.excess = excess
        self.window = window
        self.gens: dict[int, _Gen] = {}
        self.gen = -1
        self.detections: list[Detection] = []
        self.flags: list[tuple[int, int, int, float]] = []  # (gen, step, rank, t) of every straggler flag
        self.finished: set[str] = set()  # labels that reported done/final: their exit is no failure
        self._named: set[tuple[str, int | None]] = set()

    def start_gen(self, gen: int, members: Mapping[int, str], first_step: int, now: float) -> None:
        self.gen = gen
        self.gens[gen] = _Gen(dict(members), now, first_step)

    def _detect(self, d: Detection) -> Detection | None:
        key = (d.by, d.rank)
        if key in self._named:
            return None
        self._named.add(key)
        self.detections.append(d)
        return d

    def feed(self, ev: Mapping[str, Any]) -> list[Detection]:
        """Take one rank event; returns what it revealed (a finite-check or backend detection)."""
        g = self.gens.get(ev.get("gen", -1))
        kind = ev["ev"]
        out: list[Detection | None] = []
        if kind in ("done", "final"):
            self.finished.add(ev["label"])
        if g is None:
            return []
        if kind == "arrive":
            g.arrivals.setdefault(ev["step"], {})[ev["rank"]] = ev["t"]
            g.compute.setdefault(ev["rank"], {})[ev["step"]] = ev["compute_s"]
        elif kind == "step" and ev.get("nonfinite"):
            bad = ev["nonfinite"]
            out.append(
                self._detect(
                    Detection(ev["t"], "finite_check", bad[0] if len(bad) == 1 else None, ev["gen"], ev["step"],
                              f"non-finite gradients from rank(s) {bad} at step {ev['step']}; optimizer step skipped")
                )
            )
        elif kind == "failed":
            g.failed = True
            if not ev.get("aborted") and not ev.get("planned"):
                named = rank_in_text(ev.get("error", ""))
                out.append(
                    self._detect(
                        Detection(ev["t"], "backend", named, ev["gen"], ev.get("step"),
                                  f"rank {ev['rank']} got {ev.get('error', '')[:300]}")
                    )
                )
        return [d for d in out if d is not None]

    def check(
        self, now: float, exits: Mapping[str, int | None], heartbeats: Mapping[str, float]
    ) -> list[Detection]:
        """Process exits (label -> exit code or None), heartbeats (label -> last beat) and stalls."""
        g = self.gens.get(self.gen)
        if g is None:
            return []
        out: list[Detection | None] = []
        for rank, label in g.members.items():
            code = exits.get(label)
            if code is not None and label not in self.finished:
                out.append(self._detect(Detection(now, "exit", rank, self.gen, None,
                                                  f"rank {rank}'s process exited with code {code} mid-job")))
            elif code is None and label in heartbeats and now - heartbeats[label] > self.heartbeat_s:
                out.append(self._detect(Detection(now, "heartbeat", rank, self.gen, None,
                                                  f"rank {rank}'s heartbeat stopped {now - heartbeats[label]:.1f} s ago")))
        if not g.failed:
            for step in sorted(g.arrivals):
                arrived = g.arrivals[step]
                if len(arrived) == len(g.members):
                    continue
                for rank in stalled_ranks(arrived, g.members, now, self.stall_s):
                    out.append(self._detect(Detection(
                        now, "stall", rank, self.gen, step,
                        f"rank {rank} never arrived at step {step}'s gradient all_reduce; {len(arrived)} peer(s) "
                        f"waited {now - min(arrived.values()):.1f} s")))
                break  # only the earliest incomplete step: later ones are waiting on it
        out += self._stragglers(g)
        return [d for d in out if d is not None]

    def _stragglers(self, g: _Gen) -> list[Detection | None]:
        out: list[Detection | None] = []
        warm = set(range(g.first_step, g.first_step + WARM_STEPS))
        for step in sorted(g.arrivals):
            arrived = g.arrivals[step]
            if step in g.evaluated or len(arrived) < len(g.members) or step in warm:
                continue
            g.evaluated.add(step)
            samples = window_samples(g.compute, step, window=self.window, skip=warm)
            if min(len(x) for x in samples.values()) < STRAGGLER_MIN_STEPS:
                continue
            t = max(arrived.values())
            for rank in sorted(straggler_flags(samples, excess=self.excess)):
                self.flags.append((self.gen, step, rank, t))
                mine = statistics.fmean(samples[rank])
                out.append(self._detect(Detection(
                    t, "straggler", rank, self.gen, step,
                    f"rank {rank}'s mean compute {mine * 1e3:.1f} ms over {len(samples[rank])} steps is > 1 std and "
                    f"> {self.excess:.0%} above its peers'")))
        return out
