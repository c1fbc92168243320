"""Speed of one model, after its verdict (``--perf``): the step timed on the target and on the CPU reference.

The verdict comes first and is never lost over speed: a failure here is recorded in the row's ``perf``
and the outcome stands. What is timed are named steps (``target``, ``reference``; ``eager`` beside a
compiled ``target``), each a callable that returns when its device has finished (the target's steps
synchronize the device through the adapter). They run:

1. warm-up rounds (first-call costs: lazy initialisation, allocator growth, autotuning);
2. timed rounds, every step once per round, the order rotating from round to round so neither side always
   runs first. Rounds interleave the sides on purpose: the per-round target/reference ratio cancels what
   the machine's load does to both (`harness.speed`). They stop once the interval of the quantity the gate
   compares is tight enough to decide (`TIGHT`, after `ADAPT_MIN` rounds: a steady 2 ms model needs tens
   of rounds, not hundreds; `TIGHT_DISTURBED` on a disturbed host, whose drift the gate allows for anyway),
   else when the budget (seconds) is spent;
3. while they run, the host's disturbance is read (`HostWatch`: the share of the time the timing thread was
   runnable but waiting, other processes' CPU use, load, PSI), so a gate can tell a busy host from slower
   code (`harness.analysis.perfgate`);
4. a profile of the target step on the clock the step is timed on (`op_profile`), kept compactly, so that a
   later run found slower can say which op added the time.

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

import os
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from harness.results.draft import RowDraft
from harness.run.context import DEFAULT_BUDGET_S
from harness.speed import median_ranks, op_intervals, ratios, summarize, top_ops

if TYPE_CHECKING:  # types only: perf runs after the target side, never imported by it
    import torch

    from harness.backends import Adapter
    from harness.run.modes import Plan
    from harness.run.target import TargetSide

WARMUP = 2  # rounds
MIN_ROUNDS = 5  # samples a median and its interval need, whatever the budget
ADAPT_MIN = 10  # rounds before an interval counts as tight: fewer leave the order statistics too coarse
TIGHT = 0.08  # stop once the compared quantity's 95% interval of the median spans at most 8% (hi/lo <= 1.08):
# two such runs give a slowdown interval of about +-5.5%, far inside the gate's 1.2x threshold; at 5% a quiet
# host's smoke list took 10-100 rounds a model and --perf cost 3.6x a plain run (scripts/perf_rates.py)
TIGHT_DISTURBED = 0.10  # ... at most 10% while the host is disturbed: the gate then widens the interval by its
# drift (1.15x, harness.analysis.perfgate.DRIFT), which rounds do not narrow; more of them only cost
MAX_ROUNDS = 200  # a 1 ms model does not need thousands
HARD_CAP = 5.0  # x budget: a model too slow for MIN_ROUNDS stops here (after 3 rounds at least)
PROFILE_ROUNDS = 3  # profiled steps (5 for a step under `PROFILE_FAST_S`)
PROFILE_FAST_S = 0.02
THREADS = 1  # intra-op threads while timing (see above)

Step = Callable[[], object]


def _deciding(samples: dict[str, list[float]]) -> list[float]:
    """What the gate compares: the per-round target/reference ratio, else the target's (first step's) times."""
    if samples.get("target") and samples.get("reference"):
        return ratios(samples["target"], samples["reference"])
    return next(iter(samples.values()), [])


def tight(x: list[float], tol: float = TIGHT, min_rounds: int = ADAPT_MIN) -> bool:
    """Whether the 95% interval of the median of ``x`` (`harness.speed.median_ranks`) spans at most ``tol``."""
    if len(x) < min_rounds:
        return False
    lo, hi = median_ranks(len(x))
    xs = sorted(x)
    return xs[lo] > 0 and xs[hi] / xs[lo] <= 1 + tol


def time_rounds(steps: dict[str, Step], budget_s: float, *, clocks: dict[str, Callable[[], float]] | None = None,
                warmup: int = WARMUP, min_rounds: int = MIN_ROUNDS, max_rounds: int = MAX_ROUNDS,
                wall: Callable[[], float] = time.perf_counter, adaptive: bool = True,
                tolerance: Callable[[], float] = lambda: TIGHT) -> dict[str, dict[str, list[float]]]:
    """Seconds per call of each step on each clock (``{clock: {step: [s, ...]}}``; default: the wall clock),
    interleaved: round r runs the steps starting from the (r mod k)-th.

    Stops once the compared quantity is `tight` (within ``tolerance()``, asked every few rounds) on the
    first clock (``adaptive``), once the budget (wall time) is spent and ``min_rounds`` are done, at
    ``max_rounds``, or (for a model whose rounds are long) at ``HARD_CAP`` x the budget after 3 rounds."""
    clocks = clocks or {"wall": wall}
    first = next(iter(clocks))
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    samples: dict[str, dict[str, list[float]]] = {c: {n: [] for n in names} for c in clocks}
    start = wall()
    r = 0
    tol = TIGHT
    while r < max_rounds:
        elapsed = wall() - start
        if r and elapsed >= budget_s and (r >= min_rounds or (r >= 3 and elapsed >= HARD_CAP * budget_s)):
            break
        if adaptive and r >= max(min_rounds, ADAPT_MIN):
            if r % 5 == 0:
                tol = tolerance()
            if tight(_deciding(samples[first]), tol):
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


# ----------------------------------------------------------------------------------------------
# How disturbed the host was while the rounds ran
# ----------------------------------------------------------------------------------------------


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except OSError:
        return None


def _schedstat() -> tuple[int, int] | None:
    """(ns on a CPU, ns runnable but waiting for one) of the calling thread; None where the kernel keeps none."""
    text = _read("/proc/thread-self/schedstat")
    try:
        run, wait, *_ = (int(x) for x in (text or "").split())
    except ValueError:
        return None
    return run, wait


def _cpu_jiffies() -> tuple[int, int, int] | None:
    """(busy, total) jiffies of all the host's CPUs and how many there are, from /proc/stat."""
    text = _read("/proc/stat")
    if not text:
        return None
    lines = text.splitlines()
    try:
        fields = [int(x) for x in lines[0].split()[1:]]
    except (ValueError, IndexError):
        return None
    idle = sum(fields[3:5])  # idle, iowait
    n = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    return sum(fields[:8]) - idle, sum(fields[:8]), n


