"""Whose fault an exception is: the device's, the worker's memory cap's, the model's (load, reference), or
the target's (a missing op, out of memory, a crash), as row fields.

The order is the rule: a device fault anywhere in the exception's chain wins over the phase (seeding
every device is part of loading a model; loaders wrap the backend's error), then an import that failed
under the worker's memory cap, then exhausted memory in any phase, then the phase, then a missing op,
then an error raised while compiling (`compile_fail`, with its stage and the op or node it names),
then a crash. Errors that compiled code raises when it runs are classified like eager ones. A backend that
reports a failed kernel at the next synchronize (as CUDA does) gets that report attributed to the model
that ran before it (`target_failure`).

While compiling, the compiler runs things on the device too (Inductor's graph passes build example
tensors there; AOT tracing dispatches to a tensor-subclass backend). What the backend raises there is
told apart: an op it refuses ("Could not run 'aten::X' ...", "prims::device_put ... is not an aten op")
is the backend's `unsupported_op`, naming the op and, in ``compile_stage``, the compiler's stage that ran
it; any other error its own code raised stays `compile_fail`, the stage being the compiler's frame that
called into the device (``Inductor graph passes`` for `torch/_inductor/fx_passes/`), and the message
says the backend's code raised it.
"""

from __future__ import annotations

import re
import sys
import traceback
from dataclasses import dataclass

from harness.backends import Adapter, owner
from harness.backends.errors import chain
from harness.results.draft import RowDraft
from harness.run.memory import capped, import_failure
from harness.verdict import FailureEvidence, failure

_OOM = re.compile(r"can't allocate memory|out of memory|DefaultCPUAllocator|CUDA out of memory", re.IGNORECASE)
TRACEBACK_LINES = 40
CAP_TOO_SMALL = "MemCapTooSmall"  # error_type of a failure to import under the worker's memory cap


def _trim_traceback(exc: BaseException) -> str:
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    text = "".join(lines).splitlines()
    if len(text) > TRACEBACK_LINES:
        text = text[:8] + [f"... ({len(text) - TRACEBACK_LINES} lines trimmed) ..."] + text[-(TRACEBACK_LINES - 9) :]
    return "\n".join(text)


def classify_exception(exc: BaseException, adapter: Adapter | None = None, stage: str = "target",
                       host_inputs: bool = False) -> RowDraft:
    """Measurement fields for an exception raised in `stage` (load, reference or target); the outcome is
    `harness.verdict.failure`'s, from what this reads of the exception (`host_inputs`: an op variation's own
    inputs and CPU run, where memory is the host side's).

    A device fault anywhere in the exception's chain wins over the stage (seeding every device is part
    of loading a model; loaders wrap the backend's error): the device is to blame, not the model. An
    import that fails under the worker's memory cap is the cap's (`CAP_TOO_SMALL`: the run stops). Then
    exhausted memory in any phase is `oom`, naming the phase; then the stage; then a missing op, then a
    crash."""
    said = str(exc)[:2000]
    fault = adapter.blames_device(exc, stage) if adapter is not None else None
    links = chain(exc)
    oom = any(isinstance(e, MemoryError) or _OOM.search(str(e)) for e in links)
    missing = adapter.parse_missing_op(exc) if adapter is not None and fault is None else None
    compiled = compile_failure(exc, adapter) if fault is None else None
    outcome = failure(FailureEvidence(stage, device_fault=fault is not None, cap_too_small=capped() and import_failure(exc),
                                      out_of_memory=oom, missing_op=missing is not None, compiling=compiled is not None,
                                      host_inputs=host_inputs))
    row = RowDraft(outcome=outcome, error_type=type(exc).__name__, error_message=said, traceback=_trim_traceback(exc))
    if outcome == "device_error":
        assert adapter is not None and fault is not None
        if fault is not exc:
            row.update(error_type=type(fault).__name__, error_message=(
                f"{fault} (in the {stage} phase, raised as {type(exc).__name__}: {str(exc)[:300]})")[:2000])
        row.update(device_fault=True, device_unreachable=adapter.unreachable(exc, stage))
    elif outcome == "load_fail" and capped() and import_failure(exc):
        row["error_type"] = CAP_TOO_SMALL
    elif outcome == "oom":
        row["error_message"] = f"out of memory in the {stage} phase: {said}"
    elif outcome == "unsupported_op":  # the backend's gap, also where the compiler ran the op on it while compiling
        assert missing is not None and adapter is not None
        row.update(unsupported_op=missing.op, unsupported_dtype=missing.dtype)
        if compiled is not None:
            row.update(compile_stage=compiled.stage, compile_node=compiled.node, error_message=(
                f"the {adapter.kind} backend refused {missing.op} while the compiler ran it ({compiled.stage}): "
                f"{said}")[:2000])
    elif outcome == "compile_fail":
        assert compiled is not None
        where = compiled.stage + (f", at {compiled.node}" if compiled.node else "")
        if compiled.backend_raised and adapter is not None:
            where += f"; raised in the {adapter.kind} backend's own code, which the compiler ran on the device"
        row.update(compile_stage=compiled.stage, compile_node=compiled.node,
                   error_message=f"compile failed in {where}: {said}"[:2000])
    return row


