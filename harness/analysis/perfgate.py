"""The speed gate: which models got slower beyond noise, between two runs (`diff`) or against a committed
perf baseline (`baseline check`), and which ops added the time.

Each row measured with ``--perf`` holds summaries (`harness.speed.summarize`) of its timed step. What is
compared is the **target/reference ratio** when both rows have one (interleaved rounds: the machine's
load cancels), else the target's latency. A model is a perf regression when `harness.speed.compare` says
so: slower by at least the threshold, with the interval of the slowdown (both runs' own noise) above 1.
Models on the perf allowlist (known-noisy ones: ``model-id-or-pattern  # why`` per line) are reported
but do not gate. Only models whose step ran in both rows are compared: an outcome change is the other
gate's business.

A shared host can make two identical runs differ by more than either run's own interval says: the
thread's CPU time grows with whatever shares the caches and the memory bus, and target and reference do
not grow alike. So each row keeps how disturbed its timing was (``perf.host``, `harness.run.perf.HostWatch`;
``perf.ran_alone``), and where either side was disturbed (`disturbance`) the gate widens the slowdown's
interval by what such hosts were measured to drift (`DRIFT`) and says **inconclusive** instead of
guessing (`judge`): a model that could be a regression but cannot be told from the host is listed apart,
with the reason, and never gates; one slower beyond even the widened interval is still a regression. A
ratio that grew while the target's own step did not is the reference's doing: inconclusive too.

Pure functions over row dicts; which rows is the caller's.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from harness import speed

QUANTITIES = {"ratio": "target/reference", "target": "target latency"}


def quantity_label(q: str) -> str:
    """What a change compared: a quantity, or a collective setting's ratio to its baseline (``setting:NAME``)."""
    return QUANTITIES.get(q) or f"{q.removeprefix('setting:')} / baseline setting"


@dataclass
class PerfChange:
    """One (model, configuration) whose speed moved beyond noise."""

    model_id: str
    config: str
    quantity: str  # what was compared: "ratio" (target/reference) or "target" (latency, seconds)
    base: float  # the base's median
    head: float
    slowdown: float  # head / base (> 1: slower)
    lo: float
    hi: float
    op: str = ""  # the op that added the most time (from the two runs' op profiles), if any
    op_factor: float | None = None
    op_share: float | None = None  # of the added time
    detail: str = ""  # "1.62x slower [1.55-1.70]; aten::_softmax self time 4.1x (62% of the added time)"
    note: str = ""  # why it is allowlisted
    why: str = ""  # why it is inconclusive (or what disturbed a decided one)


@dataclass
class KernelChange:
    """One model whose kernel got slower beyond noise (`harness.speed.kernel_shifts`) while its step as a
    whole did not show a regression: the op, its factor and interval, its share of the step."""

    model_id: str
    config: str
    op: str
    base_us: float
    head_us: float
    slowdown: float
    lo: float
    hi: float
    share: float  # of the head step's op time
    step: str = ""  # what the step as a whole read ("1.12x slower [0.95-1.31]", inconclusive ...)
    why: str = ""  # what disturbed either side's timing (the interval was widened by DRIFT)

    @property
    def detail(self) -> str:
        return (f"{self.op} self time {self.slowdown:.1f}x [{self.lo:.2f}-{self.hi:.2f}], {self.share:.0%} of the "
                f"step's op time; the step: {self.step}")


