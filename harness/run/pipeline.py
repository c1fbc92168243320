"""One model, end to end: load -> inputs -> reference x2 -> fp64 oracle -> target -> compare -> localize.

`run_one` never raises for a model's problems; it returns a `Measurement` whose outcome is the first
stage that failed (load_fail, ref_fail, ref_nondeterministic, then the target's unsupported_op, crash,
oom, drift) or pass. Timeouts and worker deaths are decided by the supervisor, which sees the process
die. Which device faults count against the device is the backend adapter's call.

Every phase that ran on the device ends by synchronizing it, on success and on error: a backend that
reports a failed kernel at the next synchronizing call (as CUDA does) then reports it here, with the
model that caused it, not with the next one.
"""

from __future__ import annotations

import copy
import re
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from harness.backends import Adapter, adapter_for
from harness.backends.base import OpCensus
from harness.backends.contracts import Emulate, contract
from harness.backends.errors import chain
from harness.models.inputs import make_inputs
from harness.models.labels import make_labels
from harness.models.load import load_model
from harness.models.model_list import ModelEntry
from harness.models.outputs import output_tensors
from harness.results.rows import Measurement
from harness.run.compare import Tolerance, compare_outputs, identical
from harness.run.localize import capture, first_drift
from harness.run.memory import PhaseClock, capped, import_failure
from harness.run.opcheck import OpJudge
from harness.run.oracle import COPY_MAX_PARAMS, DEFAULT_MAX_PARAMS, fp64_outputs, n_params
from harness.run.repro import describe, repro_preamble, write_repro
from harness.run.train import (
    OPTIMIZERS,
    family_floors,
    missing_grads,
    prepare,
    replay_updates,
    train_metrics,
    train_step,
)

_OOM = re.compile(r"can't allocate memory|out of memory|DefaultCPUAllocator|CUDA out of memory", re.IGNORECASE)
TRACEBACK_LINES = 40
CAP_TOO_SMALL = "MemCapTooSmall"  # error_type of a failure to import under the worker's memory cap
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


def _trim_traceback(exc: BaseException) -> str:
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    text = "".join(lines).splitlines()
    if len(text) > TRACEBACK_LINES:
        text = text[:8] + [f"... ({len(text) - TRACEBACK_LINES} lines trimmed) ..."] + text[-(TRACEBACK_LINES - 9) :]
    return "\n".join(text)


def classify_exception(exc: BaseException, adapter: Adapter | None = None, stage: str = "target") -> dict[str, Any]:
    """Measurement fields for an exception raised in `stage` (load, reference or target).

    A device fault anywhere in the exception's chain wins over the stage (seeding every device is part
    of loading a model; loaders wrap the backend's error): the device is to blame, not the model. An
    import that fails under the worker's memory cap is the cap's (`CAP_TOO_SMALL`: the run stops). Then
    exhausted memory in any phase is `oom`, naming the phase; then the stage; then a missing op, then a
    crash."""
    base = {
        "error_type": type(exc).__name__,
        "error_message": str(exc)[:2000],
        "traceback": _trim_traceback(exc),
    }
    fault = adapter.blames_device(exc, stage) if adapter is not None else None
    if fault is not None:
        if fault is not exc:
            base["error_type"] = type(fault).__name__
            base["error_message"] = (f"{fault} (in the {stage} phase, raised as {type(exc).__name__}: "
                                     f"{str(exc)[:300]})")[:2000]
        return {"outcome": "device_error", "device_fault": True, **base}
    if capped() and import_failure(exc):
        return {"outcome": "load_fail", **base, "error_type": CAP_TOO_SMALL}
    links = chain(exc)
    if any(isinstance(e, MemoryError) or _OOM.search(str(e)) for e in links):
        return {"outcome": "oom", **base, "error_message": f"out of memory in the {stage} phase: {str(exc)[:2000]}"}
    if stage == "load":
        return {"outcome": "load_fail", **base}
    if stage == "reference":
        return {"outcome": "ref_fail", **base}
    missing = adapter.parse_missing_op(exc) if adapter is not None else None
    if missing is not None:
        return {"outcome": "unsupported_op", "unsupported_op": missing.op, "unsupported_dtype": missing.dtype, **base}
    return {"outcome": "crash", **base}


