"""One model, end to end: load -> reference side (fp32 twice, fp64 oracle, declared-precision expected) ->
target -> compare -> explain a drift (the first diverging kernel, the first drifting module).

`run_one` never raises for a model's problems; it returns a `Measurement` whose outcome is the first
stage that failed (load_fail, ref_fail, ref_nondeterministic, skipped where the mode does not apply, then
the target's unsupported_op, crash, oom, drift) or pass. Timeouts and worker deaths are decided by the
supervisor, which sees the process die; whose fault an exception is, is `attribution`'s call. What one
step is (a forward, a training step, a teacher-forced decoding) is the mode's (`modes`), and so are the
row fields it measures beyond the verdict; the reference side and the target side are phases of their
own (`reference`, `target`), each device phase ending with a synchronize. With a reference cache
(`Task.ref_cache`) a model seen before takes its reference side from there, and its CPU model goes to
the device itself instead of a copy (no CPU copy is kept, nor an fp64 one, unless the mode needs the CPU
model after the target: train mode's replayed updates); a drift that needs them for localization
rebuilds them then.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from harness.backends import adapter_for
from harness.backends.contracts import Emulate, amp, autocast_region, contract, with_amp
from harness.models.inputs import make_inputs
from harness.models.load import load_model
from harness.models.model_list import ModelEntry
from harness.outcomes import PASSING
from harness.results.rows import Measurement
from harness.run.attribution import classify_exception, drain
from harness.run.compare import Tolerance, compare_outputs
from harness.run.configs import CompileWatch, Configuration, compile_cache, retry_in_fresh_cache, uncompile
from harness.run.localize import capture, first_drift
from harness.run.memory import PhaseClock
from harness.run.modes import mode_for
from harness.run.opcheck import OpJudge
from harness.run.oracle import COPY_MAX_PARAMS, n_params
from harness.run.perf import DEFAULT_BUDGET_S, measure_model
from harness.run.refcache import RefCache
from harness.run.reference import ReferenceSide, Stop, reference_side
from harness.run.repro import describe, repro_preamble, write_repro
from harness.run.target import census_fields, target_side, to_device

OP_SAMPLE = 2  # calls judged per op signature when the op check samples


@dataclass
class Task:
    """One model to run on one target device with the given backend settings."""

    entry: dict[str, Any]
    target: str  # device string: "sim:1", "cuda:0", "cpu"
    settings: dict[str, Any] = field(default_factory=dict)  # precision, ops, attn
    seed: int = 0
    localize: bool = True
    repro_dir: str = ""  # where the first diverging op's standalone repro goes ("" = none)
    backends: list[str] = field(default_factory=list)  # modules the repro imports to get the backend
    ref_cache: str = ""  # reference cache directory ("" = none: the reference side is computed)
    perf: bool = False  # time the step after the verdict (harness.run.perf)
    perf_budget_s: float = DEFAULT_BUDGET_S
    compile_cache: str = ""  # --compile: Inductor's cache directory ("" = torch's default)
    quiet_lock: str = ""  # --perf beside other workers: the run's lock file (harness.fleet.quiet)
    quiet_wait_s: float = 30.0  # the longest wait for it


def run_one(task: Task, on_phase: Callable[[str], None] | None = None) -> Measurement:
    """Run one model end to end; never raises for model problems. `on_phase(name)` hears each phase
    start (the worker tells the supervisor, whose time budget differs for loading)."""
    entry = ModelEntry(**task.entry) if isinstance(task.entry, dict) else task.entry
    tol = Tolerance(
        tol=entry.atol if entry.atol is not None else Tolerance.tol,
        atol=entry.atol,
        rtol=entry.rtol,
    )
    t_start = time.perf_counter()
    with PhaseClock(on_phase) as clock:
        fields = _pipeline(entry, task, tol, clock)
    return Measurement(
        model_id=entry.id,
        device=task.target,
        load_time_s=clock.seconds("load"),
        ref_time_s=fields.pop("_ref_s", None),
        expected_time_s=clock.seconds("expected"),
        target_time_s=fields.pop("_target_s", None),
        phases=clock.phases,
        **fields,
        wall_time_s=time.perf_counter() - t_start,
        peak_rss_mb=round(clock.rss.peak_mb, 1),
    )


def _pipeline(entry: ModelEntry, task: Task, tol: Tolerance, clock: PhaseClock) -> dict[str, Any]:
    out: dict[str, Any] = {}
    after: list[Callable[[], dict[str, Any]]] = []
    try:
        _phases(entry, task, tol, clock, out, after)
    except Stop as stop:
        return {**out, **stop.fields}
    for timing in after:  # speed, once the verdict is complete
        with clock.phase("perf"):
            out.update(timing())
    return out


def _phases(entry: ModelEntry, task: Task, tol: Tolerance, clock: PhaseClock, out: dict[str, Any],
            after: list[Callable[[], dict[str, Any]]]) -> None:
    """The phases, writing the row's fields into `out` (`Stop` where the row ends early); what runs after
    the verdict goes into `after`."""
    device = task.target
    adapter = adapter_for(device)
    mode = mode_for(task.settings)
    with clock.phase("load"):
        try:
            loaded = load_model(entry, seed=task.seed, attn_implementation=task.settings.get("attn"),
                                dtype=task.settings.get("dtype"))
            model = loaded.model
            inputs = make_inputs(model, loaded.config, entry, seed=task.seed)
        except Exception as e:  # LoadError, or inputs/construction failing: "could not load this model"
            raise Stop(classify_exception(e, adapter, "load")) from None

    cfg = Configuration.of(task.settings)
    declared = contract(with_amp(adapter.declared_precision(task.settings), cfg.amp))
    if declared.amp is not None:
        tol = replace(tol, amp_eps=torch.finfo(declared.amp).eps)
    cache = RefCache(task.ref_cache) if task.ref_cache else None
    side = reference_side(model, loaded, entry, inputs, mode, declared, task.settings, task.seed, adapter, clock,
                          cache)
    out.update(side.plan.fields, _ref_s=side.ref_s, oracle=side.oracle_rule)
    out.update(side.fields)

    # A small model keeps its CPU copy for module-level localization (and train mode's replayed updates);
    # a real checkpoint moves to the device in place (one copy of the weights, held by the device). A cached
    # reference side needs no CPU copy for localization: the rare drift rebuilds it (`_cpu_models`).
    params = n_params(model)
    localizes = task.localize and mode.localizes and (mode.keeps_cpu_model or params <= COPY_MAX_PARAMS)
    keep_cpu = mode.keeps_cpu_model or (params <= COPY_MAX_PARAMS and ((task.localize and not side.cached) or task.perf))
    cpu_model = model if keep_cpu else None
    judge = _judge(device, declared, task.settings.get("op_check", "auto"), params)
    if not cfg.compiled:
        with clock.phase("target"):
            target = target_side(model, side.plan, device, adapter, task.settings, task.seed, judge,
                                 copy_model=keep_cpu, cfg=cfg)
        if task.perf:
            after.append(_perf(side.plan, cpu_model, target, device, adapter, task))
        _verdict(entry, task, mode, side, target, declared, tol, cpu_model, adapter, clock, out,
                 inputs if localizes else None)
        return
    # Compiled: a row that does not pass also says what the same step does eagerly on the same device.
    def compiled(directory: str) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        with compile_cache(directory):
            try:
                with clock.phase("target"):
                    target = target_side(model, side.plan, device, adapter, task.settings, task.seed, judge,
                                         copy_model=keep_cpu, cfg=cfg, contract=declared,
                                         watch=CompileWatch(clock.announce, lambda: clock.current))
                fields.update(target.compile_fields)
                if task.perf:
                    fields["_perf"] = _perf(side.plan, cpu_model, target, device, adapter, task)
                # localized by the graph check's node, not by module hooks (they would change what is compiled)
                _verdict(entry, task, mode, side, target, declared, tol, cpu_model, adapter, clock, fields)
            except Stop as stop:
                fields.update(stop.fields)
        return fields

    row = compiled(task.compile_cache)
    if row.get("outcome") not in PASSING and not row.get("device_fault"):
        if not keep_cpu:
            uncompile(model)  # it went to the device in place
        eager: dict[str, Any] = {}
        with clock.phase("eager"):
            try:
                target = target_side(model, side.plan, device, adapter, task.settings, task.seed,
                                     _judge(device, declared, task.settings.get("op_check", "auto"), params),
                                     copy_model=keep_cpu, cfg=cfg.eager())
                _verdict(entry, replace(task, repro_dir=""), mode, side, target, declared, tol, cpu_model, adapter,
                         clock, eager)
            except Stop as stop:
                eager.update(stop.fields)
        # the compile cache is the harness's state: a failure it may have caused is tried in a fresh one first
        row = retry_in_fresh_cache(task.compile_cache, row, eager.get("outcome", ""), compiled) or row
        if row.get("outcome") not in PASSING and not row.get("device_fault"):
            row.update(eager_message(row, eager, device))
    timing = row.pop("_perf", None)
    if timing is not None:
        after.append(timing)
    out.update(row)


def eager_message(compiled: dict[str, Any], eager: dict[str, Any], device: str) -> dict[str, Any]:
    """The compiled row's `eager_outcome` and its message saying whose failure it is."""
    outcome = eager.get("outcome", "")
    if outcome in PASSING:
        head = f"compiled only; eager on {device} passes ({outcome})"
    else:
        why = eager.get("first_drift_op") or eager.get("unsupported_op") or eager.get("error_type") or ""
        head = f"eager on {device} fails too ({outcome}{': ' + why if why else ''})"
    return {"eager_outcome": outcome, "error_message": f"{head}; {compiled.get('error_message', '')}"[:2000]}


