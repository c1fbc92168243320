"""One model, end to end: load -> inputs -> reference x2 -> fp64 oracle -> target -> compare -> localize.

`run_one` never raises for a model's problems; it returns a `Measurement` whose outcome is the first
stage that failed (load_fail, ref_fail, ref_nondeterministic, then the target's unsupported_op, crash,
oom, drift) or pass. Timeouts and worker deaths are decided by the supervisor, which sees the process
die. Which device faults count against the device is the backend adapter's call.
"""

from __future__ import annotations

import copy
import re
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.backends import Adapter, adapter_for
from harness.backends.base import OpCensus
from harness.backends.contracts import Emulate, contract
from harness.models.inputs import make_inputs
from harness.models.load import load_model
from harness.models.model_list import ModelEntry
from harness.models.outputs import output_tensors
from harness.results.rows import Measurement
from harness.run.compare import Tolerance, compare_outputs, identical
from harness.run.localize import capture, first_drift
from harness.run.memory import PeakRss
from harness.run.opcheck import OpJudge
from harness.run.repro import describe, repro_preamble, write_repro

_OOM = re.compile(r"can't allocate memory|out of memory|DefaultCPUAllocator|CUDA out of memory", re.IGNORECASE)
TRACEBACK_LINES = 40


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

    A device fault wins over the stage (seeding every device is part of loading a model): the device
    is to blame, not the model. Elsewhere a missing op, then memory, then a crash."""
    base = {
        "error_type": type(exc).__name__,
        "error_message": str(exc)[:2000],
        "traceback": _trim_traceback(exc),
    }
    if adapter is not None and adapter.is_device_fault(exc):
        return {"outcome": "device_error", "device_fault": True, **base}
    if stage == "load":
        return {"outcome": "load_fail", **base}
    if stage == "reference":
        return {"outcome": "ref_fail", **base}
    missing = adapter.parse_missing_op(exc) if adapter is not None else None
    if missing is not None:
        return {"outcome": "unsupported_op", "unsupported_op": missing.op, "unsupported_dtype": missing.dtype, **base}
    if isinstance(exc, MemoryError) or _OOM.search(str(exc)):
        return {"outcome": "oom", **base}
    return {"outcome": "crash", **base}


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


def run_one(task: Task) -> Measurement:
    """Run one model end to end; never raises for model problems."""
    entry = ModelEntry(**task.entry) if isinstance(task.entry, dict) else task.entry
    tol = Tolerance(
        tol=entry.atol if entry.atol is not None else Tolerance.tol,
        atol=entry.atol,
        rtol=entry.rtol,
    )
    timings: dict[str, Any] = {}
    t_start = time.perf_counter()
    with PeakRss() as rss:
        fields = _pipeline(entry, task, tol, timings)
    return Measurement(
        model_id=entry.id,
        device=task.target,
        **timings,
        **fields,
        wall_time_s=time.perf_counter() - t_start,
        peak_rss_mb=round(rss.peak_mb, 1),
    )


def _pipeline(entry: ModelEntry, task: Task, tol: Tolerance, timings: dict[str, Any]) -> dict[str, Any]:
    attn = task.settings.get("attn")
    device = task.target
    adapter = adapter_for(device)
    t0 = time.perf_counter()
    try:
        loaded = load_model(entry, seed=task.seed, attn_implementation=attn)
        model = loaded.model
        inputs = make_inputs(model, loaded.config, entry, seed=task.seed)
    except Exception as e:  # LoadError, or inputs/construction failing: "could not load this model"
        return classify_exception(e, adapter, "load")
    timings["load_time_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    try:
        ref = _forward(model, inputs)
    except Exception as e:
        return classify_exception(e, adapter, "reference")
    timings["ref_time_s"] = time.perf_counter() - t0
    try:
        ref2 = _forward(model, inputs)
    except Exception as e:
        return classify_exception(e, adapter, "reference")
    if not identical(ref, ref2):
        return {"outcome": "ref_nondeterministic", "error_message": "two fp32 reference runs on CPU differ"}

    oracle_model = None
    try:
        oracle_model = copy.deepcopy(model).double()
        oracle = _forward(oracle_model, _to(inputs, "cpu", torch.float64))
    except Exception:
        oracle, oracle_model = None, None  # fp64 unsupported by this model: fall back to cosine/allclose

    declared = contract(adapter.declared_precision(task.settings))
    expected = None
    if not declared.exact:
        t0 = time.perf_counter()
        try:
            with Emulate(declared):
                expected = _forward(model, inputs)
        except Exception:
            expected = None  # the model cannot run under the emulation: judged by the fp32 envelope alone
        timings["expected_time_s"] = time.perf_counter() - t0

    census = OpCensus()
    judge = OpJudge(torch.device(device).type, declared) if task.settings.get("op_check", True) else None
    try:
        adapter.seed(task.seed)
        target_inputs = _to(inputs, device)
        with adapter.apply(task.settings), adapter.census() as census:
            tmodel = copy.deepcopy(model).to(device)
            if judge is not None:
                judge.name_modules(tmodel)
            _forward(tmodel, target_inputs)  # warm-up: first-call costs (lazy init) stay out of the timing
            if judge is not None:
                # Every kernel judged on its own inputs. After the plain run: a dispatch mode changes
                # some paths (torch.compile'd code runs eagerly under one), and the verdict on errors
                # belongs to the model's own path.
                try:
                    with judge:
                        _forward(tmodel, target_inputs)
                except Exception:
                    judge = None
            t0 = time.perf_counter()
            tout = _forward(tmodel, target_inputs)
            timings["target_time_s"] = time.perf_counter() - t0
    except Exception as e:
        return {**classify_exception(e, adapter), **_census_fields(census)}

    verdict = compare_outputs(ref, tout, oracle, tol, expected)
    result: dict[str, Any] = {
        **_census_fields(census),
        "metrics": {c.name: c.to_dict() for c in verdict.checks},
        **verdict.summary(),
        "contract": declared.name,
        "outcome": verdict.outcome,
        "ops_checked": judge.checked if judge is not None else None,
    }
    kernel = judge.failure if judge is not None else None
    if verdict.outcome != "drift" and kernel is None:
        return result
    result["outcome"] = "drift"
    result["nonfinite"] = verdict.nonfinite
    worst = verdict.worst
    messages = []
    if kernel is not None:
        result.update(describe(kernel))
        messages.append(
            f"kernel {kernel.op} (in {kernel.module or 'the top module'}, inputs {', '.join(kernel.inputs[:4])}) is "
            f"beyond the declared {declared.name} precision on its own inputs (ratio {kernel.ratio:.3g})"
            + (f"; {kernel.note}" if kernel.note else "")
        )
        if task.repro_dir:
            result["repro_path"] = str(_repro(kernel, declared, adapter, task, entry.id))
    if verdict.outcome == "drift" and worst is not None:
        messages.append(
            f"output {worst.name!r} out of tolerance: rmse ratio {worst.rmse_ratio}, declared ratio "
            f"{worst.declared_ratio}, max abs {worst.max_abs}" + (" (non-finite values on target)" if verdict.nonfinite else "")
        )
    elif verdict.outcome != "drift":
        messages.append(f"outputs within the {'fp32' if verdict.ok else 'declared'} envelope")
    result["error_message"] = "; ".join(messages)
    if task.localize:
        try:
            site = _localize(model, oracle_model, tmodel, inputs, target_inputs, tol, adapter, task.settings,
                             None if declared.exact else declared)
        except Exception as e:  # localization is diagnostics: never lose the verdict over it
            result["error_message"] += f"; localization failed: {type(e).__name__}: {e}"
        else:
            if site is not None:
                result["first_drift_module"] = site.module
                result["first_drift_module_type"] = site.module_type
    return result


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
