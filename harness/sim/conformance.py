"""OpInfo conformance: PyTorch's own per-op inputs, run on sim and on CPU, compared (values and errors).

Why OpInfos: ``torch.testing._internal.common_methods_invocations.op_db`` is the corpus PyTorch
uses to test every backend; its samples hit the edge cases (empty tensors, broadcasting,
non-contiguous inputs, scalar arguments) a model zoo never reaches. Used by
``tests/test_opinfo_conformance.py`` (exact at ``highest``), ``tests/test_sim_fidelity.py`` and
``scripts/opinfo_table.py`` (per-op counts, and the differences by class).

A case is one call made twice, on CPU and on sim, with the same seed (sim:N draws from a CPU generator
seeded like the CPU default one, so random ops compare exactly too). Its kinds: ``sample`` (an OpInfo
sample, per dtype), ``grad`` (the sample's backward with seeded output gradients), ``error`` (an
OpInfo ``error_inputs`` case) and ``alias`` (an ``out=`` that is one of the op's own inputs, or an
overlapping view of one). Both sides must give the same values (bit for bit when exact: the sign
of a zero and NaN-ness too) or raise the same exception type with the same message, device names
aside; sim may instead raise the standard missing-kernel error (``unsupported``, not a difference).

The sim run is traced under ``op_profile("full")``; a case that needs an op outside the profile
under test is *skipped* (that is coverage, not conformance), as is one whose CPU reference is itself
nondeterministic. The comparison is ``harness.sim.differential``; hand-written cases for the surfaces
OpInfo does not reach (host-side arguments, device APIs, accelerator-only kernels) are in
``harness.sim.contracts``.

Not imported by ``harness.sim``: it needs ``torch.testing._internal``, which needs ``expecttest``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch.utils import _pytree as pytree

from . import opset as _opset
from .differential import (  # noqa: F401  (re-exported: the comparison is part of this module's API)
    CLASSES,
    FP32_ATOL,
    FP32_RTOL,
    Observed,
    SampleResult,
    attempt,
    bits_differ,
    compare,
    compare_sides,
    cpu_deterministic,
    is_standard_missing,
    normalize_error,
    traced,
)

# OpInfo id -> why it is not compared at all.
EXCLUDED: dict[str, str] = {
    "empty": "returns uninitialized memory",
    "empty_like": "returns uninitialized memory",
    "empty_strided": "returns uninitialized memory",
    "empty_permuted": "returns uninitialized memory",
    "new_empty": "returns uninitialized memory",
    "new_empty_strided": "returns uninitialized memory",
    "nn.functional.dropout": "draws a fresh mask per call through native_dropout (nondeterministic)",
}

# OpInfo id -> why its values may differ between sim and the CPU at highest/full, for reasons outside
# sim (its kernels are the CPU's): such a difference is reported as "explained", not as sim's.
EXPLAINED: dict[str, str] = {
    "linalg.lstsq": "LAPACK gelsy's pivot array is allocated uninitialized, so a rank-deficient input's answer "
                    "depends on what that memory held before (the CPU alone gives different answers)",
    "linalg.lstsq.grad_oriented": "as linalg.lstsq (gelsy reads an uninitialized pivot array)",
    "nn.functional.linear_cross_entropy.chunked": "PyTorch's Python code picks the fp16/bf16 accumulation policy "
        "and dtype by device type: 'accurate' with fp32 on the CPU, 'compact' in the input dtype on any device "
        "without a table entry (CUDA has its own): sim takes a non-CPU device's path",
    "nn.functional.linear_cross_entropy.chunked_none": "as nn.functional.linear_cross_entropy.chunked",
}

def op_db() -> list:
    """The OpInfo database (imports torch.testing._internal; needs the ``expecttest`` package)."""
    from torch.testing._internal.common_methods_invocations import op_db as db

    return list(db)


def opinfo_id(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def samples(op, limit: int | None, seed: int = 0, dtype: torch.dtype = torch.float32,
            requires_grad: bool = False, reference: bool = False) -> list:
    """The first `limit` samples of `op` (all when None), made for device ``sim`` as PyTorch's own
    ``test_compare_cpu`` does: arguments an op wants on the host stay there. `reference`: the larger
    ``reference_inputs`` set where the OpInfo has one."""
    out = []
    torch.manual_seed(seed)
    make = op.reference_inputs if reference else op.sample_inputs
    with _opset.op_profile("full"):
        for s in make("sim", dtype, requires_grad=requires_grad):
            out.append(s)
            if limit is not None and len(out) >= limit:
                break
    return out


def _to_cpu(sample, keep_grad: bool = False):
    def move(t):
        if not isinstance(t, torch.Tensor):
            return t
        c = t.detach().to("cpu", copy=True)
        return c.requires_grad_(t.requires_grad) if keep_grad else c

    moved = sample.transform(move)
    if moved.kwargs.get("device") is not None:  # factories: sim -> cpu
        moved.kwargs = {**moved.kwargs, "device": "cpu"}
    return moved


def _fresh(sample, keep_grad: bool = False):
    def copy(t):
        if not isinstance(t, torch.Tensor):
            return t
        c = t.detach().clone()
        return c.requires_grad_(t.requires_grad) if keep_grad else c

    with _opset.op_profile("full"):
        return sample.transform(copy)


# ---- running OpInfo cases ---------------------------------------------------------------------------


def _skip_for_profile(ops: set[str], profile: str) -> str:
    prof = _opset.resolve(profile)
    missing = sorted(n for n in ops if not _allowed(prof, n))
    return f"needs {', '.join(missing)} (not in '{profile}')" if missing else ""


def _pair(op, sample, *, mode: str, exact: bool, profile: str, seed: int, kind: str = "sample",
          call: Callable | None = None, keep_grad: bool = False) -> tuple[SampleResult, Observed, Observed]:
    call = call or (lambda s: op(s.input, *s.args, **s.kwargs))
    try:
        cpu = _to_cpu(sample, keep_grad)
        dev = _fresh(sample, keep_grad)
    except RuntimeError as e:  # sparse samples: sim simulates strided tensors only
        return SampleResult("skipped", f"sample cannot be copied: {str(e)[:100]}", kind=kind), Observed(), Observed()
    want = attempt(lambda: call(cpu), seed=seed)
    got = traced(lambda: call(dev), seed=seed, mode=mode)
    leaves = pytree.tree_leaves(want.value)
    if any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in leaves):
        return SampleResult("skipped", "sample holds device tensors the CPU copy cannot reach", kind=kind), want, got
    if any(isinstance(t, torch.Tensor) and t.layout != torch.strided for t in leaves):
        return SampleResult("skipped", "sparse layouts are not simulated", kind=kind), want, got
    if got.error is not None and "from the 'Sparse" in str(got.error):
        return SampleResult("skipped", "sparse layouts are not simulated", kind=kind), want, got
    why = _skip_for_profile(got.ops, profile)
    if why:
        return SampleResult("skipped", why, aten_ops=got.ops, kind=kind), want, got
    on_sim = [t for t in pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
              if isinstance(t, torch.Tensor) and t.device.type == "sim"]
    if not on_sim and not str(sample.kwargs.get("device", "")).startswith("sim"):
        return SampleResult("skipped", "sample creates its tensors on another device", kind=kind), want, got
    asked = sample.kwargs.get("device")  # factories: an explicit device other than sim keeps its outputs there
    device = "sim" if asked is None or str(asked).startswith("sim") else torch.device(asked).type
    result = compare_sides(want, got, exact=exact, kind=kind, device=device)
    same_type = want.error is not None and type(want.error) is type(got.error)
    if (result.klass == "numerics" or (result.status == "failed" and same_type)) and not cpu_deterministic(
            lambda: call(_to_cpu(sample, keep_grad)), want, seed, runs=4, sim=got):
        result = SampleResult("skipped", "the CPU reference is nondeterministic here", kind=kind)
    result.aten_ops = got.ops
    return result, want, got



def run_sample(op, sample, *, mode: str, profile: str = "young", exact: bool, seed: int = 0) -> SampleResult:
    """Run one OpInfo sample on CPU and sim at precision `mode` and compare (values or errors)."""
    return _pair(op, sample, mode=mode, exact=exact, profile=profile, seed=seed)[0]


def _grad_call(op):
    def call(s):
        out = op(s.input, *s.args, **s.kwargs)
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        ins = [t for t in pytree.tree_leaves((s.input, s.args, s.kwargs))
               if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outs or not ins:
            return None
        g = torch.Generator().manual_seed(1234)
        grads = [torch.randn(o.shape, generator=g, dtype=o.dtype).to(o.device) for o in outs]
        return torch.autograd.grad(outs, ins, grads, allow_unused=True)
    return call


def run_grad(op, sample, *, mode: str, exact: bool, profile: str, seed: int) -> SampleResult:
    """The sample's gradients (seeded output gradients) on CPU and sim."""
    return _pair(op, sample, mode=mode, exact=exact, profile=profile, seed=seed, kind="grad",
                 call=_grad_call(op), keep_grad=True)[0]


