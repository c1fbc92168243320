"""The tiny zoo: config shrinking, candidate checks, the isolated pool, the committed list."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from harness.fleet import zoo
from harness.models import heads, shrink, tiny
from harness.models.configs import find_attr
from harness.models.model_list import load_model_list

SAMPLE = ["bert", "gpt2", "llama", "t5", "whisper", "vit", "swin", "resnet", "qwen2_vl", "deepseek_v3",
          "gemma3", "mixtral", "wav2vec2", "clip", "mamba2"]


def walk(config: Any) -> list[Any]:
    from transformers import PretrainedConfig

    out = [config]
    for key in config.sub_configs or {}:
        sub = getattr(config, key, None)
        if isinstance(sub, PretrainedConfig):
            out.extend(walk(sub))
    return out


@pytest.mark.parametrize("model_type", SAMPLE)
def test_shrink_config_is_small_and_valid(model_type: str) -> None:
    config = tiny.shrink_config(model_type)
    for cfg in walk(config):
        for name in ("hidden_size", "d_model", "n_embd", "intermediate_size"):
            value = getattr(cfg, name, None)
            if isinstance(value, int):
                assert value <= shrink.INTERMEDIATE, (cfg.model_type, name, value)
        for name in ("num_hidden_layers", "num_layers", "n_layer", "encoder_layers", "decoder_layers"):
            value = getattr(cfg, name, None)
            if isinstance(value, int):
                assert value <= 4, (cfg.model_type, name, value)
        vocab = getattr(cfg, "vocab_size", None)
        if isinstance(vocab, int):
            assert vocab <= shrink.VOCAB
            for key, value in vars(cfg).items():
                if key.endswith(("token_id", "token_index")) and isinstance(value, int):
                    assert value < shrink.VOCAB, (cfg.model_type, key, value)
    assert tiny.count_params("base", config) < zoo.MAX_PARAMS


def test_shrink_is_deterministic() -> None:
    assert tiny.shrink_config("qwen2_vl").to_dict() == tiny.shrink_config("qwen2_vl").to_dict()


def test_shrink_keeps_every_layer_kind() -> None:
    """gemma3 alternates 5 sliding layers with 1 full one; both kinds must survive shrinking."""
    text = tiny.shrink_config("gemma3").text_config
    assert set(text.layer_types) == {"sliding_attention", "full_attention"}
    assert len(text.layer_types) == text.num_hidden_layers


def test_shrink_rescales_dependent_fields() -> None:
    mla = tiny.shrink_config("deepseek_v3")
    assert mla.head_dim == mla.qk_rope_head_dim and mla.qk_head_dim == mla.qk_nope_head_dim + mla.qk_rope_head_dim
    vl = tiny.shrink_config("qwen2_vl").text_config
    assert sum(vl.rope_parameters["mrope_section"]) == vl.hidden_size // vl.num_attention_heads // 2
    m2 = tiny.shrink_config("mamba2")
    assert m2.num_heads * m2.head_dim == m2.expand * m2.hidden_size
    assert find_attr(tiny.shrink_config("llava"), "image_token_id", "image_token_index") < shrink.VOCAB


def test_candidates_come_from_the_registry() -> None:
    cands = heads.candidates()
    assert len(cands) > 1500 and cands == sorted(set(cands))
    assert ("bert", "masked-lm") in cands and ("whisper", "speech-seq2seq") in cands
    assert {task for _, task in cands} <= set(heads.HEADS)


@pytest.mark.parametrize("model_type, task", [("bert", "qa"), ("wav2vec2", "ctc"), ("encodec", "base")])
def test_check_candidate(model_type: str, task: str) -> None:
    res = zoo.check_candidate(model_type, task)
    assert res["status"] == "ok", res
    assert res["params"] < zoo.MAX_PARAMS and res["forward_s"] >= 0
    entry = zoo.result_to_entry(res)
    assert entry.id == f"tiny/{model_type}/{task}" and entry.source == "tiny"


def test_check_candidate_rejects_monsters() -> None:
    res = zoo.check_candidate("bert", "base", max_params=1000)
    assert res["status"] == "too-big"


# pathological candidates for the pool: module-level so spawned workers can import them
def fake_check(model_type: str, task: str) -> dict[str, Any]:
    if model_type == "segfault":
        os._exit(139)
    if model_type == "hang":
        time.sleep(60)
    if model_type == "hog":
        hog = bytearray(1500 * 2**20)
        for i in range(0, len(hog), 4096):
            hog[i] = 1
        time.sleep(60)
    if model_type == "raise":
        raise RuntimeError("boom")
    return {"arch": model_type, "task": task, "status": "ok"}


@pytest.mark.long
def test_pool_survives_crashes_hangs_and_memory_hogs() -> None:
    items = [("ok1", "base"), ("segfault", "base"), ("hang", "base"), ("hog", "base"), ("raise", "base"),
             ("ok2", "base")]
    results = zoo.run_candidates(items, jobs=2, timeout_s=8, max_rss_mb=900, tasks_per_child=2,
                                 progress=False, check=fake_check)
    status = {r["arch"]: r["status"] for r in results}
    assert status == {"ok1": "ok", "segfault": "crash", "hang": "timeout", "hog": "memory", "raise": "crash",
                      "ok2": "ok"}


def test_generate_writes_a_loadable_list(tmp_path: Path) -> None:
    out = tmp_path / "zoo.csv"
    counts = zoo.generate(out, jobs=1, only=["bert/masked-lm", "vit/image-cls", "gpt2/base"])
    assert counts["candidates"] == 3 and counts["kept"] == 3
    entries = load_model_list(str(out))
    assert [e.id for e in entries] == ["tiny/bert/masked-lm", "tiny/gpt2/base", "tiny/vit/image-cls"]
    assert {e.modality for e in entries} == {"text", "vision"}


def test_committed_zoo_is_consistent() -> None:
    entries = load_model_list("tiny-zoo")
    assert len(entries) >= 1000
    cands = set(heads.candidates())
    for e in entries:
        assert e.id == f"tiny/{e.arch}/{e.task}" and (e.arch, e.task) in cands
    assert [e.id for e in entries] == sorted(e.id for e in entries)
    assert len({e.arch for e in entries}) >= 300


@pytest.mark.slow
def test_full_zoo_generation_reproduces_the_committed_list(tmp_path: Path) -> None:
    out = tmp_path / "tiny-zoo.csv"
    counts = zoo.generate(out, jobs=os.cpu_count() or 2)
    assert counts["kept"] >= 1000
    fresh = {e.id for e in load_model_list(str(out))}
    committed = {e.id for e in load_model_list("tiny-zoo")}
    assert len(fresh ^ committed) <= 0.02 * len(committed), sorted(fresh ^ committed)[:20]
