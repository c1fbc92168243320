"""The reference side of one model, all on the CPU: the fp32 reference (run twice: a reference that differs
from itself judges nothing), the fp64 oracle every error is measured against, and the expected reference
under the target's declared precision contract.

Nothing here depends on the target but the contract it declares, which is why this side can be computed
once and reused (see the reference cache). A model whose reference cannot be made stops here with its
row fields (`Stop`): ref_fail or ref_nondeterministic, or skipped where the mode does not apply to it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from harness.backends import Adapter
from harness.backends.contracts import Contract, Emulate
from harness.models.model_list import ModelEntry
from harness.run.attribution import classify_exception
from harness.run.compare import identical
from harness.run.memory import PhaseClock
from harness.run.modes import Mode, Plan, Skip
from harness.run.oracle import DEFAULT_MAX_PARAMS, fp64_outputs


class Stop(Exception):
    """The model's row ends here, with these fields."""

    def __init__(self, fields: dict[str, Any]) -> None:
        super().__init__(fields.get("outcome", ""))
        self.fields = fields


@dataclass
class ReferenceSide:
    plan: Plan
    ref: dict[str, torch.Tensor]
    oracle: dict[str, torch.Tensor] | None
    oracle_rule: str  # which rule judges the row (fp64-copy, fp64-streamed, none (...))
    oracle_model: torch.nn.Module | None  # the fp64 copy, for module-level localization
    expected: dict[str, torch.Tensor] | None  # None: the contract is exact, or the model cannot run emulated
    ref_s: float


def reference_side(model: torch.nn.Module, loaded: Any, entry: ModelEntry, inputs: dict[str, Any], mode: Mode,
                   declared: Contract, settings: dict[str, Any], seed: int, adapter: Adapter,
                   clock: PhaseClock) -> ReferenceSide:
    """Run the reference phases (`Stop` with the row's fields when the model goes no further)."""
    with clock.phase("reference"):
        try:
            t0 = time.perf_counter()
            torch.manual_seed(seed)
            plan = mode.plan(model, loaded, entry, inputs, seed)
            ref = plan.first if plan.first is not None else plan.step(model, plan.inputs)
            ref_s = time.perf_counter() - t0
            torch.manual_seed(seed + 1)  # a step that depends on the seed is not reproducible
            ref2 = plan.step(model, plan.inputs)
        except Skip as e:
            raise Stop({"outcome": "skipped", "error_message": str(e)}) from None
        except Exception as e:
            raise Stop(classify_exception(e, adapter, "reference")) from None
        if not identical(ref, ref2):
            raise Stop({"outcome": "ref_nondeterministic", "error_message": "two fp32 reference runs on CPU differ "
                        "(the second under another seed: the step draws random numbers, or is not deterministic)"})
        del ref2

    with clock.phase("oracle"):
        oracle, rule, oracle_model = fp64_outputs(
            model, plan.inputs, plan.step, max_params=int(settings.get("oracle_max_params", DEFAULT_MAX_PARAMS)),
            streamed=mode.streamed_oracle,
        )
        if not mode.localizes:
            oracle_model = None  # it serves module-level localization only

    expected = None
    if not declared.exact:
        with clock.phase("expected"):
            try:
                with Emulate(declared):
                    expected = plan.step(model, plan.inputs)
            except Exception:
                expected = None  # the model cannot run under the emulation: judged by the fp32 envelope alone
    return ReferenceSide(plan, ref, oracle, rule, oracle_model, expected, ref_s)
