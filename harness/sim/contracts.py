"""Hand-written sim-vs-CPU cases for what OpInfo samples do not reach (issue 39's classes).

Each `EdgeContract` builds its inputs for one device and runs a call: with ``cpu`` for the control and
with ``sim`` for the device under test, compared as `differential.compare_sides` compares OpInfo samples
(values bit for bit at ``highest``, or the same error type and message). Host-side arguments stay
on the CPU on both sides, as a CUDA user passes them. A contract without a CPU control (a device API,
an accelerator-only kernel) states its own expectation: `expect_missing` names the op whose standard
missing-kernel error sim must raise, `expect_error` starts the error CUDA raises there (device name
``sim:0``); otherwise sim must not raise (the case asserts what it needs). Where the CPU kernel is
defective (issue 49: a conformance suite holds devices to the mathematical result there) a contract has
no CPU control and asserts that result: `_device_semantics_cases`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import differential

Fn = Callable[[str], object]


@dataclass(frozen=True)
class EdgeContract:
    name: str
    klass: str  # one of differential.CLASSES
    fn: Fn
    cpu_control: bool = True
    expect_missing: str = ""  # without a control: the op sim must report as not implemented
    expect_error: str = ""  # without a control: the start of the error sim must raise (as CUDA does)


def _arange(device: str, n: int = 6) -> torch.Tensor:
    return torch.arange(float(n), device=device)


def _idx(device: str, *values: int) -> torch.Tensor:
    return torch.tensor(values, device=device)


# ---- 1. ops whose kernel goes through a DispatchStub outside sim's kernel ------------------------------

def _stub_cases() -> list[EdgeContract]:
    return [
        EdgeContract("kaiser_window", "dispatch_stub", lambda d: torch.kaiser_window(8, device=d)),
        EdgeContract("kaiser_window.beta", "dispatch_stub",
                 lambda d: torch.kaiser_window(9, periodic=False, beta=5.0, device=d)),
        EdgeContract("signal.windows.kaiser", "dispatch_stub", lambda d: torch.signal.windows.kaiser(7, device=d)),
    ]


# ---- 2. aliasing out= and in-place overlap ------------------------------------------------------------

def _alias(fn: Callable[[torch.Tensor], object]) -> Fn:
    def run(d: str) -> object:
        x = _arange(d)
        res = fn(x)
        return res, x

    return run


def _alias_cases() -> list[EdgeContract]:
    def kth(x):
        return torch.kthvalue(x, 2, out=(x[:1], torch.empty(1, dtype=torch.long, device=x.device)))

    return [
        EdgeContract("gather out=input", "aliasing", _alias(lambda x: torch.gather(x, 0, _idx(x.device, 2, 0, 1), out=x))),
        EdgeContract("take out=input", "aliasing", _alias(lambda x: torch.take(x, _idx(x.device, 5, 4, 3), out=x[:3]))),
        EdgeContract("kthvalue values=input", "aliasing", _alias(kth)),
        EdgeContract("masked_select out=input", "aliasing", _alias(lambda x: torch.masked_select(x, x > 2, out=x))),
        EdgeContract("cat overlapping out", "aliasing", _alias(lambda x: torch.cat([x[:2], x[2:4]], out=x[1:5]))),
        EdgeContract("index_select out=input", "aliasing",
                 _alias(lambda x: torch.index_select(x, 0, _idx(x.device, 1, 0), out=x[:2]))),
        EdgeContract("add out=partial overlap", "aliasing", _alias(lambda x: torch.add(x[:-1], 1, out=x[1:]))),
        EdgeContract("add_ partial overlap", "aliasing", _alias(lambda x: x[1:].add_(x[:-1]))),
        EdgeContract("mul_ self overlap (expand)", "aliasing",
                 _alias(lambda x: x[:1].expand(4).mul_(2))),
        EdgeContract("sort values=input", "aliasing",
                 _alias(lambda x: torch.sort(x, out=(x, torch.empty(6, dtype=torch.long, device=x.device))))),
        EdgeContract("index_put_ values=self", "aliasing",
                 _alias(lambda x: x.index_put_((_idx(x.device, 0, 1),), x[1:3]))),
        EdgeContract("im2col out=input", "aliasing", _im2col_alias, cpu_control=False),
    ]


def _im2col_alias(d: str) -> object:
    """im2col writing over its own input: the CPU resizes `out` first and reads what it wrote (its threads
    race over it); the result must be the input's as it was."""
    x = torch.arange(16.0, device=d).reshape(1, 1, 4, 4)
    want = torch._C._nn.im2col(x.cpu(), (2, 2), (1, 1), (0, 0), (2, 2))
    res = torch._C._nn.im2col(x, (2, 2), (1, 1), (0, 0), (2, 2), out=x.reshape(1, 4, 4))
    _assert_equal(res, want, "im2col out=input")
    return None