# Stages of torch.compile, told apart by the innermost frame of the backend's error that belongs to one
# (frames of the target backend's own code skipped: the compiler ran something on the device, which raised).
DYNAMO, AOT, PASSES, BACKEND = "Dynamo trace", "AOT/functionalization", "Inductor graph passes", "backend codegen"
_PASSES_FILES = re.compile(r"torch/_inductor/(fx_passes/|pattern_matcher|constant_folding|freezing)")  # run nodes
_BACKEND_FILES = re.compile(r"torch/_inductor/(graph|scheduler|lowering|ir|codecache|cpp_builder|select_algorithm|"
                            r"async_compile|output_code|codegen/|kernel/|runtime/)")
_AOT_FILES = re.compile(r"torch/(_functorch/|fx/experimental/proxy_tensor|_subclasses/functional_tensor)")
_NODE = (
    re.compile(r"While executing %(\S+) : .*?target=([^\]\s]+)"),  # an FX interpreter naming its node
    re.compile(r"\btarget: (<[^>]+>|\S+)"),  # Inductor's lowering errors
    re.compile(r"\b(?:call_function|call_method) (<[^>]+>|[\w.]+)\("),  # Dynamo's fake-tensor run of a node
    re.compile(r"\bbackward through ([\w.:]+)"),  # AOTAutograd tracing the backward of an op without one
)


def _frames(exc: BaseException, adapter: Adapter | None = None) -> list[tuple[str, bool]]:
    """(file name, the target backend's own code?) of each frame on `exc`'s traceback, innermost first."""
    code = owner.backend_code(adapter.kind) if adapter is not None else None
    out = []
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        own = code is not None and code.owns(frame.f_globals.get("__name__"), frame.f_code.co_filename)
        out.append((frame.f_code.co_filename.replace("\\", "/"), own))
        tb = tb.tb_next
    return out[::-1]


def _stage(inner: BaseException, adapter: Adapter | None = None) -> tuple[str, bool]:
    """The compiler's stage that raised `inner`, and whether the target backend's own code raised it there."""
    frames = _frames(inner, adapter)
    raised = bool(frames) and frames[0][1]
    for name, own in frames:
        if own:
            continue  # the device's code, run by the compiler: the stage is the compiler's frame that called it
        if _PASSES_FILES.search(name):
            return PASSES, raised
        if _BACKEND_FILES.search(name):
            return BACKEND, raised
        if _AOT_FILES.search(name):
            return AOT, raised
        if "/torch/" not in name and not name.startswith("<"):
            return BACKEND, raised  # a backend outside torch (a vendor's compiler)
    return BACKEND, False  # no compiler frame above the backend's code: its own compiler (a vendor's) raised


@dataclass(frozen=True)
class CompileFailure:
    """Where the compiler failed: the row's ``compile_stage`` and ``compile_node``."""

    stage: str  # DYNAMO, AOT, PASSES or BACKEND
    node: str  # the op or graph node the error names ("" : none)
    backend_raised: bool  # the target backend's own code raised it (the compiler ran something on the device)


def compile_failure(exc: BaseException, adapter: Adapter | None = None) -> CompileFailure | None:
    """Where an error raised while Dynamo traced or a backend compiled struck (None: not the compiler's). The
    node is the op or graph node the error names, if any."""
    if "torch._dynamo" not in sys.modules:  # nothing compiled in this process
        return None
    from torch._dynamo.exc import BackendCompilerFailed, TorchDynamoException

    links = chain(exc)
    if not any(isinstance(e, TorchDynamoException) for e in links):
        return None
    failed = next((e for e in links if isinstance(e, BackendCompilerFailed)), None)
    inner = getattr(failed, "inner_exception", None)
    stage, raised = DYNAMO, False
    if failed is not None:
        stage, raised = _stage(inner, adapter) if isinstance(inner, BaseException) else (BACKEND, False)
    node = ""
    for e in chain(inner) if isinstance(inner, BaseException) else links:
        for pattern in _NODE:
            m = pattern.search(str(e))
            if m:
                node = (f"%{m.group(1)} ({m.group(2)})" if m.lastindex == 2 else m.group(1))[:200]
                break
        if node:
            break
    return CompileFailure(stage, node, raised)


def drain(adapter: Adapter, device: str) -> BaseException | None:
    """Synchronize `device` on an error path: what it reports late (or None)."""
    try:
        adapter.synchronize(device)
    except Exception as e:
        return e
    return None


def target_failure(exc: BaseException, late: BaseException | None, adapter: Adapter) -> RowDraft:
    """The fields for a target run that raised `exc`, the device having reported `late` at the
    synchronize after it: a device fault in either wins; else the late error, which was queued first."""
    if late is None or adapter.blames_device(exc) is not None:
        return classify_exception(exc, adapter)
    fields = classify_exception(late, adapter)
    fields["error_message"] = (f"{fields['error_message']} (reported late, at synchronize; the run had raised "
                               f"{type(exc).__name__}: {str(exc)[:300]})")[:2000]
    return fields


