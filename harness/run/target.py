"""The target side of one model: the model on the target device, and the step run there.

Three runs (four where the mode asks for an extra one: generate's free-running decoding), each under the
variant's settings (`harness.run.variants`) and the backend's op census: a warm-up (first-call costs such as lazy initialisation stay out of
the timing), the op check's run (every kernel judged on its own inputs
against the CPU; after the plain run, because a dispatch mode changes some paths and the verdict on
errors belongs to the model's own path), and the run that is judged. Each ends by synchronizing the
device: a backend that reports a failed kernel at the next synchronizing call (as CUDA does) reports it
here, with this model. A failure stops the row with its fields (`reference.Stop`).

Under a compiled configuration (`harness.run.compiled`) the model is compiled in place before the warm-up, which
then compiles it (`CompileWatch` counts graphs, breaks, recompiles and compile seconds), and the step
runs under autocast; a compiled run is judged by the graph check (`harness.run.graphcheck`: the
compiled graphs' nodes against the CPU) instead of the op check, whose dispatch mode would see only the
ops compiled code calls outside its fused kernels.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.backends import Adapter
from harness.backends.base import OpCensus
from harness.backends.contracts import amp
from harness.models.load import forget_lazy
from harness.results.draft import RowDraft
from harness.run.attribution import drain, target_failure
from harness.run.compiled import CompileWatch, compile_model
from harness.run.context import ModelRun, Stop
from harness.run.graphcheck import check_graphs
from harness.run.modes import Plan
from harness.run.opcheck import OpCheck
from harness.run.variants import Variant


@dataclass
class TargetSide:
    model: torch.nn.Module  # the model on the device
    inputs: dict[str, Any]  # the step's inputs on the device
    out: dict[str, torch.Tensor]  # the judged run's named outputs, on the CPU
    seconds: float  # the judged run, synchronized
    census: OpCensus
    op_check: Any  # the op check (an OpCheck; compiled: the graph check's), None when off or it could not run
    extra: Any = None  # the plan's extra run's result (None: it has none)
    row: RowDraft = field(default_factory=RowDraft)  # row fields it measured: CompileWatch's, a parallel run's ranks


def census_fields(census: OpCensus) -> RowDraft:
    """What the backend said it ran: on the CPU (fallback ops), itself (native ops); nothing if it does not say."""
    if census.fallback is None and census.native is None:
        return RowDraft()
    return RowDraft(op_census=True, fallback_ops=census.fallback or {}, native_ops=census.native or [])


def to_device(inputs: dict[str, Any], device: str | torch.device, dtype: torch.dtype | None = None) -> dict[str, Any]:
    out = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor):
            v = v.to(device)
            if dtype is not None and v.is_floating_point():
                v = v.to(dtype)
        out[k] = v
    return out


def target_side(run: ModelRun, variant: Variant, check: OpCheck | None, *, last: TargetSide | None = None,
                watch: CompileWatch | None = None) -> TargetSide:
    """Run the plan's step on the run's device as `variant` says: on the loaded model (a copy of it where the
    CPU model is kept), a fresh one, or the device model `last` left; compiled, `watch` counts the
    compilation and the graph check judges by the variant's contract."""
    assert run.side is not None
    plan, device, adapter, cfg = run.side.plan, run.device, run.adapter, variant.cfg
    census = OpCensus()
    watch = watch if cfg.compiled else None
    recorder = None
    try:
        adapter.seed(run.task.seed)
        inputs = to_device(plan.inputs, device)
        with adapter.apply(variant.settings), amp(cfg.amp_dtype), watch or contextlib.nullcontext():
            with adapter.census() as census:
                if variant.source == "reuse" and last is not None:
                    tmodel = last.model
                else:
                    model, copy_model = run.fresh_model() if variant.source == "fresh" else (run.model, run.keep_cpu)
                    forget_lazy(model, run.loaded.lazy)  # what the reference's forward cached is the CPU's
                    tmodel = copy.deepcopy(model).to(device) if copy_model else _on(model, device)
                if cfg.compiled:
                    recorder = compile_model(tmodel, cfg)
                elif check is not None:
                    check.name_modules(tmodel)
                if variant.warmup:
                    plan.step(tmodel, inputs)  # first-call costs (compiled: the compile)
                if check is not None and recorder is None:
                    check = _checked_run(check, plan, tmodel, inputs, adapter, device)
                if recorder is not None:
                    recorder.capturing = True  # each graph's inputs, for the graph check
                t0 = time.perf_counter()
                out = plan.step(tmodel, inputs)
                adapter.synchronize(device)  # what the device reports late is this model's
                seconds = time.perf_counter() - t0
                if recorder is not None:
                    recorder.capturing = False
                extra = None
                if plan.extra is not None and variant.extra:
                    extra = plan.extra(tmodel, inputs)
                    adapter.synchronize(device)
            compiled = watch.freeze() if watch is not None else RowDraft()
            if recorder is not None:
                check = None if check is None else check_graphs(
                    recorder.graphs, cfg, variant.declared, torch.device(device).type,
                    [n for n, _ in tmodel.named_parameters()])
                recorder.graphs = []
                for x in (*(check.raised if check is not None else ()), drain(adapter, device)):
                    if x is not None and adapter.blames_device(x) is not None:
                        raise x
    except Exception as e:
        stop = target_failure(e, drain(adapter, device), adapter)
        stop.update(census_fields(census))
        stop.update(watch.fields() if watch is not None else {})
        raise Stop(stop) from None
    return TargetSide(tmodel, inputs, out, seconds, census, check, extra, compiled)


def _on(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """`model` on `device`, moved only if it is not there yet (a backend whose parameters move by
    swap_tensors refuses to swap those a compiled graph still holds)."""
    where = torch.device(device)
    if all(t.device == where for t in (*model.parameters(), *model.buffers())):
        return model
    return model.to(device)


def _checked_run(check: OpCheck, plan: Plan, tmodel: torch.nn.Module, inputs: dict[str, Any], adapter: Adapter,
                device: str) -> OpCheck | None:
    """The op check's run; None if it could not run (the plain run decides then), unless a device
    fault stopped it: that is the device's, and stops the row."""
    check.phase = plan.phase
    try:
        with check:
            plan.step(tmodel, inputs)
        adapter.synchronize(device)
    except Exception as e:
        late = drain(adapter, device)
        for x in (e, late):
            if x is not None and adapter.blames_device(x) is not None:
                raise x from None
        return None
    return check