def _assert_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got = got.cpu()
    same = got.shape == want.shape and torch.equal(got.isnan(), want.isnan()) and torch.equal(
        got.nan_to_num(0.0), want.nan_to_num(0.0))
    assert same, f"{what}: got {got.flatten()[:8].tolist()}, want {want.flatten()[:8].tolist()}"


# ---- 3. host-side arguments (CPU as on CUDA) ----------------------------------------------------------

def _pack(d: str, lengths: object) -> object:
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    seq = torch.arange(24.0, device=d).reshape(3, 2, 4)
    packed = pack_padded_sequence(seq, lengths)
    padded, lens = pad_packed_sequence(packed)
    return packed.data, packed.batch_sizes.device.type, packed.batch_sizes.tolist(), padded, lens.tolist()


def _host_cases() -> list[EdgeContract]:
    return [
        EdgeContract("tensor_split cpu indices", "host_args",
                 lambda d: torch.tensor_split(_arange(d, 10), torch.tensor([2, 5]))),
        EdgeContract("tensor_split cpu sections", "host_args",
                 lambda d: torch.tensor_split(_arange(d, 10), torch.tensor(3))),
        EdgeContract("tensor_split device indices", "host_args",
                 lambda d: torch.tensor_split(_arange(d, 10), _idx(d, 2, 5)), cpu_control=False,
                 expect_error="tensor_split expected tensor_indices_or_sections to be on cpu, but it's on sim:0"),
        EdgeContract("pack_padded_sequence cpu lengths", "host_args", lambda d: _pack(d, torch.tensor([3, 2]))),
        EdgeContract("pack_padded_sequence list lengths", "host_args", lambda d: _pack(d, [3, 1])),
        EdgeContract("pack_padded_sequence device lengths", "host_args", lambda d: _pack(d, _idx(d, 3, 2)),
                 cpu_control=False,
                 expect_error="'lengths' argument should be a 1D CPU int64 tensor, but got 1D sim:0 Long tensor"),
        EdgeContract("pack_sequence", "host_args", lambda d: _pack_sequence(d)),
        EdgeContract("index cpu indices", "host_args", lambda d: _arange(d)[torch.tensor([4, 0, 2])]),
        EdgeContract("index cpu mask", "host_args", lambda d: _arange(d)[torch.tensor([1, 0, 1, 0, 1, 1], dtype=torch.bool)]),
        EdgeContract("index_put_ cpu indices", "host_args",
                 lambda d: _arange(d).index_put_((torch.tensor([1, 3]),), torch.tensor(9.0, device=d))),
    ]


def _pack_sequence(d: str) -> object:
    from torch.nn.utils.rnn import pack_sequence

    packed = pack_sequence([torch.ones(3, device=d), torch.zeros(2, device=d)])
    return packed.data, packed.batch_sizes.device.type, packed.batch_sizes.tolist()


# ---- 4. numerical edge cases ------------------------------------------------------------------------

def _logit_backward(n: int, eps: float | None) -> Fn:
    def run(d: str) -> object:
        x = torch.linspace(-0.5, 1.5, n, device=d).requires_grad_()
        g = torch.full((n,), -1.0, device=d)
        torch.logit(x, eps).backward(g)
        return x.grad

    return run