def psi_cpu_some() -> float | None:
    """/proc/pressure/cpu ``some avg10``: the share (%) of the last 10 s some task waited for a CPU."""
    for line in (_read("/proc/pressure/cpu") or "").splitlines():
        if line.startswith("some "):
            for item in line.split()[1:]:
                key, _, value = item.partition("=")
                if key == "avg10":
                    try:
                        return float(value)
                    except ValueError:
                        return None
    return None


class HostWatch:
    """The host's disturbance over a window of the calling thread (the timed rounds). Thread CPU time is
    not stretched by waiting, but it does grow with what shares the cores' caches and the memory bus, so
    a gate needs both: how long this thread waited while runnable (its schedstat) and how much other work
    ran beside it (/proc/stat's busy CPUs less this thread's own time); the 1-minute load per core (a
    lagging sign, the run's own workers in it) and PSI ``cpu some avg10`` beside them."""

    def __init__(self) -> None:
        self._wall = time.perf_counter_ns()
        self._sched = _schedstat()
        self._cpu = _cpu_jiffies()

    def stop(self) -> dict[str, float]:
        wall = time.perf_counter_ns() - self._wall
        sched, cpu = _schedstat(), _cpu_jiffies()
        out: dict[str, float] = {}
        run_share = None
        if wall > 0 and self._sched is not None and sched is not None:
            run_share = (sched[0] - self._sched[0]) / wall
            out["wait_share"] = round(max(0.0, (sched[1] - self._sched[1]) / wall), 3)
        if self._cpu is not None and cpu is not None and cpu[1] > self._cpu[1] and run_share is not None:
            busy_cores = (cpu[0] - self._cpu[0]) / (cpu[1] - self._cpu[1]) * cpu[2]
            out["others_cores"] = round(max(0.0, busy_cores - run_share), 2)  # cores' worth of other work
        cpus = os.cpu_count() or 1
        out["load_per_core"] = round(os.getloadavg()[0] / cpus, 2)
        psi = psi_cpu_some()
        if psi is not None:
            out["psi_some_avg10"] = psi
        return out


