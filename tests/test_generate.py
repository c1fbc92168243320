"""Generate mode: greedy decoding with a KV cache through transformers' generate(), teacher-forced along
the reference's tokens and judged step by step on the real sim device, through the real CLI and runner;
sim's planted cache bug caught at the step it starts, and nothing else touched by it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import LIST_HEADER, list_rows

from harness.cli import main as cli_main
from harness.fleet.runner import RunConfig, run_models
from harness.models.inputs import make_inputs
from harness.models.model_list import ModelEntry, load_model_list
from harness.models.tiny import build_tiny
from harness.outcomes import headline
from harness.results.rows import step_output
from harness.results.store import ResultStore
from harness.run.generate import TeacherForced, agreement, decode, prompt

STEPS = {step_output(k) for k in range(8)}


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if (not k.startswith("PORTHARNESS_") or k == "PORTHARNESS_SIM_NAMESPACE")}
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, timeout=600,
                          env=env)


def run(tmp_path: Path, pairs: list[tuple[str, str]], **settings: str) -> dict[str, dict]:
    lst = tmp_path / "l.csv"
    lst.write_text(LIST_HEADER + list_rows(pairs))
    db = tmp_path / "r.db"
    config = RunConfig(settings={"precision": "default", "ops": "young", "mode": "generate", **settings}, jobs=2,
                       retries=0, progress=False)
    run_models(load_model_list(str(lst)), config, db, list_name="generate")
    with ResultStore(db) as store:
        return {r["model_id"]: r for r in store.results().to_dict("records")}


@pytest.mark.long
def test_check_gpt2_decodes_eight_steps_judged_one_by_one() -> None:
    r = cli("check", "tiny/gpt2/causal-lm", "--target", "sim", "--mode", "generate", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads(r.stdout[r.stdout.find("{"):])
    assert row["outcome"] in ("pass", "pass_declared") and row["settings"]["mode"] == "generate"
    assert set(row["metrics"]) == STEPS and row["metrics"][step_output(7)]["shape"][0] == 2  # batch of 2 rows
    assert all(m["ok_declared"] for m in row["metrics"].values())
    assert (row["new_tokens"], row["tokens_matched"], row["first_divergent_step"]) == (8, 8, None)
    assert row["target_tokens"] == row["ref_tokens"] and len(row["ref_tokens"][0]) == 8
    assert row["first_drift_step"] is None and row["divergence"] == ""


@pytest.mark.long
def test_seq2seq_vision_text_and_a_model_without_a_generation_head(tmp_path: Path) -> None:
    rows = run(tmp_path, [("t5", "seq2seq-lm"), ("llava", "image-text-to-text"), ("bert", "masked-lm")])
    for m in ("tiny/t5/seq2seq-lm", "tiny/llava/image-text-to-text"):
        assert rows[m]["outcome"] in ("pass", "pass_declared"), rows[m]["error_message"]
        assert set(rows[m]["metrics"]) == STEPS and rows[m]["tokens_matched"] == 8
    bert = rows["tiny/bert/masked-lm"]
    assert bert["outcome"] == "skipped" and "no generation head" in bert["error_message"]
    counts = {"pass": 2, "skipped": 1}
    assert headline(counts)["tested"] == 2  # a skipped model is not in the denominator


def test_planted_cache_bug_is_caught_at_its_step_on_the_static_cache(tmp_path: Path) -> None:
    """Step 0 (the prompt) and step 1 clean, step 2 on drift: the row names step 2, the cache path and the
    index_copy_ kernel; where every step's logits stay inside the declared envelope (BLOOM's), the failing
    kernel names the step it ran in; a model whose generate() keeps its own cache cannot take a StaticCache:
    skipped."""
    rows = run(tmp_path, [("gpt2", "causal-lm"), ("t5", "seq2seq-lm"), ("bloom", "causal-lm"), ("rwkv", "causal-lm")],
               cache="static", numerics="cache-off-by-one")
    for m in ("tiny/gpt2/causal-lm", "tiny/t5/seq2seq-lm", "tiny/bloom/causal-lm"):
        row = rows[m]
        assert (row["outcome"], row["first_drift_step"], row["first_drift_op"]) == ("drift", 2, "aten::index_copy_")
        assert "step 2 (step 0 clean: the cache path)" in row["error_message"]
        ok = {k: row["metrics"][step_output(k)]["ok_declared"] for k in range(8)}
        if m == "tiny/bloom/causal-lm":
            assert all(ok.values()) and "the kernel ran in step 2" in row["error_message"], row["error_message"]
        else:
            assert ok[0] and ok[1] and not ok[2], ok
    rwkv = rows["tiny/rwkv/causal-lm"]
    assert rwkv["outcome"] == "skipped" and "not a StaticCache" in rwkv["error_message"]


def _llama() -> tuple[torch.nn.Module, dict]:
    model = build_tiny("llama", "causal-lm", seed=0).eval()
    entry = ModelEntry(id="tiny/llama/causal-lm", source="tiny", arch="llama", task="causal-lm")
    return model, prompt(model, make_inputs(model, model.config, entry))


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_the_cache_bug_changes_nothing_before_its_step_and_no_single_forward(cache: str) -> None:
    import copy

    import harness.sim as sim

    model, inputs = _llama()
    tokens = decode(model, inputs, 5, cache).tokens
    tmodel = copy.deepcopy(model).to("sim:1")  # not the current device: the planted kernels keep to the model's
    tinputs = {k: v.to("sim:1") for k, v in inputs.items()}
    step = TeacherForced(5, cache, tokens)
    with torch.no_grad():
        clean, forward = step(tmodel, tinputs), tmodel(**tinputs).logits.cpu()
        sim.reset_numerics_hits()
        with sim.numerics_bugs("cache-off-by-one"):
            bugged, forward_bugged = step(tmodel, tinputs), tmodel(**tinputs).logits.cpu()
    same = {k: torch.equal(clean[step_output(k)], bugged[step_output(k)]) for k in range(5)}
    assert same == {0: True, 1: True, 2: False, 3: False, 4: False}
    assert torch.equal(forward, forward_bugged)  # a single forward writes its cache in one piece: untouched
    assert set(sim.numerics_hits()) == {"aten::index_copy_" if cache == "static" else "aten::cat"}


def test_free_running_divergence_is_a_near_tie_inside_the_envelope_and_a_bug_outside() -> None:
    ref_tokens = torch.tensor([[5, 6, 7], [1, 2, 3]])
    target = torch.tensor([[5, 6, 7], [1, 9, 3]])  # row 1 flips at step 1
    logits = torch.zeros(2, 16)
    logits[1, 2], logits[1, 9] = 1.0, 0.999  # the reference's top two at row 1, step 1: margin 1e-3
    ref = {step_output(k): logits for k in range(3)}
    oracle = {k: v.double() for k, v in ref.items()}
    expected = {k: v + 0.01 for k, v in ref.items()}  # the declared precision moves logits by 1e-2
    got = agreement(ref_tokens, target, ref, oracle, expected, floor=1e-4)
    assert (got["tokens_matched"], got["first_divergent_step"], got["divergence"]) == (1, 1, "near-tie")
    assert got["divergence_margin"] == pytest.approx(1e-3, rel=1e-3)
    assert got["divergence_envelope"] == pytest.approx(2 * (3 * 0.01 + 1e-4), rel=1e-3)  # m = 3: 32 logits
    exact = agreement(ref_tokens, target, ref, oracle, None, floor=1e-4)  # fp32 contract: no room for a flip
    assert exact["divergence"] == "bug" and exact["divergence_envelope"] == pytest.approx(2e-4)
    beyond = agreement(ref_tokens, target, ref, oracle, expected, floor=1e-4, step_ok={step_output(1): False})
    assert beyond["divergence"] == "bug"  # a small margin, but the step's own logits are beyond the bound
    same = agreement(ref_tokens, ref_tokens, ref, oracle, expected, floor=1e-4)
    assert (same["tokens_matched"], same["first_divergent_step"], same.get("divergence")) == (3, None, None)


def test_a_decoder_only_prompt_is_left_padded_and_decoding_is_deterministic() -> None:
    model, inputs = _llama()
    mask = inputs["attention_mask"]
    assert mask[1, 0] == 0 and mask[1, -1] == 1 and mask[0].all()  # row 1's padding moved to the front
    a, b = decode(model, inputs, 3, "dynamic"), decode(model, inputs, 3, "static")
    assert a.cache_kind == "DynamicCache" and b.cache_kind == "StaticCache"
    assert torch.equal(a.tokens, b.tokens) and len(a.logits) == 3 and a.logits[0].shape == (2, model.config.vocab_size)
    forced = TeacherForced(3, "dynamic", a.tokens)(model, inputs)
    assert all(torch.equal(forced[step_output(k)], a.logits[k]) for k in range(3))


@pytest.mark.long
def test_check_of_a_model_without_a_generation_head_says_skipped_and_why() -> None:
    r = cli("check", "tiny/bert/masked-lm", "--mode", "generate")
    assert r.returncode == 0, r.stderr[-2000:]  # skipped, not failed
    assert "skipped" in r.stdout and "BertForMaskedLM has no generation head" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--cache", "static"], "--cache: only with --mode generate"),
    (["--mode", "generate", "--new-tokens", "0"], "--new-tokens 0: must be between 1 and 1024"),
])
def test_generate_options_are_checked_before_anything_runs(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                          args: list[str], message: str) -> None:
    # in-process: the options are refused before any model, worker or DB (the CLI's own process start is
    # covered above)
    assert cli_main(["check", "tiny/gpt2/causal-lm", "--db", str(tmp_path / "r.db"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r.db").exists()
