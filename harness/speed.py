"""The statistics of speed: one run's timing samples summarized, two runs' summaries compared.

Pure functions (numbers in, numbers out), shared by the measurement (`harness.run.perf`) and the gates
(`harness.analysis.perfgate`), so every place that says "slower" means the same thing.

Why these statistics. A shared machine's load swings a model's latency by tens of percent from one run
to the next, and within a run someone else's burst lands on a few iterations:

- each run is summarized by its **median** (a burst moves a few samples, not the median) and the
  **distribution-free interval of the median** from the order statistics (the binomial ranks: exact for any
  distribution, and honest at the few rounds a slow model gets on a busy machine, where a bootstrap's
  interval comes out too narrow), plus the quartiles a reader sees as the spread;
- where the target and the CPU reference are both timed, they run **interleaved**, one round each in
  turn, and the quantity that gates is the **per-round target/reference ratio**: load that slows the
  machine for a moment slows both halves of a round, and cancels in their ratio;
- two runs are compared by the **ratio of their medians** with an interval that adds both runs' own
  noise (on the log scale their variances add: the runs are independent). A run is a **regression** only
  when the slowdown reaches the threshold (``--perf-regression``, 1.2) **and** the interval's lower end
  is above 1: a slowdown that large which the two runs' own spread cannot explain.

Summaries, not samples, are compared: the history, a committed perf baseline and a result row all keep
the summary, so the same test runs on each.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

CONFIDENCE = 0.95
DEFAULT_THRESHOLD = 1.2


def _z(confidence: float) -> float:
    from scipy.stats import norm

    return float(norm.ppf(0.5 + confidence / 2))


@functools.lru_cache(maxsize=1024)  # the timing loop asks after every round
def median_ranks(n: int, confidence: float = CONFIDENCE) -> tuple[int, int]:
    """0-based ranks (lo, hi) of the sorted samples that bound the median with at least ``confidence``
    (P(Binomial(n, 1/2) < lo + 1) <= alpha / 2 on each side); (0, n - 1) when n is too small for that
    (5 samples: 94%)."""
    from scipy.stats import binom

    k = int(binom.ppf((1 - confidence) / 2, n, 0.5))  # smallest k with P(B <= k) >= alpha / 2
    lo = max(0, k - 1)
    return lo, n - 1 - lo


def summarize(samples: Sequence[float], *, confidence: float = CONFIDENCE) -> dict[str, float | int]:
    """``{median, q1, q3, lo, hi, min, max, n}`` of positive timing samples (seconds, or a ratio); ``lo``/``hi``
    bound the median at ``confidence`` (`median_ranks`). ValueError when no sample is finite and positive."""
    x = np.asarray([s for s in samples if s is not None], dtype=float)
    x = np.sort(x[np.isfinite(x) & (x > 0)])
    if x.size == 0:
        raise ValueError("no finite positive timing samples to summarize")
    median = float(np.median(x))
    q1, q3 = (float(v) for v in np.percentile(x, [25, 75]))
    lo, hi = median_ranks(int(x.size), confidence)
    return {"median": median, "q1": q1, "q3": q3, "lo": min(float(x[lo]), median), "hi": max(float(x[hi]), median),
            "min": float(x[0]), "max": float(x[-1]), "n": int(x.size)}


def ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """Per-round ratios of two interleaved series (rounds where either is missing or not positive are left out)."""
    return [a / b for a, b in zip(num, den, strict=False) if a and b and a > 0 and b > 0]


def _log_se(s: Mapping[str, Any], z: float) -> float:
    """Standard error of log(median) from a summary's interval (0 when the samples did not vary)."""
    lo, hi = float(s.get("lo") or 0), float(s.get("hi") or 0)
    if lo <= 0 or hi <= 0:
        return math.inf
    return (math.log(hi) - math.log(lo)) / (2 * z)


@dataclass(frozen=True)
class Shift:
    """Head against base: ``slowdown`` = head median / base median (> 1: slower), with its interval."""

    slowdown: float
    lo: float
    hi: float
    regressed: bool  # slowdown >= threshold and lo > 1
    faster: bool  # slowdown <= 1/threshold and hi < 1

    def describe(self) -> str:
        if self.slowdown >= 1:
            return f"{self.slowdown:.2f}x slower [{self.lo:.2f}-{self.hi:.2f}]"
        return f"{1 / self.slowdown:.2f}x faster [{self.lo:.2f}-{self.hi:.2f} of the base time]"


