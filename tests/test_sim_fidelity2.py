"""sim under the peer conformance suite (issue 49): regressions for what torchcts found, and the suite itself.

The fast cases stand for its suites without needing it: recurrent layers and their training (autograd,
training: the fused cells PyTorch asks any accelerator for), SyncBatchNorm's kernels (multi_device), the
functional ``set`` with a storage and half-precision histc (generated, operators), the manifest that
declares what sim lacks. The edge contracts where the CPU kernel is defective are
``harness.sim.contracts`` (tests/test_sim_fidelity.py). ``-m slow`` runs torchcts itself at level 2 on
sim and the CPU (scripts/cts_table.py; ``pip install --no-deps torchcts==0.4.1``).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import harness.sim as sim

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _full_highest():
    with sim.op_profile("full"), sim.precision("highest"):
        yield


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_recurrent_layer_trains_on_sim_as_on_cpu(kind: str):
    torch.manual_seed(0)
    ref = getattr(torch.nn, kind)(3, 4, num_layers=2, batch_first=True)
    dev = getattr(torch.nn, kind)(3, 4, num_layers=2, batch_first=True).to("sim")
    dev.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 3)
    for model, inp in ((ref, x), (dev, x.to("sim"))):
        out, _ = model(inp)
        out.square().mean().backward()
    for (name, p), q in zip(ref.named_parameters(), dev.parameters(), strict=True):
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-5, atol=1e-6, msg=f"{kind} grad {name}")


def test_sync_batch_norm_kernels_match_batch_norm():
    # SyncBatchNorm's path with one process: stats per device, gathered with counts, then elemt
    x = torch.randn(4, 3, 5)
    mean, invstd = torch.batch_norm_stats(x.to("sim"), 1e-5)
    rm, rv = torch.zeros(3, device="sim"), torch.ones(3, device="sim")
    gmean, ginvstd = torch.batch_norm_gather_stats_with_counts(
        x.to("sim"), mean[None], invstd[None], rm, rv, 0.1, 1e-5, torch.tensor([20.0], device="sim"))
    y = torch.batch_norm_elemt(x.to("sim"), None, None, gmean, ginvstd, 1e-5)
    want_rm, want_rv = torch.zeros(3), torch.ones(3)
    want = F.batch_norm(x, want_rm, want_rv, training=True, momentum=0.1, eps=1e-5)
    torch.testing.assert_close(y.cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rm.cpu(), want_rm)
    torch.testing.assert_close(rv.cpu(), want_rv)


def test_fused_attention_entry_matches_math():
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    out = torch.ops.aten._scaled_dot_product_fused_attention_overrideable(
        q.to("sim"), k.to("sim"), v.to("sim"), None, 0.0, True)[0]
    torch.testing.assert_close(out.cpu(), F.scaled_dot_product_attention(q, k, v, is_causal=True),
                               rtol=1e-5, atol=1e-5)


def test_functional_set_with_a_storage():
    src = torch.arange(6.0, device="sim")
    got = torch.ops.aten.set.source_Storage_storage_offset(torch.empty(0, device="sim"), src.untyped_storage(),
                                                           1, [2, 2], [2, 1])
    assert got.device.type == "sim"
    torch.testing.assert_close(got.cpu(), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_histc_counts_are_integers(dtype: torch.dtype):
    x = torch.full((4062,), 0.5, dtype=dtype)
    got = torch.histc(x.to("sim"), bins=1, min=0.0, max=1.0)
    assert got.dtype == dtype
    assert got.item() == torch.tensor(4062.0).to(dtype).item()  # the CPU: 4060 (fp16), 512 (bf16)


def _by_squaring(base: torch.Tensor, n: int) -> torch.Tensor:
    """The peer suite's contract for one lane: exponentiation by squaring, the first set bit the factor itself."""
    if n == 0:
        return torch.ones((), dtype=base.dtype)
    result, factor = None, base
    while n:
        if n & 1:
            result = factor.clone() if result is None else result * factor
        n >>= 1
        if n:
            factor = factor * factor
    return result


