"""Speed of one model, after its verdict (``--perf``): the step timed on the target and on the CPU reference.

The verdict comes first and is never lost over speed: a failure here is recorded in the row's ``perf``
and the outcome stands. What is timed are named steps (``target``, ``reference``; ``eager`` beside a
compiled ``target``), each a callable that returns when its device has finished (the target's steps
synchronize the device through the adapter). They run:

1. warm-up rounds (first-call costs: lazy initialisation, allocator growth, autotuning);
2. timed rounds until the budget is spent (seconds, not a count: a 5 ms model gets hundreds of rounds, a
   2 s one the minimum), every step once per round, the order rotating from round to round so neither
   side always runs first. Rounds interleave the sides on purpose: the per-round target/reference ratio
   cancels what the machine's load does to both (`harness.speed`);
3. a profile of the target step (torch.profiler, self time per ATen op), kept compactly, so that a later
   run found slower can say which op added the time.

The device's peak memory over the timed target steps is recorded where its device module reports one.

Which clock measures the device is the adapter's answer (`Adapter.perf_clock`): the wall clock around a
synchronized step for an accelerator; the thread's CPU time for a device whose kernels run to completion
on the calling thread (sim, the CPU), which leaves out what other processes do to the wall clock. Both
sides of the ratio use it; the wall clock's summaries are kept beside it (``perf.wall``).

Timing runs with one intra-op thread (`THREADS`): a parallel region waits for its slowest thread, and on
a shared host one descheduled thread made a 2 ms tiny-gpt2 forward take 130-220 ms (measured on this
project's 2-core machine with other runs beside it; 1.8-4.2 ms interquartile with one thread). One
thread also makes the CPU reference the same yardstick on hosts with different core counts.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from harness.speed import ratios, summarize, top_ops

DEFAULT_BUDGET_S = 1.0  # timed rounds per model (all steps together), after warm-up
WARMUP = 2  # rounds
MIN_ROUNDS = 5  # samples a median and its interval need, whatever the budget
MAX_ROUNDS = 200  # a 1 ms model does not need thousands
HARD_CAP = 5.0  # x budget: a model too slow for MIN_ROUNDS stops here (after 3 rounds at least)
PROFILE_ROUNDS = 3
THREADS = 1  # intra-op threads while timing (see above)

Step = Callable[[], object]


def time_rounds(steps: dict[str, Step], budget_s: float, *, clocks: dict[str, Callable[[], float]] | None = None,
                warmup: int = WARMUP, min_rounds: int = MIN_ROUNDS, max_rounds: int = MAX_ROUNDS,
                wall: Callable[[], float] = time.perf_counter) -> dict[str, dict[str, list[float]]]:
    """Seconds per call of each step on each clock (``{clock: {step: [s, ...]}}``; default: the wall clock),
    interleaved: round r runs the steps starting from the (r mod k)-th.

    The budget is wall time: stops once it is spent and ``min_rounds`` are done, at ``max_rounds``, or (for a
    model whose rounds are long) at ``HARD_CAP`` x the budget after 3 rounds."""
    clocks = clocks or {"wall": wall}
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    samples: dict[str, dict[str, list[float]]] = {c: {n: [] for n in names} for c in clocks}
    start = wall()
    r = 0
    while r < max_rounds:
        elapsed = wall() - start
        if r and elapsed >= budget_s and (r >= min_rounds or (r >= 3 and elapsed >= HARD_CAP * budget_s)):
            break
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = {c: read() for c, read in clocks.items()}
            steps[name]()
            for c, read in clocks.items():
                samples[c][name].append(read() - t0[c])
        r += 1
    return samples


def summaries(samples: dict[str, list[float]]) -> dict[str, Any]:
    """The row's ``perf`` timings: each step's summary, the per-round target/reference ratio, and the
    per-round eager/target speedup (where an ``eager`` step ran beside a compiled ``target``)."""
    out: dict[str, Any] = {name: summarize(s) for name, s in samples.items() if s}
    if samples.get("target") and samples.get("reference"):
        out["ratio"] = summarize(ratios(samples["target"], samples["reference"]))
    if samples.get("target") and samples.get("eager"):
        out["speedup"] = summarize(ratios(samples["eager"], samples["target"]))
    return out


def op_profile(step: Step, activity: Any = None, *, rounds: int = PROFILE_ROUNDS) -> dict[str, Any]:
    """Self time per ATen op per step (µs): the device's time where the profiler records the device
    (``activity``), else the host's (a backend whose kernels run on the host, like sim). Each round is a
    profile of one step of its own and every op keeps its median over the rounds: a burst of someone
    else's work lands on one round and in whichever op was running, and the median leaves it out."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([activity] if activity is not None else [])
    per_round: list[dict[str, float]] = []
    clock = "host"
    for _ in range(rounds):
        with profile(activities=activities) as prof:
            step()
        host: dict[str, float] = {}
        dev: dict[str, float] = {}
        for evt in prof.key_averages():
            if evt.key.startswith("aten::"):
                host[evt.key] = host.get(evt.key, 0.0) + float(evt.self_cpu_time_total)
                device_us = float(getattr(evt, "self_device_time_total", 0) or 0) if activity is not None else 0.0
                dev[evt.key] = dev.get(evt.key, 0.0) + device_us
        # A backend that reports device time has it on its ops; one whose kernels run on the host has none
        if any(v > 0 for v in dev.values()):
            per_round.append(dev)
            clock = "device"
        else:
            per_round.append(host)
    ops = {op: float(np.median([r.get(op, 0.0) for r in per_round])) for op in set().union(*per_round)}
    return {"rounds": rounds, "total_us": round(float(np.median([sum(r.values()) for r in per_round])), 1),
            "ops": top_ops(ops), "clock": clock}


