"""Compare target outputs against the reference: the fp64-oracle rule plus plain error metrics.

Following PyTorch's dynamo accuracy runner (`torch._dynamo.utils.same`): an fp32 result on the target
passes when it is not much further from an fp64 run than the fp32 CPU reference itself is,

    rmse(oracle64, target) <= m * rmse(oracle64, ref32) + tol / 10,   m = 2 (fp32), 3 (bf16/fp16 or numel < 1000)

which tolerates the reference's own rounding noise instead of demanding bitwise equality. Without an
oracle (the model cannot run in fp64) it falls back to cosine similarity >= 0.99 plus allclose(tol).

Three-way (the vLLM-Neuron accuracy method): when the target declares reduced precision, an *expected*
reference emulating that contract on the CPU (`harness.backends.contracts`) gives the second envelope,

    rmse(oracle64, target) <= m * rmse(oracle64, expected) + tol / 10,

so an output outside the fp32 envelope but inside the declared one is `pass_declared`, and only an
output outside both is `drift`: error the declared precision does not explain.
We also keep cosine similarity, max abs and max relative error per output, because "how far" matters
as much as "pass/fail" when triaging reduced-precision defaults. Integer/bool outputs must be equal.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from harness.outcomes import BEYOND, judge
from harness.results.draft import RowDraft

DEFAULT_TOL = 1e-3  # the dynamo runner's HF inference tolerance
COSINE_FALLBACK = 0.99
AMP_ULPS = 1  # see Tolerance.amp_eps: rounding an output to the low dtype alone costs half an ulp


@dataclass
class Tolerance:
    tol: float = DEFAULT_TOL
    # Allclose fallback when no fp64 oracle is available.
    atol: float | None = None
    rtol: float | None = None
    # The floor tol/10 relative to the oracle's RMS instead of absolute: for gradients and updates,
    # whose scales differ by orders of magnitude between parameters (an absolute 1e-4 would pass any
    # gradient of 1e-5). For an O(1) output the two floors are the same.
    relative: bool = False
    # ... but never below this RMS per output family (the name up to "/": "grad", "sgd", "adamw"): a
    # gradient that is zero in exact arithmetic (a bias softmax ignores) is pure rounding noise, and a
    # floor relative to itself would judge one summation order's noise against another's.
    min_rms: dict[str, float] = field(default_factory=dict)
    # Under an autocast contract (amp-bf16, amp-fp16): the low dtype's eps. The expected reference's error
    # is one draw of autocast's rounding, made with the CPU's op lists, not the target's: for a scalar
    # (the loss) or a few-element tensor that draw can be near zero by chance. So the declared envelope
    # also allows AMP_ULPS ulp of the low dtype at the output's own magnitude.
    amp_eps: float = 0.0

    def floor(self, oracle: torch.Tensor, name: str = "") -> float:
        if not self.relative:
            return self.tol / 10.0
        rms = torch.sqrt(torch.mean(torch.square(oracle.double()))).item()
        return self.tol / 10.0 * max(rms, self.min_rms.get(name.split("/", 1)[0], 0.0))

    def near_zero(self, oracle: torch.Tensor, name: str = "") -> bool:
        """Whether the output is below its family's noise floor (`min_rms`): a gradient that cancels to
        about zero, whose direction (cosine) is that of rounding noise and says nothing."""
        family = self.min_rms.get(name.split("/", 1)[0], 0.0)
        return self.relative and family > 0 and torch.sqrt(torch.mean(torch.square(oracle.double()))).item() < family


@dataclass
class TensorCheck:
    """Metrics for one named output tensor."""

    name: str
    ok: bool
    shape: list[int]
    dtype: str
    rmse_target: float | None = None
    rmse_ref: float | None = None
    bound: float | None = None
    rmse_ratio: float | None = None  # rmse_target / bound: > 1 is outside the fp32 envelope
    rmse_expected: float | None = None  # the declared-precision expected reference's own error
    declared_bound: float | None = None
    declared_ratio: float | None = None  # rmse_target / declared_bound: > 1 is beyond the declared precision
    ok_declared: bool = False  # within the fp32 or the declared envelope
    cosine: float | None = None
    max_abs: float | None = None
    max_rel: float | None = None
    nonfinite: bool = False  # target has NaN/inf where the reference is finite
    near_zero: bool = False  # below its family's noise floor (a gradient that cancels): its cosine means nothing
    note: str = ""

    @property
    def judgement(self) -> str:
        """within fp32, within declared or beyond (`harness.outcomes.judge`): every label's one source."""
        return judge(self.ok, self.ok_declared)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "name"}