@pytest.mark.parametrize("op", ["pow", "pow_", "float_power"])
def test_complex_integral_exponents_are_exponentiated_by_squaring(op: str):
    """The CPU's complex pow goes through exp and log even for exponent 3 + 0j; a lane whose exponent is a finite,
    non-negative integer is the repeated product (non-integral, negative or complex exponents: the CPU's)."""
    g = torch.Generator().manual_seed(0)
    base = torch.complex(torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)).to(torch.complex128
                                                                                                 if op == "float_power"
                                                                                                 else torch.complex64)
    base[0, 0] = complex(float("inf"), 0.0)  # 1 * (inf + 0j) is NaN: the first factor is taken as it is
    exps = torch.tensor([0, 1, 2, 3, 7, 12, 2.5, -2], dtype=torch.float32)
    exponent = torch.complex(exps, torch.zeros(8)).expand(6, 8).to(base.dtype)
    exponent = torch.where(torch.arange(8) == 7, exponent + 1j, exponent)  # the last column complex: the CPU's
    fn = {"pow": torch.pow, "float_power": torch.float_power, "pow_": lambda b, e: b.clone().pow_(e)}[op]
    got = fn(base.to("sim"), exponent.to("sim")).cpu()
    cpu = fn(base, exponent)
    for i in range(6):
        for j, n in enumerate(exps.tolist()):
            want = _by_squaring(base[i, j], int(n)) if j < 6 else cpu[i, j]
            assert torch.equal(got[i, j], want.to(got.dtype)) or (got[i, j].isnan().all() and want.isnan().all()), \
                (op, i, j, got[i, j], want)
    assert not torch.equal(got[:, 3], cpu[:, 3])  # the CPU's exp/log differs from the product in the last bits


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_ldexp_by_integers_scales_each_lane_on_its_own(dtype: torch.dtype):
    """The CPU multiplies by 2^e + 0j, so a lane overflowing to inf makes the other one NaN (inf * 0)."""
    import math

    x = torch.tensor([1 + 0j, 0 + 1j, complex(float("inf"), 1), 1e-3 + 2j, 3 - 4j, 0j], dtype=dtype)
    e = torch.tensor([200, -200, 5, 2**40, -(2**40), 1500], dtype=torch.int64)

    def lane(v: float, k: int) -> float:
        if v == 0 or not math.isfinite(v):
            return v
        if k > 2**31 - 1:
            return math.copysign(math.inf, v)
        try:
            return math.ldexp(v, max(k, -(2**31)))
        except OverflowError:
            return math.copysign(math.inf, v)

    want = torch.tensor([complex(lane(v.real, k), lane(v.imag, k)) for v, k in zip(x.tolist(), e.tolist(), strict=True)],
                        dtype=dtype)
    for got in (torch.ldexp(x.to("sim"), e.to("sim")), x.to("sim").ldexp_(e.to("sim")),
                torch.ldexp(x.to("sim"), e.to("sim"), out=torch.empty_like(x, device="sim"))):
        assert torch.equal(got.cpu(), want), (got.cpu(), want)
    assert torch.ldexp(x, e)[5].isnan()  # the CPU's: 0j * (2^1500 + 0j) = 0 * inf, NaN


@pytest.mark.parametrize("fn", [torch.i0, torch.special.i0, torch.special.modified_bessel_i0])
def test_i0_is_finite_up_to_where_it_overflows(fn):
    """The CPU's float32 i0 computes e^x first and is inf from x = 88.7; I0(91) = 1.4e38 fits."""
    x = torch.tensor([1.0, -20.0, 89.0, -91.0, 92.0, float("nan"), float("inf"), float("-inf")])
    got = fn(x.to("sim")).cpu()
    want = torch.i0(x[:6].double()).float()  # float64 has the range: one rounding to float32
    assert torch.allclose(got[:6], want, rtol=1e-6, equal_nan=True), (got, want)
    assert torch.isinf(got[4]) and not torch.isfinite(fn(x)[2:4]).any()  # beyond float32: inf; the CPU's, before
    assert got[6:].tolist() == [float("inf")] * 2 and fn(x)[6:].isnan().all()  # I0(+-inf) = inf; the CPU: NaN


