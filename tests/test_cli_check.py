"""`portharness check`: one model through the real worker, the verdict, and the exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.sim.opset import PROFILE_DIR


def check(*args: str, timeout: float = 600) -> tuple[int, dict, str]:
    res = subprocess.run(
        [sys.executable, "-m", "harness.cli", "check", *args, "--json"],
        capture_output=True, text=True, timeout=timeout, env=dict(os.environ),
    )
    row = json.loads(res.stdout) if res.stdout.strip().startswith("{") else {}
    return res.returncode, row, res.stderr


def test_bert_passes_at_highest_precision() -> None:
    code, row, err = check("tiny/bert/base", "--precision", "highest")
    assert code == 0, err[-2000:]
    assert row["outcome"] == "pass"
    assert row["max_abs_err"] == 0.0  # highest is bit-exact against the CPU reference


@pytest.mark.long
def test_bert_at_default_precision_is_within_what_sim_declares() -> None:
    code, row, _ = check("tiny/bert/base", "--precision", "default")
    assert code == 0  # pass_declared counts as matched
    assert row["outcome"] == "pass_declared" and row["contract"] == "bf16-matmul"
    assert 0 < row["max_abs_err"] < 0.05  # measurable, but small: bf16-rounded matmul inputs
    assert row["rmse_ratio"] > 1 >= row["declared_ratio"]


@pytest.mark.long
def test_declaring_fp32_on_bf16_hardware_is_drift_and_names_the_first_module() -> None:
    code, row, _ = check("tiny/bert/base", "--precision", "default", "--declared-precision", "fp32")
    assert code == 1
    assert row["outcome"] == "drift" and row["settings"]["declared_precision"] == "fp32"
    assert row["first_drift_module_type"] == "Linear"
    assert row["first_drift_op"] in ("aten::addmm", "aten::mm", "aten::bmm")  # the matmul's own result


@pytest.mark.long
def test_missing_op_is_reported_by_name(tmp_path: Path) -> None:
    # gelu has no device-generic composite: a backend without its kernel cannot run it (layer norm, say,
    # has one: a backend without native_layer_norm still runs it, decomposed)
    ops = [line for line in (PROFILE_DIR / "young.txt").read_text().splitlines() if not line.startswith("aten::gelu")]
    profile = tmp_path / "no-gelu.txt"
    profile.write_text("\n".join(ops) + "\n")
    code, row, _ = check("tiny/bert/base", "--precision", "highest", "--ops", str(profile))
    assert code == 1
    assert row["outcome"] == "unsupported_op"
    assert row["unsupported_op"] == "aten::gelu"
    assert "Could not run 'aten::gelu'" in row["error_message"]


@pytest.mark.long
def test_injected_nan_is_drift_localized_to_a_module() -> None:
    code, row, _ = check("tiny/bert/base", "--precision", "highest", "--fault", "sim:0=nan:1.0")
    assert code == 1
    assert row["outcome"] == "drift"
    assert row["first_drift_module"].startswith("embeddings.")
    assert "non-finite" in row["error_message"]


@pytest.mark.long
def test_flex_attention_is_an_unsupported_op() -> None:
    code, row, _ = check("tiny/llama/causal-lm", "--precision", "highest", "--ops", "full", "--attn", "flex_attention")
    assert code == 1
    assert row["outcome"] == "unsupported_op"
    assert row["unsupported_op"] == "flex_attention"