def run_errors(op, *, mode: str, profile: str, seed: int = 0) -> list[SampleResult]:
    """OpInfo ``error_inputs``, made once on the CPU and once on sim (same seed), compared."""
    if getattr(op, "error_inputs_func", None) is None:
        return []
    try:
        torch.manual_seed(seed)
        on_cpu = list(op.error_inputs("cpu"))
        torch.manual_seed(seed)
        with _opset.op_profile("full"):
            on_sim = list(op.error_inputs("sim"))
    except Exception as e:
        return [SampleResult("skipped", f"error_inputs raised {type(e).__name__}: {str(e)[:80]}", kind="error")]
    if len(on_cpu) != len(on_sim):
        return [SampleResult("skipped", "error_inputs differ between devices", kind="error")]
    out = []
    for i, (c, s) in enumerate(zip(on_cpu, on_sim, strict=True)):
        cs, ss = c.sample_input, s.sample_input
        want = attempt(lambda cs=cs: op(cs.input, *cs.args, **cs.kwargs), seed=seed + i)
        got = traced(lambda ss=ss: op(ss.input, *ss.args, **ss.kwargs), seed=seed + i, mode=mode)
        why = _skip_for_profile(got.ops, profile)
        if why:
            out.append(SampleResult("skipped", why, kind="error"))
            continue
        r = compare_sides(want, got, exact=True, kind="error")
        r.aten_ops = got.ops
        out.append(r)
    return out