def test_incomplete_gamma_of_a_tiny_shape_keeps_eulers_constant():
    """Q(a, x) = a E1(x) for a -> 0 (mpmath at 80 digits: Q(1e-300, 1e-300) = 6.9019831223331217e-298,
    Q(1e-300, 1) = 2.1938393439552027e-301); the CPU gives 6.9078e-298 and 7.966e-301, and P(1e-300, 1) > 1."""
    a = torch.tensor([1e-300, 1e-300, 1e-300, 0.5], dtype=torch.float64)
    x = torch.tensor([1e-300, 1.0, 30.0, 2.0], dtype=torch.float64)
    q = torch.igammac(a.to("sim"), x.to("sim")).cpu()
    p = torch.igamma(a.to("sim"), x.to("sim")).cpu()
    want = [6.9019831223331217234e-298, 2.1938393439552027368e-301]
    for got, exact in zip(q[:2].tolist(), want, strict=True):
        assert abs(got - exact) <= exact * 5e-13, (got, exact)
    assert 0 < q[2].item() < 1e-313 and p[:3].tolist() == [1.0, 1.0, 1.0]
    assert torch.equal(q[3:], torch.igammac(a[3:], x[3:])) and torch.equal(p[3:], torch.igamma(a[3:], x[3:]))
    assert torch.igamma(a, x)[1].item() > 1.0  # the CPU's