def _drain(adapter: Adapter, device: str) -> BaseException | None:
    """Synchronize `device` on an error path: what it reports late (or None)."""
    try:
        adapter.synchronize(device)
    except Exception as e:
        return e
    return None


def _target_failure(exc: BaseException, late: BaseException | None, adapter: Adapter) -> dict[str, Any]:
    """The fields for a target run that raised `exc`, the device having reported `late` at the
    synchronize after it: a device fault in either wins; else the late error, which was queued first."""
    if late is None or adapter.blames_device(exc) is not None:
        return classify_exception(exc, adapter)
    fields = classify_exception(late, adapter)
    fields["error_message"] = (f"{fields['error_message']} (reported late, at synchronize; the run had raised "
                               f"{type(exc).__name__}: {str(exc)[:300]})")[:2000]
    return fields


def _to(inputs: dict[str, Any], device: str | torch.device, dtype: torch.dtype | None = None) -> dict[str, Any]:
    out = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor):
            v = v.to(device)
            if dtype is not None and v.is_floating_point():
                v = v.to(dtype)
        out[k] = v
    return out


def _forward(model: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        out = model(**inputs)
    return {k: v.detach().cpu() for k, v in output_tensors(out).items()}


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
    device = task.target
    adapter = adapter_for(device)
    with clock.phase("load"):
        try:
            loaded = load_model(entry, seed=task.seed, attn_implementation=task.settings.get("attn"),
                                dtype=task.settings.get("dtype"))
            model = loaded.model
            inputs = make_inputs(model, loaded.config, entry, seed=task.seed)
        except Exception as e:  # LoadError, or inputs/construction failing: "could not load this model"
            return classify_exception(e, adapter, "load")
    out: dict[str, Any] = {}
    train = task.settings.get("mode") == "train"
    step = _forward
    if train:
        prepare(model)
        no_labels = "the head takes no labels"
        try:
            labels = make_labels(model, loaded.config, entry.task, inputs, seed=task.seed)
        except Exception as e:  # labels are ours to make: the step falls back to the fixed reduction
            labels, no_labels = {}, f"no labels could be made: {type(e).__name__}: {str(e)[:200]}"

    with clock.phase("reference"):
        try:
            t0 = time.perf_counter()
            torch.manual_seed(task.seed)
            if train:
                step, inputs, out["loss_kind"], ref = _train_step_for(model, inputs, labels, task.seed, no_labels)
            else:
                ref = step(model, inputs)
            out["_ref_s"] = time.perf_counter() - t0
            torch.manual_seed(task.seed + 1)  # train mode: a step that depends on the seed is not reproducible
            ref2 = step(model, inputs)
        except Exception as e:
            return classify_exception(e, adapter, "reference")
        if not identical(ref, ref2):
            return {"outcome": "ref_nondeterministic", "error_message": "two fp32 reference runs on CPU differ"
                    + (" (under different seeds: the training step draws random numbers)" if train else "")}
        del ref2

    with clock.phase("oracle"):
        oracle, out["oracle"], oracle_model = fp64_outputs(
            model, inputs, step, max_params=int(task.settings.get("oracle_max_params", DEFAULT_MAX_PARAMS)),
            streamed=not train,
        )
        if train:
            oracle_model = None  # it serves module-level localization; train mode localizes to a parameter

    declared = contract(adapter.declared_precision(task.settings))
    expected = None
    if not declared.exact:
        with clock.phase("expected"):
            try:
                with Emulate(declared):
                    expected = step(model, inputs)
            except Exception:
                expected = None  # the model cannot run under the emulation: judged by the fp32 envelope alone

    # A small model keeps its CPU copy for module-level localization; a real checkpoint moves to the
    # device in place (one copy of the weights, held by the device).
    keep_cpu = train or (n_params(model) <= COPY_MAX_PARAMS and task.localize)  # train: updates replay on it
    census = OpCensus()
    judge = _judge(device, declared, task.settings.get("op_check", "auto"), n_params(model))
    with clock.phase("target"):
        try:
            adapter.seed(task.seed)
            target_inputs = _to(inputs, device)
            with adapter.apply(task.settings), adapter.census() as census:
                tmodel = copy.deepcopy(model).to(device) if keep_cpu else model.to(device)
                if not keep_cpu:
                    model = None
                if judge is not None:
                    judge.name_modules(tmodel)
                step(tmodel, target_inputs)  # warm-up: first-call costs (lazy init) stay out of the timing
                if judge is not None:
                    # Every kernel judged on its own inputs. After the plain run: a dispatch mode changes
                    # some paths (torch.compile'd code runs eagerly under one), and the verdict on errors
                    # belongs to the model's own path, but not a sick device's.
                    try:
                        with judge:
                            step(tmodel, target_inputs)
                        adapter.synchronize(device)
                    except Exception as e:
                        late = _drain(adapter, device)
                        for x in (e, late):
                            if x is not None and adapter.blames_device(x) is not None:
                                raise x from None
                        judge = None
                t0 = time.perf_counter()
                tout = step(tmodel, target_inputs)
                adapter.synchronize(device)  # what the device reports late is this model's
                out["_target_s"] = time.perf_counter() - t0
        except Exception as e:
            return {**out, **_target_failure(e, _drain(adapter, device), adapter), **_census_fields(census)}

    with clock.phase("compare"):
        if train:  # the optimizers judged on the target's own gradients (see harness.run.train)
            ref = {**ref, **replay_updates(model, tout)}
            tol = replace(tol, relative=True, min_rms=family_floors(ref))
            if oracle is not None:
                oracle = {**oracle, **replay_updates(model, tout, torch.float64)}
            if expected is not None:
                expected = {**expected, **{k: v for k, v in ref.items() if k.split("/")[0] in OPTIMIZERS}}
        verdict = compare_outputs(ref, tout, oracle, tol, expected)
    out.update(
        _census_fields(census),
        metrics={c.name: c.to_dict() for c in verdict.checks},
        **verdict.summary(),
        contract=declared.name,
        outcome=verdict.outcome,
        ops_checked=judge.checked if judge is not None else None,
        ops_sampled_out=judge.sampled_out if judge is not None and judge.per_signature is not None else None,
    )
    if train:
        out.update(train_metrics(ref, tout, {c.name: c for c in verdict.checks}))
        missing = missing_grads(ref, tout)
        if missing:
            out["missing_grads"] = missing
            out["outcome"] = "missing_grad"
            out["error_message"] = (f"{len(missing)} parameter(s) got no gradient on the target: "
                                    + ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else ""))
            return out
    kernel = judge.failure if judge is not None else None
    if verdict.outcome != "drift" and kernel is None:
        return out
    out["outcome"] = "drift"
    out["nonfinite"] = verdict.nonfinite
    worst = verdict.worst
    messages = []
    if kernel is not None:
        out.update(describe(kernel))
        where = f"kernel {kernel.op} (in {kernel.module or 'the top module'}, inputs {', '.join(kernel.inputs[:4])})"
        messages.append(
            f"{where} is beyond the declared {declared.name} precision on its own inputs (ratio {kernel.ratio:.3g})"
            + (f"; {kernel.note}" if kernel.note else "")
            if kernel.ratio is not None else  # a wrong shape or dtype: nothing to measure, still the finding
            f"{where} returns output {kernel.output} unlike the CPU's: {kernel.note or 'not comparable'}"
        )
        if task.repro_dir:
            out["repro_path"] = str(_repro(kernel, declared, adapter, task, entry.id))
    if verdict.outcome == "drift" and worst is not None:
        messages.append(
            f"output {worst.name!r} out of tolerance: rmse ratio {worst.rmse_ratio}, declared ratio "
            f"{worst.declared_ratio}, max abs {worst.max_abs}" + (" (non-finite values on target)" if verdict.nonfinite else "")
        )
    elif verdict.outcome != "drift":
        messages.append(f"outputs within the {'fp32' if verdict.ok else 'declared'} envelope")
    if out.get("first_drift_param"):
        messages.append(f"first parameter whose gradient drifts: {out['first_drift_param']}")
    elif train and kernel is not None:  # gradients within the envelope: name the kernel's parameter
        envelope = "declared" if not declared.exact else "fp32"
        if kernel.param:
            out["first_drift_param"] = kernel.param
            messages.append(f"gradients within the {envelope} envelope; the drifting kernel's parameter (or its "
                            f"module's nearest): {kernel.param}")
        elif (moved := _most_moved_gradient(verdict.checks)):  # e.g. the loss, outside every module
            out["first_drift_param"] = moved
            messages.append(f"gradients within the {envelope} envelope; the drifting kernel has no parameter of its "
                            f"own or of its module's, the gradient it moved most: {moved}")
    out["error_message"] = "; ".join(messages)
    if task.localize and model is not None and not train:  # train mode localizes to a parameter
        with clock.phase("localize"):
            try:
                site = _localize(model, oracle_model, tmodel, inputs, target_inputs, tol, adapter, task.settings,
                                 None if declared.exact else declared)
                adapter.synchronize(device)
            except Exception as e:  # localization is diagnostics: never lose the verdict over it
                late = _drain(adapter, device)
                out["error_message"] += (f"; localization failed: {type(e).__name__}: {e}"
                                         + (f" (the device then reported {type(late).__name__}: {late})" if late else ""))
            else:
                if site is not None:
                    out["first_drift_module"] = site.module
                    out["first_drift_module_type"] = site.module_type
    return out


