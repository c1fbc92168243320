"""One op variation on the target, alone: regenerate its inputs, run it on the CPU and on the device, judge it.

The pipeline of a model, for one kernel call, in two phases as the supervisor sees them: ``reference`` (the
inputs regenerated from the seed and the signature: an op this torch lacks, or a signature that cannot be
rebuilt, is ``load_fail``; then the call on the CPU in fp32, under the target's declared contract and in
fp64: the CPU rejecting the regenerated inputs is ``ref_fail``), ``target`` (the call on
the device under the run's settings, synchronized: a missing kernel is ``unsupported_op`` naming it, a
raise ``crash``, the device's own failure ``device_error``; a segfault or a hang is the supervisor's
``crash``/``timeout`` of this variation alone), then the comparison (on the CPU, within ``target``'s time).

The judgement is the op check's (`harness.run.opcheck.judge_output`), so a variation's verdict and the op
check's agree: each float output (and each argument the op writes) against the fp64 oracle, bounded by the
CPU's own error under the fp32 rule (``pass``), else under the declared contract (``pass_declared``), else
``drift``, with the op's standalone repro. Integer and boolean outputs must be equal. A random op, or one
returning uninitialised memory, only has to run: ``skipped``, saying so (its values are not comparable).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from harness import verdict
from harness.backends import Adapter, adapter_for
from harness.backends.contracts import Contract, Emulate, contract
from harness.ops.signature import display, regenerate, resolve
from harness.outcomes import BEYOND, WITHIN_FP32, judge
from harness.phases import COMPARE, REFERENCE, TARGET
from harness.results.draft import RowDraft
from harness.results.rows import Measurement
from harness.run.attribution import classify_exception, drain, target_failure
from harness.run.context import Stop, Task
from harness.run.opcheck import OpFailure, judge_output, repro_preamble, write_repro
from harness.run.target import census_fields

_UNINITIALISED = frozenset({"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
                            "new_empty_strided"})


ANNOUNCED = (REFERENCE.name, TARGET.name)  # where the budget and the policy differ


@dataclass
class Call:
    """A variation, ready to run: the callable and its CPU arguments."""

    fn: Callable[..., Any]
    args: list[Any]
    kwargs: dict[str, Any]
    op: str  # as backends name it
    overload: torch._ops.OpOverload | None  # the ATen overload (None: an OpInfo's Python callable)

    @property
    def random(self) -> bool:
        o = self.overload
        if o is None:
            return False
        return (o._schema.name.removeprefix("aten::") in _UNINITIALISED
                or any(a.name == "generator" for a in o._schema.arguments))

    def written(self) -> list[int]:
        """Positions of the arguments the op writes (in-place and out= ops)."""
        if self.overload is None:
            return []
        return [i for i, a in enumerate(self.overload._schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write and i < len(self.args)]


def call_for(spec: dict[str, Any], seed: int) -> Call:
    """The variation's call, its inputs regenerated on the CPU."""
    if spec.get("source") == "opinfo":
        from harness.ops.opinfo import sample_call

        fn, args, kwargs = sample_call(spec, seed)
        return Call(fn, args, kwargs, spec.get("display", spec.get("op", "")), None)
    overload = resolve(spec["op"])
    args, kwargs = regenerate(spec, seed)
    return Call(overload, args, kwargs, display(spec["op"]), overload)


