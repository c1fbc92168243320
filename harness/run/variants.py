"""Ways of running the target's step, and the re-runs that feed a verdict.

A `Variant` is one way of running the step on the device: its backend settings, its configuration
(eager or compiled, autocast), the contract its outputs are judged by, where its model comes from and
which extras it runs. The pipeline runs the *first* variant the run's settings name (eager, or compiled
under ``--compile``), judges it, then asks each `FollowUp` in turn whether the row needs one more run of
the target under other settings, and folds that run's verdict into the row:

- `EagerRecheck`: a compiled row that does not pass runs the same step eagerly on the same device, on a
  fresh model, and says whose failure it is ("compiled only; eager on sim:0 passes").
- `Confirmation`: a row that passes only within the declared precision (``pass_declared``) runs once more
  at the device's highest precision, judged by the fp32 rule (the adapter says how: `confirm_settings`).
  There rounding is gone, so what is left is a bug: the row becomes ``drift`` with the first drifting
  module, op and step named from that run. A device without such a mode leaves the row ``unconfirmed``.
  A row that drifts at the declared precision runs there too, to be located: rounding can mask where a
  drift starts (a decoding step, an op near the envelope); the verdict stays the declared run's.

Both are the same mechanism: a variant, run through the pipeline's one path, and a merge rule. The
merge rules are `harness.verdict`'s (`confirmed`, `located`, `rechecked`): plain functions of the row's
fields, tested without a device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

from harness import phases, verdict
from harness.backends.contracts import Contract, contract
from harness.outcomes import PASSING
from harness.phases import Phase
from harness.results.draft import RowDraft
from harness.run.compiled import Configuration, retry_in_fresh_cache
from harness.run.context import ModelRun

Source = Literal["first", "fresh", "reuse"]  # the loaded model; a fresh one; the device model the last run left


@dataclass(frozen=True)
class Variant:
    """One way of running the target's step."""

    name: str  # in messages: "eager", "compiled (inductor)", "eager re-check", "confirmation at highest"
    phase: Phase  # the phase the clock and the supervisor see (harness.phases: each runs on the device)
    settings: dict[str, Any]  # the backend's settings around the step
    cfg: Configuration  # compiled or eager, autocast
    declared: Contract  # what its outputs are judged by
    source: Source = "first"
    warmup: bool = True  # a run before the judged one (first-call costs; compiled: the compile)
    extra: bool = True  # the plan's extra run (generate's free-running decoding)
    repro: bool = True  # a first diverging op gets a standalone repro
    localize: bool = True  # a drift is localized to a module (where the run localizes at all)
    op_check: bool = True  # the op check (or, compiled, the graph check) runs where the settings ask
    timed: bool = False  # --perf times this run's step after the verdict
    cache: str | None = None  # compiled: its compile-cache directory (None: the run's)
    of: Variant | None = None  # the variant this one re-checks

    @property
    def first(self) -> bool:
        return self.source == "first"


def first_variant(run: ModelRun) -> Variant:
    """The run the settings name: eager, or compiled in place (localized by the graph check's node, not by
    module hooks, which would change what is compiled)."""
    cfg = Configuration.of(run.settings)
    name = f"compiled ({cfg.label()})" if cfg.compiled else "eager"
    return Variant(name, phases.TARGET, run.settings, cfg, run.declared, localize=not cfg.compiled,
                   timed=run.task.perf and run.parallel is None)


Rerun = Callable[[Variant], RowDraft]  # the pipeline's one path: a variant run and judged, its row fields


class FollowUp(Protocol):
    def after(self, run: ModelRun, judged: Variant, row: RowDraft) -> Variant | None:
        """The variant to run now, given the verdict's fields so far (`row`, judged by `judged`); None when
        none is due (it may note why in `row`)."""

    def merge(self, run: ModelRun, row: RowDraft, variant: Variant, fields: RowDraft, rerun: Rerun) -> bool:
        """Fold `variant`'s row fields into the row (`rerun` runs another variant, if it needs one); True when
        the row's verdict is now the variant's."""


