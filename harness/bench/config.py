"""What a collectives benchmark run measures: its configuration, and per-repeat times -> ratios."""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from harness.comms.settings import parse_setting

KIB = 1024
MIB = 1024 * 1024
DEFAULT_SIZES = [4 * KIB, 64 * KIB, 1 * MIB, 16 * MIB]
BASELINE = "fused"
DEFAULT_SETTINGS = [BASELINE, "skinny", "bucket:256k", "cap:256k", "per-host"]
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_reduce_coalesced")
DDP_OP = "ddp_step"
COALESCED_TENSORS = 16
DEFAULT_REPEATS = 10
DEFAULT_WARMUP = 2
ELEMENT_BYTES = 4  # float32
MAX_SIZE = 1 << 30

# target -> (c10d backend name registered by harness.sim.distributed, transport label for rows)
TARGETS = {"sim": ("sim", "sim(gloo)"), "cpu": ("shaped_gloo", "gloo"), "cuda": ("shaped_nccl", "nccl")}

# The DDP model: GPT-2 shrunk so a step is short on a 2-core host but the gradients (~5.7 MiB in
# fp32) are big enough for the communication settings to show. No dropout: nothing random in a step.
DDP_CONFIG = {
    "vocab_size": 8192,
    "n_embd": 128,
    "n_layer": 2,
    "n_head": 2,
    "n_positions": 64,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
DDP_BATCH = (2, 32)  # sequences x tokens per rank
RANK_MB = 500  # what one rank process holds: torch imported (~220 MiB) plus the DDP model, its gradients, buffers
RANKS_PER_CPU = 8  # beyond this the ranks only wait for cores: the timings say nothing


def rank_limit() -> tuple[int, str]:
    """How many rank processes this machine can hold (by available memory and CPUs), and why, in words."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    avail_mb = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    avail_mb = int(line.split()[1]) // 1024
    except OSError:
        pass
    limits = [(RANKS_PER_CPU * cpus, f"{cpus} CPU(s) x {RANKS_PER_CPU}")]
    if avail_mb is not None:
        limits.append((avail_mb // RANK_MB, f"{avail_mb} MiB available / ~{RANK_MB} MiB per rank"))
    n, why = min(limits)
    return max(n, 2), why


def check_ranks(n: int, what: str = "world size") -> None:
    """ValueError when `n` rank processes would not fit on this machine (it would take a shared host down)."""
    limit, why = rank_limit()
    if n > limit:
        raise ValueError(f"{what} {n}: this machine can hold at most {limit} rank processes ({why}); "
                         f"use {limit} or fewer, or a bigger machine")



@dataclass
class BenchConfig:
    """One benchmark run; `validate` explains every bad value before any process starts."""

    target: str = "sim"
    world_size: int = 2
    sizes: list[int] = field(default_factory=lambda: list(DEFAULT_SIZES))
    settings: list[str] = field(default_factory=lambda: list(DEFAULT_SETTINGS))
    ops: list[str] = field(default_factory=lambda: list(OPS))
    repeats: int = DEFAULT_REPEATS
    warmup: int = DEFAULT_WARMUP
    ddp: bool = True
    timeout_s: float = 300.0
    backends: list[str] = field(default_factory=list)  # modules each rank imports first (--backend)

    def validate(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"unknown target {self.target!r}; expected one of {', '.join(TARGETS)}")
        if not isinstance(self.world_size, int) or self.world_size < 2:
            raise ValueError(
                f"world size must be an integer >= 2 (a collective needs peers), got {self.world_size}"
            )
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout_s:g}")
        if self.target != "cuda":
            check_ranks(self.world_size)
        bad_ops = [o for o in self.ops if o not in OPS]
        if bad_ops:
            raise ValueError(f"unknown op(s) {', '.join(bad_ops)}; expected some of {', '.join(OPS)}")
        smallest = ELEMENT_BYTES * self.world_size * COALESCED_TENSORS
        for s in self.sizes:
            if not isinstance(s, int) or isinstance(s, bool) or s < smallest or s > MAX_SIZE:
                raise ValueError(
                    f"bad size {s!r}: sizes are byte counts from {smallest} (float32 x world size "
                    f"{self.world_size} x {COALESCED_TENSORS} coalesced tensors) to {MAX_SIZE}"
                )
        if not self.settings:
            raise ValueError("no settings to measure")
        for name in self.settings:
            s = parse_setting(name)  # raises ValueError naming the grammar
            if s.placement == "per-host" and self.world_size % s.ranks_per_host:
                raise ValueError(
                    f"setting {name!r}: {s.ranks_per_host} ranks per host does not divide world size "
                    f"{self.world_size}"
                )
        if len(set(self.settings)) != len(self.settings):
            raise ValueError(f"duplicate settings in {self.settings}")
        if self.target == "cuda":
            import torch

            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if n < self.world_size:
                raise ValueError(
                    f"--target cuda needs one GPU per rank (nccl refuses two ranks on one GPU): "
                    f"world size {self.world_size}, {n} GPU(s) visible"
                )

    def with_baseline(self) -> BenchConfig:
        """The baseline is always measured (first), since every ratio is against it."""
        if BASELINE in self.settings:
            names = [BASELINE] + [s for s in self.settings if s != BASELINE]
        else:
            names = [BASELINE, *self.settings]
        return BenchConfig(**{**asdict(self), "settings": names})


@dataclass
class Measurement:
    """One op x size x setting: its time spread and its ratio vs the baseline (paired per repeat)."""

    op: str
    size_bytes: int
    setting: str
    settings: dict
    times_s: list[float]
    median_s: float
    p10_s: float
    p90_s: float
    ratio: float
    ratio_p10: float
    ratio_p90: float

    def as_dict(self) -> dict:
        return asdict(self)


def spread(xs: Sequence[float]) -> tuple[float, float, float]:
    """(p10, median, p90), linearly interpolated (numpy's default method)."""
    if not xs:
        raise ValueError("quantile of no values")
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    deciles = statistics.quantiles(xs, n=10, method="inclusive")
    return deciles[0], statistics.median(xs), deciles[-1]


def summarize(
    times: dict[tuple[str, int, str], list[float]], settings: dict[str, dict], baseline: str = BASELINE
) -> list[Measurement]:
    """Per-repeat times (slowest rank) -> measurements with ratios vs ``baseline`` of the same op/size."""
    out = []
    for (op, size, name), ts in times.items():
        base = times[(op, size, baseline)]
        ratios = [t / b for t, b in zip(ts, base, strict=True) if b > 0]
        p10, med, p90 = spread(ts)
        r10, rmed, r90 = spread(ratios)
        out.append(
            Measurement(
                op=op, size_bytes=size, setting=name, settings=settings[name], times_s=list(ts),
                median_s=med, p10_s=p10, p90_s=p90, ratio=rmed, ratio_p10=r10, ratio_p90=r90,
            )
        )
    order = {n: i for i, n in enumerate(settings)}
    op_order = {o: i for i, o in enumerate((*OPS, DDP_OP))}
    out.sort(key=lambda m: (op_order.get(m.op, 99), m.size_bytes, order[m.setting]))
    return out