def _grid_nonfinite(mode: str) -> Fn:
    def run(d: str) -> object:
        inp = torch.arange(16.0, device=d).reshape(1, 1, 4, 4)
        nan, inf = float("nan"), float("inf")
        grid = torch.tensor([[[[nan, 0.0], [inf, 0.5]], [[0.2, -inf], [0.1, 0.1]]]])
        got = F.grid_sample(inp, grid.to(d), mode=mode, align_corners=False)
        # a NaN coordinate samples as -1, an infinite one is out of range (zero padding: 0); the CPU gives NaN
        want = F.grid_sample(inp.cpu(), grid.nan_to_num(-1.0, posinf=-100.0, neginf=-100.0), mode=mode,
                             align_corners=False)
        _assert_equal(got, want, f"grid_sample {mode}")

    return run


def _numerics_cases() -> list[EdgeContract]:
    cases = [EdgeContract(f"logit backward n={n} eps={eps}", "numerics", _logit_backward(n, eps))
             for n in (7, 8, 9, 16, 17, 33) for eps in (None, 0.25)]
    cases += [EdgeContract(f"grid_sample non-finite {m}", "numerics", _grid_nonfinite(m), cpu_control=False)
              for m in ("bilinear", "nearest")]
    big = [1e5, -1e5, 65519.0, 65520.0, 3e38, float("inf")]
    cases += [
        EdgeContract("fp16 saturation .half()", "numerics", lambda d: torch.tensor(big, device=d).half()),
        EdgeContract("fp16 saturation Linear.half()", "numerics", lambda d: _half_linear(d, big)),
        EdgeContract("ldexp wide int64 exponents", "numerics", _ldexp_wide, cpu_control=False),
        EdgeContract("col2im", "numerics",
                 lambda d: F.fold(torch.arange(16.0, device=d).reshape(1, 4, 4), (3, 3), (2, 2))),
    ]
    return cases


def _ldexp_wide(d: str) -> object:
    """The CPU truncates int64 exponents to 32 bits (2**31 + 5 acts as -2**31 + 5): they saturate instead."""
    got = torch.ldexp(torch.ones(4, device=d), torch.tensor([1, 2**31 + 5, -(2**40), 200], device=d))
    _assert_equal(got, torch.tensor([2.0, float("inf"), 0.0, float("inf")]), "ldexp")
    return None


def _half_linear(d: str, weights: list[float]) -> object:
    lin = torch.nn.Linear(len(weights), 1).to(d)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([weights], device=d))
    return lin.half().weight.detach()


# ---- 5. device APIs and accelerator-only kernels -------------------------------------------------------

def _pin(d: str) -> object:
    t = torch.arange(4.0)
    p = t.pin_memory()
    assert p.is_pinned(), "pin_memory() gave memory that is_pinned() denies"
    return p.to(d, non_blocking=True)


def _loader(d: str) -> object:
    data = torch.utils.data.TensorDataset(torch.arange(8.0).reshape(4, 2))
    batches = list(torch.utils.data.DataLoader(data, batch_size=2, pin_memory=True))
    assert all(b[0].is_pinned() for b in batches), "DataLoader(pin_memory=True) gave unpinned batches"
    return torch.cat([b[0].to(d) for b in batches])


def _resize_output(d: str) -> object:
    t = torch.zeros(0, device=d)
    torch.ops.aten._resize_output_(t, [5], t.device)
    assert tuple(t.shape) == (5,), f"_resize_output_ left shape {tuple(t.shape)}"
    z = torch.zeros(0, device=d)
    r = torch.ops.aten._resize_output(z, [2, 3], z.device)
    assert tuple(r.shape) == (2, 3) and r.device.type == "sim", f"_resize_output gave {r.shape} on {r.device}"
    return None


def _qkv(d: str) -> torch.Tensor:
    return torch.randn(1, 2, 8, 16, device=d)