def _verdict(entry: ModelEntry, task: Task, mode: Any, side: ReferenceSide, target: Any, declared: Any,
             tol: Tolerance, model: torch.nn.Module | None, adapter: Any, clock: PhaseClock, out: dict[str, Any],
             inputs: dict[str, Any] | None = None) -> None:
    """Compare the target's step with the reference side's and explain a drift, writing the row's fields
    into `out` (`model`: the CPU model, if kept; `inputs`: the model's, to localize a drift to a module)."""
    device = task.target
    judge = target.judge
    out["_target_s"] = target.seconds
    with clock.phase("compare") if clock.current != "eager" else contextlib.nullcontext():
        ref, oracle, expected, tol = mode.before_compare(model, side.ref, target.out, side.oracle, side.expected, tol)
        verdict = compare_outputs(ref, target.out, oracle, tol, expected)
    out.update(
        census_fields(target.census),
        metrics={c.name: c.to_dict() for c in verdict.checks},
        **verdict.summary(),
        contract=declared.name,
        outcome=verdict.outcome,
        ops_checked=judge.checked if judge is not None else None,
        ops_sampled_out=judge.sampled_out if judge is not None and judge.per_signature is not None else None,
    )
    judged = mode.judge(ref, target.out, verdict)
    out.update(judged.fields, **mode.measure(side, target, verdict, tol))
    if judged.outcome is not None:
        out.update(outcome=judged.outcome, error_message=judged.message)
        return
    kernel = judge.failure if judge is not None else None
    if verdict.outcome != "drift" and kernel is None:
        return
    out["outcome"] = "drift"
    out["nonfinite"] = verdict.nonfinite
    worst = verdict.worst
    messages = []
    if kernel is not None:
        out.update(describe(kernel))
        what = "kernel" if kernel.func is not None else "compiled graph node"  # the graph check's: no ATen op
        where = f"{what} {kernel.op} (in {kernel.module or 'the top module'}, inputs {', '.join(kernel.inputs[:4])})"
        messages.append(
            f"{where} is beyond the declared {declared.name} precision on its own inputs (ratio {kernel.ratio:.3g})"
            + (f"; {kernel.note}" if kernel.note else "")
            if kernel.ratio is not None else  # a wrong shape or dtype: nothing to measure, still the finding
            f"{where} returns output {kernel.output} unlike the CPU's: {kernel.note or 'not comparable'}"
        )
        if task.repro_dir and kernel.func is not None:  # a compiled graph's node has no single ATen op to replay
            preamble = repro_preamble(task.backends, adapter.repro_setup(task.settings))
            out["repro_path"] = str(write_repro(kernel, contract=declared, target=task.target, preamble=preamble,
                                                model_id=entry.id, directory=Path(task.repro_dir)))
    if verdict.outcome == "drift" and worst is not None:
        messages.append(
            f"output {worst.name!r} out of tolerance: rmse ratio {worst.rmse_ratio}, declared ratio "
            f"{worst.declared_ratio}, max abs {worst.max_abs}" + (" (non-finite values on target)" if verdict.nonfinite else "")
        )
    elif verdict.outcome != "drift":
        messages.append(f"outputs within the {'fp32' if verdict.ok else 'declared'} envelope")
    messages += mode.explain(out, kernel, verdict, "fp32" if declared.exact else "declared")
    out["error_message"] = "; ".join(messages)
    if inputs is not None:  # the caller localizes: a small model, eager, a mode that names modules
        with clock.phase("localize"):
            try:
                cpu, oracle_model = ((model, side.oracle_model) if not side.cached
                                     else _cpu_models(entry, task, side, model))
                site = _localize(cpu, oracle_model, target.model, inputs, target.inputs, tol, adapter,
                                 task.settings, None if declared.exact else declared)
                adapter.synchronize(device)
            except Exception as e:  # localization is diagnostics: never lose the verdict over it
                late = drain(adapter, device)
                out["error_message"] += (f"; localization failed: {type(e).__name__}: {e}"
                                         + (f" (the device then reported {type(late).__name__}: {late})" if late else ""))
            else:
                if site is not None:
                    out["first_drift_module"] = site.module
                    out["first_drift_module_type"] = site.module_type


