"""The phases of one job, in one table: the order they run in, what each is doing, and where it runs.

Where a phase runs decides what a worker's death or hang in it says (`harness.fleet.policy`): on the host
before the target (`reference`: the model loaded, the reference side computed, cached or harvested) it says
nothing about the target (`ref_timeout`, no strike); on the target device (`device`: the step, its
re-runs, the timing, localization) it is evidence against the device; on the host after the target
(`host`: the comparison; the compiler, which has its own deadline) it strikes no device. Each way of running
the target (`harness.run.variants`) names its phase from here; every list of phases elsewhere is derived
from this table, never written out again.

A row's `phases` holds those it reached (a phase taken from the reference cache has {"s": 0, "cached":
true}); `compile` is no timed phase but where a worker is while the compiler runs (--compile-timeout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Where = Literal["reference", "device", "host"]


@dataclass(frozen=True)
class Phase:
    name: str
    where: Where
    doing: str  # what a notice says while it runs long (harness.fleet.notices)


LOAD = Phase("load", "reference", "loading the model (a big checkpoint takes a while)")
REF_CACHE = Phase("ref_cache", "reference", "looking the reference side up in the reference cache")
REFERENCE = Phase("reference", "reference", "running the fp32 CPU reference")
ORACLE = Phase("oracle", "reference", "computing the fp64 oracle (a float64 copy of the model: the slowest reference phase)")
EXPECTED = Phase("expected", "reference", "running the declared-precision expected reference")
REF_STORE = Phase("ref_store", "reference", "storing the reference side in the reference cache")
HARVEST = Phase("harvest", "reference", "recording the reference step's op calls as variations")
TARGET = Phase("target", "device", "running on the target")
COMPARE = Phase("compare", "host", "comparing the outputs")
LOCALIZE = Phase("localize", "device", "localizing the drift module by module")
CONFIRM = Phase("confirm", "device", "confirming a declared-precision pass at the device's highest precision")
EAGER = Phase("eager", "device", "running the step eagerly to see whose failure it is")
RECOMPILE = Phase("recompile", "device", "compiling again in a fresh compile cache (the run's own may have caused the "
                  "failure) and running it")
PERF = Phase("perf", "device", "timing the step (--perf)")
COMPILE = Phase("compile", "host", "compiling the target's step ({compile}; a cold Inductor cache takes minutes, later "
                "runs reuse it)")

TABLE: tuple[Phase, ...] = (LOAD, REF_CACHE, REFERENCE, ORACLE, EXPECTED, REF_STORE, HARVEST, TARGET, COMPARE, LOCALIZE,
                            CONFIRM, EAGER, RECOMPILE, PERF, COMPILE)
BY_NAME: dict[str, Phase] = {p.name: p for p in TABLE}
PHASES: tuple[str, ...] = tuple(p.name for p in TABLE if p is not COMPILE)  # the timed ones, in the order they run
COMPILE_PHASE = COMPILE.name
REFERENCE_PHASES: frozenset[str] = frozenset(p.name for p in TABLE if p.where == "reference")
DEVICE_PHASES: frozenset[str] = frozenset(p.name for p in TABLE if p.where == "device")
# no phase heard yet: "" (a Ray actor's is read from its node only near a deadline)
PHASE_DOING: dict[str, str] = {"": "running", **{p.name: p.doing for p in TABLE}}
