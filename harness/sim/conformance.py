"""OpInfo conformance: PyTorch's own per-op sample inputs, run on sim and on CPU, compared.

Why OpInfos: ``torch.testing._internal.common_methods_invocations.op_db`` is the corpus PyTorch
uses to test every backend; its samples hit the edge cases (empty tensors, broadcasting,
non-contiguous inputs, scalar arguments) a model zoo never reaches. Used by
``tests/test_opinfo_conformance.py`` (exact at ``highest``) and ``scripts/opinfo_table.py``
(per-op counts at ``default``, with fp32 tolerances).

Each sample runs on CPU and on sim with the same seed (sim:N draws from a CPU generator seeded like
the CPU default one, so random ops compare exactly too). The sim run is traced under
``op_profile("full")``; a sample that needs an op outside the profile under test is *skipped*
(that is coverage, not conformance), as is one the CPU reference itself rejects.

Not imported by ``harness.sim``: it needs ``torch.testing._internal``, which needs ``expecttest``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree

from . import opset as _opset
from . import precision_mode as _precision

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

FP32_RTOL = 1.3e-6  # torch.testing.assert_close's defaults for float32
FP32_ATOL = 1e-5


@dataclass
class SampleResult:
    status: str  # "passed" | "skipped" | "failed"
    reason: str = ""
    max_abs_err: float | None = None
    aten_ops: set[str] = field(default_factory=set)


def op_db() -> list:
    """The OpInfo database (imports torch.testing._internal; needs the ``expecttest`` package)."""
    from torch.testing._internal.common_methods_invocations import op_db as db

    return list(db)


def opinfo_id(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def samples(op, limit: int | None, seed: int = 0) -> list:
    """The first `limit` float32 samples of `op` (all when None), made for device ``sim`` as
    PyTorch's own ``test_compare_cpu`` does: arguments an op wants on the host stay there."""
    out = []
    torch.manual_seed(seed)
    with _opset.op_profile("full"):
        for s in op.sample_inputs("sim", torch.float32):
            out.append(s)
            if limit is not None and len(out) >= limit:
                break
    return out


def _to_cpu(sample):
    def move(t):
        return t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor) else t

    moved = sample.transform(move)
    if moved.kwargs.get("device") is not None:  # factories: sim -> cpu
        moved.kwargs = {**moved.kwargs, "device": "cpu"}
    return moved


def _fresh(sample):
    with _opset.op_profile("full"):
        return sample.transform(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape or not a.numel():
        return 0.0
    if not (a.is_floating_point() or a.is_complex()):
        return float((a.long() != b.long()).any()) if a.dtype != torch.bool else float((a != b).any())
    d = (
        a.to(torch.complex128 if a.is_complex() else torch.float64)
        - b.to(torch.complex128 if b.is_complex() else torch.float64)
    ).abs()
    same_nan = a.isnan() & b.isnan() if not a.is_complex() else a.isnan().any() & b.isnan().any()
    d = torch.where(same_nan, torch.zeros_like(d), d).nan_to_num(nan=math.inf)
    return float(d.max())


def compare(got, want, *, rtol: float, atol: float) -> tuple[bool, str, float]:
    """(equal?, why not, max abs error) for two output pytrees; `got` must live on sim."""
    g_leaves, g_spec = pytree.tree_flatten(got)
    w_leaves, w_spec = pytree.tree_flatten(want)
    if g_spec != w_spec:
        return False, f"output structure differs: {g_spec} vs {w_spec}", math.inf
    worst = 0.0
    for g, w in zip(g_leaves, w_leaves, strict=True):
        if isinstance(w, torch.Tensor):
            if not isinstance(g, torch.Tensor):
                return False, f"expected a tensor, got {type(g).__name__}", math.inf
            if g.device.type != "sim":
                return False, f"output on {g.device}, expected sim", math.inf
            g = g.cpu()
            worst = max(worst, _max_err(g, w))
            try:
                torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True)
            except AssertionError as e:
                return False, str(e).splitlines()[0][:200], max(worst, _max_err(g, w))
        elif isinstance(w, float) and isinstance(g, float) and math.isnan(w) and math.isnan(g):
            continue
        elif g != w:
            return False, f"non-tensor output {g!r} != {w!r}", math.inf
    return True, "", worst