def _device_cases() -> list[EdgeContract]:
    q = _qkv
    cases = [
        EdgeContract("pin_memory", "device_api", _pin, cpu_control=False),
        EdgeContract("DataLoader pin_memory=True", "device_api", _loader, cpu_control=False),
        EdgeContract("_resize_output_", "device_api", _resize_output, cpu_control=False),
        EdgeContract("torch.Generator(device)", "device_api",
                 lambda d: torch.randn(3, device=d, generator=torch.Generator(d).manual_seed(1)).sum().item()),
    ]
    missing = {
        "aten::_scaled_dot_product_flash_attention": lambda d: torch.ops.aten._scaled_dot_product_flash_attention(
            q(d), q(d), q(d)),
        "aten::_scaled_dot_product_efficient_attention":
            lambda d: torch.ops.aten._scaled_dot_product_efficient_attention(q(d), q(d), q(d), None, False),
        "aten::_scaled_dot_product_cudnn_attention":
            lambda d: torch.ops.aten._scaled_dot_product_cudnn_attention(q(d), q(d), q(d), None, False),
    }
    cases += [EdgeContract(f"{name} is not implemented", "device_api", fn, cpu_control=False, expect_missing=name)
              for name, fn in missing.items()]
    return cases


# ---- 6. where the CPU kernel is defective or missing: the mathematical answer (issue 49) ----------------

def _logit_neg_zero(d: str) -> object:
    """logit'(x) = 1 / (x (1 - x)): -inf at -0.0, whatever the length (the CPU's SIMD lanes give +inf)."""
    for n in (1, 7, 8, 9, 17):
        got = torch.ops.aten.logit_backward(torch.ones(n, device=d), torch.full((n,), -0.0, device=d), None)
        assert torch.isneginf(got.cpu()).all(), f"logit_backward(-0.0), n={n}: {got.cpu().tolist()}"
    return None


def _kaiser_limits(d: str) -> object:
    """A huge beta has a finite window (I0 overflows on the CPU: NaN); an infinite one is a unit impulse."""
    big = torch.kaiser_window(9, periodic=False, beta=1000.0, device=d).cpu()
    assert torch.isfinite(big).all() and big[4] == 1.0 and big[0] == 0.0, f"kaiser beta=1000: {big.tolist()}"
    impulse = torch.kaiser_window(9, periodic=False, beta=float("inf"), device=d).cpu()
    _assert_equal(impulse, torch.eye(9)[4], "kaiser beta=inf")
    return None


def _saturate(d: str) -> object:
    """_saturate_weight_to_fp16 clamps to fp16's range at any rank and leaves its input alone."""
    for shape in [(), (3,), (2, 3), (2, 2, 3)]:
        w = torch.full(shape, 1e5, device=d)
        got = torch.ops.aten._saturate_weight_to_fp16(w)
        _assert_equal(got, torch.full(shape, 65504.0), f"_saturate_weight_to_fp16 {shape}")
        _assert_equal(w, torch.full(shape, 1e5), "_saturate_weight_to_fp16's input")
    return None


def _complex_add(d: str) -> object:
    """a + b with alpha 1 adds per component: (1 + 0j) * (inf + 0j) is (inf + nanj), so no multiply."""
    inf = float("inf")
    a = torch.tensor([1 + 1j, inf + 0j, 2 - 1j], dtype=torch.complex64)
    b = torch.tensor([inf + 0j, 1 + 0j, complex(0, -inf)], dtype=torch.complex64)
    ad, bd = a.to(d), b.to(d)
    for got, want in [(ad + bd, torch.complex(a.real + b.real, a.imag + b.imag)),
                      (ad - bd, torch.complex(a.real - b.real, a.imag - b.imag)),
                      (torch.rsub(ad, bd), torch.complex(b.real - a.real, b.imag - a.imag)),
                      (ad.clone().add_(bd), torch.complex(a.real + b.real, a.imag + b.imag))]:
        _assert_equal(torch.view_as_real(got.cpu()), torch.view_as_real(want), "complex add/sub")
    return None


