"""One model, end to end: load -> reference side (fp32 twice, fp64 oracle, declared-precision expected) ->
target -> compare -> explain a drift (the first diverging kernel, the first drifting module).

`run_one` never raises for a model's problems; it returns a `Measurement` whose outcome is the first
stage that failed (load_fail, ref_fail, ref_nondeterministic, skipped where the mode does not apply, then
the target's unsupported_op, crash, oom, drift) or pass. Timeouts and worker deaths are decided by the
supervisor, which sees the process die; whose fault an exception is, is `attribution`'s call. What one
step is (a forward, a training step, a teacher-forced decoding) is the mode's (`modes`), and so are the
row fields it measures beyond the verdict; the reference side and the target side are phases of their
own (`reference`, `target`), each device phase ending with a synchronize. How the target runs is a
`variants.Variant` (eager, compiled); after the first verdict, each follow-up (`variants.FOLLOW_UPS`: a
compiled failure re-checked eagerly, a declared-precision pass confirmed at full precision) may run the
target once more under other settings through the same path and fold its verdict into the row. With a reference cache
(`Task.ref_cache`) a model seen before takes its reference side from there, and its CPU model goes to
the device itself instead of a copy (no CPU copy is kept, nor an fp64 one, unless the mode needs the CPU
model after the target: train mode's replayed updates); a drift that needs them for localization
rebuilds them then.

Every phase hands its row fields over as a `harness.results.draft.RowDraft` (Measurement's field names, each
checked where it is set) and the pipeline merges them into one `Row`; its own timings are typed attributes there.
A new way of running a model adds phases and producers, never a field list.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from harness import phases
from harness.backends import adapter_for
from harness.backends.base import OpCensus
from harness.backends.contracts import Emulate, amp, autocast_region, contract, with_amp
from harness.models.model_list import ModelEntry
from harness.outcomes import BEYOND
from harness.results.draft import RowDraft
from harness.results.rows import Measurement
from harness.run.attribution import classify_exception, drain
from harness.run.compare import Tolerance, compare_outputs
from harness.run.compiled import Configuration, compiling
from harness.run.context import ModelRun, Stop, Task, load
from harness.run.localize import ModuleOutput, capture, first_drift
from harness.run.memory import PhaseClock
from harness.run.modes import mode_for
from harness.run.opcheck import OpCheck, describe, repro_preamble, write_repro
from harness.run.oracle import COPY_MAX_PARAMS, n_params
from harness.run.perf import measure_model
from harness.run.refcache import RefCache
from harness.run.reference import reference_side
from harness.run.target import TargetSide, census_fields, target_side, to_device
from harness.run.variants import FOLLOW_UPS, Variant, first_variant
from harness.verdict import KEPT, StepEvidence, kernel_message
from harness.verdict import reference as reference_outcome
from harness.verdict import step as decide

OP_SAMPLE = 2  # calls judged per op signature when the op check samples

__all__ = ["Task", "run_one"]


def run_one(task: Task, on_phase: Callable[[str], None] | None = None,
            recorder: Callable[[], Any] | None = None, parallel: Any = None) -> Measurement:
    """Run one model end to end; never raises for model problems. `on_phase(name)` hears each phase
    start (the worker tells the supervisor, whose time budget differs for loading). `recorder()` makes a
    dispatch mode that records the reference step's op calls into the row's `harvest` (run --harvest:
    `harness.ops.harvest.Harvest`, a later stage, handed in by the worker). `parallel`: the target side of a
    model spread over several devices (--parallel: `harness.parallel.launch.Parallel`, handed in likewise)."""
    entry = ModelEntry(**task.entry) if isinstance(task.entry, dict) else task.entry
    tol = Tolerance(
        tol=entry.atol if entry.atol is not None else Tolerance.tol,
        atol=entry.atol,
        rtol=entry.rtol,
    )
    t_start = time.perf_counter()
    with PhaseClock(on_phase) as clock:
        row = _pipeline(entry, task, tol, clock, recorder, parallel)
    return row.fields.measurement(
        model_id=entry.id,
        device=task.target,
        load_time_s=clock.seconds("load"),
        ref_time_s=row.ref_s,
        expected_time_s=clock.seconds("expected"),
        target_time_s=row.target_s,
        phases=clock.phases,
        wall_time_s=time.perf_counter() - t_start,
        peak_rss_mb=round(clock.rss.peak_mb, 1),
    )


@dataclass
class Row:
    """The row while the phases run: the fields they decided, and the seconds its timings take from them."""

    fields: RowDraft = field(default_factory=RowDraft)
    ref_s: float | None = None  # the reference step's first run (a cached side's, as it was when computed)
    target_s: float | None = None  # the first variant's judged run: a follow-up's runs are not the row's timings


@dataclass
class Judged:
    """One run of the target as a variant says, judged: its row fields (its failure's, where it stopped), and its
    target side (None: it stopped before the judged run finished)."""

    fields: RowDraft
    target: TargetSide | None


def _pipeline(entry: ModelEntry, task: Task, tol: Tolerance, clock: PhaseClock,
              recorder: Callable[[], Any] | None = None, parallel: Any = None) -> Row:
    row = Row()
    after: list[Callable[[], RowDraft]] = []
    try:
        _phases(entry, task, tol, clock, row, after, recorder, parallel)
    except Stop as stop:
        row.fields.update(stop.fields)
        return row
    if after:  # the verdict is complete: a worker that dies timing the step keeps it
        clock.establish(_established(row.fields))
    for timing in after:  # speed, once the verdict is complete
        with clock.phase(phases.PERF):
            row.fields.update(timing())
    return row


def _phases(entry: ModelEntry, task: Task, tol: Tolerance, clock: PhaseClock, row: Row,
            after: list[Callable[[], RowDraft]], recorder: Callable[[], Any] | None = None,
            parallel: Any = None) -> None:
    """The phases, writing into `row` (`Stop` where the row ends early); what runs after the verdict goes
    into `after`."""
    adapter = adapter_for(task.target)
    mode = mode_for(task.settings)
    with clock.phase(phases.LOAD):
        try:
            loaded, inputs = load(entry, task)
        except Exception as e:  # LoadError, or inputs/construction failing: "could not load this model"
            raise Stop(classify_exception(e, adapter, "load")) from None
    if parallel is not None and (why := parallel.skip(loaded.config)):
        raise Stop({"outcome": reference_outcome(applies=False), "error_message": why})

    declared = contract(with_amp(adapter.declared_precision(task.settings), Configuration.of(task.settings).amp))
    if declared.amp is not None:
        tol = replace(tol, amp_eps=torch.finfo(declared.amp).eps)
    run = ModelRun(entry, task, mode, adapter, clock, loaded, inputs, declared, tol)
    run.recorder = recorder() if recorder is not None else None
    run.parallel = parallel
    run.side = side = reference_side(run, RefCache(task.ref_cache) if task.ref_cache else None)
    row.ref_s = side.ref_s
    row.fields.update(side.plan.fields, oracle=side.oracle_rule)
    row.fields.update(side.fields)
    if run.recorder is not None:
        _harvest(run, row.fields)

    # A small model keeps its CPU copy for module-level localization (and train mode's replayed updates);
    # a real checkpoint moves to the device in place (one copy of the weights, held by the device). A cached
    # reference side needs no CPU copy for localization: the rare drift rebuilds it (`ModelRun.cpu_models`).
    params = n_params(run.model)
    run.small = params <= COPY_MAX_PARAMS
    run.localizes = task.localize and mode.localizes and (mode.keeps_cpu_model or params <= COPY_MAX_PARAMS)
    run.keep_cpu = mode.keeps_cpu_model or parallel is not None or (  # the ranks load what the CPU model is
        params <= COPY_MAX_PARAMS and ((task.localize and not side.cached) or task.perf))

    judged = first_variant(run)
    first = _attempt(run, judged, after)
    decided = first.fields  # the verdict's fields; follow-ups may amend or replace them
    row.target_s = first.target.seconds if first.target is not None else None
    # what a worker dying in a follow-up (or the timing) must not lose: the supervisor hears it now
    run.clock.establish(_established(decided))

    def rerun(variant: Variant) -> RowDraft:
        return _attempt(run, variant).fields

    for follow in FOLLOW_UPS:
        variant = follow.after(run, judged, decided)
        if variant is None:
            continue
        if follow.merge(run, decided, variant, _attempt(run, variant).fields, rerun):
            judged = variant
    row.fields.update(decided)


def _established(row: RowDraft) -> dict[str, Any]:
    """What of a verdict a later phase's death keeps (`harness.verdict.KEPT`), for the supervisor."""
    return {k: row[k] for k in ("outcome", "error_message", *KEPT) if row.get(k) not in (None, "")}


def _harvest(run: ModelRun, out: RowDraft) -> None:
    """The op calls the reference step made (recorded in its second run; with a cached reference side, in
    one more step now) into the row's `harvest`: diagnostics for the op worklist, never worth a verdict."""
    assert run.side is not None
    with run.clock.phase(phases.HARVEST):
        try:
            if not run.recorder.recorded:
                with run.recorder:
                    run.side.plan.step(run.model, run.side.plan.inputs)
            out["harvest"] = run.recorder.result()
        except Exception as e:
            out["harvest"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    run.recorder = None


def _attempt(run: ModelRun, variant: Variant, after: list[Callable[[], RowDraft]] | None = None) -> Judged:
    """Run the target as `variant` says and judge it. The first variant's phases are the row's own (target,
    compare, localize); a follow-up's are all one phase of its name."""
    fields = RowDraft()
    clock = run.clock
    target = None
    own = contextlib.nullcontext() if variant.first else clock.phase(variant.phase)
    cache = variant.cache if variant.cache is not None else run.task.compile_cache
    with own, compiling(variant.cfg, cache, clock.announce, lambda: clock.current) as watch:
        try:
            with clock.phase(variant.phase) if variant.first else contextlib.nullcontext():
                target = (target_side(run, variant, _op_check(run, variant), watch=watch) if run.parallel is None
                          else _parallel_side(run, variant))
            fields.update(target.row)
            if variant.timed and after is not None:
                after.append(_perf(run, target, variant))
            _verdict(run, variant, target, fields)
        except Stop as stop:
            fields.update(stop.fields)
    return Judged(fields, target)


def _verdict(run: ModelRun, variant: Variant, target: TargetSide, out: RowDraft) -> None:
    """Compare the target's step with the reference side's and explain a drift, writing the row's fields
    into `out`."""
    assert run.side is not None
    side, mode, declared, clock = run.side, run.mode, variant.declared, run.clock
    check = target.op_check
    with clock.phase(phases.COMPARE) if variant.first else contextlib.nullcontext():
        ref, oracle, expected, tol = mode.before_compare(run.cpu_model, side.ref, target.out, side.oracle,
                                                         side.expected if not declared.exact else None, run.tol)
        verdict = compare_outputs(ref, target.out, oracle, tol, expected)
    out.update(census_fields(target.census))
    out.update(
        verdict.summary(),
        metrics={c.name: c.to_dict() for c in verdict.checks},
        contract=declared.name,
        ops_checked=check.checked if check is not None else None,
        ops_sampled_out=check.sampled_out if check is not None and check.per_signature is not None else None,
    )
    assessed = mode.assess(ref, target.out, verdict)
    out.update(assessed.fields, **mode.measure(side, target, verdict, tol))
    kernel = check.failure if check is not None else None
    judgements = tuple(c.judgement for c in verdict.checks)
    found = decide(StepEvidence(judgements, kernel is not None, tuple(assessed.missing_grads)))
    out.update(found.fields, outcome=found.outcome)
    if found.message:
        out["error_message"] = found.message
    if found.outcome != "drift":
        return
    out["nonfinite"] = verdict.nonfinite
    worst = verdict.worst
    messages = []
    if kernel is not None:
        out.update(describe(kernel))
        what = "kernel" if kernel.func is not None else "compiled graph node"  # the graph check's: no ATen op
        messages.append(kernel_message(what, kernel.op, kernel.inputs, declared.name, kernel.ratio, kernel.note,
                                       where=kernel.module or "the top module", output=f"output {kernel.output}"))
        if run.task.repro_dir and variant.repro and kernel.func is not None:  # a graph's node has no single ATen op
            preamble = repro_preamble(run.task.backends, run.adapter.repro_setup(variant.settings))
            out["repro_path"] = str(write_repro(kernel, contract=declared, target=run.device, preamble=preamble,
                                                model_id=run.entry.id, directory=Path(run.task.repro_dir)))
    beyond = BEYOND in judgements
    if beyond and worst is not None:
        messages.append(
            f"output {worst.name!r} out of tolerance: rmse ratio {_g(worst.rmse_ratio)}, declared ratio "
            f"{_g(worst.declared_ratio)}, max abs {_g(worst.max_abs)}"
            + (" (non-finite values on target)" if verdict.nonfinite else "")
        )
    elif not beyond:
        messages.append(f"outputs within the {'fp32' if verdict.ok else 'declared'} envelope")
    messages += mode.explain(out, kernel, verdict, "fp32" if declared.exact else "declared")
    if run.parallel is not None and run.parallel.note:  # which rank, before or after the collectives
        messages.append(run.parallel.note)
    out["error_message"] = "; ".join(messages)
    if run.localizes and variant.localize:
        with clock.phase(phases.LOCALIZE) if variant.first else contextlib.nullcontext():
            _localized(run, variant, target, out)


def _localized(run: ModelRun, variant: Variant, target: TargetSide, out: RowDraft) -> None:
    """The first drifting module, into `out` (localization is diagnostics: never lose the verdict over it)."""
    try:
        cpu, oracle_model = run.cpu_models()
        site = _localize(run, variant, cpu, oracle_model, target)
        if run.parallel is None:  # (the ranks synchronized their own devices)
            run.adapter.synchronize(run.device)
    except Exception as e:
        late = drain(run.adapter, run.device) if run.parallel is None else None
        out["error_message"] += (f"; localization failed: {type(e).__name__}: {e}"
                                 + (f" (the device then reported {type(late).__name__}: {late})" if late else ""))
    else:
        if site is not None:
            out["first_drift_module"] = site.module
            out["first_drift_module_type"] = site.module_type
            if site.rank is not None:
                out["error_message"] += (f"; the first drifting module is {site.module} on rank {site.rank} "
                                         f"({run.parallel.devices[site.rank]})")


def _whole_only(ref: list[ModuleOutput], ranks: list[ModuleOutput]) -> list[ModuleOutput]:
    """A rank's module outputs of the reference's shapes: tensor parallel's local shards (a colwise layer's
    slice of the features) are no module's whole output, so they judge nothing."""
    shapes = {(r.qualname, r.call, k): t.shape for r in ref for k, t in r.tensors.items()}
    return [replace(r, tensors={k: t for k, t in r.tensors.items() if shapes.get((r.qualname, r.call, k)) == t.shape})
            for r in ranks]


def _g(v: float | None) -> str:
    """A number as a message shows it: three significant digits (65.1, not 65.05722897265998)."""
    return "-" if v is None else f"{v:.3g}"


def _perf(run: ModelRun, target: TargetSide, variant: Variant) -> Callable[[], RowDraft]:
    """The speed measurement, bound to this model's CPU copy and device model now (the pipeline lets go
    of the CPU model of a checkpoint that moved to the device in place). A compiled variant also times the
    step eagerly: the speedup."""
    assert run.side is not None
    plan, cpu_model = run.side.plan, run.cpu_model
    return lambda: measure_model(plan, cpu_model, target, run.device, run.adapter, variant.settings,
                                 run.task.perf_budget_s, compiled=variant.cfg.compiled)


def _parallel_side(run: ModelRun, variant: Variant) -> TargetSide:
    """The step on every rank of the group (`harness.parallel.launch`, handed in by the worker): its outputs as a
    target side's; a rank that fails stops the row (`Stop`) with its fields, the rank named."""
    assert run.side is not None
    t0 = time.perf_counter()
    out = _on_ranks(run, variant)
    row = RowDraft(parallel=run.parallel.fields(), **run.parallel.compiled)
    if run.parallel.timed:
        row["collectives"] = run.parallel.timed
    return TargetSide(run.model, run.side.plan.inputs, out, time.perf_counter() - t0, OpCensus(), None, row=row)


def _on_ranks(run: ModelRun, variant: Variant, localize: bool = False) -> dict[str, torch.Tensor]:
    """One launch of the step on the group's ranks, as `variant` runs it (their modules recorded: `localize`)."""
    assert run.side is not None
    return run.parallel.run(model=run.model, entry=asdict(run.entry), inputs=run.inputs, settings=variant.settings,
                            seed=run.task.seed, fields=dict(run.side.plan.fields), reference=run.side.ref,
                            cfg=asdict(variant.cfg), localize=localize)


def _op_check(run: ModelRun, variant: Variant) -> OpCheck | None:
    """The op check for this run of the target (compiled: the graph check, which takes its place): every call
    for small models (and `all`), the first calls of each signature for real checkpoints (a 24-layer model
    repeats each kernel 24 times)."""
    how = run.settings.get("op_check", "auto")
    if how == "off" or not variant.op_check or run.parallel is not None:
        return None
    sampled = how == "sampled" or (how == "auto" and not run.small)
    return OpCheck(torch.device(run.device).type, variant.declared, per_signature=OP_SAMPLE if sampled else None)


def _localize(run: ModelRun, variant: Variant, model: torch.nn.Module, oracle_model: torch.nn.Module | None,
              target: TargetSide):
    inputs, declared = run.inputs, None if variant.declared.exact else variant.declared
    ref_rec = capture(model, lambda: model(**inputs))
    oracle_rec = (
        capture(oracle_model, lambda: oracle_model(**to_device(inputs, "cpu", torch.float64))) if oracle_model else None
    )
    expected_rec = None
    if declared is not None:
        with Emulate(declared), autocast_region("cpu"):
            expected_rec = capture(model, lambda: model(**inputs))
    if run.parallel is not None:  # the ranks again, each recording its modules
        _on_ranks(run, variant, localize=True)
        order = {(r.qualname, r.call): i for i, r in enumerate(ref_rec)}
        sites = [(order.get(site.key, len(order)), rank, site) for rank, recs in enumerate(run.parallel.modules)
                 if (site := first_drift(ref_rec, _whole_only(ref_rec, recs), oracle_rec, run.tol, expected_rec))]
        if not sites:
            return None
        _, rank, site = min(sites, key=lambda s: s[:2])  # the first in the forward, whichever rank it is on
        site.rank = rank
        return site
    # the target's settings only around the target (they may be global)
    with run.adapter.apply(variant.settings), amp(declared.amp if declared is not None else None):
        with autocast_region(torch.device(run.adapter.kind)):
            tgt_rec = capture(target.model, lambda: target.model(**target.inputs))
    return first_drift(ref_rec, tgt_rec, oracle_rec, run.tol, expected_rec)
