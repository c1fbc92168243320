"""Checkpoints as people save them, through the real loader and the real `check`: sharded safetensors,
a bf16 checkpoint (`--dtype`), the head a local dir was saved with, and the real-size path (one copy of
the weights moved to the device, the streamed fp64 oracle, the sampled op check) on a small model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.models.load import load_model
from harness.models.model_list import ModelEntry, find_entry
from harness.models.tiny import build_tiny
from harness.phases import PHASES
from harness.run import modes, oracle, pipeline
from harness.run.pipeline import Task, run_one


def check(*args: str) -> tuple[int, dict]:
    r = subprocess.run([sys.executable, "-m", "harness.cli", "check", *args, "--json"],
                       capture_output=True, text=True, timeout=600)
    start = r.stdout.find("{")
    assert start >= 0, r.stderr[-3000:]
    return r.returncode, json.loads(r.stdout[start:])


@pytest.fixture(scope="module")
def gpt2() -> torch.nn.Module:
    return build_tiny("gpt2", "causal-lm", seed=0)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory, gpt2: torch.nn.Module) -> Path:
    d = tmp_path_factory.mktemp("gpt2-sharded")
    gpt2.save_pretrained(d, max_shard_size="100KB")
    return d


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory, gpt2: torch.nn.Module) -> Path:
    d = tmp_path_factory.mktemp("gpt2-bf16")
    build_tiny("gpt2", "causal-lm", seed=0).to(torch.bfloat16).save_pretrained(d)
    return d


def test_sharded_safetensors_load_exactly(sharded: Path, gpt2: torch.nn.Module) -> None:
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) > 1 and (sharded / "model.safetensors.index.json").is_file()
    entry = find_entry(str(sharded))
    assert entry.source == "local" and entry.task == "causal-lm"  # the head it was saved with
    loaded = load_model(entry)
    want = gpt2.state_dict()
    got = loaded.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_task_override_and_unknown_heads(sharded: Path) -> None:
    assert find_entry(str(sharded), task="base").task == "base"


def test_bf16_checkpoint_loads_as_asked(bf16_dir: Path) -> None:
    entry = find_entry(str(bf16_dir))
    dtypes = {name: {p.dtype for p in load_model(entry, dtype=name).model.parameters()}
              for name in (None, "auto", "fp16")}
    assert dtypes == {None: {torch.float32}, "auto": {torch.bfloat16}, "fp16": {torch.float16}}
    with pytest.raises(ValueError, match="--dtype 'int8'"):
        load_model(entry, dtype="int8")


@pytest.mark.long
def test_check_a_sharded_checkpoint_records_every_phase(sharded: Path) -> None:
    rc, row = check(str(sharded), "--target", "sim:1", "--precision", "highest", "--ops", "full")
    assert (rc, row["outcome"]) == (0, "pass"), row.get("error_message")
    assert row["task"] == "causal-lm" and row["oracle"] == "fp64-copy"
    assert [p for p in PHASES if p in row["phases"]] == ["load", "reference", "oracle", "target", "compare"]
    for p in row["phases"].values():
        assert p["s"] >= 0 and p["peak_rss_mb"] > 100
    assert row["ops_checked"] > 30 and row["ops_sampled_out"] is None  # small: every call judged


@pytest.mark.long
def test_check_a_bf16_checkpoint_with_dtype_auto(bf16_dir: Path) -> None:
    rc, row = check(str(bf16_dir), "--target", "sim:1", "--dtype", "auto")
    assert row["settings"]["dtype"] == "auto"  # part of the run's identity
    assert row["outcome"] in ("pass", "pass_declared"), row.get("error_message")
    assert rc == 0
    bad = subprocess.run([sys.executable, "-m", "harness.cli", "check", str(bf16_dir), "--dtype", "int4"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--dtype" in bad.stderr


@pytest.fixture
def as_real_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Treat every model as a real checkpoint: in-place move, streamed oracle, sampled op check."""
    monkeypatch.setattr(oracle, "COPY_MAX_PARAMS", 0)
    monkeypatch.setattr(pipeline, "COPY_MAX_PARAMS", 0)


def _task(**settings: object) -> Task:
    entry = ModelEntry(id="tiny/gpt2/causal-lm", source="tiny", arch="gpt2", task="causal-lm")
    return Task(entry=entry.__dict__, target="sim:1", settings={"precision": "highest", "ops": "full", **settings})


def test_real_size_path_gives_the_small_models_verdict(as_real_size: None) -> None:
    import harness.sim  # noqa: F401  (the sim device in this process)

    sampled = run_one(_task())
    assert sampled.outcome == "pass" and sampled.oracle == "fp64-streamed"
    assert sampled.ops_sampled_out and sampled.ops_checked
    every = run_one(_task(op_check="all"))
    assert every.outcome == "pass" and every.ops_sampled_out is None
    assert every.ops_checked == sampled.ops_checked + sampled.ops_sampled_out  # nothing lost, only sampled


def test_real_size_path_still_catches_and_names_a_kernel_bug(as_real_size: None) -> None:
    import harness.sim  # noqa: F401

    entry = ModelEntry(id="tiny/bert/masked-lm", source="tiny", arch="bert", task="masked-lm")
    m = run_one(Task(entry=entry.__dict__, target="sim:1", settings={"ops": "full", "numerics": "gelu-mixup"}))
    assert m.outcome == "drift" and m.first_drift_op == "aten::gelu"
    assert m.first_drift_op_module == "bert.encoder.layer.0.intermediate.intermediate_act_fn"
    assert m.first_drift_module == ""  # module localization needs a second copy: small models only


def test_streamed_oracle_matches_the_fp64_copy(gpt2: torch.nn.Module) -> None:
    from harness.models.inputs import make_inputs

    inputs = make_inputs(gpt2, gpt2.config, ModelEntry(id="g", source="tiny", arch="gpt2", task="causal-lm"))
    copy_out, rule_copy, _ = oracle.fp64_outputs(gpt2, inputs, modes.forward)
    saved = oracle.COPY_MAX_PARAMS
    try:
        oracle.COPY_MAX_PARAMS = 0
        stream_out, rule_stream, model64 = oracle.fp64_outputs(gpt2, inputs, modes.forward)
    finally:
        oracle.COPY_MAX_PARAMS = saved
    assert (rule_copy, rule_stream, model64) == ("fp64-copy", "fp64-streamed", None)
    assert all(p.dtype == torch.float32 for p in gpt2.parameters())  # streamed: the weights stay fp32
    for k, v in copy_out.items():
        assert stream_out[k].dtype == torch.float64
        torch.testing.assert_close(stream_out[k], v, rtol=1e-12, atol=1e-12)


def test_oracle_budget_falls_back_and_says_so() -> None:
    import harness.sim  # noqa: F401

    m = run_one(_task(oracle_max_params=1000))
    assert m.oracle.startswith("none (") and "--oracle-max-params" in m.oracle
    assert m.outcome == "pass"  # judged by the allclose/cosine fallback