# ----------------------------------------------------------------------------------------------
# Which ops the step's time goes to, on the step's own clock
# ----------------------------------------------------------------------------------------------


def _ns_clock(clock: tuple[str, Callable[[], float]]) -> Callable[[], int]:
    name, read = clock
    if name == "thread-cpu":
        return time.thread_time_ns
    if name == "wall":
        return time.perf_counter_ns
    return lambda: int(read() * 1e9)


def _call_cost(clock_ns: Callable[[], int]) -> int:
    """What the timer's bracket adds to each op it times: a clock read, and calling the op from Python (an
    `OpOverload`, where the step itself calls it from C++): the least of a few brackets around a call that
    does next to nothing (``aten::alias`` of a CPU scalar)."""
    import torch

    alias, x = torch.ops.aten.alias.default, torch.zeros(())
    best = None
    for _ in range(50):
        t0 = clock_ns()
        alias(x)
        d = clock_ns() - t0
        best = d if best is None else min(best, d)
    return best or 0


_timer_cls: Any = None


def _op_timer(clock_ns: Callable[[], int]) -> Any:
    """A TorchDispatchMode that adds each ATen call's time on ``clock_ns`` to its op (``aten::_softmax``, the
    overloads together, as the profiler names them). Ops a kernel calls inside itself run below the mode,
    so each call is counted once: its self time is the whole call."""
    global _timer_cls
    if _timer_cls is None:
        from torch.utils._python_dispatch import TorchDispatchMode

        class OpTimer(TorchDispatchMode):
            def __init__(self, clock: Callable[[], int]) -> None:
                super().__init__()
                self.clock = clock
                self.ns: dict[str, int] = {}
                self.calls: dict[str, int] = {}

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
                t0 = self.clock()
                out = func(*args, **(kwargs or {}))
                t1 = self.clock()
                name = func._schema.name
                self.ns[name] = self.ns.get(name, 0) + t1 - t0
                self.calls[name] = self.calls.get(name, 0) + 1
                return out

        _timer_cls = OpTimer
    return _timer_cls(clock_ns)


def op_profile(step: Step, clock: tuple[str, Callable[[], float]] = ("thread-cpu", time.thread_time), *,
               rounds: int = PROFILE_ROUNDS, step_s: float | None = None, activity: torch.profiler.ProfilerActivity | None = None,
               compiled: bool = False) -> dict[str, Any]:
    """Self time per op per step (µs) on the clock the step is timed on, over ``rounds`` steps after one
    warm-up step (every op's total over them divided by the same count, so the ops add up to the profiled
    step's op time). On the thread's CPU time (sim, the CPU), a dispatch-mode timer reads that clock around
    each op: no profiler to start, and load that only stretches the wall clock stays out. For a wall-clock
    device whose profiler records the device (``activity``), the device's own time per op. A ``compiled``
    step runs its graphs below any dispatch mode (Dynamo runs eagerly under one), so torch.profiler's host
    self time it is, said so. ``step_s``: the timed step's median on its clock, which the op total is held
    against (`_against_step`)."""
    if compiled or (activity is not None and clock[0] == "wall"):
        prof = _profiler_profile(step, activity, rounds, host=compiled)
        if prof is not None:
            if compiled and prof["clock"] == "host":
                prof["note_clock"] = "a compiled step: torch.profiler's host self time, not the step's clock"
            return _against_step(prof, step_s)
    clock_ns = _ns_clock(clock)
    bias = _call_cost(clock_ns)
    ns: dict[str, int] = {}
    per_round: dict[str, list[float]] = {}
    calls = 0
    for r in range(rounds + 1):
        timer = _op_timer(clock_ns)
        with timer:
            step()
        if r == 0:
            continue  # the first step through the mode warms its own code paths
        for op, t in timer.ns.items():
            own = max(0, t - bias * timer.calls[op])
            ns[op] = ns.get(op, 0) + own
            per_round.setdefault(op, []).append(own / 1e3)
        calls += sum(timer.calls.values())
    per_step = {op: t / rounds / 1e3 for op, t in ns.items()}
    ops = top_ops(per_step)
    out = {"clock": clock[0], "rounds": rounds, "total_us": round(sum(per_step.values()), 1),
           "ops": ops, "ci": op_intervals(per_round, [op for op, _ in ops]), "calls": round(calls / rounds)}
    return _against_step(out, step_s)


