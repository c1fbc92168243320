"""The verdict of one job, decided in one place: typed evidence in, a typed finding out.

Every outcome a row can get (`harness.outcomes`) is chosen here, by plain rules over plain data; the pipeline,
its follow-ups, attribution, the op variations, the harvest and the supervisor's word on a dead worker gather
the evidence and call these functions, and none picks an outcome itself. tests/test_verdict.py holds the
rules as tables.

- `step`: one run of the target's step. The comparison (`harness.run.compare`: every output against the fp64
  oracle, within fp32, within the declared precision, or beyond), the op check's first kernel beyond its
  contract, and what the mode saw (train: parameters without a gradient). A missing gradient is
  `missing_grad`; an output beyond, or a kernel beyond, is `drift`; else `pass_declared` or `pass`.
- `reference`: the reference side (the mode does not apply: `skipped`; two fp32 runs differ:
  `ref_nondeterministic`) and `harvested` (a harvest's row).
- `failure`: an exception, as attribution reads it. A device fault anywhere in its chain wins (`device_error`),
  then an import the worker's memory cap broke (`load_fail`), then exhausted memory (`oom`; the harness's own
  inputs for an op variation: the host side's failure), then the phase it rose in (`load_fail`, `ref_fail`),
  then a missing op (`unsupported_op`), an error while compiling (`compile_fail`), else `crash`.
- `death`: a worker that died or was killed under a job, by the phase it was in (`harness.phases`): out of
  time on the reference side is `ref_timeout`, elsewhere `timeout`; SIGKILLed otherwise, `oom` (the kernel's
  OOM killer); else `crash`. `after_death` keeps what earlier phases established: a pass within the declared
  precision whose run at full precision crashed says both.
- follow-ups (`harness.run.variants`): `confirmed` folds a pass_declared row's run at the device's highest
  precision in (confirmed, hidden drift, unconfirmed, or the device's failure); `located` a drift's run there
  (where it starts); `rechecked` a compiled failure's eager run (whose failure it is).
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from harness.outcomes import PASSING, outcome_of
from harness.phases import DEVICE_PHASES, REFERENCE_PHASES

# -- one run of the step ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepEvidence:
    judgements: tuple[str, ...]  # each output's: within fp32 / within declared / beyond (harness.outcomes)
    kernel_beyond: bool = False  # the op check (or the graph check) found a kernel beyond its contract
    missing_grads: tuple[str, ...] = ()  # train: parameters with a gradient on the reference and none on the target


@dataclass(frozen=True)
class Finding:
    outcome: str
    message: str = ""  # "" : the caller's own words stand
    fields: dict[str, Any] = field(default_factory=dict)


def step(e: StepEvidence) -> Finding:
    """The outcome of one judged run of the step."""
    if e.missing_grads:
        shown = ", ".join(e.missing_grads[:5]) + (" ..." if len(e.missing_grads) > 5 else "")
        return Finding("missing_grad", f"{len(e.missing_grads)} parameter(s) got no gradient on the target: {shown}",
                       {"missing_grads": list(e.missing_grads)})
    compared = outcome_of(e.judgements)
    return Finding("drift" if e.kernel_beyond else compared)


def kernel_message(what: str, op: str, inputs: list[str], declared: str, ratio: float | None, note: str = "",
                   where: str = "", output: str = "") -> str:
    """How a kernel beyond its contract is said, by the model's op check and by an op variation alike."""
    at = f"{what} {op} ({f'in {where}, ' if where else ''}inputs {', '.join(inputs[:4])}{' ...' if len(inputs) > 4 else ''})"
    if ratio is not None:
        return f"{at} is beyond the declared {declared} precision on its own inputs (ratio {ratio:.3g})" + (
            f"; {note}" if note else "")
    return f"{at} returns {output or 'a result'} unlike the CPU's: {note or 'not comparable'}"


# -- the reference side ----------------------------------------------------------------------------------------


def reference(*, applies: bool = True, deterministic: bool = True) -> str | None:
    """The reference side's own outcome: None when the step goes on to the target."""
    if not applies:
        return "skipped"
    if not deterministic:
        return "ref_nondeterministic"
    return None