def run_sample(op, sample, *, mode: str, profile: str = "young", exact: bool, seed: int = 0) -> SampleResult:
    """Run one OpInfo sample on CPU and sim at precision `mode` and compare."""
    young = _opset.resolve(profile)
    try:
        cpu = _to_cpu(sample)
        dev = _fresh(sample)
    except RuntimeError as e:  # sparse samples: sim simulates strided tensors only
        return SampleResult("skipped", f"sample cannot be copied: {str(e)[:100]}")
    torch.manual_seed(seed)
    try:
        want = op(cpu.input, *cpu.args, **cpu.kwargs)
    except Exception as e:
        return SampleResult("skipped", f"CPU reference raised {type(e).__name__}")
    if any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in pytree.tree_leaves(want)):
        return SampleResult("skipped", "sample holds device tensors the CPU copy cannot reach")
    torch.manual_seed(seed)
    with _opset.op_profile("full"), _precision.precision(mode):
        _opset.start_trace()
        try:
            got = op(dev.input, *dev.args, **dev.kwargs)
            error = None
        except Exception as e:
            got, error = None, e
        finally:
            ops = _opset.stop_trace()
    names = {n if "." in n.split("::", 1)[1] else f"{n}.default" for n in ops}
    missing = sorted(n for n in names if not _allowed(young, n))
    if missing:
        return SampleResult("skipped", f"needs {', '.join(missing)} (not in '{profile}')", aten_ops=names)
    if error is not None and "from the 'Sparse" in str(error):
        return SampleResult("skipped", "sparse layouts are not simulated", aten_ops=names)
    if error is not None:
        return SampleResult(
            "failed", f"sim raised {type(error).__name__}: {str(error)[:160]}", aten_ops=names
        )
    on_sim = [t for t in pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
              if isinstance(t, torch.Tensor) and t.device.type == "sim"]
    if not on_sim and not str(sample.kwargs.get("device", "")).startswith("sim"):
        return SampleResult("skipped", "sample creates its tensors on another device, not on sim", aten_ops=names)
    if any(isinstance(t, torch.Tensor) and t.layout != torch.strided for t in pytree.tree_leaves(want)):
        return SampleResult("skipped", "sparse layouts are not simulated", aten_ops=names)
    tol = (0.0, 0.0) if exact else (FP32_RTOL, FP32_ATOL)
    ok, why, err = compare(got, want, rtol=tol[0], atol=tol[1])
    return SampleResult("passed" if ok else "failed", why, err, names)


def _allowed(profile, name: str) -> bool:
    ops = profile.ops
    if ops is None:
        return True
    packet, _, overload = name.partition(".")
    return packet in ops or name in ops or (overload == "default" and packet in ops)


def run_op(op, *, limit: int | None, mode: str, exact: bool, profile: str = "young") -> list[SampleResult]:
    """All results for one OpInfo (an excluded one yields a single skipped result)."""
    oid = opinfo_id(op)
    if oid in EXCLUDED:
        return [SampleResult("skipped", EXCLUDED[oid])]
    try:
        batch = samples(op, limit)
    except Exception as e:  # e.g. sparse samples: sim simulates strided tensors only
        return [SampleResult("skipped", f"sample_inputs on sim raised {type(e).__name__}: {str(e)[:100]}")]
    return [run_sample(op, s, mode=mode, exact=exact, profile=profile, seed=i) for i, s in enumerate(batch)]


def summarize(results: Iterable[SampleResult]) -> dict:
    results = list(results)
    errs = [r.max_abs_err for r in results if r.max_abs_err is not None]
    return {
        "aten_ops": sorted(set().union(*(r.aten_ops for r in results))) if results else [],
        "passed": sum(r.status == "passed" for r in results),
        "skipped": sum(r.status == "skipped" for r in results),
        "failed": sum(r.status == "failed" for r in results),
        "max_abs_err": max(errs) if errs else None,
    }