def _lanes(x: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(x.resolve_conj())


def _lane_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with each lane its own sum of real products (a chip's complex gemm; the suite's oracle)."""
    return torch.complex(a.real @ b.real - a.imag @ b.imag, a.real @ b.imag + a.imag @ b.real)


def _add_lanes(x: torch.Tensor, y: torch.Tensor, k: float = 1.0) -> torch.Tensor:
    """x + k y per component (the CPU's complex add and scale multiply by k + 0j: NaN lanes next to an inf)."""
    return torch.complex(x.real + k * y.real, x.imag + k * y.imag)


def test_complex_matmul_family_keeps_determinate_lanes_next_to_an_inf():
    """The CPU's complex gemm scales its sum by alpha = 1 + 0j: (inf + NaN j) * (1 + 0j) turns the real lane NaN
    too. A lane whose real products hold no NaN and no opposite infinities has a value (here inf)."""
    inf = float("inf")
    a = torch.tensor([[complex(inf, 0), 1 + 1j], [2 + 0j, 3 - 1j]], dtype=torch.complex128)
    b = torch.tensor([[1 + 0j, 2 + 0j], [1 + 0j, 1j]], dtype=torch.complex128)
    c = torch.tensor([[1 + 2j, -1j], [0.5 + 0j, 2 + 0j]], dtype=torch.complex128)
    product = _lane_product(a, b)
    s = {k: v.to("sim") for k, v in {"a": a, "b": b, "c": c}.items()}
    cases = {
        "mm": (torch.mm(s["a"], s["b"]), product),
        "mm out": (torch.mm(s["a"], s["b"], out=torch.empty(2, 2, dtype=a.dtype, device="sim")), product),
        "bmm": (torch.bmm(s["a"][None], s["b"][None])[0], product),
        "addmm": (torch.addmm(s["c"], s["a"], s["b"], beta=2, alpha=1), _add_lanes(2 * c, product)),
        "baddbmm_": (s["c"][None].clone().baddbmm_(s["a"][None], s["b"][None])[0], _add_lanes(c, product)),
        "addbmm": (torch.addbmm(s["c"], s["a"][None].expand(2, 2, 2), s["b"][None].expand(2, 2, 2)),
                   _add_lanes(c, product, 2.0)),
        "linear out": (torch.ops.aten.linear.out(s["a"], s["b"].t(), s["c"][0],
                                                 out=torch.empty(2, 2, dtype=a.dtype, device="sim")),
                       _add_lanes(product, c[0].expand(2, 2))),
    }
    for name, (got, want) in cases.items():
        got, want = _lanes(got.cpu()), _lanes(want)
        assert torch.equal(got.isnan(), want.isnan()), (name, got, want)
        torch.testing.assert_close(got, want, equal_nan=True, msg=name)
    assert torch.mm(a, b)[0].isnan().all()  # the CPU's: both lanes of row 0 NaN; its real lanes are inf
    finite = torch.randn(3, 4, dtype=torch.complex64), torch.randn(4, 2, dtype=torch.complex64)
    assert torch.equal(torch.mm(*(t.to("sim") for t in finite)).cpu(), torch.mm(*finite))  # the CPU's bits


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_bce_with_logits_of_minus_inf_is_inf(reduction: str):
    """The CPU's (1 - t) x + m + log(e^-m + e^(-x-m)) at x = -inf is -inf + inf; t softplus(-x) + (1 - t)
    softplus(x) is inf."""
    x = torch.tensor([float("-inf"), 2.0, -1.5, float("inf")])
    t = torch.tensor([0.25, 0.5, 1.0, 0.0])
    want = torch.tensor([float("inf"), 0.0, 0.0, float("inf")])
    want[1:3] = F.binary_cross_entropy_with_logits(x[1:3], t[1:3], reduction="none")
    want = {"none": want, "mean": want.mean(), "sum": want.sum()}[reduction]
    got = F.binary_cross_entropy_with_logits(x.to("sim"), t.to("sim"), reduction=reduction).cpu()
    assert torch.equal(got, want), (got, want)
    out = torch.ops.aten.binary_cross_entropy_with_logits.out(
        x.to("sim"), t.to("sim"), reduction={"none": 0, "mean": 1, "sum": 2}[reduction],
        out=torch.empty(0, device="sim"))
    assert torch.equal(out.cpu(), want)
    assert F.binary_cross_entropy_with_logits(x, t, reduction="none")[0].isnan()  # the CPU's


def test_lanczos_taps_at_the_sincs_zeros_weigh_nothing():
    """Downsampling 5 -> 7 columns, output column 3's tap on input column 4 sits on a zero of the sinc: the CPU
    weighs it sin(pi k) / (pi k), not 0, and spreads that column's inf; it is the interpolation without it."""
    x = torch.linspace(-0.41, 0.0, 20).reshape(1, 1, 4, 5).repeat(1, 2, 1, 1)
    x[0, 0, 0, 4], x[0, 1, 3, 4] = float("inf"), float("-inf")
    got = torch.ops.aten._upsample_lanczos2d_aa(x.to("sim"), [6, 7], False).cpu()
    without = x.clone()
    without[..., 4] = 0.0
    torch.testing.assert_close(got[..., 3], torch.ops.aten._upsample_lanczos2d_aa(without, [6, 7], False)[..., 3])
    cpu = torch.ops.aten._upsample_lanczos2d_aa(x, [6, 7], False)
    assert not cpu[..., 3].isfinite().all()
    assert torch.equal(got[..., :2], cpu[..., :2])  # columns the infinities do not reach: the CPU's bits
    out = torch.empty(0, device="sim")
    torch.ops.aten._upsample_lanczos2d_aa.out(x.to("sim"), [6, 7], False, out=out)
    assert torch.equal(out.cpu(), got)


def test_embedding_bag_scales_each_row_by_its_own_frequency():
    """torchcts' case: indices [1, 1, 2, 1, 2, 4] in two bags; with scale_grad_by_freq row r's gradient is over its
    count in the batch (3, 2, 1). The CPU divides rows 2 and 4 by 3."""
    indices, offsets = torch.tensor([1, 1, 2, 1, 2, 4]), torch.tensor([0, 3])
    offset2bag, bag_size = torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([3, 3])
    grad = torch.tensor([[1.0, -0.5], [-0.25, 2.0]])
    want = torch.zeros(5, 2)
    for position, row in enumerate(indices.tolist()):
        want[row] += grad[offset2bag[position]] / int((indices == row).sum())
    s = {k: v.to("sim") for k, v in dict(i=indices, o=offsets, b=offset2bag, n=bag_size, g=grad,
                                         m=torch.zeros(2, dtype=torch.long)).items()}
    weight = torch.zeros(5, 2, device="sim", requires_grad=True)
    torch.embedding_bag(weight, s["i"], s["o"], True, 0, False, None, False)[0].backward(s["g"])
    results = {
        "autograd": weight.grad,
        "_embedding_bag_backward": torch.ops.aten._embedding_bag_backward(
            s["g"], s["i"], s["o"], s["b"], s["n"], s["m"], 5, True, 0, False, None, -1),
        "dense": torch.ops.aten._embedding_bag_dense_backward(s["g"], s["i"], s["b"], s["n"], s["m"], 5, True, 0,
                                                              None, -1),
        "dense out": torch.ops.aten._embedding_bag_dense_backward.out(
            s["g"], s["i"], s["b"], s["n"], s["m"], 5, True, 0, None, -1, out=torch.empty(5, 2, device="sim")),
    }
    for name, got in results.items():
        torch.testing.assert_close(got.cpu(), want, msg=name)
    cpu = torch.ops.aten._embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, torch.zeros(2, dtype=torch.long),
                                                       5, True, 0, None, -1)
    assert not torch.allclose(cpu, want)  # the CPU's


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_unsigned_negation_wraps(dtype: torch.dtype):
    """neg of a wide unsigned type (what materializes a _neg_view) is -x mod 2^bits; the CPU has no kernel."""
    bits = torch.iinfo(dtype).bits
    values = [0, 1, 7, 2 ** (bits - 1), 2**bits - 1]
    x = torch.tensor([v - 2**bits if v >= 2 ** (bits - 1) and dtype == torch.uint64 else v for v in values],
                     dtype=torch.int64).to(dtype) if dtype == torch.uint64 else torch.tensor(values, dtype=dtype)
    want = [(-v) % 2**bits for v in values]
    view = torch.ops.aten._neg_view(x.to("sim"))
    assert view.is_neg()
    for got in (view.clone(), view.resolve_neg(), view.cpu(), torch.neg(x.to("sim")), x.to("sim").neg_(),
                torch.neg(x.to("sim"), out=torch.empty(0, dtype=dtype, device="sim"))):
        assert got.dtype == dtype and [v % 2**bits for v in got.cpu().tolist()] == want, got
    with pytest.raises(NotImplementedError):
        torch.neg(x)  # the CPU's


def test_diff_out_is_the_cpus():
    """The suite judges diff.out against the CPU's own result (the complex sub behind it multiplies by 1 + 0j:
    inf next to a lane makes it NaN), while it holds sub itself to per-component lanes."""
    x = torch.tensor([[complex(float("-inf"), -0.3), complex(float("nan"), -0.25), 1 - 0.2j],
                      [0.1 + 2j, 0.5 + complex(0, float("inf")), 0.25 + 0.1j]], dtype=torch.complex128)
    want = torch.diff(x, out=torch.empty(0, dtype=x.dtype))
    got = torch.diff(x.to("sim"), out=torch.empty(0, dtype=x.dtype, device="sim")).cpu()
    assert torch.equal(_lanes(got).isnan(), _lanes(want).isnan()), (got, want)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)


