"""The real runner over the smoke list (50+ architectures, every modality) on the real `sim` device.

The full tiny zoo (1,400+ models) is the `slow` test at the bottom and `portharness run --list tiny-zoo`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.fleet.runner import RunConfig, run_models
from harness.models.model_list import load_model_list
from harness.results.store import ResultStore

EXPECTED = Path(__file__).resolve().parents[1] / "model_lists" / "expected"


def _run(tmp_path: Path, list_name: str, settings: dict, jobs: int = 2) -> tuple[list, list[dict]]:
    entries = load_model_list(list_name)
    db = tmp_path / f"{list_name}.db"
    summary = run_models(entries, RunConfig(settings=settings, jobs=jobs, timeout_s=600, progress=False), db,
                         list_name=list_name)
    assert summary.unfinished == 0
    # The committed expected file of this configuration stays true: a change that moves an outcome
    # updates it in the same commit (portharness baseline update).
    gate = subprocess.run([sys.executable, "-m", "harness.cli", "baseline", "check", "--db", str(db),
                           "--expected-dir", str(EXPECTED)], capture_output=True, text=True, timeout=120)
    assert gate.returncode == 0, gate.stdout[-3000:] + gate.stderr[-2000:]
    with ResultStore(db) as store:
        return entries, store.results(summary.run_id).to_dict("records")


def test_smoke_list_is_bit_exact_on_sim_at_highest_precision(tmp_path: Path) -> None:
    entries, rows = _run(tmp_path, "smoke", {"precision": "highest", "ops": "full"})
    assert len({e.arch for e in entries}) >= 50
    assert sorted(r["model_id"] for r in rows) == sorted(e.id for e in entries)  # one row per model
    by_outcome: dict[str, list[str]] = {}
    for r in rows:
        by_outcome.setdefault(r["outcome"], []).append(r["model_id"])
    # With every op allowed and true fp32, sim must reproduce the CPU reference: anything else is a
    # bug in the backend (or the harness), never "expected drift".
    assert not by_outcome.get("drift"), by_outcome.get("drift")
    assert not by_outcome.get("crash"), [(r["model_id"], r["error_message"][:200]) for r in rows
                                         if r["outcome"] == "crash"]
    assert len(by_outcome.get("pass", [])) >= 0.9 * len(rows), {k: len(v) for k, v in by_outcome.items()}


@pytest.mark.long
def test_smoke_list_on_the_young_default_backend(tmp_path: Path) -> None:
    """Default sim settings: bf16 matmul operands are what sim declares, so models leave the fp32 envelope
    but stay inside the declared one (pass_declared, never drift); the partial op set blocks some models."""
    entries, rows = _run(tmp_path, "smoke", {"precision": "default", "ops": "young"})
    assert len(rows) == len(entries)
    outcomes = {r["outcome"] for r in rows}
    assert "pass_declared" in outcomes and "drift" not in outcomes, [r["model_id"] for r in rows if r["outcome"] == "drift"]
    for r in rows:
        if r["outcome"] == "pass_declared":
            assert r["rmse_ratio"] is None or r["rmse_ratio"] > 1
            assert r["contract"] == "bf16-matmul" and r["ops_checked"] > 0
        if r["outcome"] == "unsupported_op":
            assert r["unsupported_op"].startswith("aten::") or r["unsupported_op"] == "flex_attention"


@pytest.mark.long
def test_smoke_list_in_train_mode(tmp_path: Path) -> None:
    """One training step per model at default settings: gradients and updates stay inside the declared
    precision; what fails is a missing (backward) op, named."""
    entries, rows = _run(tmp_path, "smoke", {"precision": "default", "ops": "young", "mode": "train"})
    assert len(rows) == len(entries)
    assert {r["outcome"] for r in rows} <= {"pass", "pass_declared", "unsupported_op"}, [
        (r["model_id"], r["outcome"]) for r in rows if r["outcome"] not in ("pass", "pass_declared", "unsupported_op")]
    assert all(r["grad_worst_ratio"] is not None and r["loss_kind"] for r in rows if r["outcome"] == "pass_declared")


@pytest.mark.slow
def test_smoke_list_in_generate_mode(tmp_path: Path) -> None:
    """Greedy decoding of 8 tokens per generative model at default settings, judged step by step: every
    step inside the declared precision; the models without a generation head skipped, with the reason.
    (The default suite decodes a few models in tests/test_generate.py.)"""
    entries, rows = _run(tmp_path, "smoke", {"precision": "default", "ops": "young", "mode": "generate"})
    assert len(rows) == len(entries)
    assert {r["outcome"] for r in rows} <= {"pass", "pass_declared", "unsupported_op", "skipped"}, [
        (r["model_id"], r["outcome"]) for r in rows if r["outcome"] not in ("pass", "pass_declared", "unsupported_op",
                                                                            "skipped")]
    ran = [r for r in rows if r["outcome"] in ("pass", "pass_declared")]
    assert len(ran) >= 20 and all(r["new_tokens"] == 8 and r["tokens_matched"] is not None for r in ran)
    assert all("generation head" in r["error_message"] for r in rows if r["outcome"] == "skipped")


@pytest.mark.slow
def test_smoke_list_compiled_with_inductor_on_sim(tmp_path: Path) -> None:
    """Inductor's generated code on sim over smoke (minutes cold on two cores): no compiled drift (the graph
    check judges every node of the compiled graphs); every row that does not run also fails eagerly on sim,
    so none is the compiler's; graph breaks are counted with their reasons."""
    entries, rows = _run(tmp_path, "smoke", {"precision": "default", "ops": "young", "compile": "inductor"})
    assert len(rows) == len(entries)
    bad = [(r["model_id"], r["outcome"], r["eager_outcome"]) for r in rows if r["outcome"] not in ("pass", "pass_declared")]
    assert all(outcome != "drift" and eager not in ("", "pass", "pass_declared") for _, outcome, eager in bad), bad
    compiled = [r for r in rows if r["outcome"] in ("pass", "pass_declared")]
    assert all(r["graph_count"] and r["compile_s"] is not None for r in compiled)
    assert all(len(r["graph_break_reasons"]) == min(3, r["graph_breaks"]) for r in compiled if r["graph_breaks"])


@pytest.mark.slow
def test_full_tiny_zoo(tmp_path: Path) -> None:
    entries, rows = _run(tmp_path, "tiny-zoo", {"precision": "default", "ops": "young"})
    assert len(entries) >= 1000
    assert sorted(r["model_id"] for r in rows) == sorted(e.id for e in entries)