@dataclass
class PerfGate:
    """The outcome of comparing every model's speed."""

    threshold: float = speed.DEFAULT_THRESHOLD
    regressions: list[PerfChange] = field(default_factory=list)  # gating
    allowlisted: list[PerfChange] = field(default_factory=list)  # slower beyond noise, but known-noisy
    inconclusive: list[PerfChange] = field(default_factory=list)  # could be slower; the host cannot tell (not gating)
    faster: list[PerfChange] = field(default_factory=list)  # informational
    kernels: list[KernelChange] = field(default_factory=list)  # gating: a kernel slower beyond noise, the step not
    settings: list[PerfChange] = field(default_factory=list)  # gating: a collective setting's cost grew beyond noise
    compared: int = 0  # models with a speed on both sides
    geomean: float | None = None  # of every compared model's slowdown (head / base)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        return {k: _finite(v) for k, v in out.items()}


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def perf_of(row: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A row's ``perf`` when its step was timed (None: not measured, or the measurement failed)."""
    perf = None if row is None else row.get("perf")
    if not isinstance(perf, Mapping) or not perf or perf.get("error"):
        return None
    return dict(perf) if "target" in perf or "ratio" in perf else None


def quantity(base: Mapping[str, Any], head: Mapping[str, Any]) -> str | None:
    """What two measurements can be compared on: the ratio when both have it, else the latency."""
    for q in QUANTITIES:
        if isinstance(base.get(q), Mapping) and isinstance(head.get(q), Mapping):
            return q
    return None


def _median(perf: Mapping[str, Any], key: str) -> float | None:
    s = perf.get(key)
    v = s.get("median") if isinstance(s, Mapping) else None
    return float(v) if v else None


def compare_perf(model_id: str, config: str, base: Mapping[str, Any], head: Mapping[str, Any], *,
                 threshold: float = speed.DEFAULT_THRESHOLD) -> tuple[PerfChange, speed.Shift] | None:
    """Two measurements of one model compared (None when they share no quantity)."""
    q = quantity(base, head)
    if q is None:
        return None
    shift = speed.compare(base[q], head[q], threshold=threshold)
    if shift is None:
        return None
    added_us, scale = _added(q, shift.slowdown, base, head)
    bp, hp = base.get("profile"), head.get("profile")
    ops = speed.op_shifts(bp, hp, added_us=added_us, scale=scale, faster=shift.slowdown < 1)
    change = PerfChange(model_id, config, q, float(base[q]["median"]), float(head[q]["median"]), shift.slowdown,
                        shift.lo, shift.hi, detail=speed.explain(shift, ops, base=bp, head=hp, scale=scale))
    if ops:
        change.op, change.op_factor, change.op_share = ops[0].op, ops[0].factor, round(ops[0].share, 4)
    return change, shift


def _added(q: str, slowdown: float, base: Mapping[str, Any], head: Mapping[str, Any]) -> tuple[float | None, float]:
    """The target step's added time per step (µs, on its clock, in the head run's terms) and the host's part of
    its change (what the base's op times are scaled by). Where the ratio is compared, the target's own time
    moved by the slowdown times the host's part: the host's part is the target's change the ratio does not
    show (interleaved rounds cancel it), and the added time is what the ratio shows. One kernel change then
    has about one share of it across models, however much busier one run's host was."""
    b_t, h_t = _median(base, "target"), _median(head, "target")
    if b_t and h_t:
        host = (h_t / b_t) / slowdown if q == "ratio" else 1.0
        return (h_t - b_t * host) * 1e6, host
    b_ref, h_ref = _median(base, "reference"), _median(head, "reference")  # a perf baseline keeps no target time
    return None, (h_ref / b_ref if q == "ratio" and b_ref and h_ref else 1.0)


# ----------------------------------------------------------------------------------------------
# A host too disturbed to decide
# ----------------------------------------------------------------------------------------------

REGRESSION, INCONCLUSIVE, FASTER, UNCHANGED = "regression", "inconclusive", "faster", "unchanged"

# perf.host signs, each read over the timed rounds, and the level past which a side's timing is disturbed
# (a quiet host: the timed thread runs alone, nothing else busy, rounds within a few percent)
DISTURBED: tuple[tuple[str, float, str], ...] = (
    ("wait_share", 0.10, "the timed thread waited for a CPU {:.0%} of the time"),
    ("others_cores", 0.5, "other processes kept {:.1f} core(s) busy beside it"),
    ("load_per_core", 2.0, "load average {:.1f} per core"),
    ("spread", 0.15, "its rounds spread {:.0%} (interquartile / median)"),
)
# How far two identical runs on a disturbed host move apart that their own intervals do not cover (smoke on
# sim, 2 cores, one CPU-bound and one memory-bound neighbour per core, load 15-26: ratios up to 1.17x, and
# 1.08-1.11x with intervals that left out 1), with some room: the widened interval of the false
# alarm (1.35x [1.09-1.69]) holds 1.
DRIFT = 1.15
OWN_STEP = 0.5  # a ratio regression needs the target's own step to grow by at least this share of it (log scale)


def disturbance(perf: Mapping[str, Any] | None) -> list[str]:
    """What disturbed a measurement's timing (empty: nothing measured did), from ``perf.host`` and
    ``perf.ran_alone``; a row measured before these were kept (or a perf baseline) has none to say."""
    if not perf:
        return []
    out = ["timed beside the run's other workers (ran_alone false)"] if perf.get("ran_alone") is False else []
    host = perf.get("host")
    if isinstance(host, Mapping):
        for key, limit, text in DISTURBED:
            v = host.get(key)
            if isinstance(v, (int, float)) and v >= limit:
                out.append(text.format(v))
    return out


def judge(shift: speed.Shift, base: Mapping[str, Any], head: Mapping[str, Any], *,
          threshold: float = speed.DEFAULT_THRESHOLD) -> tuple[str, str]:
    """The verdict on one model's shift (`harness.speed.compare`) and why: ``regression``, ``inconclusive``,
    ``faster`` or ``unchanged``. With neither side disturbed, the shift's own verdict. With either side
    disturbed, the interval widened by `DRIFT`: a regression (or faster) only beyond it; inconclusive where
    the widened interval reaches the threshold, so a real slowdown the host hid is never passed as unchanged."""
    b, h = disturbance(base), disturbance(head)
    sides = [("base and head", b)] if b == h else [("base", b), ("head", h)]
    why = "; ".join(f"{side}: {', '.join(d)}" for side, d in sides if d)
    lo, hi = (shift.lo / DRIFT, shift.hi * DRIFT) if why else (shift.lo, shift.hi)
    if shift.slowdown >= threshold and lo > 1:
        own = _own_step(base, head)
        if own is not None and math.log(own) < OWN_STEP * math.log(shift.slowdown):
            return INCONCLUSIVE, _ratio_moved(base, head, own) + (f"; {why}" if why else "")
        return REGRESSION, why
    if why and hi >= threshold:
        return INCONCLUSIVE, f"the host was too disturbed to tell a {threshold:g}x slowdown from its noise: {why}"
    if shift.slowdown <= 1 / threshold and hi < 1:
        return FASTER, why
    return UNCHANGED, why


def _own_step(base: Mapping[str, Any], head: Mapping[str, Any]) -> float | None:
    """The target step's own latency, head over base, where a ratio was compared and both kept it."""
    if not (isinstance(base.get("ratio"), Mapping) and isinstance(head.get("ratio"), Mapping)):
        return None
    b, h = _median(base, "target"), _median(head, "target")
    return h / b if b and h else None


def _ratio_moved(base: Mapping[str, Any], head: Mapping[str, Any], own: float) -> str:
    b_ref, h_ref = _median(base, "reference"), _median(head, "reference")
    ref = f"; the CPU reference {h_ref / b_ref:.2f}x" if b_ref and h_ref else ""
    return f"the ratio grew but the target's own step did not as much ({own:.2f}x{ref}): not the target's doing"


def kernel_regressions(change: PerfChange, shift: speed.Shift, base: Mapping[str, Any], head: Mapping[str, Any],
                       kind: str) -> list[KernelChange]:
    """The kernels of one model whose own time grew by `speed.KERNEL_THRESHOLD` with an interval above 1 (widened
    by `DRIFT` where either side's timing was disturbed, as the step's is), on the step's clock, the base's op
    times scaled by how much the other ops of their profile moved: a kernel five times slower is a regression
    the morning after, whatever the busy host did to the step as a whole."""
    why = "; ".join(d for d in (*disturbance(base), *disturbance(head)))
    out = []
    for k in speed.kernel_shifts(base.get("profile"), head.get("profile")):
        lo = k.lo / DRIFT if why else k.lo
        if k.slowdown >= speed.KERNEL_THRESHOLD and lo > 1:
            out.append(KernelChange(change.model_id, change.config, k.op, round(k.base_us, 1), round(k.head_us, 1),
                                    k.slowdown, lo, k.hi * DRIFT if why else k.hi, round(k.share, 4),
                                    step=f"{shift.describe()}{' (' + kind + ')' if kind != UNCHANGED else ''}", why=why))
    return out


def collective_shifts(model: str, config: str, base: Mapping[str, Any] | None, head: Mapping[str, Any] | None, *,
                      threshold: float = speed.DEFAULT_THRESHOLD) -> list[tuple[PerfChange, str]]:
    """Each collective setting both rows timed (`--parallel --perf --collectives`), its ratio to the baseline
    setting compared night to night like a step (`judge`: a regression beyond both runs' noise and the host's,
    else inconclusive where the host could hide one)."""
    b, h = (r.get("collectives") if isinstance(r, Mapping) else None for r in (base, head))
    if not isinstance(b, Mapping) or not isinstance(h, Mapping) or b.get("baseline") != h.get("baseline"):
        return []
    out = []
    for name, hs in (h.get("settings") or {}).items():
        bs = (b.get("settings") or {}).get(name)
        if not isinstance(bs, Mapping) or not isinstance(hs.get("ratio"), Mapping) or not isinstance(bs.get("ratio"), Mapping):
            continue
        shift = speed.compare(bs["ratio"], hs["ratio"], threshold=threshold)
        if shift is None:
            continue
        kind, why = judge(shift, {"host": b.get("host")}, {"host": h.get("host")}, threshold=threshold)
        if kind in (REGRESSION, INCONCLUSIVE):
            out.append((PerfChange(model, config, f"setting:{name}", float(bs["ratio"]["median"]),
                                   float(hs["ratio"]["median"]), shift.slowdown, shift.lo, shift.hi,
                                   detail=f"{name} / {h['baseline']}: {shift.describe()}", why=why), kind))
    return out


def allowed(model_id: str, allowlist: Mapping[str, str]) -> str | None:
    """The reason ``model_id`` is on the perf allowlist (exact id or fnmatch pattern), else None."""
    for pattern, reason in allowlist.items():
        if model_id == pattern or fnmatch.fnmatchcase(model_id, pattern):
            return reason or "on the perf allowlist"
    return None


def gate(pairs: list[tuple[str, str, Mapping[str, Any] | None, Mapping[str, Any] | None]], *,
         threshold: float = speed.DEFAULT_THRESHOLD, allowlist: Mapping[str, str] | None = None) -> PerfGate:
    """Compare ``(model, config, base row, head row)`` pairs; rows without a speed on either side are skipped."""
    if not threshold > 1:
        raise ValueError(f"--perf-regression {threshold}: must be > 1 (1.2 = 20% slower)")
    res = PerfGate(threshold=threshold)
    slowdowns = []
    for model, config, b_row, h_row in pairs:
        for change, kind in collective_shifts(model, config, b_row, h_row, threshold=threshold):
            (res.settings if kind == REGRESSION else res.inconclusive if kind == INCONCLUSIVE else []).append(change)
        b, h = perf_of(b_row), perf_of(h_row)
        if b is None or h is None:
            continue
        compared = compare_perf(model, config, b, h, threshold=threshold)
        if compared is None:
            continue
        change, shift = compared
        res.compared += 1
        slowdowns.append(shift.slowdown)
        kind, change.why = judge(shift, b, h, threshold=threshold)
        if kind != REGRESSION and allowed(model, allowlist or {}) is None:
            res.kernels += kernel_regressions(change, shift, b, h, kind)
        if kind == REGRESSION:
            reason = allowed(model, allowlist or {})
            if reason is not None:
                change.note = reason
                res.allowlisted.append(change)
            else:
                res.regressions.append(change)
        elif kind == INCONCLUSIVE:
            res.inconclusive.append(change)
        elif kind == FASTER:
            res.faster.append(change)
    res.geomean = speed.geomean(slowdowns)
    for items in (res.regressions, res.allowlisted, res.inconclusive, res.kernels):
        items.sort(key=lambda c: (-c.slowdown, c.model_id))
    res.faster.sort(key=lambda c: (c.slowdown, c.model_id))
    return res


def format_gate(res: PerfGate, *, limit: int = 50) -> list[str]:
    """Text lines for a summary: the perf regressions (gating), the allowlisted and the faster ones."""
    if not res.compared and not res.settings:
        return []
    gm = f"; geometric mean head/base {res.geomean:.3f}" if res.geomean else ""
    lines = [f"\nspeed: {res.compared} model(s) compared{gm}; regression = >= {res.threshold:g}x slower with the "
             "slowdown's 95% interval above 1"]

    def section(title: str, items: list[PerfChange]) -> None:
        if not items:
            return
        lines.append(f"\n{title} ({len(items)}):")
        for c in items[:limit]:
            what = quantity_label(c.quantity)
            note = f"  [{c.note}]" if c.note else ""
            note += f"  ({c.why})" if c.why else ""
            lines.append(f"  {c.model_id}  [{c.config}]  {what} {c.base:.4g} -> {c.head:.4g}: {c.detail}{note}")
        if len(items) > limit:
            lines.append(f"  ... and {len(items) - limit} more")

    section(f"PERF REGRESSIONS > {res.threshold:g}x", res.regressions)
    section(f"COLLECTIVE SETTINGS COSTING MORE > {res.threshold:g}x (their ratio to the baseline setting)", res.settings)
    if res.kernels:
        lines.append(f"\nKERNEL REGRESSIONS >= {speed.KERNEL_THRESHOLD:g}x, the step not a regression ({len(res.kernels)}):")
        for k in res.kernels[:limit]:
            lines.append(f"  {k.model_id}  [{k.config}]  {k.detail}" + (f"  ({k.why})" if k.why else ""))
        if len(res.kernels) > limit:
            lines.append(f"  ... and {len(res.kernels) - limit} more")
    section("perf allowlist (slower, not counted)", res.allowlisted)
    section("perf inconclusive: the host could not tell (not counted; rerun on a quieter host)", res.inconclusive)
    section("faster (not gating)", res.faster)
    return lines


def read_allowlist(path: str | None) -> dict[str, str]:
    """The perf allowlist: ``model-id-or-pattern  # why`` per line (the reason may be left out)."""
    if path is None:
        return {}
    from harness.files import read_text

    out: dict[str, str] = {}
    for line in read_text(path, "--perf-allowlist").splitlines():
        entry, _, reason = line.partition("#")
        if entry.strip():
            out[entry.strip()] = reason.strip()
    return out
