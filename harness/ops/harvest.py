"""The harvest: every op call a model's reference step makes, recorded as variations (no tensors).

A dispatch mode around one more run of the reference step on the CPU (the step the mode defines: a
forward, a training step with its backward, a teacher-forced decoding) records each call's signature
(`harness.ops.signature`): the first call of a signature is encoded and its values observed, later ones
only counted. What it sees is what the op check sees on the target, one level below autograd: composite
ops arrive decomposed, and an op's own sub-calls stay inside it.

Two ways in: ``run --harvest`` records it inside a model's run (the pipeline's `recorder`: the reference's
first step runs under it, a model's first step being the one that calls everything, lazily made caches
included; should it ever differ from the determinism re-run, a plain step is the reference instead; a
cached reference side runs one more step for it), and ``ops harvest`` runs just the load and the step
(`harvest_model`), through the same pool, for a list's models.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness import verdict
from harness.models.model_list import ModelEntry
from harness.ops.signature import Signature, Unrepresentable, call_key, merge_gens, observations
from harness.phases import HARVEST, LOAD
from harness.results.draft import RowDraft
from harness.results.rows import Measurement
from harness.run.attribution import classify_exception
from harness.run.context import Task, load
from harness.run.modes import Skip, mode_for

# Plumbing, not kernels: reading a scalar back, aliasing, re-pointing a storage.
_NOT_KERNELS = frozenset({"_local_scalar_dense", "detach", "alias", "lift_fresh", "set_", "resize_", "_copy_from",
                          "_copy_from_and_resize", "record_stream"})


_RECORDED: dict[Any, bool] = {}


def recorded(func: torch._ops.OpOverload) -> bool:
    """An ATen kernel (not plumbing); looked up once per overload (this runs for every call)."""
    known = _RECORDED.get(func)
    if known is None:
        name = func._schema.name
        known = _RECORDED[func] = name.startswith("aten::") and name[6:] not in _NOT_KERNELS
    return known


# Quick call key -> its variation (id, spec, models observed), across the models this process harvests: a
# signature seen once is not encoded again; its values are observed in the first few models that call it
# and merged (`merge_gen`: the more demanding observation), so one model with near-zero activations at a
# kernel does not hide a bug there.
_KNOWN: dict[Any, tuple[str, dict[str, Any], int] | None] = {}
OBSERVED = 2  # models whose values a process observes per signature (the first few are as good as all)
_KNOWN_MAX = 20_000  # about 20 MB of signatures; a worker that sees more starts over


class Harvest(TorchDispatchMode):
    """While active, record every ATen call as a variation: `result()` gives the uses and signatures."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # the reference step runs eagerly: no per-call guard against Dynamo (~10 us a call)

    def __init__(self) -> None:
        super().__init__()
        self._calls: dict[Any, int] = {}
        self._sigs: dict[Any, tuple[str, dict[str, Any], int] | None] = {}  # this model's, from `_KNOWN`

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if recorded(func):
            try:
                key = call_key(func, args, kwargs)
                hash(key)
            except (TypeError, RuntimeError):  # unhashable arguments; a sparse tensor (no strides)
                key = None
            if key is not None:
                if key not in self._sigs:  # this model's first call of it: observed before the call (an
                    known = _KNOWN.get(key, False)  # in-place op changes its inputs)
                    if known is False:
                        if len(_KNOWN) >= _KNOWN_MAX:
                            _KNOWN.clear()
                        try:
                            sig = Signature.of(func, args, kwargs)
                            known = (sig.id, sig.spec(), 1)
                        except Unrepresentable:
                            known = None
                    elif known is not None and known[2] < OBSERVED:
                        vid, spec, n = known
                        known = (vid, {**spec, "gens": merge_gens(spec["gens"], observations(args, kwargs))}, n + 1)
                    _KNOWN[key] = self._sigs[key] = known
                self._calls[key] = self._calls.get(key, 0) + 1
        return func(*args, **kwargs)

    @property
    def recorded(self) -> bool:
        """Whether it saw a step (the reference's first; not when the reference side was cached)."""
        return bool(self._calls)

    def result(self) -> dict[str, Any]:
        """``{"uses": {variation id: calls}, "specs": {variation id: signature}}``."""
        uses: dict[str, int] = {}
        specs: dict[str, dict[str, Any]] = {}
        for key, calls in self._calls.items():
            known = self._sigs.get(key)
            if known is None:
                continue
            vid, spec, _ = known
            uses[vid] = uses.get(vid, 0) + calls
            if vid in specs:  # another quick key, the same signature: widen what was seen
                specs[vid] = {**specs[vid], "gens": merge_gens(specs[vid]["gens"], spec["gens"])}
            else:
                specs[vid] = spec
        return {"uses": uses, "specs": specs}


def harvest_model(task: Task, on_phase: Callable[[str], None] | None = None) -> Measurement:
    """``ops harvest``'s job: load the model, plan its step and run it once on the CPU, recorded. The row
    is ``pass`` when harvested, else the load or reference failure (``skipped`` where the mode does not
    apply)."""
    entry = ModelEntry(**task.entry) if isinstance(task.entry, dict) else task.entry
    phases: dict[str, dict[str, float]] = {}
    t_start = time.perf_counter()

    def phase(name: str) -> float:
        if on_phase is not None:
            on_phase(name)
        return time.perf_counter()

    stage = "load"
    try:
        t0 = phase(LOAD.name)
        loaded, inputs = load(entry, task)
        phases["load"] = {"s": round(time.perf_counter() - t0, 4)}
        stage = "reference"
        t0 = phase(HARVEST.name)
        mode = mode_for(task.settings)
        model = loaded.model
        plan = mode.plan(model, loaded, entry, inputs, task.seed)
        h = Harvest()
        with h:
            plan.step(model, plan.inputs)
        phases["harvest"] = {"s": round(time.perf_counter() - t0, 4)}
        harvest = h.result()
        fields = RowDraft(outcome=verdict.harvested(), harvest=harvest,
                          error_message=f"{len(harvest['uses'])} variations, {sum(harvest['uses'].values())} calls")
    except Skip as e:
        fields = RowDraft(outcome=verdict.harvested(applies=False), error_message=str(e))
    except Exception as e:
        fields = classify_exception(e, None, stage)
    return Measurement(model_id=entry.id, device=task.target, phases=phases, load_time_s=phases.get("load", {}).get("s"),
                       wall_time_s=time.perf_counter() - t_start, **fields)