PROFILE_OVERHEAD_S = 0.06  # starting and reading a profile of one step (measured: 50-80 ms on sim)


def profile_rounds(target_s: float | None, budget_s: float) -> int:
    """Profiled steps: about a quarter of the timing budget, 3 to 5 (each a profile of its own)."""
    if not target_s or target_s <= 0:
        return PROFILE_ROUNDS
    return int(min(5, max(PROFILE_ROUNDS, 0.25 * budget_s / (target_s + PROFILE_OVERHEAD_S))))


def measure(steps: dict[str, Step], *, budget_s: float = DEFAULT_BUDGET_S, clock: tuple[str, Callable[[], float]] = (
            "wall", time.perf_counter), profile: Step | None = None, activity: Any = None,
            reset_peak: Callable[[], None] | None = None, peak_mb: Callable[[], float | None] | None = None
            ) -> dict[str, Any]:
    """Time ``steps`` (`time_rounds`) on ``clock`` (the one the target's adapter says measures its device;
    the wall clock's summaries are kept beside it when it is another), profile ``profile`` (the target step),
    read the device's peak memory; returns the row's fields (``perf_*`` and the ``perf`` dict). Never raises:
    a failure is in ``perf.error``."""
    import torch

    t0 = time.perf_counter()
    perf: dict[str, Any] = {"budget_s": budget_s, "warmup": WARMUP, "threads": THREADS, "clock": clock[0]}
    fields: dict[str, Any] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        _timed(steps, budget_s, clock, profile, activity, reset_peak, peak_mb, perf, fields)
    finally:
        torch.set_num_threads(threads)
    perf["wall_s"] = round(time.perf_counter() - t0, 3)
    return {**fields, "perf": perf}


def _timed(steps: dict[str, Step], budget_s: float, clock: tuple[str, Callable[[], float]], profile: Step | None,
           activity: Any, reset_peak: Callable[[], None] | None, peak_mb: Callable[[], float | None] | None,
           perf: dict[str, Any], fields: dict[str, Any]) -> None:
    peak_kept = peak_mb is not None
    if peak_kept and reset_peak is not None:
        try:  # peak memory is optional: a backend without statistics still has its timing
            peak_kept = reset_peak() is not False
        except Exception as e:
            peak_kept, perf["peak_mem_error"] = False, _error(e)
    try:
        clocks = {clock[0]: clock[1], "wall": time.perf_counter}
        samples = time_rounds(steps, budget_s, clocks=clocks)
        perf.update(summaries(samples[clock[0]]))
        perf["samples_us"] = {k: [round(v * 1e6) for v in s] for k, s in samples[clock[0]].items()}  # re-analysis
        if clock[0] != "wall":
            perf["wall"] = summaries(samples["wall"])
        fields.update(_headline(perf, len(next(iter(samples[clock[0]].values()), []))))
    except Exception as e:  # speed is diagnostics: the verdict stands
        perf["error"] = _error(e)
    if peak_kept:
        try:
            peak = peak_mb()
            fields["perf_peak_mem_mb"] = None if peak is None else round(peak, 2)
        except Exception as e:
            perf["peak_mem_error"] = _error(e)
    if profile is not None and "error" not in perf:
        try:
            perf["profile"] = op_profile(profile, activity, rounds=profile_rounds(fields.get("perf_target_s"), budget_s))
        except Exception as e:
            perf["profile_error"] = _error(e)


def _headline(perf: dict[str, Any], rounds: int) -> dict[str, Any]:
    def median(key: str) -> float | None:
        return perf[key]["median"] if key in perf else None

    return {"perf_target_s": median("target"), "perf_ref_s": median("reference"), "perf_ratio": median("ratio"),
            "perf_speedup": median("speedup"), "perf_rounds": rounds}


def _error(e: BaseException) -> str:
    where = traceback.extract_tb(e.__traceback__)[-1:] if e.__traceback__ else []
    at = f" (at {where[0].filename.rsplit('/', 1)[-1]}:{where[0].lineno})" if where else ""
    return f"{type(e).__name__}: {str(e)[:300]}{at}"


def measure_model(plan: Any, cpu_model: Any, target: Any, device: str, adapter: Any, settings: dict[str, Any],
                  budget_s: float, *, compiled: bool = False) -> dict[str, Any]:
    """`measure` for one model after its verdict: ``plan``'s step on the device model and inputs the
    target side left (`target.TargetSide`), under the backend's settings and synchronized, and on the CPU
    model (``cpu_model``; None when the model moved to the device in place: the target alone is timed).
    ``compiled``: the device model was compiled (torch.compile); the same step also runs eagerly
    (``torch.compiler.set_stance("force_eager")``: the compiled module's own code, not compiled) as
    ``eager``, which gives the speedup."""

    def on_target() -> None:
        with adapter.apply(settings):
            plan.step(target.model, target.inputs)
        adapter.synchronize(device)

    steps: dict[str, Step] = {"target": on_target}
    if compiled:
        import torch

        def eager() -> None:
            with torch.compiler.set_stance("force_eager"):
                on_target()

        steps["eager"] = eager
    if cpu_model is not None:
        steps["reference"] = lambda: plan.step(cpu_model, plan.inputs)
    out = measure(steps, budget_s=budget_s, clock=adapter.perf_clock(), profile=on_target,
                  activity=adapter.profiler_activity(),
                  reset_peak=lambda: adapter.reset_peak_memory(device), peak_mb=lambda: adapter.peak_memory_mb(device))
    if cpu_model is None:
        out["perf"]["note"] = "reference not timed: the model moved to the device in place (a checkpoint too large to copy)"
    return out