def harvested(*, applies: bool = True) -> str:
    """A harvest's row: its op calls recorded (`pass`), or the mode does not apply."""
    return "pass" if applies else "skipped"


# -- an exception ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FailureEvidence:
    stage: str  # the phase it rose in: load, reference, target ...
    device_fault: bool = False  # the backend says its device failed (anywhere in the exception's chain)
    cap_too_small: bool = False  # an import failed under the worker's memory cap
    out_of_memory: bool = False
    missing_op: bool = False  # the backend named an op it lacks
    compiling: bool = False  # the compiler raised it
    host_inputs: bool = False  # an op variation's own inputs and CPU run: memory there is the host side's


def failure(e: FailureEvidence) -> str:
    if e.device_fault:
        return "device_error"
    if e.cap_too_small:
        return "load_fail"
    if e.out_of_memory and not e.host_inputs:
        return "oom"
    if e.stage == "load":
        return "load_fail"
    if e.stage == "reference":
        return "ref_fail"
    if e.missing_op:
        return "unsupported_op"
    if e.compiling:
        return "compile_fail"
    return "crash"


# -- a worker's death ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeathEvidence:
    phase: str  # the phase it was in ("" : none heard)
    killed_for: str | None = None  # why the supervisor killed it ("timeout", ...); None: it died by itself
    signal: int | None = None


def death(e: DeathEvidence) -> str:
    if e.killed_for == "timeout":
        return "ref_timeout" if e.phase in REFERENCE_PHASES else "timeout"
    if e.signal == signal.SIGKILL:
        return "oom"
    return "crash"


# What an earlier phase established that a death in a later one keeps (the rest is the death's)
KEPT = ("contract", "metrics", "rmse_ratio", "declared_ratio", "max_abs_err", "max_rel_err", "min_cosine", "nonfinite",
        "first_drift_module", "first_drift_module_type", "first_drift_op", "first_drift_op_module",
        "first_drift_op_inputs", "first_drift_op_ratio", "first_drift_step", "first_drift_param", "grad_worst_ratio",
        "loss_delta", "grad_norm_ratio", "loss_kind", "tokens_matched", "first_divergent_step", "divergence",
        "ops_checked", "fallback_ops", "native_ops", "op_census", "repro_path", "compile_stage", "graph_count",
        "graph_breaks", "confirm", "confirm_note", "eager_outcome")


def after_death(outcome: str, message: str, phase: str, earlier: dict[str, Any] | None) -> dict[str, Any]:
    """The row of a job whose worker died (or hung) in `phase`, with `outcome` and `message` from `death`, after
    earlier phases had established `earlier` (the first run's verdict, sent before a follow-up began): the
    death is the row's outcome (device evidence where the phase runs on the device), and what came before is
    kept beside it (`earlier_outcome`, its measures, and the message says both)."""
    row: dict[str, Any] = {"outcome": outcome, "error_message": message[:2000]}
    if not earlier or phase not in DEVICE_PHASES or not earlier.get("outcome"):
        return row
    before = str(earlier["outcome"])
    row.update({k: earlier[k] for k in KEPT if earlier.get(k) not in (None, "")})
    row["earlier_outcome"] = before
    said = str(earlier.get("error_message") or "")
    row["error_message"] = (f"{message}; before it, the step was {before}" + (f" under the {earlier['contract']} contract" if earlier.get("contract")
                                                else "") + (f" ({said[:400]})" if said else ""))[:2000]
    if phase == "confirm" and before == "pass_declared":
        row["confirm"] = "unconfirmed"
        row["confirm_note"] = f"the run at the device's highest precision did not finish ({outcome}): {message}"[:500]
    return row


# -- follow-ups: a run of the target under other settings, folded into the row ---------------------------------

CONFIRMED, UNCONFIRMED, HIDDEN = "confirmed", "unconfirmed", "hidden drift"


