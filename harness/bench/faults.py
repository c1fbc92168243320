"""One bad rank in a collective job: the scenarios, their configuration, and how each is injected.

A scenario makes one rank (``fault_rank``) go bad at one step (``fault_step``) of a DDP training job:

=========== ======================================================================================
scenario    what the bad rank does
=========== ======================================================================================
``none``    nothing: the healthy baseline (false straggler flags, the recovery reference)
``hang``    never enters the step's gradient all_reduce (the process stays alive, as with a hung
            kernel: its heartbeat keeps beating, it just never arrives)
``slow:F``  a straggler: from the fault step on, its compute before the collective takes F times
            as long as its own healthy steps did (default F = 3)
``nan``     contributes NaN gradients for one step
``die``     its process exits mid-step (sim: SIGSEGV in a kernel; other backends: SIGKILL)
``flap:F``  intermittent: from the fault step on, a seeded half of its steps are F times slower
=========== ======================================================================================

How a scenario reaches the rank depends on the backend. On ``sim`` the device itself goes bad, with
the sim's own fault switches (`harness.sim.set_faults`): ``hang`` is a kernel that stalls for an hour,
``die`` a kernel that segfaults, ``nan`` kernels whose outputs are NaN, and ``slow``/``flap`` the
sim's ``slow`` fault: every kernel stays busy a little longer (sized from the rank's healthy compute
time and its kernel count per step, so F means the same on every machine). On any other backend
(gloo on CPU, nccl) the harness injects the same behaviour in the rank's own process, at the
gradient all_reduce: the DDP comm hook works longer, blocks, kills the process or fills the bucket
with NaN before handing it to the backend. Either way the backend underneath sees one rank that is
late, absent, dead or poisonous. Slowness is busy work, not sleep, on both: the straggler rule reads
the rank's busy time.

Everything here but `Injector`'s sim branch is plain Python; torch is imported by the rank only.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from harness.bench.config import TARGETS, check_ranks
from harness.comms.settings import parse_setting

if TYPE_CHECKING:  # the rank imports torch; parsing and validating scenarios must not
    import torch

SCENARIOS = ("none", "hang", "slow", "nan", "die", "flap")
ALL = ["hang", "slow:3", "nan", "die", "flap:3"]  # `--faults all`: the five fault scenarios
DEFAULT_FACTOR = 3.0
RECOVERABLE = ("hang", "die")  # the bad rank is gone: a spare can take its place
SCENARIO_GRAMMAR = (
    "scenarios are a comma-separated list of none, hang, slow[:F], nan, die, flap[:F] (F: slowdown "
    "factor > 1, default 3), or 'all' for hang,slow:3,nan,die,flap:3"
)
HANG_S = 3600.0  # a hang outlives every deadline: the supervisor kills the rank, nothing else ends it
MAX_SPARES = 4


@dataclass(frozen=True)
class FaultSpec:
    """One scenario: its kind and, for ``slow``/``flap``, the slowdown factor."""

    kind: str
    factor: float = 1.0

    @property
    def name(self) -> str:
        if self.kind in ("slow", "flap"):
            return f"{self.kind}:{self.factor:g}"
        return self.kind

    @property
    def recoverable(self) -> bool:
        return self.kind in RECOVERABLE


def parse_scenario(text: str) -> FaultSpec:
    """``'slow:3'`` -> FaultSpec('slow', 3.0); unknown names and bad factors raise ValueError."""
    raw = text.strip().lower()
    kind, sep, value = raw.partition(":")
    if kind not in SCENARIOS:
        raise ValueError(f"unknown fault scenario {text.strip()!r}; {SCENARIO_GRAMMAR}")
    if kind not in ("slow", "flap"):
        if sep:
            raise ValueError(f"fault scenario {kind!r} takes no value (got {text.strip()!r}); {SCENARIO_GRAMMAR}")
        return FaultSpec(kind)
    if not sep:
        return FaultSpec(kind, DEFAULT_FACTOR)
    try:
        factor = float(value)
    except ValueError:
        factor = float("nan")
    if not factor > 1.0 or factor > 1000:
        raise ValueError(
            f"bad slowdown factor in {text.strip()!r}: expected a number > 1 and <= 1000 (times slower); "
            f"{SCENARIO_GRAMMAR}"
        )
    return FaultSpec(kind, factor)


def parse_scenarios(text: str) -> list[FaultSpec]:
    """``'hang,slow:3'`` or ``'all'`` -> specs, in order, without duplicates."""
    items = [t for t in (x.strip() for x in text.split(",")) if t]
    if not items:
        raise ValueError(f"no fault scenarios given; {SCENARIO_GRAMMAR}")
    specs: list[FaultSpec] = []
    for item in items:
        for spec in [parse_scenario(x) for x in ALL] if item.lower() == "all" else [parse_scenario(item)]:
            if spec not in specs:
                specs.append(spec)
    return specs


@dataclass
class FaultConfig:
    """One fault matrix on one target and world size; `validate` explains every bad value up front.

    ``timeout_s`` is the detection budget every scenario must meet. The backend's own collective
    timeout (gloo/nccl process-group timeout) is half of it, so the backend gets a chance to fail the
    collective by itself inside the budget; the harness watchdog names a rank that has not arrived
    at a collective ``stall_s`` (a fifth of the budget) after its first peer did.
    """

    target: str = "sim"
    world_size: int = 2
    scenarios: list[str] = field(default_factory=lambda: list(ALL))
    settings: list[str] = field(default_factory=lambda: ["fused"])
    fault_rank: int = 1
    fault_step: int = 5
    steps: int = 20
    spare: int = 0
    timeout_s: float = 10.0
    seed: int = 0
    restart_step: int | None = None  # `none` only: re-form the group at this step (the recovery reference)
    straggler_excess: float | None = None  # None: 10% on cuda (Megatron's), 50% where ranks share host cores
    startup_s: float = 120.0  # for every rank (and spare) to import torch and build the model
    deadline_s: float = 90.0  # for the job itself, from the first step: past it, everything is killed

    @property
    def collective_timeout_s(self) -> float:
        return self.timeout_s / 2

    @property
    def stall_s(self) -> float:
        return self.timeout_s / 5

    @property
    def excess(self) -> float:
        """How far above its peers' mean a straggler's compute must be (besides 1 std).

        Megatron's 10% assumes each rank owns its device. On ``cpu`` and ``sim`` the "devices" are
        emulated on host cores that several ranks (and other tenants) share, and a healthy rank's busy
        time drifts 10-20% above its peers' for a while (measured on a 2-vCPU CI host, cpu and sim,
        world 2 and 4, over 8-step windows: 5 of 32 healthy runs had a rank > 10% and > 1 std above the
        others, 1 of 32 > 20%, none > 30%). So there the bar is 50%: still far below what a straggler
        costs (slow:3 is +200%, flap:3 about +100% on average).
        """
        if self.straggler_excess is not None:
            return self.straggler_excess
        return 0.10 if self.target == "cuda" else 0.50

    @property
    def backend(self) -> str:
        return TARGETS[self.target][1]

    def specs(self) -> list[FaultSpec]:
        return [parse_scenario(s) for s in self.scenarios]

    def validate(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"unknown target {self.target!r}; expected one of {', '.join(TARGETS)}")
        if not isinstance(self.world_size, int) or not 2 <= self.world_size <= 16:
            raise ValueError(f"world size must be an integer from 2 to 16 (one bad rank needs peers), got {self.world_size}")
        self.specs()  # raises on a bad scenario name
        if not self.scenarios:
            raise ValueError(f"no fault scenarios given; {SCENARIO_GRAMMAR}")
        if not 0 <= self.fault_rank < self.world_size:
            raise ValueError(f"fault rank {self.fault_rank} is not a rank of world size {self.world_size}")
        if self.steps < 4:
            raise ValueError(f"steps must be >= 4 (warm-up, healthy steps, the fault, a step after), got {self.steps}")
        if not 2 <= self.fault_step <= self.steps - 2:
            raise ValueError(
                f"fault step must be from 2 (step 0 is warm-up, step 1 is the healthy baseline a slowdown is "
                f"sized from) to steps - 2 = {self.steps - 2}, got {self.fault_step}"
            )
        if not 0 <= self.spare <= MAX_SPARES:
            raise ValueError(f"spare must be from 0 to {MAX_SPARES} hot spare ranks, got {self.spare}")
        if self.target != "cuda":
            check_ranks(self.world_size + self.spare, "world size + spares")
        if not 0.5 <= self.timeout_s <= 600:
            raise ValueError(f"timeout must be from 0.5 to 600 seconds, got {self.timeout_s}")
        if self.restart_step is not None and not 1 <= self.restart_step < self.steps:
            raise ValueError(f"restart step must be from 1 to steps - 1 = {self.steps - 1}, got {self.restart_step}")
        if self.straggler_excess is not None and not 0 < self.straggler_excess <= 10:
            raise ValueError(f"straggler excess must be a fraction > 0 and <= 10 (0.1 = 10%), got {self.straggler_excess}")
        if not self.settings:
            raise ValueError("no collective settings given")
        for name in self.settings:
            s = parse_setting(name)  # raises ValueError naming the grammar
            if s.placement == "per-host" and self.world_size % s.ranks_per_host:
                raise ValueError(
                    f"setting {name!r}: {s.ranks_per_host} ranks per host does not divide world size {self.world_size}"
                )
        if self.target == "cuda":
            import torch

            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if n < self.world_size + self.spare:
                raise ValueError(
                    f"--target cuda needs one GPU per rank and spare: world size {self.world_size} + "
                    f"{self.spare} spare(s), {n} GPU(s) visible"
                )

    def as_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------------------------
# Injection (runs in the rank process)
# ----------------------------------------------------------------------------------------------


def flap_step(seed: int, step: int) -> bool:
    """Whether a flapping rank is slow at ``step``: a seeded coin, the same on every backend."""
    return random.Random(seed * 1_000_003 + step).random() < 0.5


class Injector:
    """What the bad rank does at each step; every other rank gets an inert one.

    The job calls `step_begin` before a step's forward, `at_collective` in the DDP comm hook before
    the gradient all_reduce, `step_end` after backward, and `observe` with each healthy step's
    compute time (the baseline ``slow``/``flap`` are sized from). ``mode`` is ``"sim"`` (switch the
    sim device's faults) or ``"harness"`` (act at the collective, any backend).
    """

    def __init__(
        self,
        spec: FaultSpec,
        *,
        bad: bool,
        mode: str,
        fault_step: int,
        seed: int = 0,
        device_index: int = 0,
        on_fire: Callable[[int], None] | None = None,
    ) -> None:
        self.spec = spec
        self.bad = bad and spec.kind != "none"
        self.mode = mode
        self.fault_step = fault_step
        self.seed = seed
        self.device = f"sim:{device_index}"
        self.healthy: list[float] = []  # compute seconds of steps 1 .. fault_step-1
        self.launches = 0  # sim kernels per step, counted in step 0
        self.injected_at: float | None = None
        self.on_fire = on_fire  # told (before the fault acts: a dying rank says so first) when it first fires

    # -- sizing ---------------------------------------------------------------------------------

    def observe(self, step: int, compute_s: float) -> None:
        if 1 <= step < self.fault_step:
            self.healthy.append(compute_s)

    def extra_s(self, step: int) -> float:
        """Seconds of extra compute the bad rank takes at ``step`` (0 when it is not slow then)."""
        if not self.bad or step < self.fault_step or self.spec.kind not in ("slow", "flap"):
            return 0.0
        if self.spec.kind == "flap" and not flap_step(self.seed, step):
            return 0.0
        base = statistics.median(self.healthy) if self.healthy else 0.01
        return (self.spec.factor - 1.0) * base

    def _fired(self, step: int) -> bool:
        """Whether the fault acts at ``step`` (and record the first time it did)."""
        if not self.bad or step < self.fault_step:
            return False
        if self.spec.kind in ("nan",) and step != self.fault_step:
            return False
        if self.injected_at is None:
            self.injected_at = time.time()
            if self.on_fire is not None:
                self.on_fire(step)
        return True

    # -- hooks ----------------------------------------------------------------------------------

    def step_begin(self, step: int) -> None:
        if self.mode != "sim":
            return
        import harness.sim

        if step == 0 and self.bad and self.spec.kind in ("slow", "flap"):
            # Count the kernels of a step: a zero-length slowdown on every launch (step 0 is warm-up).
            harness.sim.set_faults(self.device, slow=1.0, slow_s=0.0)
            return
        if not self._fired(step):
            return
        kind = self.spec.kind
        if kind == "hang":
            harness.sim.set_faults(self.device, hang=1.0, hang_s=HANG_S, seed=self.seed)
        elif kind == "die":
            harness.sim.set_faults(self.device, crash=1.0, seed=self.seed)
        elif kind == "nan":
            harness.sim.set_faults(self.device, nan=1.0, seed=self.seed)
        else:  # slow / flap: every kernel of this step works its share of the extra time
            extra = self.extra_s(step)
            if extra > 0 and self.launches:
                harness.sim.set_faults(self.device, slow=1.0, slow_s=extra / self.launches, seed=self.seed)
            else:
                harness.sim.clear_faults(self.device)

    def step_end(self, step: int) -> None:
        if self.mode != "sim" or not self.bad:
            return
        import harness.sim

        if step == 0 and self.spec.kind in ("slow", "flap"):
            counts = harness.sim.injected_counts().get(self.device, {})
            self.launches = int(counts.get("slow", 0))
        if self.spec.kind in ("slow", "flap", "nan"):
            harness.sim.clear_faults(self.device)  # no fault may touch the finiteness flags or the optimizer

    def at_collective(self, step: int, bucket: torch.Tensor | None) -> None:
        """Harness mode: act on the gradient bucket before it goes to the backend."""
        if self.mode == "sim" or not self._fired(step):
            return
        kind = self.spec.kind
        if kind == "hang":
            threading.Event().wait(HANG_S)
        elif kind == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "nan":
            bucket.fill_(float("nan"))
        else:
            busy(self.extra_s(step))


def busy(seconds: float) -> None:
    """Work (spin) for ``seconds`` of this thread's CPU time: a slow device is busy, not asleep."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
