"""Whose fault an exception is: the device's, the worker's memory cap's, the model's (load, reference), or
the target's (a missing op, out of memory, a crash), as row fields.

The order is the rule: a device fault anywhere in the exception's chain wins over the phase (seeding
every device is part of loading a model; loaders wrap the backend's error), then an import that failed
under the worker's memory cap, then exhausted memory in any phase, then the phase, then a missing op,
then a crash. A backend that reports a failed kernel at the next synchronize (as CUDA does) gets that
report attributed to the model that ran before it (`target_failure`).
"""

from __future__ import annotations

import re
import traceback
from typing import Any

from harness.backends import Adapter
from harness.backends.errors import chain
from harness.run.memory import capped, import_failure

_OOM = re.compile(r"can't allocate memory|out of memory|DefaultCPUAllocator|CUDA out of memory", re.IGNORECASE)
TRACEBACK_LINES = 40
CAP_TOO_SMALL = "MemCapTooSmall"  # error_type of a failure to import under the worker's memory cap


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


def drain(adapter: Adapter, device: str) -> BaseException | None:
    """Synchronize `device` on an error path: what it reports late (or None)."""
    try:
        adapter.synchronize(device)
    except Exception as e:
        return e
    return None


def target_failure(exc: BaseException, late: BaseException | None, adapter: Adapter) -> dict[str, Any]:
    """The fields for a target run that raised `exc`, the device having reported `late` at the
    synchronize after it: a device fault in either wins; else the late error, which was queued first."""
    if late is None or adapter.blames_device(exc) is not None:
        return classify_exception(exc, adapter)
    fields = classify_exception(late, adapter)
    fields["error_message"] = (f"{fields['error_message']} (reported late, at synchronize; the run had raised "
                               f"{type(exc).__name__}: {str(exc)[:300]})")[:2000]
    return fields


