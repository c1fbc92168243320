"""Verdicts relative to the declared precision, and sim's planted numeric bugs caught and localized."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import LIST_HEADER, list_rows

from harness.backends.contracts import CONTRACTS, Emulate, contract, round_tf32
from harness.fleet.runner import RunConfig, run_models
from harness.models.model_list import load_model_list
from harness.results.store import ResultStore
from harness.run.compare import Tolerance, check_tensor, compare_outputs
from harness.run.opcheck import judge_output
from harness.verdict import StepEvidence, step


def outcome(comparison) -> str:  # noqa: ANN001
    """A comparison's outcome, as the verdict decides it from the judgements alone."""
    return step(StepEvidence(tuple(c.judgement for c in comparison.checks))).outcome


def test_contract_roundings() -> None:
    x = torch.tensor([1.0 + 2**-12, 1.0 + 2**-9, -3.14159265])
    assert torch.equal(contract("bf16-matmul").round_operand(x), x.to(torch.bfloat16).float())
    assert round_tf32(x)[0] == 1.0 and round_tf32(x)[1] == 1.0 + 2**-9  # 10-bit mantissa
    assert contract("fp32").exact and set(CONTRACTS) == {"fp32", "tf32", "bf16-matmul", "fp16-matmul", "amp-bf16", "amp-fp16"}
    assert not contract("amp-bf16").exact and contract("amp-bf16").amp == torch.bfloat16
    with pytest.raises(ValueError, match="expected one of"):
        contract("fp8")


def test_emulation_rounds_only_the_matmul_family() -> None:
    a, b = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)), torch.randn(8, 8)
    with Emulate(contract("bf16-matmul")):
        mm, add = a @ b, a + b
    assert torch.equal(mm, a.bfloat16().float() @ b.bfloat16().float()) and torch.equal(add, a + b)


def test_three_way_rule() -> None:
    g = torch.Generator().manual_seed(0)
    oracle = torch.randn(4000, generator=g, dtype=torch.float64)
    ref = oracle.float()
    expected = (oracle + 1e-3 * torch.randn(4000, generator=g, dtype=torch.float64)).float()
    within = (oracle + 1e-3 * torch.randn(4000, generator=g, dtype=torch.float64)).float()  # same noise level
    beyond = (oracle + 1e-2 * torch.randn(4000, generator=g, dtype=torch.float64)).float()
    tol = Tolerance()
    ok32 = check_tensor("y", ref, ref, oracle, tol, expected)
    assert ok32.ok and ok32.ok_declared
    c = check_tensor("y", ref, within, oracle, tol, expected)
    assert not c.ok and c.ok_declared and c.rmse_ratio > 1 >= c.declared_ratio
    d = check_tensor("y", ref, beyond, oracle, tol, expected)
    assert not d.ok and not d.ok_declared and d.declared_ratio > 1
    assert outcome(compare_outputs({"y": ref}, {"y": within}, {"y": oracle}, tol, {"y": expected})) == "pass_declared"
    assert outcome(compare_outputs({"y": ref}, {"y": beyond}, {"y": oracle}, tol, {"y": expected})) == "drift"
    assert outcome(compare_outputs({"y": ref}, {"y": within}, {"y": oracle}, tol)) == "drift"  # fp32 declared


def test_op_judge_rule() -> None:
    x = torch.rand(64, dtype=torch.float64) + 0.5
    right = torch.rsqrt(x.float())
    assert judge_output(right, right, torch.rsqrt(x))[0]
    assert not judge_output(right * (1 + 1e-3), right, torch.rsqrt(x))[0]
    assert judge_output(right * (1 + 2**-24), right, torch.rsqrt(x))[0]  # an ulp is rounding, not a bug


# A model that calls the bug's op on real floats, and one that never calls it: default sim settings.
CASES = [
    ("bf16-accumulate", ("llama", "base"), "aten::mean.dim", ("bert", "base")),
    ("softmax-no-max", ("bloom", "causal-lm"), "aten::_softmax", ("llama", "base")),
    ("approx-exp", ("llama", "base"), "aten::rsqrt", ("bert", "base")),
    ("gelu-mixup", ("bert", "base"), "aten::gelu", ("llama", "base")),
]


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict[str, dict]:
    d = tmp_path_factory.mktemp("clean")
    lst = d / "l.csv"
    lst.write_text(LIST_HEADER + list_rows(sorted({c[1] for c in CASES} | {c[3] for c in CASES})))
    s = run_models(load_model_list(str(lst)), RunConfig(jobs=2, timeout_s=300, progress=False), d / "r.db")
    with ResultStore(d / "r.db") as st:
        return {r["model_id"]: r for r in st.results(s.run_id).to_dict("records")}


@pytest.mark.parametrize(("kind", "user", "op", "bystander"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.long
def test_planted_bug_is_drift_localized_to_its_op(tmp_path: Path, clean, kind, user, op, bystander) -> None:
    lst = tmp_path / "l.csv"
    lst.write_text(LIST_HEADER + list_rows([user, bystander]))
    db = tmp_path / "r.db"
    s = run_models(load_model_list(str(lst)), RunConfig(settings={"precision": "default", "ops": "young", "numerics": kind},
                                                     jobs=2, timeout_s=300, progress=False), db)
    with ResultStore(db) as st:
        rows = {r["model_id"]: r for r in st.results(s.run_id).to_dict("records")}
    u, b = rows[f"tiny/{user[0]}/{user[1]}"], rows[f"tiny/{bystander[0]}/{bystander[1]}"]
    assert clean[u["model_id"]]["outcome"] in ("pass", "pass_declared")  # without the bug it is fine
    assert u["outcome"] == "drift" and u["first_drift_op"] == op, (u["outcome"], u["first_drift_op"], u["error_message"])
    assert u["first_drift_op_module"] and u["first_drift_op_inputs"]
    repro = Path(u["repro_path"])
    assert repro.is_file() and repro.with_suffix(".pt").is_file()
    r = subprocess.run([sys.executable, str(repro)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0 and "BEYOND the declared precision" in r.stdout, r.stderr[-2000:]
    from harness.files import safe_name
    from harness.report import build_report

    site = tmp_path / "site"
    build_report(db, site)
    page = (site / "models" / f"{safe_name(u['model_id'])}.html").read_text()
    assert f"../repro/{repro.name}" in page and (site / "repro" / repro.name).is_file()
    c = clean[b["model_id"]]  # a model that never calls the op: bit-for-bit the clean result
    assert (b["outcome"], b["max_abs_err"], b["declared_ratio"]) == (c["outcome"], c["max_abs_err"], c["declared_ratio"])