def confirmed(out: MutableMapping[str, Any], confirm: Mapping[str, Any], declared: str) -> bool:
    """The row after its confirmation run's fields (`confirm`) came in; True when the row's verdict is now
    the confirmation's (a hidden drift, or the device failing under it)."""
    outcome = confirm.get("outcome", "")
    if confirm.get("device_fault"):  # the device failed: that is the row's news, whatever it passed before
        out.update(confirm)
        return True
    if outcome in PASSING:
        ratio = confirm.get("rmse_ratio")
        out.update(confirm=CONFIRMED, confirm_note="within the fp32 envelope at the device's highest precision"
                   + (f" (rmse ratio {ratio:.3g})" if isinstance(ratio, int | float) else ""))
        return False
    if outcome == "drift":
        before = f"pass_declared at the declared {declared} precision" + "".join(
            f", {label} {out[key]:.3g}" for key, label in (("rmse_ratio", "rmse ratio"), ("declared_ratio", "declared ratio"))
            if isinstance(out.get(key), int | float))
        kept = {k: v for k, v in out.items() if k not in confirm}  # what only the first run measured
        out.clear()
        out.update(kept, **confirm)
        out.update(confirm=HIDDEN, confirm_note=before)
        out["error_message"] = (f"the declared {declared} precision hid a drift: at the device's highest precision "
                                f"the outputs are beyond the fp32 envelope; {confirm.get('error_message', '')}"
                                )[:2000]
        return True
    why = confirm.get("unsupported_op") or confirm.get("error_type") or outcome
    out.update(confirm=UNCONFIRMED, confirm_note=f"the run at the device's highest precision did not finish "
               f"({outcome}: {why}): {str(confirm.get('error_message', ''))[:300]}")
    return False


# Where a drift starts, as its run at the device's highest precision names it (not train's first drifting
# parameter: that is the first in the model's order whose gradient drifts, and rounding gone, more do)
LOCATION = ("first_drift_step", "first_drift_op", "first_drift_op_module", "first_drift_op_inputs",
            "first_drift_op_ratio", "first_drift_module", "first_drift_module_type", "repro_path")


def located(out: MutableMapping[str, Any], at_highest: Mapping[str, Any], declared: str) -> None:
    """A row that drifts at the declared precision, after its run at the highest: where that run drifts too,
    the first drifting step, op and module are its (rounding no longer masks them), the verdict and its
    measures stay the declared run's, and the note says what moved."""
    if at_highest.get("outcome") != "drift":
        what = at_highest.get("outcome") or "did not finish"
        out["confirm_note"] = (f"at the device's highest precision the step {'passes' if what in PASSING else what}"
                               f": the drift is in the declared {declared} path")
        return
    found = {k: at_highest[k] for k in LOCATION if at_highest.get(k) not in (None, "")}
    moved = [f"{k.removeprefix('first_drift_').replace('_', ' ')} {found[k]} (at {declared}: {out.get(k, '-')})"
             for k in ("first_drift_step", "first_drift_op", "first_drift_module")
             if k in found and found[k] != out.get(k)]
    out.update(found)
    out["confirm_note"] = "located at the device's highest precision" + (": " + "; ".join(moved) if moved else
                                                                          ", where it starts at the same place")
    if moved:
        out["error_message"] = f"{out.get('error_message', '')}; at full precision it is first seen at: {'; '.join(moved)}"[:2000]


def rechecked(compiled: Mapping[str, Any], eager: Mapping[str, Any], device: str) -> dict[str, Any]:
    """A compiled row that did not pass, after the same step ran eagerly: its `eager_outcome` and the message
    saying whose failure it is (the compiler's alone, or the device's eager path too)."""
    outcome = eager.get("outcome", "")
    if outcome in PASSING:
        head = f"compiled only; eager on {device} passes ({outcome})"
    else:
        why = eager.get("first_drift_op") or eager.get("unsupported_op") or eager.get("error_type") or ""
        head = f"eager on {device} fails too ({outcome}{': ' + why if why else ''})"
    return {"eager_outcome": outcome, "error_message": f"{head}; {compiled.get('error_message', '')}"[:2000]}