def _profiler_profile(step: Step, activity: torch.profiler.ProfilerActivity | None, rounds: int, *,
                      host: bool) -> dict[str, Any] | None:
    """torch.profiler's self time per ATen op per step: the device's where it recorded any, else (``host``)
    the host's; None when neither."""
    from torch.profiler import ProfilerActivity, profile

    dev: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    for _ in range(rounds):
        with profile(activities=[ProfilerActivity.CPU] + ([activity] if activity is not None else [])) as prof:
            step()
        for evt in prof.key_averages():
            if not evt.key.startswith("aten::"):
                continue
            cpu.setdefault(evt.key, []).append(float(evt.self_cpu_time_total))
            us = float(getattr(evt, "self_device_time_total", 0) or 0) if activity is not None else 0.0
            if us > 0:
                dev.setdefault(evt.key, []).append(us)
    times, clock = (dev, "device") if dev else ((cpu, "host") if host and cpu else ({}, ""))
    if not times:
        return None
    per_step = {op: sum(us) / rounds for op, us in times.items()}
    ops = top_ops(per_step)
    return {"clock": clock, "rounds": rounds, "total_us": round(sum(per_step.values()), 1), "ops": ops,
            "ci": op_intervals(times, [op for op, _ in ops])}


COVER = 0.1  # the op total and the timed step agree within 10%, or the profile says why not


def _against_step(prof: dict[str, Any], step_s: float | None) -> dict[str, Any]:
    """The op total held against the timed step (``step_us``, ``covers`` = ops / step) and, where they differ
    by more than `COVER`, why."""
    said = prof.pop("note_clock", "")
    if not step_s or step_s <= 0:
        if said:
            prof["note"] = said
        return prof
    step_us, total = step_s * 1e6, float(prof.get("total_us") or 0)
    prof["step_us"] = round(step_us, 1)
    prof["covers"] = round(total / step_us, 3)
    ops_ms, step_ms = f"{total / 1e3:.3g}", f"{step_us / 1e3:.3g}"
    if total < (1 - COVER) * step_us:
        prof["note"] = (f"ops {ops_ms} of {step_ms} ms per step; the rest is time between ops (Python, the "
                        "framework above the dispatcher)" if prof["clock"] != "device" else
                        f"device time {ops_ms} of the step's {step_ms} ms (wall, synchronized); the rest is "
                        "the host's: launches, Python, waiting")
    elif total > (1 + COVER) * step_us:
        prof["note"] = (f"ops {ops_ms} ms per profiled step, the timed step {step_ms} ms: the profiled steps ran "
                        "slower (a busier host while profiling, or work on another thread of the step)")
    if said:
        prof["note"] = "; ".join(x for x in (said, prof.get("note", "")) if x)
    return prof


def _tolerance(watch: HostWatch) -> float:
    """How tight the rounds need to get, by the host's disturbance so far (the gate's own signs)."""
    from harness.analysis.perfgate import disturbance

    return TIGHT_DISTURBED if disturbance({"host": watch.stop()}) else TIGHT


def profile_rounds(target_s: float | None) -> int:
    """Profiled steps: 5 for a fast step (their cost is the timer's few µs per op), else 3."""
    return 5 if target_s is not None and 0 < target_s < PROFILE_FAST_S else PROFILE_ROUNDS


