"""What the collective settings cost one model's parallel step (`--parallel ... --perf --collectives SETTINGS`).

In the ranks (`rounds`): after the judged step, every setting's step is timed in turn, the order rotating
round by round (the interleaving the speed gate uses for target and reference: a moment's load slows the
settings of that round alike), each step between two barriers and synchronized, its time the slowest rank's
(a parallel step is as fast as its last rank); the messages the group's planner issued under each setting
and the seconds its collectives took (where the backend's groups are planned: sim's) are counted too.

In the worker (`summary`): per setting the step's median with its interval (`harness.speed.summarize`) and
its ratio to the baseline setting (the first named) as the median of the per-round ratios with its interval,
the messages, and the share of the step spent in collectives; plus the host's load while it ran, which the
gate reads as it reads a step's (`perf.host`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

from harness import speed

ROUNDS = 7  # timed rounds per setting, after one warm-up round
DEFAULT = "default"  # the run's own setting, where --collectives names none


def rounds(step: Callable[[], Any], names: list[str], setting: Callable[[str], contextlib.AbstractContextManager],
           sync: Callable[[], None], planners: list[Any], *, n: int = ROUNDS) -> dict[str, dict[str, Any]]:
    """Each setting's step times (seconds, the slowest rank's), messages and collective seconds, interleaved."""
    import torch
    import torch.distributed as dist

    out: dict[str, dict[str, Any]] = {s: {"times_s": [], "messages": 0, "collective_s": []} for s in names}
    for it in range(n + 1):  # round 0 warms each setting's path up
        for k in range(len(names)):
            name = names[(k + it) % len(names)]
            with contextlib.nullcontext() if name == DEFAULT else setting(name):
                dist.barrier()
                sent = sum(p.sent for p in planners)
                busy = sum(getattr(p, "busy_s", 0.0) for p in planners)
                t0 = time.perf_counter()
                step()
                sync()
                dt = time.perf_counter() - t0
                slowest = torch.tensor([dt], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=_host_group())
            if it:
                row = out[name]
                row["times_s"].append(float(slowest.item()))
                row["messages"] = sum(p.sent for p in planners) - sent
                row["collective_s"].append(sum(getattr(p, "busy_s", 0.0) for p in planners) - busy)
    return out


_gloo: Any = None


def _host_group() -> Any:
    """A gloo group over every rank, for the timing's own reduction (host tensors, whatever the device)."""
    global _gloo
    if _gloo is None:
        import torch.distributed as dist

        _gloo = dist.new_group(backend="gloo")
    return _gloo


def summary(timed: dict[str, dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """The row's `collectives`: per setting its step, its ratio to the baseline (the first named), its messages
    and the share of the step in collectives; the host's load (the gate's `disturbance` reads `host`)."""
    base = timed[names[0]]["times_s"]
    settings: dict[str, Any] = {}
    for name in names:
        row = timed[name]
        t = row["times_s"]
        entry: dict[str, Any] = {"step": speed.summarize(t), "messages": row["messages"]}
        if name != names[0]:
            entry["ratio"] = speed.summarize(speed.ratios(t, base))
        busy = [c for c in row.get("collective_s", []) if c > 0]
        if busy and t:
            entry["share"] = round(min(1.0, speed.summarize(busy)["median"] / entry["step"]["median"]), 4)
        settings[name] = entry
    load = os.getloadavg()[0] / max(1, os.cpu_count() or 1)
    return {"baseline": names[0], "settings": settings, "rounds": len(base), "host": {"load_per_core": round(load, 2)}}


def fastest(collectives: dict[str, Any]) -> tuple[str, float] | None:
    """(the fastest setting, how much faster than the baseline it is: baseline / it), from a row's summary."""
    settings = (collectives or {}).get("settings") or {}
    if not settings:
        return None
    medians = {n: float(s["step"]["median"]) for n, s in settings.items() if s.get("step")}
    if not medians:
        return None
    best = min(medians, key=medians.get)
    return best, medians[collectives["baseline"]] / medians[best]
