"""Localize drift: which module's output first leaves tolerance on the target.

A drifting logit says "something is wrong"; a bring-up engineer needs "where". We hook every
submodule in the reference (fp32 CPU), the fp64 oracle and the target model, replay the same inputs,
and walk the target's module outputs in completion order (leaves finish before their parents), judging
each with the same fp64-oracle rule as the final outputs. The first one that fails names the module
(qualified name + class) where error entered or first became visible.

Only run for rows that already drift: capturing every activation costs memory and time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from harness.models.outputs import output_tensors
from harness.run.compare import Tolerance, check_tensor


@dataclass
class ModuleOutput:
    qualname: str
    type_name: str
    call: int  # nth call of this module in the forward (shared modules run more than once)
    tensors: dict[str, torch.Tensor]


@dataclass
class DriftSite:
    module: str
    module_type: str
    output: str
    rmse_ratio: float | None
    max_abs: float | None
    call: int = 0  # the module's nth call in the forward
    rank: int | None = None  # --parallel: the rank whose module it is

    @property
    def key(self) -> tuple[str, int]:
        return self.module, self.call


def capture(model: torch.nn.Module, run: Callable[[], object],
            whole: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> list[ModuleOutput]:
    """Run `run()` with a forward hook on every submodule; return their outputs on the CPU, in order. `whole`:
    an output as one device's tensor (a rank's DTensor gathered: `harness.parallel.rank`)."""
    records: list[ModuleOutput] = []
    calls: dict[str, int] = {}
    handles = []

    def make_hook(qualname: str):
        def hook(module: torch.nn.Module, args: object, output: object) -> None:
            n = calls.get(qualname, 0)
            calls[qualname] = n + 1
            try:
                flat = output_tensors(output)
            except Exception:  # an exotic output type must not break localization of the rest
                return
            cpu = {k: whole(v.detach()).to("cpu", copy=True) for k, v in flat.items()}
            records.append(ModuleOutput(qualname, type(module).__name__, n, cpu))

        return hook

    for qualname, module in model.named_modules():
        if qualname:  # the root's output is the model output, already judged
            handles.append(module.register_forward_hook(make_hook(qualname)))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return records


def first_drift(
    ref: list[ModuleOutput],
    target: list[ModuleOutput],
    oracle: list[ModuleOutput] | None,
    tol: Tolerance | None = None,
    expected: list[ModuleOutput] | None = None,
) -> DriftSite | None:
    """The first target module output (completion order) beyond the declared envelope (the fp32 one
    when there is no `expected` reference of a reduced-precision contract)."""
    tol = tol or Tolerance()
    ref_by = {(r.qualname, r.call): r for r in ref}
    oracle_by = {(o.qualname, o.call): o for o in oracle} if oracle else {}
    expected_by = {(e.qualname, e.call): e for e in expected} if expected else {}
    for rec in target:
        key = (rec.qualname, rec.call)
        r = ref_by.get(key)
        if r is None:
            continue
        o = oracle_by.get(key)
        e = expected_by.get(key)
        for name, t in rec.tensors.items():
            rt = r.tensors.get(name)
            if rt is None:
                continue
            ot = o.tensors.get(name) if o is not None else None
            et = e.tensors.get(name) if e is not None else None
            c = check_tensor(name, rt, t, ot, tol, et)
            if not c.ok_declared:
                return DriftSite(rec.qualname, rec.type_name, name, c.rmse_ratio, c.max_abs, rec.call)
    return None
