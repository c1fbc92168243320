"""What one fault scenario measured: `ScenarioResult`, built from the rank events by `summarize`.

Times are seconds from the fault's injection (the bad rank reports it before the fault acts, so a
dying rank says so first). A scenario is *detected* when anything noticed it before the deadline:
the harness watchdog (a stall, an exit, a stopped heartbeat), the finite check, the straggler rule,
or the backend raising on a healthy rank; the bad rank is *named* when a detection blamed it.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from harness.bench.faults import FaultConfig, FaultSpec
from harness.bench.watchdog import WARM_STEPS, Detection, step_rate


@dataclass
class ScenarioResult:
    """What one scenario measured (times in seconds from the fault's injection)."""

    target: str
    backend: str
    world_size: int
    setting: str
    scenario: str
    fault_rank: int
    fault_step: int
    steps: int
    spare: int
    timeout_s: float
    detected: bool = False
    detected_by: str = ""
    detect_s: float | None = None
    named_rank: int | None = None
    named_by: str = ""
    detail: str = ""
    backend_error: bool = False
    backend_error_s: float | None = None
    clean_exit: bool = False
    nan_caught: bool | None = None
    flagged: bool | None = None
    flag_step: int | None = None
    false_flags: int = 0
    throughput_loss: float | None = None  # 1 - steps/s after the fault / baseline steps/s
    steps_per_s: float | None = None  # productive steps/s from the fault step to the end
    baseline_steps_per_s: float | None = None  # before the fault (warm-up excluded), or a healthy run's
    slowdown: float | None = None
    recovered: bool | None = None
    restart_step: int | None = None
    steps_lost: int | None = None
    resume_s: float | None = None
    params_digest: str = ""
    params_consistent: bool | None = None
    params_match: bool | None = None
    reference_digest: str = ""
    completed_steps: int = 0
    timed_out: bool = False
    wall_s: float = 0.0
    error: str = ""
    exit_codes: dict = field(default_factory=dict)
    pids: dict = field(default_factory=dict)
    detections: list = field(default_factory=list)

    @property
    def rank_named(self) -> bool:
        return self.named_rank is not None and self.named_rank == self.fault_rank and self.scenario != "none"

    def as_dict(self) -> dict:
        return {**asdict(self), "rank_named": self.rank_named}


def summarize(cfg: FaultConfig, spec: FaultSpec, setting: str, raw: dict | None, events: list[dict]) -> ScenarioResult:
    """Turn the supervisor's record of one scenario into its `ScenarioResult`."""
    res = ScenarioResult(
        target=cfg.target, backend=cfg.backend, world_size=cfg.world_size, setting=setting, scenario=spec.name,
        fault_rank=cfg.fault_rank if spec.kind != "none" else -1, fault_step=cfg.fault_step, steps=cfg.steps,
        spare=cfg.spare, timeout_s=cfg.timeout_s,
    )
    raw = raw or {}
    res.error = raw.get("error", "")
    res.timed_out = bool(raw.get("timed_out"))
    res.exit_codes = raw.get("exit_codes", {})
    res.pids = raw.get("pids", {})
    dets = [Detection(**d) for d in raw.get("detections", [])]
    res.detections = [d.as_dict() for d in dets]
    inject = next((e for e in events if e["ev"] == "inject"), None)
    t_fault = inject["t"] if inject else None
    bad_label = f"r{cfg.fault_rank}"

    # Straggler flags: on the bad rank once it is slow (slow/flap), and anywhere else (false flags).
    flags = [tuple(f) for f in raw.get("flags", [])]
    slow = spec.kind in ("slow", "flap")
    true_flags = [(s, t) for _, s, r, t in flags if slow and r == cfg.fault_rank and s >= cfg.fault_step]
    res.false_flags = len(flags) - len(true_flags)
    if slow:
        res.flagged = bool(true_flags)
        res.flag_step = min(true_flags)[0] if true_flags else None

    # Detection and naming: the first detection of the fault; the first that names a rank.
    if spec.kind == "none":  # anything the watchdog reports in a healthy run is a false alarm
        if dets:
            first = min(dets, key=lambda d: d.t)
            res.detected, res.detected_by, res.detail = True, first.by, first.detail
        relevant = []
    elif slow:  # only the straggler rule can see a straggler: its first flag on the bad rank once slow
        relevant = [
            Detection(t, "straggler", cfg.fault_rank, 0, s,
                      f"rank {cfg.fault_rank} flagged as a straggler at step {s} (> 1 std and > {cfg.excess:.0%} "
                      f"above its peers' mean compute)")
            for s, t in sorted(true_flags)[:1]
        ]
    else:  # hang, die, nan: what the straggler rule says about other ranks is not about this fault
        relevant = [d for d in dets if d.by != "straggler" and t_fault is not None and d.t >= t_fault]
    if relevant and t_fault is not None:
        first = min(relevant, key=lambda d: d.t)
        res.detected, res.detected_by = True, first.by
        res.detect_s = max(0.0, first.t - t_fault)
        res.detail = first.detail
        named = [d for d in relevant if d.rank is not None]
        if named:
            n = min(named, key=lambda d: d.t)
            res.named_rank, res.named_by = n.rank, n.by
    backend = [d for d in dets if d.by == "backend"]
    if backend and t_fault is not None:
        res.backend_error = True
        res.backend_error_s = max(0.0, min(d.t for d in backend) - t_fault)
    if not res.error:
        errs = [e.get("error", "") for e in events if e["ev"] in ("failed", "crashed") and not e.get("planned")]
        res.error = errs[0][:500] if errs else ""

    if slow:
        comp = {e["step"]: e["compute_s"] for e in events if e["ev"] == "step" and e["label"] == bad_label}
        before = [c for s, c in comp.items() if 1 <= s < cfg.fault_step]
        after = [c for s, c in comp.items() if s >= cfg.fault_step]
        if before and after:
            res.slowdown = statistics.median(after) / statistics.median(before)

    # NaN: caught by the finite check at the fault step, and no NaN in the final weights.
    finals = {e["label"]: e for e in events if e["ev"] == "final" and not e.get("unused")}
    if spec.kind == "nan":
        caught = any(d.by == "finite_check" and d.step == cfg.fault_step for d in dets)
        res.nan_caught = caught and bool(finals) and all(f.get("params_finite") for f in finals.values())

    # Clean exit: every healthy process left by itself with code 0 (none had to be killed).
    codes, killed = raw.get("exit_codes", {}), set(raw.get("killed", []))
    healthy = [label for label in codes if label not in raw.get("failed_labels", [])]
    res.clean_exit = bool(codes) and all(codes[label] == 0 and label not in killed for label in healthy)

    # Progress, recovery, parameters.
    step_end: dict[int, float] = {}
    skipped = 0
    for e in events:
        if e["ev"] == "step":
            step_end[e["step"]] = max(step_end.get(e["step"], 0.0), e["t"])
            skipped += bool(e.get("skipped")) and e.get("rank") == 0
    res.completed_steps = len(step_end)
    planned = [r for r in raw.get("reforms", []) if r.get("planned")]
    reforms = [r for r in raw.get("reforms", []) if not r.get("planned")]
    if planned:  # a `none` reference: re-formed without a fault
        res.restart_step = planned[0]["start_step"]
    if reforms:
        r = reforms[0]
        resumed = [e["t"] for e in events if e["ev"] == "step" and e.get("gen") == r["gen"]]
        res.recovered = len(step_end) == cfg.steps and bool(resumed)
        res.restart_step = r["start_step"]
        res.steps_lost = r["failed_step"] - r["start_step"] + 1
        if resumed and t_fault is not None:
            res.resume_s = min(resumed) - t_fault
    elif spec.recoverable:
        res.recovered = False
    res.steps_per_s = step_rate(step_end, cfg.fault_step - 1, cfg.steps - 1, skipped)
    res.baseline_steps_per_s = step_rate(step_end, WARM_STEPS - 1, cfg.fault_step - 1)
    set_loss(res, res.baseline_steps_per_s)
    last_gen = max((f.get("gen", 0) for f in finals.values()), default=0)
    digests = {f["digest"] for f in finals.values() if f.get("gen", 0) == last_gen and f.get("digest")}
    if digests and len(step_end) == cfg.steps:
        res.params_consistent = len(digests) == 1
        res.params_digest = sorted(digests)[0]
    return res


def set_loss(res: ScenarioResult, baseline: float | None) -> None:
    """Throughput loss against ``baseline`` steps/s (a healthy run's, when the matrix has one)."""
    res.baseline_steps_per_s = baseline
    if baseline and res.steps_per_s is not None:
        res.throughput_loss = 1.0 - res.steps_per_s / baseline
    else:
        res.throughput_loss = None