def compare(base: Mapping[str, Any] | None, head: Mapping[str, Any] | None, *, threshold: float = DEFAULT_THRESHOLD,
            confidence: float = CONFIDENCE) -> Shift | None:
    """Compare two summaries (`summarize`) of the same quantity; None when either has no positive median."""
    if threshold <= 1:
        raise ValueError(f"perf regression threshold must be > 1, got {threshold}")
    if not base or not head:
        return None
    b, h = float(base.get("median") or 0), float(head.get("median") or 0)
    if not (b > 0 and h > 0 and math.isfinite(b) and math.isfinite(h)):
        return None
    z = _z(confidence)
    r = h / b
    se = math.hypot(_log_se(base, z), _log_se(head, z))
    lo, hi = (0.0, math.inf) if math.isinf(se) else (r * math.exp(-z * se), r * math.exp(z * se))
    return Shift(r, lo, hi, regressed=r >= threshold and lo > 1, faster=r <= 1 / threshold and hi < 1)


def geomean(values: Iterable[Any]) -> float | None:
    """Geometric mean of the finite positive values (None when there are none): the dashboards' average of
    per-model ratios, which a single 10x outlier does not dominate as it would an arithmetic mean."""
    logs = []
    for v in values:
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f) and f > 0:
            logs.append(math.log(f))
    return math.exp(sum(logs) / len(logs)) if logs else None


# ----------------------------------------------------------------------------------------------
# Which ops got slower
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpShift:
    op: str
    base_us: float  # self time per step, on the clock the step was timed on
    head_us: float
    share: float  # of the step's added time (or, for a speed-up, of the time it saved)
    at_least: bool = False  # the other profile did not keep the op: the change is at least this

    @property
    def factor(self) -> float:
        return self.head_us / self.base_us if self.base_us > 0 else math.inf


def op_shifts(base: Mapping[str, Any] | None, head: Mapping[str, Any] | None, *, added_us: float | None = None,
              scale: float = 1.0, faster: bool = False) -> list[OpShift]:
    """Per op, its self time per step in both profiles (``{"ops": [[op, us], ...], "total_us": us}``, per-step
    times on the step's clock), the ops that added the most time first (``faster``: that saved the most).

    Each op's share is of ``added_us``, the step's own added time on the same clock: one kernel change then
    has one share whichever model it is in, and time added between ops (Python) is nobody's op. Without it,
    of the profiles' totals' difference. ``scale`` multiplies the base's times into the head run's terms:
    the host's part of the step's change (a busier host's caches make every op slower alike), so that
    what is left is the code's. Only what both sides measured is compared: an op one profile did not keep
    counts there at the most it can have had (`unseen_us`), never as new (or gone). [] when a profile is
    missing or nothing was added (saved)."""
    if not base or not head or not base.get("ops") or not head.get("ops"):
        return []
    b_ops = {k: v * scale for k, v in _pairs(base["ops"])}
    h_ops = dict(_pairs(head["ops"]))
    sign = -1.0 if faster else 1.0
    if added_us is None or not sign * added_us > 0:
        added_us = _total(head, h_ops) - _total(base, dict(_pairs(base["ops"]))) * scale
    if not sign * added_us > 0:
        return []
    if not faster:  # an op the head did not keep cannot be shown to have grown
        unseen = unseen_us(base) * scale
        out = [OpShift(op, b_ops.get(op, unseen), h, (h - b_ops.get(op, unseen)) / added_us, op not in b_ops)
               for op, h in h_ops.items()]
    else:  # ... nor one the base did not keep to have shrunk
        unseen = unseen_us(head)
        out = [OpShift(op, b, h_ops.get(op, unseen), (h_ops.get(op, unseen) - b) / added_us, op not in h_ops)
               for op, b in b_ops.items()]
    return sorted((s for s in out if sign * (s.head_us - s.base_us) > 0), key=lambda s: (-s.share, s.op))


KEEP_SHARE, KEEP_OPS = 0.001, 40  # what a row's op profile keeps (`top_ops`)