def _rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.sqrt(torch.mean(torch.square(a.double() - b.double()))).item()


def _multiplier(ref: torch.Tensor) -> float:
    return 3.0 if ref.dtype in (torch.float16, torch.bfloat16) or ref.numel() < 1000 else 2.0


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _ratio(num: float, bound: float) -> float:
    return num / bound if bound > 0 else (0.0 if num == 0 else math.inf)


def check_tensor(
    name: str,
    ref: torch.Tensor,
    target: torch.Tensor,
    oracle: torch.Tensor | None,
    tol: Tolerance,
    expected: torch.Tensor | None = None,
) -> TensorCheck:
    """Judge one output against the fp32 envelope and, given `expected`, the declared one (CPU tensors)."""
    out = _check_fp32(name, ref, target, oracle, tol)
    out.ok_declared = out.ok
    if out.ok or expected is None or expected.shape != ref.shape or not ref.is_floating_point() or out.cosine is None:
        return out
    m = torch.isfinite(ref.double())
    t, e = target.double()[m], expected.double()[m]
    if not bool(torch.isfinite(e).all()):
        return out
    if out.bound is not None and oracle is not None:
        o = oracle.double()[m]
        out.rmse_expected = _rmse(o, e)
        out.declared_bound = _multiplier(ref) * out.rmse_expected + tol.floor(o, name)
        if tol.amp_eps:
            out.declared_bound += AMP_ULPS * tol.amp_eps * torch.sqrt(torch.mean(torch.square(o))).item()
        out.declared_ratio = _ratio(out.rmse_target or 0.0, out.declared_bound)
        out.ok_declared = (out.rmse_target or 0.0) <= out.declared_bound
    else:  # no oracle: as close to the expected reference as the fallback asks of the fp32 one
        atol = tol.atol if tol.atol is not None else tol.tol
        rtol = tol.rtol if tol.rtol is not None else tol.tol
        out.ok_declared = bool(torch.allclose(t, e, atol=atol, rtol=rtol)) or (
            _cosine(e, t) >= COSINE_FALLBACK and (t - e).abs().max().item() <= 10 * atol
        )
    return out


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = (a.norm() * b.norm()).item()
    return torch.dot(a, b).item() / denom if denom > 0 else (1.0 if torch.equal(a, b) else 0.0)


def _check_fp32(name: str, ref: torch.Tensor, target: torch.Tensor, oracle: torch.Tensor | None,
                tol: Tolerance) -> TensorCheck:
    base = dict(name=name, shape=list(ref.shape), dtype=str(ref.dtype).removeprefix("torch."))
    if ref.shape != target.shape:
        return TensorCheck(ok=False, note=f"shape mismatch: ref {list(ref.shape)} vs target {list(target.shape)}", **base)
    if not ref.is_floating_point() and not ref.is_complex():
        eq = bool(torch.equal(ref, target.to(ref.dtype)))
        return TensorCheck(ok=eq, note="" if eq else "integer/bool output differs", **base)
    if ref.numel() == 0:
        return TensorCheck(ok=True, note="empty", **base)

    r, t = ref.double(), target.double()
    ref_fin, tgt_fin = torch.isfinite(r), torch.isfinite(t)
    nonfinite = bool((ref_fin & ~tgt_fin).any())
    same_mask = bool(torch.equal(ref_fin, tgt_fin))
    if not same_mask:
        # Positions of non-finite values must agree before any metric means anything.
        return TensorCheck(ok=False, nonfinite=nonfinite, note="non-finite values differ from reference", **base)
    m = ref_fin
    if not bool(m.any()):
        return TensorCheck(ok=bool(torch.equal(r.nan_to_num(), t.nan_to_num())), note="all non-finite", **base)
    r, t = r[m], t[m]
    diff = (r - t).abs()
    max_abs = diff.max().item()
    max_rel = (diff / r.abs().clamp_min(1e-12)).max().item()
    cosine = _cosine(r, t)

    out = TensorCheck(ok=False, cosine=cosine, max_abs=max_abs, max_rel=_finite(max_rel), **base)
    if oracle is not None and oracle.shape == ref.shape and torch.equal(torch.isfinite(oracle.double()), ref_fin):
        o = oracle.double()[m]
        out.rmse_target = _rmse(o, t)
        out.rmse_ref = _rmse(o, r)
        out.bound = _multiplier(ref) * out.rmse_ref + tol.floor(o, name)
        out.rmse_ratio = _ratio(out.rmse_target, out.bound)
        out.ok = out.rmse_target <= out.bound
        out.near_zero = tol.near_zero(o, name)
        if out.near_zero:
            out.note = "near zero (below its family's noise floor): its cosine compares rounding noise"
    else:
        atol = tol.atol if tol.atol is not None else tol.tol
        rtol = tol.rtol if tol.rtol is not None else tol.tol
        close = bool(torch.allclose(t, r, atol=atol, rtol=rtol))
        out.ok = close or cosine >= COSINE_FALLBACK and max_abs <= 10 * atol
        out.note = "no fp64 oracle: allclose/cosine fallback"
        out.rmse_target = _rmse(r, t)
    return out