def _most_moved_gradient(checks: list) -> str:
    """The parameter whose gradient is furthest outside the fp32 envelope ('' without gradients)."""
    grads = [c for c in checks if c.name.startswith("grad/") and c.rmse_ratio is not None]
    return max(grads, key=lambda c: c.rmse_ratio).name.removeprefix("grad/") if grads else ""


def _judge(device: str, declared, mode: str, params: int) -> OpJudge | None:
    """The op check for this model: every call for small models (and `all`), the first calls of each
    signature for real checkpoints (a 24-layer model repeats each kernel 24 times)."""
    if mode == "off":
        return None
    sampled = mode == "sampled" or (mode == "auto" and params > COPY_MAX_PARAMS)
    return OpJudge(torch.device(device).type, declared, per_signature=OP_SAMPLE if sampled else None)


def _train_step_for(model: torch.nn.Module, inputs: dict[str, Any], labels: dict[str, Any], seed: int,
                    no_labels: str) -> tuple[Callable[..., dict[str, torch.Tensor]], dict[str, Any], str,
                                             dict[str, torch.Tensor]]:
    """(step function, inputs with labels if the head's loss is used, loss kind, the first reference
    result) for train mode: the head's own loss where its labels work on the reference, else the fixed
    reduction (and why: `no_labels` when there are none)."""
    kind = f"reduction ({no_labels})"
    if labels:
        with_labels = {**inputs, **labels}
        try:
            first = train_step(model, with_labels, model_loss=True, seed=seed)
        except Exception as e:
            kind = f"reduction (the head's loss failed: {type(e).__name__}: {str(e)[:200]})"
        else:
            return (lambda m, x: train_step(m, x, model_loss=True, seed=seed)), with_labels, "model", first
    first = train_step(model, inputs, model_loss=False, seed=seed)
    return (lambda m, x: train_step(m, x, model_loss=False, seed=seed)), inputs, kind, first


def _repro(kernel, declared, adapter, task: Task, model_id: str):
    from pathlib import Path

    preamble = repro_preamble(task.backends, adapter.repro_setup(task.settings))
    return write_repro(kernel, contract=declared, target=task.target, preamble=preamble, model_id=model_id,
                       directory=Path(task.repro_dir))


def _census_fields(census: OpCensus) -> dict[str, Any]:
    if census.fallback is None and census.native is None:
        return {}
    return {"op_census": True, "fallback_ops": census.fallback or {}, "native_ops": census.native or []}


def _localize(model, oracle_model, tmodel, inputs, target_inputs, tol, adapter, settings, declared):
    ref_rec = capture(model, lambda: model(**inputs))
    oracle_rec = (
        capture(oracle_model, lambda: oracle_model(**_to(inputs, "cpu", torch.float64))) if oracle_model else None
    )
    expected_rec = None
    if declared is not None:
        with Emulate(declared):
            expected_rec = capture(model, lambda: model(**inputs))
    with adapter.apply(settings):  # the target's settings only around the target (they may be global)
        tgt_rec = capture(tmodel, lambda: tmodel(**target_inputs))
    return first_drift(ref_rec, tgt_rec, oracle_rec, tol, expected_rec)