def unseen_us(profile: Mapping[str, Any]) -> float:
    """The most self time an op missing from `profile` can have had: a row's keeps the ops of at least
    KEEP_SHARE of the total, KEEP_OPS at most; a committed baseline says what it dropped (``floor_us``);
    none when the list holds the whole total (the op did not run: it is new, or gone)."""
    if profile.get("floor_us") is not None:
        return float(profile["floor_us"])
    kept = [us for _, us in _pairs(profile.get("ops") or [])]
    total = float(profile.get("total_us") or 0)
    if len(kept) < KEEP_OPS and sum(kept) >= 0.99 * total:
        return 0.0  # the list holds (nearly) all of the time: an op it does not list did not run
    floor = KEEP_SHARE * total
    return max(floor, min(kept)) if len(kept) >= KEEP_OPS else floor


def _pairs(ops: Any) -> list[tuple[str, float]]:
    return [(str(k), float(v)) for k, v in (ops.items() if isinstance(ops, Mapping) else ops)]


def _total(prof: Mapping[str, Any], ops: Mapping[str, float]) -> float:
    return float(prof.get("total_us") or sum(ops.values()))


MIN_SHARE = 0.25  # an op named as the cause holds at least this share of the added time


def explain(shift: Shift, ops: list[OpShift], *, base: Mapping[str, Any] | None = None,
            head: Mapping[str, Any] | None = None, scale: float = 1.0) -> str:
    """``1.62x slower [1.55-1.70]; aten::_softmax self time 4.1x (62% of the added time)``, or for a
    speed-up ``1.40x faster [...]; aten::_softmax self time 4.1x less (80% of the time saved)``; when every
    op moved about alike, says so and names the largest contributor instead."""
    text = shift.describe()
    if base and head and base.get("clock") and head.get("clock") and base["clock"] != head["clock"]:
        return f"{text}; the op profiles are on different clocks ({base['clock']}, {head['clock']}): not compared"
    if not ops:
        return text + ("; the op profiles do not show the added time" if base and head else "; no op profile to compare")
    top = ops[0]
    slower = top.head_us > top.base_us
    factor = top.factor if slower else (top.base_us / top.head_us if top.head_us > 0 else math.inf)
    what = ("new in this run" if slower else "gone in this run") if math.isinf(factor) else (
        ("at least " if top.at_least else "") + (f"{factor:.1f}x" if slower else f"{factor:.1f}x less"))
    time_of = "the added time" if slower else "the time saved"
    overall = _overall(base, head, scale)
    if overall is not None and not math.isinf(factor) and factor <= (overall if slower else 1 / overall) * 1.1:
        verb = "slower" if slower else "faster"
        return f"{text}; {verb} across ops (largest: {top.op} {what}, {min(top.share, 1.0):.0%} of {time_of})"
    if top.share < MIN_SHARE:
        return f"{text}; no op holds much of {time_of} (largest: {top.op} {what}, {top.share:.0%} of it)"
    # other ops' noise can shrink the step's added time below this op's own growth: never more than all of it
    return f"{text}; {top.op} self time {what} ({min(top.share, 1.0):.0%} of {time_of})"


def _overall(base: Mapping[str, Any] | None, head: Mapping[str, Any] | None, scale: float) -> float | None:
    if not base or not head:
        return None
    b, h = float(base.get("total_us") or 0) * scale, float(head.get("total_us") or 0)
    return h / b if b > 0 and h > 0 else None


def top_ops(self_us: Mapping[str, float], *, min_share: float = KEEP_SHARE, limit: int = KEEP_OPS) -> list[list[Any]]:
    """The ops worth keeping from a profile: ``[op, µs]`` pairs with at least ``min_share`` of the self time,
    at most ``limit``, largest first (a row keeps this, not the whole profile; a list keeps the order
    through JSON, whose objects the store writes with sorted keys)."""
    total = sum(v for v in self_us.values() if v > 0)
    if total <= 0:
        return []
    kept = sorted(((k, v) for k, v in self_us.items() if v >= min_share * total), key=lambda kv: (-kv[1], kv[0]))
    return [[k, round(v, 1)] for k, v in kept[:limit]]