def _alias_targets(sample, result: torch.Tensor) -> list[tuple[str, Callable]]:
    """Ways to pass one of the sample's own tensors (or an overlapping view of one) as ``out=``. Only
    where the result fits the target's memory: an ``out=`` the CPU kernel must grow while it reads the
    same tensor is a use-after-free on the CPU itself (avg_pool3d's does corrupt the heap)."""
    tensors = [t for t in pytree.tree_leaves((sample.input, sample.args)) if isinstance(t, torch.Tensor)]
    targets = []
    for k, t in enumerate(tensors):
        if t.dtype != result.dtype:
            continue
        if t.numel() >= result.numel():
            targets.append((f"out=input{k}", lambda s, k=k: _nth_tensor(s, k)))
        if t.dim() >= 1 and t.shape[0] >= 2 and t[1:].numel() >= result.numel():
            targets.append((f"out=input{k}[1:]", lambda s, k=k: _nth_tensor(s, k)[1:]))
    return targets


def _nth_tensor(sample, k: int) -> torch.Tensor:
    return [t for t in pytree.tree_leaves((sample.input, sample.args)) if isinstance(t, torch.Tensor)][k]


def run_aliases(op, batch: list, *, mode: str, profile: str, seed: int = 0, per_op: int = 4) -> list[SampleResult]:
    """``out=`` aliasing one of the op's inputs: both sides must refuse alike, or compute alike. Where the
    CPU accepts the aliasing and its own result is not the op's result (the kernel overwrote an input
    it was still reading: mm's gemm, im2col), the values are undefined and only the refusal is compared."""
    if not op.supports_out:
        return []
    out: list[SampleResult] = []
    for i, sample in enumerate(batch):
        cpu = _to_cpu(sample)
        result = attempt(lambda cpu=cpu: op(cpu.input, *cpu.args, **cpu.kwargs), seed=seed + i).value
        if not isinstance(result, torch.Tensor):  # errors, and ops with several outputs
            continue
        for label, pick in _alias_targets(cpu, result):
            if len(out) >= per_op:
                return out

            def call(s, pick=pick):
                res = op(s.input, *s.args, **s.kwargs, out=pick(s))
                return res, s.input

            r, want, _ = _pair(op, sample, mode=mode, exact=True, profile=profile, seed=seed + i, kind="alias",
                               call=call)
            if r.klass == "numerics" and not _same_values(want.value[0], result):
                r = SampleResult("skipped", "the CPU's own result is corrupted by the aliasing (undefined)", kind="alias")
            r.reason = f"{label}: {r.reason}" if r.reason else label
            if r.klass:
                r.klass = "aliasing"
            out.append(r)
    return out


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and not bits_differ(a.detach(), b.detach())