def measure(steps: dict[str, Step], *, budget_s: float = DEFAULT_BUDGET_S, clock: tuple[str, Callable[[], float]] = (
            "wall", time.perf_counter), profile: Step | None = None, activity: torch.profiler.ProfilerActivity | None = None,
            reset_peak: Callable[[], None] | None = None, peak_mb: Callable[[], float | None] | None = None,
            adaptive: bool = True, compiled: bool = False) -> RowDraft:
    """Time ``steps`` (`time_rounds`) on ``clock`` (the one the target's adapter says measures its device;
    the wall clock's summaries are kept beside it when it is another), read the host's disturbance over the
    rounds (``perf.host``), profile ``profile`` (the target step) on the same clock, read the device's peak
    memory; returns the row's fields (``perf_*`` and the ``perf`` dict). Never raises: a failure is in
    ``perf.error``."""
    import torch

    t0 = time.perf_counter()
    perf: dict[str, Any] = {"budget_s": budget_s, "warmup": WARMUP, "threads": THREADS, "clock": clock[0]}
    fields = RowDraft()
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        _timed(steps, budget_s, clock, profile, activity, reset_peak, peak_mb, perf, fields, adaptive, compiled)
    finally:
        torch.set_num_threads(threads)
    perf["wall_s"] = round(time.perf_counter() - t0, 3)
    fields["perf"] = perf
    return fields


def _timed(steps: dict[str, Step], budget_s: float, clock: tuple[str, Callable[[], float]], profile: Step | None,
           activity: torch.profiler.ProfilerActivity | None, reset_peak: Callable[[], None] | None, peak_mb: Callable[[], float | None] | None,
           perf: dict[str, Any], fields: RowDraft, adaptive: bool, compiled: bool) -> None:
    peak_kept = peak_mb is not None
    if peak_kept and reset_peak is not None:
        try:  # peak memory is optional: a backend without statistics still has its timing
            peak_kept = reset_peak() is not False
        except Exception as e:
            peak_kept, perf["peak_mem_error"] = False, _error(e)
    try:
        clocks = {clock[0]: clock[1], "wall": time.perf_counter}
        watch = HostWatch()
        samples = time_rounds(steps, budget_s, clocks=clocks, adaptive=adaptive, tolerance=lambda: _tolerance(watch))
        perf["host"] = watch.stop()
        perf.update(summaries(samples[clock[0]]))
        perf["samples_us"] = {k: [round(v * 1e6) for v in s] for k, s in samples[clock[0]].items()}  # re-analysis
        if clock[0] != "wall":
            perf["wall"] = summaries(samples["wall"])
        decided = perf.get("ratio") or perf.get("target")
        if decided:
            perf["host"]["spread"] = round((decided["q3"] - decided["q1"]) / decided["median"], 3)
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
            target_s = fields.get("perf_target_s")
            perf["profile"] = op_profile(profile, clock, rounds=profile_rounds(target_s), step_s=target_s,
                                         activity=activity, compiled=compiled)
        except Exception as e:
            perf["profile_error"] = _error(e)


def _headline(perf: dict[str, Any], rounds: int) -> RowDraft:
    def median(key: str) -> float | None:
        return perf[key]["median"] if key in perf else None

    return RowDraft(perf_target_s=median("target"), perf_ref_s=median("reference"), perf_ratio=median("ratio"),
                    perf_speedup=median("speedup"), perf_rounds=rounds)


def _error(e: BaseException) -> str:
    where = traceback.extract_tb(e.__traceback__)[-1:] if e.__traceback__ else []
    at = f" (at {where[0].filename.rsplit('/', 1)[-1]}:{where[0].lineno})" if where else ""
    return f"{type(e).__name__}: {str(e)[:300]}{at}"


def measure_model(plan: Plan, cpu_model: torch.nn.Module | None, target: TargetSide, device: str, adapter: Adapter,
                  settings: dict[str, Any], budget_s: float, *, compiled: bool = False) -> RowDraft:
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
                  reset_peak=lambda: adapter.reset_peak_memory(device), peak_mb=lambda: adapter.peak_memory_mb(device),
                  compiled=compiled)
    if cpu_model is None:
        out["perf"]["note"] = "reference not timed: the model moved to the device in place (a checkpoint too large to copy)"
    return out