# ----------------------------------------------------------------------------------------------
# A kernel's own time: its per-step self time compared like a step (the kernel gate)
# ----------------------------------------------------------------------------------------------
# A step that is mostly other ops hides one kernel's slowdown in its own noise on a busy host (a layer norm 5x
# slower may add 20% to a step whose rounds spread 30%); the op's own time, profiled round by round on the
# step's clock, shows it. The profile keeps each kept op's interval of its per-round median (`op_intervals`),
# and two profiles' ops are compared like two steps (`compare`), the base's op scaled by how much the rest of its
# profile moved (the host's part, measured in the same profiling windows): only an op that holds at least
# KERNEL_MIN_SHARE of the head step's op time (tiny ops are noise), whose rounds agree (their
# interval within KERNEL_MAX_SPREAD of its median each way) and that both sides kept (an op appearing or
# vanishing, a warm-up's doing, is never a kernel change) is judged.
KERNEL_MIN_SHARE = 0.05
KERNEL_MAX_SPREAD = 2.0
KERNEL_THRESHOLD = 1.5  # a kernel regression: at least this much slower (and beyond both runs' noise)
KERNEL_MIN_REST = 0.3  # the other ops hold at least this share of the base step: they measure the host's part


def op_intervals(per_round: Mapping[str, Sequence[float]], ops: Iterable[str]) -> dict[str, list[float]]:
    """``{op: [lo, hi]}``: the interval of each op's median self time per step (µs) over the profiled rounds,
    for `ops` (a profile's kept ones), as `summarize` bounds a step's median."""
    out = {}
    for op in ops:
        samples = [v for v in per_round.get(op, ()) if v > 0]
        if len(samples) >= 2:
            s = summarize(samples)
            out[op] = [round(float(s["lo"]), 1), round(float(s["hi"]), 1)]
    return out


@dataclass(frozen=True)
class KernelShift:
    op: str
    base_us: float  # self time per step, the base's scaled by the host's part
    head_us: float
    slowdown: float
    lo: float
    hi: float
    share: float  # of the head step's op time

    def describe(self) -> str:
        return (f"{self.op} self time {self.slowdown:.1f}x [{self.lo:.2f}-{self.hi:.2f}] "
                f"({self.share:.0%} of the step's op time)")


def kernel_shifts(base: Mapping[str, Any] | None, head: Mapping[str, Any] | None, *,
                  confidence: float = CONFIDENCE) -> list[KernelShift]:
    """Each op both profiles kept with an interval, large enough and steady enough to judge (see above),
    compared head against base, the base's time scaled by how much the other ops of the same profiled steps
    moved (the host's part: two identical runs on a host busier in one run's profiling window read 1, a
    kernel five times slower reads 5); slowest first."""
    if not base or not head or (base.get("clock") and head.get("clock") and base["clock"] != head["clock"]):
        return []  # (a committed baseline does not say its clock: the configuration's is the same)
    b_ci, h_ci = base.get("ci") or {}, head.get("ci") or {}
    b_ops, h_ops = dict(_pairs(base.get("ops") or [])), dict(_pairs(head.get("ops") or []))
    b_total, h_total = _total(base, b_ops), _total(head, h_ops)
    out = []
    for op, h in h_ops.items():
        b = b_ops.get(op)
        if b is None or op not in b_ci or op not in h_ci or b <= 0 or h <= 0 or b_total <= 0 or h_total <= 0:
            continue
        if h < KERNEL_MIN_SHARE * h_total:
            continue
        (blo, bhi), (hlo, hhi) = b_ci[op], h_ci[op]
        if not _steady(b, blo, bhi) or not _steady(h, hlo, hhi):
            continue
        # The host's part, from the other ops of the same profiled steps: a busier moment while profiling slows
        # every op alike (a profile is its own window, apart from the timed rounds), one kernel's change does not
        b_rest, h_rest = b_total - b, h_total - h
        if b_rest < KERNEL_MIN_REST * b_total or h_rest <= 0:
            continue  # the op is nearly the whole step: the step's own gate judges it
        host = h_rest / b_rest
        shift = compare({"median": b * host, "lo": blo * host, "hi": bhi * host}, {"median": h, "lo": hlo, "hi": hhi},
                        threshold=KERNEL_THRESHOLD, confidence=confidence)
        if shift is not None:
            out.append(KernelShift(op, b * host, h, shift.slowdown, shift.lo, shift.hi, h / h_total))
    return sorted(out, key=lambda k: (-k.slowdown, k.op))


def _steady(median: float, lo: float, hi: float) -> bool:
    return lo > 0 and hi > 0 and median / lo <= KERNEL_MAX_SPREAD and hi / median <= KERNEL_MAX_SPREAD