def _complex_kernels(d: str) -> object:
    """Kernels the CPU lacks for complex dtypes: complex32 flip moves raw bits, a complex window is real."""
    bits = torch.tensor([[0, -(2**31), 0x7C017E00], [0x3555B555, 0x00010002, -1]], dtype=torch.int32)
    got = torch.flip(bits.to(d).view(torch.complex32), [0, 1]).view(torch.int32)
    _assert_equal(got, torch.flip(bits, [0, 1]), "flip complex32")
    window = torch.kaiser_window(9, periodic=False, beta=1000.0, dtype=torch.complex64, device=d).cpu()
    real = torch.kaiser_window(9, periodic=False, beta=1000.0, device=d).cpu()
    _assert_equal(torch.view_as_real(window), torch.view_as_real(real.to(torch.complex64)), "complex kaiser")
    return None


def _cumprod_and_ties(d: str) -> object:
    """Complex cumprod starts from the first element (the CPU's 1 + 0j turns inf + 0j into inf + nanj);
    maximum/minimum of +0.0 and -0.0 keep the first (the CPU's strided float64 kernel: the second)."""
    inf = float("inf")
    x = torch.tensor([inf + 0j, 2 + 0j, 1 + 1j], dtype=torch.complex64)
    got = torch.cumprod(x.to(d), 0).cpu()
    want = [x[0].item()]
    for v in x[1:].tolist():
        want.append(want[-1] * v)  # Python's product, per component
    _assert_equal(torch.view_as_real(got), torch.view_as_real(torch.tensor(want, dtype=torch.complex64)), "cumprod")
    base = torch.tensor([[-0.0, 0.0, -0.0, 0.0], [0.0, -0.0, 0.0, -0.0]], dtype=torch.float64)
    for fn in (torch.maximum, torch.minimum):
        signs = torch.signbit(fn(base.to(d).t(), (-base).to(d).t())).cpu()
        assert torch.equal(signs, torch.signbit(base.t())), f"{fn.__name__} of signed zeros: {signs.tolist()}"
    return None


def _gcd_minimum(d: str) -> object:
    """gcd(int8 min, odd) is 1 (|-128| as unsigned); gcd(min, 0) stays min. The CPU's abs() wraps."""
    left = torch.tensor([-128, -128, -128], dtype=torch.int8)
    got = torch.gcd(left.to(d), torch.tensor([31, -31, 0], dtype=torch.int8, device=d))
    _assert_equal(got, torch.tensor([1, 1, -128], dtype=torch.int8), "gcd int8")
    return None


def _group_norm_no_weight(d: str) -> object:
    """group_norm's backward without a weight (the CPU's kernel fails: "tensor does not have a device")."""
    x = torch.linspace(-2.0, 2.0, 24).reshape(2, 4, 3)
    g = torch.linspace(0.25, 2.5, 24).reshape(2, 4, 3)
    xd = x.to(d).requires_grad_()
    F.group_norm(xd, 2, weight=None, bias=torch.zeros(4, device=d)).backward(g.to(d))
    xc = x.clone().requires_grad_()
    F.group_norm(xc, 2, weight=torch.ones(4), bias=torch.zeros(4)).backward(g)  # the same gradient
    torch.testing.assert_close(xd.grad.cpu(), xc.grad)
    return None


def _lazy_clone(d: str) -> object:
    x = torch.arange(6.0, device=d)
    y = torch.ops.aten._lazy_clone(x)
    x.add_(1)
    _assert_equal(y, torch.arange(6.0), "_lazy_clone")
    return None


def _close_to_cpu(fn: Callable[[str], tuple]) -> Fn:
    """An accelerator's kernel the CPU lacks, against the CPU's composite of the same function."""
    def run(d: str) -> object:
        torch.manual_seed(0)
        want = fn("cpu")
        torch.manual_seed(0)
        got = fn(d)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-5)
        return None

    return run


def _lstm(d: str) -> tuple:
    cell = torch.nn.LSTMCell(3, 4).to(d)
    x, h0, c0 = torch.randn(2, 3).to(d).requires_grad_(), torch.randn(2, 4).to(d), torch.randn(2, 4).to(d)
    h, c = cell(x, (h0, c0))
    (h.sum() + c.square().sum()).backward()
    return h, c, x.grad, cell.weight_hh.grad


