"""The outcome vocabulary: every verdict a (model, target, settings) row can carry, in one table.

Each outcome says where its cause lies (the model/reference side or the target), how bad it is for
the night-to-night gate, whether the runner retries it on another device, and how the report draws it.
Everything else (store validation, diff severity, matrix columns, report colours, runner retries)
reads this table; nothing else lists outcomes.

Precedence in the worker is the order below: the first stage that fails decides the outcome.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Outcome:
    name: str
    severity: int  # for the diff gate: a higher value in the head run than in the base is "worse"
    colour: str  # report colour
    meaning: str
    reference_side: bool = False  # the model or the CPU reference failed, or the mode does not apply to the
    # model: says nothing about the target
    device_side: bool = False  # the device failed, not the model: re-run elsewhere / on resume
    retryable: bool = False  # suspicious enough to re-run on another device
    ran: bool = False  # the target ran the model to the end (the "ran %" numerator)
    matched: bool = False  # ... and its numerics matched (the "numerics matched %" numerator)


TABLE: tuple[Outcome, ...] = (
    Outcome("load_fail", 6, "#546e7a", "the model could not be loaded or fed", reference_side=True),
    Outcome("ref_fail", 6, "#78909c", "the fp32 CPU reference raised", reference_side=True),
    Outcome("ref_nondeterministic", 6, "#90a4ae", "two fp32 CPU reference runs differ", reference_side=True),
    Outcome("ref_timeout", 6, "#a1887f", "the reference side (loading, the fp32 CPU reference, the fp64 oracle, the "
            "expected reference, the harvest) ran past its time budget before the target ran (the phase in the row; "
            "raise --timeout or --load-timeout)", reference_side=True),
    Outcome("skipped", 0, "#b0bec5", "the mode does not apply to this model (generate: no generation head; the "
            "reason is in the row)", reference_side=True),
    Outcome("device_error", 5, "#37474f", "the device failed (its backend said so); the model is re-run",
            device_side=True, retryable=True),
    Outcome("unsupported_op", 3, "#6a1b9a", "the target lacks an op (named in the row)"),
    Outcome("compile_fail", 5, "#ad1457", "--compile: tracing or compiling raised (the stage, Dynamo trace, "
            "AOT/functionalization, Inductor graph passes or backend codegen, and the op or node in the row)"),
    Outcome("crash", 5, "#c62828", "the target run raised or its worker died", retryable=True),
    Outcome("timeout", 4, "#8d6e63", "the model ran past the time budget", retryable=True),
    Outcome("oom", 4, "#5d4037", "out of memory"),
    Outcome("missing_grad", 2, "#d84315", "train mode: a parameter with a gradient on the reference got none on "
            "the target (named in the row)", ran=True),
    Outcome("drift", 2, "#ef6c00", "outputs (train mode: loss, gradients, updates) beyond the comparison rule's "
            "bound", ran=True),
    Outcome("flaky", 1, "#c0a000", "failed, then passed on a retry on a healthy device", ran=True, matched=True),
    Outcome("pass_declared", 0, "#7cb342", "outside the fp32 envelope, within the target's declared precision",
            ran=True, matched=True),
    Outcome("pass", 0, "#2e7d32", "outputs within the fp32 bound", ran=True, matched=True),
)

BY_NAME: dict[str, Outcome] = {o.name: o for o in TABLE}
OUTCOMES: tuple[str, ...] = tuple(o.name for o in TABLE)
REFERENCE_SIDE: frozenset[str] = frozenset(o.name for o in TABLE if o.reference_side)
DEVICE_SIDE: frozenset[str] = frozenset(o.name for o in TABLE if o.device_side)
NOT_THE_MODELS: frozenset[str] = REFERENCE_SIDE | DEVICE_SIDE  # say nothing about the target's support
RETRYABLE: frozenset[str] = frozenset(o.name for o in TABLE if o.retryable)
RAN: frozenset[str] = frozenset(o.name for o in TABLE if o.ran)
MATCHED: frozenset[str] = frozenset(o.name for o in TABLE if o.matched)
PASSING: frozenset[str] = frozenset({"pass", "pass_declared"})
COLOURS: dict[str, str] = {o.name: o.colour for o in TABLE}
UNKNOWN_SEVERITY = 5  # an outcome written by a newer portharness: treat it like a crash


def severity(outcome: str | None) -> int:
    """Gate severity of an outcome (0 = pass)."""
    o = BY_NAME.get(outcome or "")
    return o.severity if o is not None else UNKNOWN_SEVERITY


def check(outcome: str) -> str:
    """`outcome` if it is in the vocabulary, else ValueError naming the known ones."""
    if outcome not in BY_NAME:
        raise ValueError(f"unknown outcome {outcome!r}; expected one of {', '.join(OUTCOMES)}")
    return outcome


def headline(counts: dict[str, int]) -> dict[str, float | int | dict[str, int] | None]:
    """TorchTPU's two figures: ran % of the models the target was asked to run (reference-side and
    device-side outcomes excluded), and numerics matched % of those that ran. `excluded` says which rows
    the denominator leaves out (outcome -> rows), so no reader mistakes a lost device for a small run."""
    tested = sum(n for o, n in counts.items() if o not in NOT_THE_MODELS)
    ran = sum(n for o, n in counts.items() if o in RAN)
    matched = sum(n for o, n in counts.items() if o in MATCHED)
    return {
        "tested": tested,
        "ran": ran,
        "matched": matched,
        "ran_pct": 100.0 * ran / tested if tested else None,
        "matched_pct": 100.0 * matched / ran if ran else None,
        "excluded": {o: counts[o] for o in OUTCOMES if o in NOT_THE_MODELS and counts.get(o)},
    }


# ----------------------------------------------------------------------------------------------
# One output's judgement: the row's contract applied to one output (a logits step, a gradient...)
# ----------------------------------------------------------------------------------------------
# Every per-output label (`check`'s output lines, the report's per-output tables, decoding steps, train
# gradients) comes from `output_judgement`, and the row's own pass / pass_declared / drift from
# `outcome_of` over the same judgements, so no label can say "drift" on a row that passed. (A later
# confirmation of pass_declared rows at full precision, `confirm`: confirmed / unconfirmed / hidden
# drift, refines a row beside this judgement; it does not change it.)
WITHIN_FP32 = "within fp32"  # inside the fp32 envelope (rmse ratio <= 1)
WITHIN_DECLARED = "within declared"  # outside it, inside the declared precision's (declared ratio <= 1)
BEYOND = "beyond"  # outside both: error the declared precision does not explain
JUDGEMENTS: tuple[str, ...] = (WITHIN_FP32, WITHIN_DECLARED, BEYOND)
# the outcome whose colour a judgement is drawn in (report chips)
JUDGEMENT_OUTCOME: dict[str, str] = {WITHIN_FP32: "pass", WITHIN_DECLARED: "pass_declared", BEYOND: "drift"}


def judge(ok: bool, ok_declared: bool) -> str:
    """The judgement of one output from the comparison's two verdicts (`harness.run.compare`)."""
    return WITHIN_FP32 if ok else WITHIN_DECLARED if ok_declared else BEYOND


def output_judgement(m: Mapping[str, Any] | Any) -> str:
    """The judgement of one output's stored metrics (a row's ``metrics[name]``); "" when they hold no
    verdict (a bare value of an older row). Rows written before ``ok_declared`` was stored are judged
    by their declared ratio."""
    if not isinstance(m, Mapping) or not isinstance(m.get("ok"), bool):
        return ""
    if m["ok"]:
        return WITHIN_FP32
    declared = m.get("ok_declared")
    if not isinstance(declared, bool):
        ratio = m.get("declared_ratio")
        declared = isinstance(ratio, int | float) and math.isfinite(ratio) and ratio <= 1
    return judge(False, declared)


def outcome_of(judgements: Iterable[str]) -> str:
    """The row's outcome from its outputs' judgements: pass when every one is within fp32, pass_declared
    when none is beyond, else drift (the mode and the op check may still decide otherwise)."""
    seen = set(judgements)
    return "drift" if BEYOND in seen else "pass_declared" if WITHIN_DECLARED in seen else "pass"
