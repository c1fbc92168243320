"""Run one model on the reference and on the target, and classify the outcome.

`run_one` is the whole per-model pipeline (load -> inputs -> reference x2 -> fp64 oracle -> target ->
compare -> localize) and returns a plain dict of `ResultRow` fields. `worker_main` wraps it in a
long-lived child process pinned to one target device, so a model that segfaults, hangs or eats all
memory takes down only its worker; the runner (harness/runner.py) supervises and replaces workers.

Outcomes, first match wins: load_fail, ref_fail, ref_nondeterministic, unsupported_op, crash, oom,
drift, pass (timeout and worker deaths are decided by the supervisor, which sees the process die).
"""

from __future__ import annotations

import copy
import os
import re
import resource
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from harness.models.inputs import make_inputs, output_tensors
from harness.models.load import load_model
from harness.models.model_list import ModelEntry
from harness.run.compare import Tolerance, compare_outputs, identical
from harness.run.localize import capture, first_drift

_MISSING_KERNEL = re.compile(r"Could not run '([\w:.]+)' with arguments from the '(\w+)' backend")
_FLEX = re.compile(r"FlexAttention is only supported on|flex_attention", re.IGNORECASE)
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


def _trim_traceback(exc: BaseException) -> str:
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    text = "".join(lines).splitlines()
    if len(text) > TRACEBACK_LINES:
        text = text[:8] + [f"... ({len(text) - TRACEBACK_LINES} lines trimmed) ..."] + text[-(TRACEBACK_LINES - 9) :]
    return "\n".join(text)


def parse_unsupported_op(exc: BaseException) -> str | None:
    """The missing op named by a backend's error, or 'flex_attention'; None if not a coverage gap."""
    msg = str(exc)
    m = _MISSING_KERNEL.search(msg)
    if m and isinstance(exc, NotImplementedError | RuntimeError):
        return m.group(1)
    if _FLEX.search(msg) and ("only supported" in msg or "not supported" in msg.lower()):
        return "flex_attention"
    return None


def classify_exception(exc: BaseException) -> dict[str, Any]:
    """Row fields for a target-side exception."""
    base = {
        "error_type": type(exc).__name__,
        "error_message": str(exc)[:2000],
        "traceback": _trim_traceback(exc),
    }
    op = parse_unsupported_op(exc)
    if op is not None:
        return {"outcome": "unsupported_op", "unsupported_op": op, **base}
    if isinstance(exc, MemoryError) or _OOM.search(str(exc)):
        return {"outcome": "oom", **base}
    return {"outcome": "crash", **base}


class PeakRss:
    """Samples this process's resident set size while a model runs (ru_maxrss never goes down)."""

    def __init__(self, interval_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._page_mb = os.sysconf("SC_PAGE_SIZE") / 2**20

    def _rss_mb(self) -> float:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self._page_mb
        except OSError:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_mb = max(self.peak_mb, self._rss_mb())

    def __enter__(self) -> PeakRss:
        self.peak_mb = self._rss_mb()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self.peak_mb, self._rss_mb())


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


class _TargetSettings:
    """Apply backend settings (sim switches, or float32 matmul precision elsewhere) for the target run."""

    def __init__(self, target: str, settings: dict[str, Any]) -> None:
        self.is_sim = torch.device(target).type == "sim"
        self.settings = settings

    def __enter__(self) -> None:
        if self.is_sim:
            import harness.sim as sim

            self._prev = (sim.get_precision(), sim.get_op_profile().name)
            sim.set_precision(self.settings.get("precision", "default"))
            sim.set_op_profile(self.settings.get("ops", "young"))
        else:
            self._prev_mm = torch.get_float32_matmul_precision()
            p = self.settings.get("precision")
            if p in ("highest", "high", "medium"):
                torch.set_float32_matmul_precision(p)

    def __exit__(self, *exc: object) -> None:
        if self.is_sim:
            import harness.sim as sim

            sim.set_precision(self._prev[0])
            sim.set_op_profile(self._prev[1])
        else:
            torch.set_float32_matmul_precision(self._prev_mm)


def run_one(task: Task) -> dict[str, Any]:
    """Run one model end to end; never raises for model problems, returns row fields instead."""
    entry = ModelEntry(**task.entry) if isinstance(task.entry, dict) else task.entry
    row: dict[str, Any] = {
        "model_id": entry.id,
        "arch": entry.arch,
        "task": entry.task,
        "modality": entry.modality,
        "target": task.target,
        "device": task.target,
        "settings": dict(task.settings),
    }
    tol = Tolerance(
        tol=entry.atol if entry.atol is not None else Tolerance.tol,
        atol=entry.atol,
        rtol=entry.rtol,
    )
    t_start = time.perf_counter()
    with PeakRss() as rss:
        row.update(_pipeline(entry, task, tol, row))
    row["wall_time_s"] = time.perf_counter() - t_start
    row["peak_rss_mb"] = round(rss.peak_mb, 1)
    return row