def _gru(d: str) -> tuple:
    cell = torch.nn.GRUCell(3, 4).to(d)
    x, h0 = torch.randn(2, 3).to(d).requires_grad_(), torch.randn(2, 4).to(d)
    h = cell(x, h0)
    h.square().sum().backward()
    return h, x.grad, cell.bias_hh.grad


def _bn_stats(d: str) -> tuple:
    x = torch.randn(4, 3, 5).to(d)
    if d == "cpu":  # the CPU has no batch_norm_stats: mean and 1 / sqrt(biased var + eps) by hand
        var, mean = torch.var_mean(x, dim=(0, 2), correction=0)
        return mean, (var + 1e-5).rsqrt()
    return torch.batch_norm_stats(x, 1e-5)


def _device_semantics_cases() -> list[EdgeContract]:
    expected = {"logit_backward(-0.0)": _logit_neg_zero, "kaiser_window large beta": _kaiser_limits,
                "_saturate_weight_to_fp16 any rank": _saturate, "complex add alpha=1 with inf": _complex_add,
                "gcd int8 minimum": _gcd_minimum, "complex32 flip, complex kaiser_window": _complex_kernels,
                "complex cumprod, signed-zero ties": _cumprod_and_ties}
    cases = [EdgeContract(n, "numerics", fn, cpu_control=False) for n, fn in expected.items()]
    cases += [
        EdgeContract("group_norm backward without weight", "errors", _group_norm_no_weight, cpu_control=False),
        EdgeContract("_lazy_clone", "device_api", _lazy_clone, cpu_control=False),
        EdgeContract("LSTMCell (fused cell)", "device_api", _close_to_cpu(_lstm), cpu_control=False),
        EdgeContract("GRUCell (fused cell)", "device_api", _close_to_cpu(_gru), cpu_control=False),
        EdgeContract("batch_norm_stats", "device_api", _close_to_cpu(_bn_stats), cpu_control=False),
    ]
    return cases


def all_contracts() -> list[EdgeContract]:
    return (_stub_cases() + _alias_cases() + _host_cases() + _numerics_cases() + _device_cases()
            + _device_semantics_cases())


def run_contract(c: EdgeContract, *, mode: str = "highest") -> differential.SampleResult:
    """One contract: sim against its CPU control, or against its own expectation."""
    got = differential.traced(lambda: c.fn("sim"), seed=0, mode=mode)
    if c.cpu_control:
        want = differential.attempt(lambda: c.fn("cpu"), seed=0)
        r = differential.compare_sides(want, got, exact=mode == "highest", kind="contract")
        if r.klass == "numerics" and not differential.cpu_deterministic(lambda: c.fn("cpu"), want, 0):
            r = differential.SampleResult("skipped", "the CPU reference is nondeterministic here", kind="contract")
        if r.status == "unsupported" and want.error is None:
            r.status, r.reason = "failed", f"sim has no kernel where the CPU computes: {r.reason}"
    elif c.expect_missing:
        e = got.error
        ok = e is not None and differential.is_standard_missing(e) and f"'{c.expect_missing}'" in str(e)[:200]
        why = "" if ok else (f"expected the standard missing-kernel error for {c.expect_missing}, got "
                             + (f"{type(e).__name__}: {str(e)[:120]}" if e is not None else "a result"))
        r = differential.SampleResult("passed" if ok else "failed", why, kind="contract")
    elif c.expect_error:
        e = got.error
        ok = e is not None and str(e).startswith(c.expect_error)
        why = "" if ok else f"expected the error {c.expect_error!r}, got " + (
            f"{type(e).__name__}: {str(e)[:120]}" if e is not None else "a result")
        r = differential.SampleResult("passed" if ok else "failed", why, kind="contract")
    else:
        e = got.error
        why = "" if e is None else f"sim raised {type(e).__name__}: {str(e)[:160]}"
        r = differential.SampleResult("failed" if e is not None else "passed", why, kind="contract")
    if r.status == "failed":
        r.klass = c.klass if r.klass != "dispatch_stub" else r.klass
    r.aten_ops = got.ops
    return r