class EagerRecheck:
    """A compiled row that does not pass: the same step eagerly, on a fresh model (the compiled one may be
    half-way through a failure, and a backend whose parameters move by swap_tensors refuses to move a
    compiled module's again). Where the run's compile cache may be the cause (`compiled.cache_suspect`: it
    is the harness's state, not the backend's), the compiled step runs again in a fresh cache first."""

    def after(self, run: ModelRun, judged: Variant, row: RowDraft) -> Variant | None:
        if not judged.cfg.compiled or row.get("outcome") in PASSING or row.get("device_fault"):
            return None
        return replace(judged, name="eager re-check", phase=phases.EAGER, cfg=judged.cfg.eager(), source="fresh",
                       extra=False, repro=False, localize=False, timed=False, of=judged)

    def merge(self, run: ModelRun, row: RowDraft, variant: Variant, fields: RowDraft, rerun: Rerun) -> bool:
        if fields.get("device_fault"):  # the device failed under the re-check: the row is the device's
            row.update(fields)
            return True
        assert variant.of is not None
        again = retry_in_fresh_cache(run.task.compile_cache, row, fields.get("outcome", ""), lambda fresh: rerun(
            replace(variant.of, name="compiled in a fresh cache", phase=phases.RECOMPILE, source="fresh", timed=False,
                    cache=fresh)))
        if again is not None:
            row.clear()
            row.update(again)
        if row.get("outcome") not in PASSING and not row.get("device_fault"):
            row.update(verdict.rechecked(row, fields, run.device))
        return False


class Confirmation:
    """A ``pass_declared`` row, confirmed at the device's highest precision; a ``drift`` row at a declared
    precision, located there (see the module docstring)."""

    def after(self, run: ModelRun, judged: Variant, out: RowDraft) -> Variant | None:
        if run.settings.get("confirm") == "off":
            return None
        outcome = out.get("outcome")
        # rounding at the declared precision can mask where a drift starts (a decoding step, an op near the envelope)
        locating = outcome == "drift" and not out.get("device_fault") and not judged.declared.exact
        if not locating and outcome != "pass_declared":
            return None
        at = _highest(run, judged)
        if isinstance(at, str):
            if not locating:
                out.update(confirm=verdict.UNCONFIRMED, confirm_note=at)
            return None
        highest, declared = at
        # An eager run's device model is left as it was (the step never changes it): run it again there.
        # Most confirmations pass: their op check (a second, per-op run) runs only for one that does not; a
        # location needs it at once.
        name = "location at full precision" if locating else \
            f"confirmation at {highest.get('precision', 'highest')} precision"
        return replace(judged, name=name, phase=phases.CONFIRM, settings=highest, declared=declared,
                       source="fresh" if judged.cfg.compiled else "reuse", warmup=judged.cfg.compiled,
                       extra=False, timed=False, op_check=locating and judged.op_check, of=judged)

    def merge(self, run: ModelRun, row: RowDraft, variant: Variant, fields: RowDraft, rerun: Rerun) -> bool:
        if row.get("outcome") == "drift":  # located (a confirmed row is pass_declared until merged)
            verdict.located(row, fields, run.declared.name)
            return False
        if (not variant.op_check and fields.get("outcome") not in PASSING and not fields.get("device_fault")
                and variant.of is not None and variant.of.op_check):
            fields = rerun(replace(variant, op_check=True))  # the op and module that drift, from that run
        return verdict.confirmed(row, fields, run.declared.name)


def _highest(run: ModelRun, judged: Variant) -> tuple[dict[str, Any], Contract] | str:
    """The settings and contract of the device's highest precision for `judged`, or why there is none."""
    highest = run.adapter.confirm_settings(judged.settings)
    if highest is None:
        return f"{run.adapter.kind} has no full-precision mode to confirm it at: the declared precision may hide a bug"
    if judged.cfg.amp:
        return (f"--amp {judged.cfg.amp}: autocast rounds at every matmul precision, so no run is free of it to "
                "confirm at")
    declared = contract(run.adapter.declared_precision(highest))
    if not declared.exact:
        return f"{run.adapter.kind} declares {declared.name} even at its highest precision: nothing to confirm it at"
    return highest, declared


FOLLOW_UPS: tuple[FollowUp, ...] = (Confirmation(), EagerRecheck())