def _pipeline(entry: ModelEntry, task: Task, tol: Tolerance, row: dict[str, Any]) -> dict[str, Any]:
    attn = task.settings.get("attn")
    t0 = time.perf_counter()
    try:
        loaded = load_model(entry, seed=task.seed, attn_implementation=attn)
        model = loaded.model
        inputs = make_inputs(model, loaded.config, entry, seed=task.seed)
    except Exception as e:  # LoadError, or inputs/construction failing: "could not load this model"
        return {**classify_exception(e), "outcome": "load_fail"}
    row["load_time_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    try:
        ref = _forward(model, inputs)
    except Exception as e:
        return {**classify_exception(e), "outcome": "ref_fail"}
    row["ref_time_s"] = time.perf_counter() - t0
    try:
        ref2 = _forward(model, inputs)
    except Exception as e:
        return {**classify_exception(e), "outcome": "ref_fail"}
    if not identical(ref, ref2):
        return {"outcome": "ref_nondeterministic", "error_message": "two fp32 reference runs on CPU differ"}

    oracle_model = None
    try:
        oracle_model = copy.deepcopy(model).double()
        oracle = _forward(oracle_model, _to(inputs, "cpu", torch.float64))
    except Exception:
        oracle, oracle_model = None, None  # fp64 unsupported by this model: fall back to cosine/allclose

    device = task.target
    target_inputs = _to(inputs, device)
    try:
        with _TargetSettings(device, task.settings):
            tmodel = copy.deepcopy(model).to(device)
            _forward(tmodel, target_inputs)  # warm-up: first-call costs (lazy init) stay out of the timing
            t0 = time.perf_counter()
            tout = _forward(tmodel, target_inputs)
            row["target_time_s"] = time.perf_counter() - t0
    except Exception as e:
        return classify_exception(e)

    verdict = compare_outputs(ref, tout, oracle, tol)
    result: dict[str, Any] = {
        "metrics": {c.name: c.to_dict() for c in verdict.checks},
        **verdict.summary(),
        "outcome": "pass" if verdict.ok else "drift",
    }
    if verdict.ok:
        return result
    worst = verdict.worst
    result["error_message"] = (
        f"output {worst.name!r} out of tolerance: rmse ratio {worst.rmse_ratio}, max abs {worst.max_abs}"
        + (" (non-finite values on target)" if verdict.nonfinite else "")
        if worst
        else "outputs differ"
    )
    result["nonfinite"] = verdict.nonfinite
    if task.localize:
        try:
            site = _localize(model, oracle_model, tmodel, inputs, target_inputs, device, task.settings, tol)
        except Exception as e:  # localization is diagnostics: never lose the verdict over it
            result["error_message"] += f"; localization failed: {type(e).__name__}: {e}"
        else:
            if site is not None:
                result["first_drift_module"] = site.module
                result["first_drift_module_type"] = site.module_type
    return result


def _localize(model, oracle_model, tmodel, inputs, target_inputs, device, settings, tol):
    ref_rec = capture(model, lambda: model(**inputs))
    oracle_rec = (
        capture(oracle_model, lambda: oracle_model(**_to(inputs, "cpu", torch.float64))) if oracle_model else None
    )
    with _TargetSettings(device, settings):
        tgt_rec = capture(tmodel, lambda: tmodel(**target_inputs))
    return first_drift(ref_rec, tgt_rec, oracle_rec, tol)


# ---------------------------------------------------------------- worker process


def _cap_memory(cap_mb: int | None) -> None:
    """Bound the address space this worker may add on top of what it has after start-up."""
    if not cap_mb:
        return
    with open("/proc/self/statm") as f:
        vsz = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = vsz + cap_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def worker_main(conn: Any, device: str, threads: int, mem_cap_mb: int | None, env: dict[str, str]) -> None:
    """Child-process loop: receive Task dicts, send back result dicts, until the pipe closes."""
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(max(1, threads))
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        import transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()  # config warnings would drown the progress bar
    except Exception:
        pass
    if device.split(":")[0] == "sim":
        import harness.sim  # noqa: F401  registers the backend (also when torch autoload is off)
    _cap_memory(mem_cap_mb)
    conn.send({"type": "ready", "pid": os.getpid(), "device": device})
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        task = Task(**msg)
        task.target = device
        try:
            result = run_one(task)
        except MemoryError as e:
            result = {"model_id": task.entry["id"], **classify_exception(e), "outcome": "oom"}
        except BaseException as e:  # bug in the harness itself: report it as a crash row, keep serving
            result = {"model_id": task.entry["id"], **classify_exception(e), "outcome": "crash"}
        conn.send({"type": "result", "row": result})


def task_dict(task: Task) -> dict[str, Any]:
    return asdict(task)
