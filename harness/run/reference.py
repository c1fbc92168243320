"""The reference side of one model, all on the CPU: the fp32 reference (run twice: a reference that differs
from itself judges nothing), the fp64 oracle every error is measured against, and the expected reference
under the target's declared precision contract.

Nothing here depends on the target but the contract it declares, which is why this side is computed
once and reused: with a reference cache (`refcache`, keyed by `refkey`) a model seen before gets its
reference, oracle and expected outputs, its determinism verdict and its mode's decisions from the cache,
and the mode rebuilds its step from those decisions (`Mode.rebuild`) without running it. A model whose
reference cannot be made stops here with its row fields (`Stop`): ref_fail or ref_nondeterministic
(cached too: they are the reference's answer), or skipped where the mode does not apply to it (not cached:
deciding it is cheap).
"""

from __future__ import annotations

import contextlib
import time

import torch

from harness import phases, verdict
from harness.backends.contracts import Emulate
from harness.models.load import forget_lazy
from harness.results.draft import RowDraft
from harness.run.attribution import classify_exception
from harness.run.compare import identical
from harness.run.context import ModelRun, ReferenceSide, Stop
from harness.run.memory import PhaseClock
from harness.run.modes import Skip
from harness.run.oracle import DEFAULT_MAX_PARAMS, fp64_outputs
from harness.run.refcache import Entry, RefCache
from harness.run.refkey import NoKey, components, key_of

GROUPS = ("ref", "oracle", "expected")  # the cached tensors' name prefixes
CACHED_PHASES = (phases.REFERENCE.name, phases.ORACLE.name, phases.EXPECTED.name)
STOPS_CACHED = ("ref_fail", "ref_nondeterministic")  # the reference's own answers (not oom, not a device's)


def reference_side(run: ModelRun, cache: RefCache | None = None) -> ReferenceSide:
    """The reference phases, or their results from `cache` (`Stop` with the row's fields when the model
    goes no further)."""
    clock = run.clock
    if cache is None:
        return _computed(run)
    with clock.phase(phases.REF_CACHE):
        try:
            parts = components(run.entry, run.loaded.config, run.inputs, mode=run.mode.name,
                               contract=run.declared.name, settings=run.adapter.reference_settings(run.settings),
                               seed=run.task.seed, memo=cache.memo)
        except NoKey as e:
            return _computed(run, RowDraft(ref_cache=f"computed (not cached: {e})"))
        key = key_of(parts)
        hit, note = cache.get(key, parts)
        if hit is not None:
            side = _from_cache(hit, run)
            if side is not None or "stop" in hit.meta:
                for name in CACHED_PHASES:
                    if name in hit.meta.get("phases", {}):
                        clock.cached(name)
                fields = RowDraft(ref_cache="cached", ref_key=key)
                if side is None:
                    raise Stop({**hit.meta["stop"], **fields})
                side.fields = fields
                return side
            note = "recomputed: the cached decisions could not rebuild the step"
    fields = RowDraft(ref_key=key)
    try:
        side = _computed(run, fields)
    except Stop as stop:
        if stop.fields.get("outcome") in STOPS_CACHED:
            with clock.phase(phases.REF_STORE):
                stored = cache.put(key, {}, {"stop": dict(stop.fields), "phases": _phase_seconds(clock)}, parts)
        else:
            stored = f"computed (not stored: {stop.fields.get('outcome')} is this run's, not the reference's answer)"
        stop.fields["ref_cache"] = _joined(note, stored)
        raise
    with clock.phase(phases.REF_STORE):
        tensors = {f"{group}/{name}": t for group, outs in zip(GROUPS, (side.ref, side.oracle, side.expected),
                                                                strict=True) for name, t in (outs or {}).items()}
        meta = {"oracle_rule": side.oracle_rule, "fields": dict(side.plan.fields), "ref_s": side.ref_s,
                "has": [g for g, outs in zip(GROUPS, (side.ref, side.oracle, side.expected), strict=True)
                        if outs is not None],
                "phases": _phase_seconds(clock)}
        side.fields["ref_cache"] = _joined(note, cache.put(key, tensors, meta, parts))
    return side


