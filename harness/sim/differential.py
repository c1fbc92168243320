"""Comparing one call run on the CPU and on sim: values bit for bit (or within fp32 tolerance), or the
same error (type and message, device names aside); the standard missing-kernel error on sim is
``unsupported``, not a difference. Shared by ``conformance`` (OpInfo cases) and ``contracts``
(hand-written ones).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree

from . import opset as _opset
from . import precision_mode as _precision

FP32_RTOL = 1.3e-6  # torch.testing.assert_close's defaults for float32
FP32_ATOL = 1e-5

# Why sim and CPU differ, for counting (issue 39's classes, plus invalid-input errors).
CLASSES = ("dispatch_stub", "aliasing", "host_args", "numerics", "device_api", "errors")


@dataclass
class SampleResult:
    # "passed" | "skipped" | "failed" | "unsupported" (sim raised the missing-kernel error) | "explained"
    # (a difference whose cause is outside sim, see EXPLAINED)
    status: str
    reason: str = ""
    max_abs_err: float | None = None
    aten_ops: set[str] = field(default_factory=set)
    kind: str = "sample"  # sample | grad | error | alias | contract
    klass: str = ""  # for a failure: one of CLASSES
    dtype: str = ""



_DEVICE = re.compile(r"\b(sim:\d+|sim|cpu|CPU|meta|cuda:\d+|cuda|PrivateUse1|privateuseone)\b")
_STANDARD_MISSING = re.compile(r"^Could not run '([\w:.]+)' with arguments from the '(\w+)' backend")


def normalize_error(e: BaseException) -> str:
    """An exception's message with device names replaced, so a CPU and a sim message compare."""
    text = str(e).split("\nException raised from ", 1)[0]  # the C++ stack of a TORCH_CHECK
    text = re.sub(r"torch\.sim\.(\w+Tensor)", r"torch.\1", text)
    return _DEVICE.sub("<device>", text).strip()


def is_standard_missing(e: BaseException, backend: str = "sim") -> bool:
    m = _STANDARD_MISSING.match(str(e))
    return isinstance(e, NotImplementedError) and m is not None and m.group(2) == backend