@dataclass
class Comparison:
    ok: bool
    checks: list[TensorCheck]

    @property
    def ok_declared(self) -> bool:
        return all(c.ok_declared for c in self.checks)

    @property
    def worst(self) -> TensorCheck | None:
        """The output that best explains the verdict: the worst beyond both envelopes, else beyond fp32."""
        failing = ([c for c in self.checks if c.judgement == BEYOND] or [c for c in self.checks if not c.ok]
                   or self.checks)
        return max(failing, key=lambda c: (c.rmse_ratio or 0.0, c.max_abs or 0.0), default=None)

    @property
    def nonfinite(self) -> bool:
        return any(c.nonfinite for c in self.checks)

    def summary(self) -> RowDraft:
        """Row-level numbers: the worst value of each metric over all outputs."""
        ratios = [c.rmse_ratio for c in self.checks if c.rmse_ratio is not None]
        declared = [c.declared_ratio for c in self.checks if c.declared_ratio is not None]
        abs_ = [c.max_abs for c in self.checks if c.max_abs is not None]
        rel = [c.max_rel for c in self.checks if c.max_rel is not None]
        cos = [c.cosine for c in self.checks if c.cosine is not None]
        return RowDraft(
            rmse_ratio=_finite(max(ratios)) if ratios else None,
            declared_ratio=_finite(max(declared)) if declared else None,
            max_abs_err=max(abs_) if abs_ else None,
            max_rel_err=max(rel) if rel else None,
            min_cosine=min(cos) if cos else None,
        )


def compare_outputs(
    ref: dict[str, torch.Tensor],
    target: dict[str, torch.Tensor],
    oracle: dict[str, torch.Tensor] | None,
    tol: Tolerance | None = None,
    expected: dict[str, torch.Tensor] | None = None,
) -> Comparison:
    """Compare flattened, named outputs (see `harness.inputs.output_tensors`)."""
    tol = tol or Tolerance()
    checks = []
    for name, r in ref.items():
        t = target.get(name)
        if t is None:
            checks.append(TensorCheck(name=name, ok=False, shape=list(r.shape), dtype=str(r.dtype), note="missing on target"))
            continue
        o = oracle.get(name) if oracle else None
        e = expected.get(name) if expected else None
        checks.append(check_tensor(name, r, t.cpu(), o, tol, e))
    for name in target.keys() - ref.keys():
        t = target[name]
        checks.append(TensorCheck(name=name, ok=False, shape=list(t.shape), dtype=str(t.dtype), note="extra output on target"))
    return Comparison(ok=all(c.ok for c in checks), checks=checks)


def identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bitwise equality of two reference runs (NaNs in the same places count as equal)."""
    if a.keys() != b.keys():
        return False
    for k, x in a.items():
        y = b[k]
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.is_floating_point():
            if not torch.equal(torch.isnan(x), torch.isnan(y)) or not torch.equal(x.nan_to_num(), y.nan_to_num()):
                return False
        elif not torch.equal(x, y):
            return False
    return True