def test_stream_of_the_unindexed_device_is_the_current_devices():
    s = torch.Stream(device="sim")  # torchcts' create_stream: an index of -1 reached sim's per-device table
    assert s.device_index == torch.sim.current_device()
    with s:
        y = torch.ones(4, device="sim") * 2
    s.synchronize()
    assert y.sum().item() == 8.0


def _cts_table():
    spec = importlib.util.spec_from_file_location("cts_table", REPO / "scripts" / "cts_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_manifest_declares_what_sim_lacks(tmp_path: Path):
    pytest.importorskip("torchcts")
    cts = _cts_table()
    ns: dict = {}
    exec(cts.write_manifest(tmp_path / "sim", "complete", "sim").read_text(), ns)
    m = ns["manifest"]
    assert (m["device_name"], m["backend_import"], m["device_count"]) == ("sim", "harness.sim", 2)
    assert not any(m["capabilities"][c] for c in cts.SIM_UNSUPPORTED)
    assert m["capabilities"]["streams"] and m["capabilities"]["multi_device"]
    ns = {}
    exec(cts.write_manifest(tmp_path / "cpu", "complete", "cpu").read_text(), ns)
    assert ns["manifest"]["device_name"] == "cpu" and ns["manifest"]["capabilities"]["sparse"]


def test_table_classifies_against_the_control():
    cts = _cts_table()
    sim_res = {"operators/a": {"status": "FAIL", "semantic_level": 2},  # sim-only
               "operators/b": {"status": "ERROR", "semantic_level": 2},  # the CPU fails too
               "generated/c": {"status": "FAIL", "semantic_level": 2},  # the CPU does not run it
               "generated/d": {"status": "SKIP", "semantic_level": 1, "skip_reason": "capability_not_declared",
                               "detail": "capability 'sparse' is not declared"},
               "generated/e": {"status": "PASS", "semantic_level": 5}}  # above the level
    cpu_res = {"operators/a": {"status": "PASS"}, "operators/b": {"status": "FAIL"},
               "generated/d": {"status": "PASS"}}
    table = cts.classify(sim_res, cpu_res, 4, ["operators", "generated"])
    assert table["operators"] == {"failed": 2, "sim-only": 1}
    assert table["generated"] == {"failed": 1, "accelerator": 1, "declared": 1}


# Cases that fail on sim and "pass" on the CPU only because torchcts exempts the CPU from them (the test
# returns early, or checks only metadata, on device cpu) where sim runs the CPU's kernel, or that use a
# capability sim declares off without the suite gating them on it. Case id substring -> why (issue 49's note
# has the evidence).
KNOWN_SIM_ONLY = {
    "test_public_vander_decreasing_backward": "torch 2.13's vander backward fails on the CPU too "
                                              "(modified by an inplace operation)",
    "test_low_level_misc_dispatcher_helpers": "_compute_linear_combination.out accumulates into its "
                                              "uninitialized out, on the CPU too",
    "test_direct_misc_backward_surfaces": "(level 3) builds a sparse COO tensor on the device under "
                                          "requires('training') only: not gated on the 'sparse' capability "
                                          "that sim's manifest declares off (scripts/cts_table.py)",
}


def unexplained_sim_only(failures: str) -> list[str]:
    """The sim-only lines of scripts/cts_table.py --failures that KNOWN_SIM_ONLY does not explain."""
    return [line for line in failures.splitlines()
            if line.startswith("sim-only") and not any(k in line for k in KNOWN_SIM_ONLY)]


def test_known_sim_only_filter():
    lines = "sim-only\tL2\toperators/test_linalg.py::test_public_vander_decreasing_backward_x\tRuntimeError\n" \
            "sim-only\tL2\toperators/test_new.py::test_y\tAssertionError\nboth\tL2\toperators/z\tE\n"
    assert unexplained_sim_only(lines) == ["sim-only\tL2\toperators/test_new.py::test_y\tAssertionError"]


@pytest.mark.slow
def test_peer_suite_level2_has_no_unexplained_sim_only_failure(tmp_path: Path):
    pytest.importorskip("torchcts")
    fails = tmp_path / "failures.txt"
    subprocess.run([sys.executable, str(REPO / "scripts" / "cts_table.py"), "--level", "2", "--out",
                    str(tmp_path), "--failures", str(fails)], check=True, timeout=4 * 3600)
    assert not unexplained_sim_only(fails.read_text()), "\n".join(unexplained_sim_only(fails.read_text()))