def run_variation(task: Task, on_phase: Callable[[str], None] | None = None) -> Measurement:
    """One variation (`task.variation`, its id in `task.entry`) on `task.target`; never raises for the
    variation's problems."""
    phases: dict[str, dict[str, float]] = {}
    t_start = time.perf_counter()

    @contextlib.contextmanager
    def phase(name: str) -> Iterator[None]:
        # The supervisor hears only where its budget and the policy differ: the CPU side (a death there is
        # not the device's) and the device's; a message per phase costs a wake-up of the supervisor, and a
        # variation is milliseconds of work
        if on_phase is not None and name in ANNOUNCED:
            on_phase(name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            phases[name] = {"s": round(time.perf_counter() - t0, 5)}

    try:
        fields = _pipeline(task, phase)
    except Stop as stop:
        fields = stop.fields
    return Measurement(model_id=task.entry["id"], device=task.target, phases=phases,
                       wall_time_s=time.perf_counter() - t_start, target_time_s=phases.get("target", {}).get("s"),
                       ref_time_s=phases.get("reference", {}).get("s"), **fields)


def _pipeline(task: Task, phase: Callable[[str], contextlib.AbstractContextManager]) -> RowDraft:
    adapter = adapter_for(task.target)
    declared = contract(adapter.declared_precision(task.settings))
    with phase(REFERENCE.name):
        try:
            call = call_for(task.variation, task.seed)
        except Exception as e:
            raise Stop(_host_side(e, "load")) from None
        try:
            ref = _reference(call, declared)
        except Exception as e:
            raise Stop(_host_side(e, "reference")) from None
    with phase(TARGET.name):
        got, census = _target(call, task, adapter)
    out = census_fields(census)
    out["contract"] = declared.name
    if call.random or ref.varies:
        name = call.overload._schema.name.removeprefix("aten::") if call.overload is not None else ""
        what = ("its result is uninitialised memory" if name in _UNINITIALISED else "a random op" if call.random
                else "the CPU itself gives different values run to run")
        out.update(outcome=verdict.reference(applies=False),
                   error_message=f"ran on {task.target} without error; not compared ({what})")
        return out
    with phase(COMPARE.name):
        out.update(_verdict(call, ref, got, declared, task))
    return out


def _host_side(e: BaseException, stage: str) -> RowDraft:
    """A failure before the target ran: the regenerated inputs or the CPU's (never the target's; memory it
    could not get here is the harness's inputs, not a kernel's)."""
    return classify_exception(e, None, stage, host_inputs=True)


@dataclass
class Reference:
    fp32: list[Any]  # the call's outputs (and written arguments) on the CPU, fp32
    expected: list[Any] | None  # ... under the declared contract (None: the contract is exact)
    oracle: list[Any] | None  # ... in fp64 (None: the CPU cannot run it so)
    varies: bool  # two fp32 runs disagree (random, or nondeterministic on the CPU itself)


def _strided_copy(x: torch.Tensor, device: torch.device | str | None = None, dtype: torch.dtype | None = None
                  ) -> torch.Tensor:
    """`x` with its own storage (the whole of it, so offset and strides stay) on `device`."""
    n = x.untyped_storage().nbytes() // max(x.element_size(), 1)
    flat = x.as_strided((n,), (1,), 0).detach().clone()
    if dtype is not None:
        flat = flat.to(dtype)
    if device is not None:
        flat = flat.to(device)
    return flat.as_strided(tuple(x.shape), tuple(x.stride()), x.storage_offset())


def _fresh(args: Any, device: Any = None, dtype: torch.dtype | None = None) -> Any:
    def one(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        cast = dtype if dtype is not None and x.is_floating_point() else None
        return _strided_copy(x, device, cast)

    return tree_map(one, args)


def _results(call: Call, args: list[Any], out: Any) -> list[Any]:
    """What is judged: the outputs, then the arguments the op wrote (when it does not return them)."""
    leaves = [x for x in tree_flatten(out)[0]]
    returned = {id(x) for x in leaves if isinstance(x, torch.Tensor)}
    return leaves + [args[i] for i in call.written() if isinstance(args[i], torch.Tensor) and id(args[i]) not in returned]


def _run(call: Call, args: list[Any], kwargs: dict[str, Any]) -> list[Any]:
    return _results(call, args, call.fn(*args, **kwargs))


def _reference(call: Call, declared: Contract) -> Reference:
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # the CPU is the reference: no TF32 on the host
    try:
        a, k = _fresh((call.args, call.kwargs))
        fp32 = _run(call, a, k)
        a, k = _fresh((call.args, call.kwargs))
        again = _run(call, a, k)
        varies = not all(_same(x, y) for x, y in zip(fp32, again, strict=False))
        expected = None
        if not declared.exact:
            a, k = _fresh((call.args, call.kwargs))
            with Emulate(declared):
                expected = _run(call, a, k)
        oracle = None
        if any(isinstance(x, torch.Tensor) and x.is_floating_point() for x in fp32):
            try:
                a, k = _fresh((call.args, call.kwargs), dtype=torch.float64)
                oracle = _run(call, a, k)
            except Exception:
                oracle = None  # the CPU has no fp64 kernel for it: judged by the no-oracle rule
    finally:
        torch.set_float32_matmul_precision(prev)
    return Reference(fp32, expected, oracle, varies)


def _same(x: Any, y: Any) -> bool:
    """Bit-equal results (NaN equal to NaN)."""
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.is_floating_point() or x.is_complex():
            return torch.equal(x.isnan(), y.isnan()) and torch.equal(torch.nan_to_num(x), torch.nan_to_num(y))
        return torch.equal(x, y)
    if isinstance(x, float) and isinstance(y, float):
        return x == y or (math.isnan(x) and math.isnan(y))
    return type(x) is type(y) and x == y


def _target(call: Call, task: Task, adapter: Adapter) -> tuple[list[Any], Any]:
    device = task.target
    census = None
    try:
        adapter.seed(task.seed)
        with adapter.apply(task.settings), adapter.census() as census:
            args, kwargs = tree_map(lambda x: torch.device(device) if isinstance(x, torch.device) else x,
                                    _fresh((call.args, call.kwargs), device=device))  # factories: made there
            out = _run(call, args, kwargs)
            adapter.synchronize(device)  # what the device reports late is this variation's
            host = [x.detach().to("cpu") if isinstance(x, torch.Tensor) else x for x in out]
            adapter.synchronize(device)
    except Exception as e:
        stop = target_failure(e, drain(adapter, device), adapter)
        stop.update(census_fields(census) if census is not None else {})
        raise Stop(stop) from None
    return host, census


def _verdict(call: Call, ref: Reference, got: list[Any], declared: Contract, task: Task) -> RowDraft:
    """pass / pass_declared / drift over every result, with the worst ratios and a drift's finding."""
    worst_fp32, worst_declared, max_abs = 0.0, 0.0, 0.0
    failure: tuple[int, float | None, str] | None = None
    judgements: list[str] = []  # each float result's, as the op check judges it
    if len(got) != len(ref.fp32):
        failure = (0, None, f"{len(got)} results vs the CPU's {len(ref.fp32)}")
    for i, (t, r) in enumerate(zip(got, ref.fp32, strict=False)):
        if failure is not None:
            break
        e = ref.expected[i] if ref.expected is not None and i < len(ref.expected) else None
        o = ref.oracle[i] if ref.oracle is not None and i < len(ref.oracle) else None
        if not isinstance(r, torch.Tensor) or not isinstance(t, torch.Tensor):
            if not _same(t, r):
                failure = (i, None, f"returns {t!r} where the CPU returns {r!r}")
            continue
        if not (r.is_floating_point() or r.is_complex()):
            if t.shape != r.shape or t.dtype != r.dtype or not torch.equal(t, r):
                n = int((t != r).sum()) if t.shape == r.shape else None
                failure = (i, None, f"{'shape/dtype' if n is None else f'{n} of {r.numel()} values'} differ "
                                    f"from the CPU's ({_describe(t)} vs {_describe(r)})")
            continue
        if r.is_complex():
            t, r = torch.view_as_real(t), torch.view_as_real(r)
            e = torch.view_as_real(e) if e is not None else None
            o = torch.view_as_real(o) if isinstance(o, torch.Tensor) and o.is_complex() else None
        oracle = o if isinstance(o, torch.Tensor) and o.shape == r.shape else None
        ok, ratio, note = judge_output(t, r, oracle)
        if ratio is not None and math.isfinite(ratio):
            worst_fp32 = max(worst_fp32, ratio)
        if t.shape == r.shape:
            diff = (t.double() - r.double()).abs()
            diff = diff[torch.isfinite(diff)]
            if diff.numel():
                max_abs = max(max_abs, float(diff.max()))
        if ok:
            judgements.append(WITHIN_FP32)
            continue
        if e is None:  # the contract is fp32: that was the declared bound
            judgements.append(BEYOND)
            failure = (i, ratio, note)
            continue
        ok, dratio, note = judge_output(t, e, oracle)
        if dratio is not None and math.isfinite(dratio):
            worst_declared = max(worst_declared, dratio)
        judgements.append(judge(False, ok))
        if not ok:
            failure = (i, dratio, note)
    fields = RowDraft(rmse_ratio=worst_fp32, declared_ratio=worst_declared if not declared.exact else None,
                      max_abs_err=max_abs)
    found = verdict.step(verdict.StepEvidence(tuple(judgements), kernel_beyond=failure is not None))
    if failure is None:
        fields["outcome"] = found.outcome
        return fields
    i, ratio, note = failure
    inputs = [_describe(x) for x in tree_flatten((call.args, call.kwargs))[0] if isinstance(x, torch.Tensor)]
    message = verdict.kernel_message("kernel", call.op, inputs, declared.name, ratio, note,
                                     output=f"result {i}")
    fields.update(outcome=found.outcome, first_drift_op=call.op, first_drift_op_inputs=inputs,
                  first_drift_op_ratio=ratio if ratio is not None and ratio < 1e300 else None, error_message=message,
                  nonfinite=any(isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())
                                and bool(torch.isfinite(r).all())
                                for t, r in zip(got, ref.fp32, strict=False) if isinstance(r, torch.Tensor)
                                and r.is_floating_point()))
    if task.repro_dir and call.overload is not None:
        adapter = adapter_for(task.target)
        failure_ = OpFailure(op=call.op, module="", param="", inputs=inputs, output=f"{i}: {_describe(got[i])}"
                             if isinstance(got[i], torch.Tensor) else f"{i}: scalar", ratio=ratio, max_abs=None,
                             note=note, args=(call.args, call.kwargs), func=call.overload)
        try:
            fields["repro_path"] = str(write_repro(
                failure_, contract=declared, target=task.target,
                preamble=repro_preamble(task.backends, adapter.repro_setup(task.settings)),
                model_id=task.entry["id"], directory=Path(task.repro_dir),
                where=f"Op variation {task.entry['id']}, run alone (portharness ops)"))
        except Exception as e:  # a repro is a help, never the verdict
            fields["error_message"] += f"; no repro written ({type(e).__name__}: {e})"
    return fields


def _describe(x: torch.Tensor) -> str:
    return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
