"""sim is the CPU it runs on (issue 39): at ``highest`` under the ``full`` profile, each case gives the
CPU's values bit for bit or the CPU's error (type and message, device names aside), or sim raises the
standard missing-kernel error.

The hand-written contracts (``harness.sim.contracts``) cover what OpInfo samples do not reach: ops whose
kernel sits behind a DispatchStub, ``out=`` aliasing an input, host-side arguments, numerical edge
cases, device APIs (pinned memory, generators, ``_resize_output_``) and accelerator-only kernels. The
OpInfo part runs, for the ops those classes were found on, every sample in several dtypes, their
gradients, ``error_inputs`` and ``out=`` aliasing an input; ``-m slow`` runs that for all of ``op_db``
(``scripts/opinfo_table.py --fidelity`` prints the same sweep's differences by class).

Needs ``expecttest`` (``torch.testing._internal`` imports it).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("expecttest", reason="torch.testing._internal (OpInfo op_db) needs expecttest")

import harness.sim as sim  # noqa: E402
from harness.sim import conformance, contracts  # noqa: E402

CONTRACTS = contracts.all_contracts()

# The OpInfos issue 39's reproductions name, and those the full sweep found differences on.
FOCUS = ("gather", "take", "kthvalue", "masked_select", "cat", "index_select", "logit", "ldexp",
         "nn.functional.grid_sample", "tensor_split", "sgn", "nn.functional.unfold", "nn.functional.avg_pool2d",
         "add", "nn.functional.embedding_bag", "nn.functional.silu", "nn.functional.mish", "to_sparse", "cross",
         "take_along_dim", "index_add")
DTYPES = (torch.float32, torch.float16, torch.int64)
LIMIT = 6

# OpInfo id -> why sim may still differ from CPU there under the full sweep (strict: a fix shows up).
XFAIL: dict[str, str] = {}

_DB = {conformance.opinfo_id(op): op for op in conformance.op_db()}


def _failures(results: list[conformance.SampleResult]) -> list[str]:
    return [f"{r.kind} {r.dtype} [{r.klass}]: {r.reason}" for r in results if r.status == "failed"]


@pytest.mark.parametrize("case", CONTRACTS, ids=[c.name for c in CONTRACTS])
def test_contract(case: contracts.EdgeContract):
    r = contracts.run_contract(case)
    assert r.status in ("passed", "skipped"), f"[{r.klass}] {r.reason}"


@pytest.mark.parametrize("oid", [o for o in FOCUS if o in _DB])
@pytest.mark.long
def test_opinfo_focus(oid: str):
    results = conformance.run_op(_DB[oid], limit=LIMIT, mode="highest", exact=True, profile="full", dtypes=DTYPES,
                                 grads=True, errors=True, aliases=True)
    failed = _failures(results)
    assert not failed, "; ".join(failed[:5])


def _sweep_params() -> list:
    out = []
    for oid, op in _DB.items():
        marks = [pytest.mark.slow]
        if oid in XFAIL:
            marks.append(pytest.mark.xfail(strict=True, reason=XFAIL[oid]))
        out.append(pytest.param(op, id=oid, marks=marks))
    return out


@pytest.mark.parametrize("op", _sweep_params())
def test_opinfo_full_sweep(op):
    results = conformance.run_op(op, limit=None, mode="highest", exact=True, profile="full",
                                 dtypes=(torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                         torch.bool, torch.complex64),
                                 grads=True, errors=True, aliases=True, reference=True)
    failed = _failures(results)
    assert not failed, "; ".join(failed[:5])


# --- the comparison itself ---------------------------------------------------------------------------


def test_bitwise_comparison_sees_the_sign_of_zero():
    ok, _, _ = conformance.compare(torch.tensor([0.0, 1.0], device="sim"), torch.tensor([-0.0, 1.0]), rtol=0, atol=0)
    assert not ok
    ok, _, _ = conformance.compare(torch.tensor([float("nan")], device="sim"), torch.tensor([float("nan")]),
                                   rtol=0, atol=0)
    assert ok


def test_errors_compare_by_type_and_message():
    cpu = conformance.Observed(error=RuntimeError("index 5 is out of bounds for dimension 0 with size 3 on cpu"))
    same = conformance.Observed(error=RuntimeError("index 5 is out of bounds for dimension 0 with size 3 on sim:0"))
    other = conformance.Observed(error=IndexError("index 5 is out of bounds for dimension 0 with size 3 on sim:0"))
    assert conformance.compare_sides(cpu, same, exact=True, kind="error").status == "passed"
    assert conformance.compare_sides(cpu, other, exact=True, kind="error").status == "failed"
    computed = conformance.Observed(value=torch.zeros(1, device="sim"))
    r = conformance.compare_sides(cpu, computed, exact=True, kind="alias")
    assert (r.status, r.klass) == ("failed", "aliasing")


def test_missing_kernel_is_not_a_difference():
    err = NotImplementedError("Could not run 'aten::foo' with arguments from the 'sim' backend. This could be ...")
    r = conformance.compare_sides(conformance.Observed(value=1), conformance.Observed(error=err), exact=True, kind="sample")
    assert r.status == "unsupported"


# --- what the fixes must not change -------------------------------------------------------------------


def test_stub_factory_outside_the_profile_is_the_standard_missing_kernel_error():
    with sim.op_profile("young"), pytest.raises(NotImplementedError, match=r"^Could not run 'aten::kaiser_window"):
        torch.kaiser_window(8, device="sim")


def test_generators_are_sim_devices_drawing_like_the_cpu():
    g = torch.Generator("sim").manual_seed(7)
    assert g.device == torch.device("sim", 0)
    assert torch.equal(torch.rand(4, device="sim", generator=g).cpu(),
                       torch.rand(4, generator=torch.Generator().manual_seed(7)))
    with pytest.raises(RuntimeError, match="Expected a 'sim' device type for generator but found 'cpu'"):
        torch.rand(4, device="sim", generator=torch.Generator())


def test_storage_resize_in_place():
    t = torch.arange(4.0, device="sim")
    s = t.untyped_storage()
    s.resize_(32)
    assert s.nbytes() == 32 and s.device.type == "sim"
    assert torch.equal(torch.empty(0, device="sim").set_(s, 0, (4,)).cpu(), torch.arange(4.0))