def _joined(note: str, stored: str) -> str:
    return f"{note}; {stored}" if note else stored


def _phase_seconds(clock: PhaseClock) -> dict[str, float]:
    """The reference phases this model ran and their seconds (what a hit saves)."""
    return {name: clock.phases[name]["s"] for name in CACHED_PHASES if name in clock.phases}


def _from_cache(hit: Entry, run: ModelRun) -> ReferenceSide | None:
    """The reference side a cache entry holds, the mode's step rebuilt from its decisions (None for a
    cached stop, or if the rebuild fails: the entry is then recomputed)."""
    meta = hit.meta
    if "stop" in meta:
        return None
    try:
        plan = run.mode.rebuild(run.model, run.loaded, run.entry, run.inputs, run.task.seed,
                                dict(meta.get("fields", {})))
    except Exception:
        return None
    groups: dict[str, dict[str, torch.Tensor]] = {g: {} for g in meta.get("has", [])}
    for name, t in hit.tensors.items():
        group, _, rest = name.partition("/")
        groups.setdefault(group, {})[rest] = t
    return ReferenceSide(plan, groups.get("ref", {}), groups.get("oracle"), meta.get("oracle_rule", ""), None,
                         groups.get("expected"), float(meta.get("ref_s") or 0.0), True)


def _computed(run: ModelRun, fields: RowDraft | None = None) -> ReferenceSide:
    fields = RowDraft(fields)
    model, mode, seed, clock = run.model, run.mode, run.task.seed, run.clock
    with clock.phase(phases.REFERENCE):
        try:
            t0 = time.perf_counter()
            torch.manual_seed(seed)
            # run --harvest: the op calls of the model's first step recorded on the way (a first step may call
            # kernels later ones do not: caches made once)
            with run.recorder if run.recorder is not None else contextlib.nullcontext():
                plan = mode.plan(model, run.loaded, run.entry, run.inputs, seed)
                ref = plan.first if plan.first is not None else plan.step(model, plan.inputs)
            ref_s = time.perf_counter() - t0
            torch.manual_seed(seed + 1)  # a step that depends on the seed is not reproducible
            ref2 = plan.step(model, plan.inputs)
            if run.recorder is not None and not identical(ref, ref2):  # the recording's doing? plain steps judge
                torch.manual_seed(seed)
                ref = plan.step(model, plan.inputs)
        except Skip as e:
            raise Stop({"outcome": verdict.reference(applies=False), "error_message": str(e)}) from None
        except Exception as e:
            raise Stop({**classify_exception(e, run.adapter, "reference"), **fields}) from None
        stop = verdict.reference(deterministic=identical(ref, ref2))
        if stop is not None:
            raise Stop({"outcome": stop, "error_message": "two fp32 reference runs on CPU differ "
                        "(the second under another seed: the step draws random numbers, or is not deterministic)",
                        **fields})
        del ref2

    with clock.phase(phases.ORACLE):
        forget_lazy(model, run.loaded.lazy)  # an fp32 cache the forward built would stay fp32 in the fp64 copy
        oracle, rule, oracle_model = fp64_outputs(
            model, plan.inputs, plan.step, max_params=int(run.settings.get("oracle_max_params", DEFAULT_MAX_PARAMS)),
            streamed=mode.streamed_oracle,
        )
        if not mode.localizes:
            oracle_model = None  # it serves module-level localization only

    expected = None
    if not run.declared.exact:
        with clock.phase(phases.EXPECTED):
            try:
                with Emulate(run.declared):
                    expected = plan.step(model, plan.inputs)
            except Exception:
                expected = None  # the model cannot run under the emulation: judged by the fp32 envelope alone
    return ReferenceSide(plan, ref, oracle, rule, oracle_model, expected, ref_s, False, fields)