def _cpu_models(entry: ModelEntry, task: Task, side: ReferenceSide, model: torch.nn.Module | None
               ) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The CPU model (`model` where it was kept; else loaded again and prepared as its plan prepares it)
    and its fp64 copy where the oracle was one: what a run without the cache keeps for localization,
    rebuilt for a drift whose reference side came from the cache."""
    if model is None:
        loaded = load_model(entry, seed=task.seed, attn_implementation=task.settings.get("attn"),
                            dtype=task.settings.get("dtype"))
        model = loaded.model
        inputs = make_inputs(model, loaded.config, entry, seed=task.seed)
        mode_for(task.settings).rebuild(model, loaded, entry, inputs, task.seed, side.plan.fields)
    return model, copy.deepcopy(model).double() if side.oracle_rule == "fp64-copy" else None


def _perf(plan, cpu_model, target, device, adapter, task) -> Callable[[], dict[str, Any]]:
    """The speed measurement, bound to this model's CPU copy and device model now (the pipeline lets go
    of the CPU model of a checkpoint that moved to the device in place). A compiled configuration
    (``--compile``, issue 20's ``compile`` setting) also times the step eagerly: the speedup."""
    return lambda: measure_model(plan, cpu_model, target, device, adapter, task.settings, task.perf_budget_s,
                                 compiled=bool(task.settings.get("compile")))


def _judge(device: str, declared, mode: str, params: int) -> OpJudge | None:
    """The op check for this model: every call for small models (and `all`), the first calls of each
    signature for real checkpoints (a 24-layer model repeats each kernel 24 times)."""
    if mode == "off":
        return None
    sampled = mode == "sampled" or (mode == "auto" and params > COPY_MAX_PARAMS)
    return OpJudge(torch.device(device).type, declared, per_signature=OP_SAMPLE if sampled else None)


def _localize(model, oracle_model, tmodel, inputs, target_inputs, tol, adapter, settings, declared):
    ref_rec = capture(model, lambda: model(**inputs))
    oracle_rec = (
        capture(oracle_model, lambda: oracle_model(**to_device(inputs, "cpu", torch.float64))) if oracle_model else None
    )
    expected_rec = None
    if declared is not None:
        with Emulate(declared), autocast_region("cpu"):
            expected_rec = capture(model, lambda: model(**inputs))
    # the target's settings only around the target (they may be global)
    with adapter.apply(settings), amp(declared.amp if declared is not None else None):
        with autocast_region(torch.device(adapter.kind)):
            tgt_rec = capture(tmodel, lambda: tmodel(**target_inputs))
    return first_drift(ref_rec, tgt_rec, oracle_rec, tol, expected_rec)