def _allowed(profile, name: str) -> bool:
    ops = profile.ops
    if ops is None:
        return True
    packet, _, overload = name.partition(".")
    return packet in ops or name in ops or (overload == "default" and packet in ops)


def run_op(op, *, limit: int | None, mode: str, exact: bool, profile: str = "young",
           dtypes: Iterable[torch.dtype] = (torch.float32,), grads: bool = False, errors: bool = False,
           aliases: bool = False, reference: bool = False) -> list[SampleResult]:
    """All results for one OpInfo (an excluded one yields a single skipped result)."""
    oid = opinfo_id(op)
    if oid in EXCLUDED:
        return [SampleResult("skipped", EXCLUDED[oid])]
    results: list[SampleResult] = []
    supported = op.supported_dtypes("cpu")
    for dtype in dtypes:
        if dtype not in supported:
            continue
        name = str(dtype).removeprefix("torch.")
        try:
            batch = samples(op, limit, dtype=dtype, reference=reference and op.reference_inputs_func is not None)
        except Exception as e:  # sample generation on sim failed where the CPU's would not
            r = compare_sides(Observed(), Observed(error=e), exact=exact, kind="sample")
            if r.status == "failed" and r.klass == "errors":
                r = SampleResult("skipped", f"sample_inputs on sim raised {type(e).__name__}: {str(e)[:100]}")
            results.append(r)
            continue
        for i, s in enumerate(batch):
            r = run_sample(op, s, mode=mode, exact=exact, profile=profile, seed=i)
            r.dtype = name
            results.append(r)
        if aliases and dtype == torch.float32:
            results += run_aliases(op, batch, mode=mode, profile=profile)
        if grads and dtype == torch.float32 and op.supports_autograd:
            try:
                gbatch = samples(op, limit, dtype=dtype, requires_grad=True)
            except Exception:
                gbatch = []
            for i, s in enumerate(gbatch):
                results.append(run_grad(op, s, mode=mode, exact=exact, profile=profile, seed=i))
    if errors:
        results += run_errors(op, mode=mode, profile=profile)
    if oid in EXPLAINED:
        for r in results:
            if r.status == "failed" and r.klass == "numerics":
                r.status, r.reason = "explained", f"{r.reason} ({EXPLAINED[oid]})"
    return results


def summarize(results: Iterable[SampleResult]) -> dict:
    results = list(results)
    errs = [r.max_abs_err for r in results if r.max_abs_err is not None and math.isfinite(r.max_abs_err)]
    return {
        "aten_ops": sorted(set().union(*(r.aten_ops for r in results))) if results else [],
        "passed": sum(r.status == "passed" for r in results),
        "skipped": sum(r.status == "skipped" for r in results),
        "failed": sum(r.status == "failed" for r in results),
        "unsupported": sum(r.status == "unsupported" for r in results),
        "explained": sum(r.status == "explained" for r in results),
        "max_abs_err": max(errs) if errs else None,
        "by_class": {k: sum(r.status == "failed" and r.klass == k for r in results) for k in CLASSES},
    }