def bits_differ(g: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether two same-dtype tensors differ in any bit, NaN payloads aside (sign of zero included)."""
    if g.is_complex():
        g, w = torch.view_as_real(g.resolve_conj()), torch.view_as_real(w.resolve_conj())
    g, w = g.contiguous(), w.contiguous()
    if not g.is_floating_point():
        return not torch.equal(g, w)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[g.element_size()]
    both_nan = g.isnan() & w.isnan()
    return bool(((g.view(ints) != w.view(ints)) & ~both_nan).any())


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


def compare(got, want, *, rtol: float, atol: float, device: str = "sim") -> tuple[bool, str, float]:
    """(equal?, why not, max abs error) for two output pytrees; `got`'s tensors must live on `device`
    (sim, unless the call asked for another). With rtol = atol = 0 the comparison is bitwise (a -0.0
    against a 0.0 is a difference)."""
    g_leaves, g_spec = pytree.tree_flatten(got)
    w_leaves, w_spec = pytree.tree_flatten(want)
    if g_spec != w_spec:
        return False, f"output structure differs: {g_spec} vs {w_spec}", math.inf
    worst = 0.0
    for g, w in zip(g_leaves, w_leaves, strict=True):
        if isinstance(w, torch.Tensor):
            if not isinstance(g, torch.Tensor):
                return False, f"expected a tensor, got {type(g).__name__}", math.inf
            if g.device.type != device:
                return False, f"output on {g.device}, expected {device}", math.inf
            if g.dtype != w.dtype or g.shape != w.shape:
                return False, f"output {g.dtype}{list(g.shape)} vs CPU {w.dtype}{list(w.shape)}", math.inf
            g = g.detach().cpu()
            w = w.detach()
            worst = max(worst, _max_err(g, w))
            if rtol == 0 and atol == 0:
                if bits_differ(g, w):
                    return False, f"values differ bitwise (max abs err {_max_err(g, w):.3g})", worst
                continue
            try:
                torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True)
            except AssertionError as e:
                return False, str(e).splitlines()[0][:200], max(worst, _max_err(g, w))
        elif isinstance(w, float) and isinstance(g, float) and math.isnan(w) and math.isnan(g):
            continue
        elif g != w:
            return False, f"non-tensor output {g!r} != {w!r}", math.inf
    return True, "", worst


@dataclass
class Observed:
    value: object = None
    error: BaseException | None = None
    ops: set[str] = field(default_factory=set)


def attempt(fn: Callable[[], object], *, seed: int) -> Observed:
    """Run `fn` (the CPU side) seeded."""
    torch.manual_seed(seed)
    try:
        return Observed(fn())
    except Exception as e:
        return Observed(error=e)


def traced(fn: Callable[[], object], *, seed: int, mode: str) -> Observed:
    """Run `fn` (the sim side) seeded, under the full profile and precision `mode`, tracing sim's ops."""
    torch.manual_seed(seed)
    with _opset.op_profile("full"), _precision.precision(mode):
        _opset.start_trace()
        try:
            out = Observed(fn())
        except Exception as e:
            out = Observed(error=e)
        finally:
            ops = _opset.stop_trace()
    out.ops = {n if "." in n.split("::", 1)[1] else f"{n}.default" for n in ops}
    return out


def compare_sides(want: Observed, got: Observed, *, exact: bool, kind: str, device: str = "sim") -> SampleResult:
    """Compare a CPU outcome with a sim one: same values, or the same error (type and message)."""
    ge, we = got.error, want.error
    if ge is not None and "DispatchStub: missing kernel" in str(ge):
        return SampleResult("failed", f"sim: internal assert: {str(ge)[:140]}", kind=kind, klass="dispatch_stub")
    if ge is not None and is_standard_missing(ge):
        if we is not None and is_standard_missing(we, "CPU"):
            return SampleResult("passed", "no kernel on either", kind=kind)
        return SampleResult("unsupported", str(ge).split(". ", 1)[0][:160], kind=kind)
    if we is not None or ge is not None:
        if we is not None and ge is not None:
            if type(ge) is type(we) and normalize_error(ge) == normalize_error(we):
                return SampleResult("passed", "same error", kind=kind)
            why = f"CPU raised {type(we).__name__}: {str(we)[:90]!r}; sim {type(ge).__name__}: {str(ge)[:90]!r}"
        elif we is not None:
            why = f"CPU raised {type(we).__name__}: {str(we)[:120]!r}; sim computed"
        else:
            why = f"sim raised {type(ge).__name__}: {str(ge)[:160]}"
        return SampleResult("failed", why, kind=kind, klass=_error_class(want, got, kind))
    tol = (0.0, 0.0) if exact else (FP32_RTOL, FP32_ATOL)
    ok, why, err = compare(got.value, want.value, rtol=tol[0], atol=tol[1], device=device)
    return SampleResult("passed" if ok else "failed", why, err, kind=kind, klass="" if ok else "numerics")


_MEMORY_OVERLAP = "refer to a single memory location"
_DEVICE_WORDS = ("same device", "to be on cpu", "on CPU", "should be a 1D CPU", "found at least two devices")


def _error_class(want: Observed, got: Observed, kind: str) -> str:
    texts = " ".join(str(e) for e in (want.error, got.error) if e is not None)
    if kind == "alias" or _MEMORY_OVERLAP in texts:
        return "aliasing"
    if got.error is not None and want.error is None and any(w in str(got.error) for w in _DEVICE_WORDS):
        return "host_args"
    return "errors"


def cpu_deterministic(fn: Callable[[], object], want: Observed, seed: int, runs: int = 3,
                      sim: Observed | None = None) -> bool:
    """Whether `runs` more CPU runs all give `want` again, and none gives `sim`'s result. Some CPU
    kernels are not deterministic: fp16 grid_sample reads memory it never wrote, LAPACK's gelsy on a
    rank-deficient matrix alternates between two answers, svdvals with out= its own input reports a
    size read from freed memory. A sim that differs from such a reference (or gives one of its
    answers) is not wrong."""
    for _ in range(runs):
        again = attempt(fn, seed=seed)
        if not _same(again, want) or (sim is not None and _same(sim, again)):
            return False
    return True


def _same(again: Observed, want: Observed) -> bool:
    if again.error is not None or want.error is not None:  # the same error, word for word
        return (again.error is None) == (want.error is None) and type(again.error) is type(want.error) and (
            again.error is None or normalize_error(again.error) == normalize_error(want.error))
    g_leaves, w_leaves = pytree.tree_leaves(again.value), pytree.tree_leaves(want.value)
    if len(g_leaves) != len(w_leaves):
        return False
    for g, w in zip(g_leaves, w_leaves, strict=True):
        if isinstance(w, torch.Tensor):
            if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
                return False
            if g.layout != torch.strided or bits_differ(g.detach().cpu(), w.detach().cpu()):
                return False
        elif g != w and not (isinstance(w, float) and math.isnan(w)):
            return False
    return True

