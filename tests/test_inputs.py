"""Input generation and output flattening, on real tiny models."""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_outputs import BaseModelOutput

from harness.models.configs import vocab_size
from harness.models.inputs import default_recipe, make_inputs
from harness.models.model_list import ModelEntry
from harness.models.outputs import needs_exact, output_tensors
from harness.models.tiny import build_tiny

_CACHE: dict[tuple[str, str], torch.nn.Module] = {}


def tiny(arch: str, task: str) -> torch.nn.Module:
    if (arch, task) not in _CACHE:
        _CACHE[(arch, task)] = build_tiny(arch, task)
    return _CACHE[(arch, task)]


def entry(arch: str, task: str, **inputs: object) -> ModelEntry:
    return ModelEntry(id=f"tiny/{arch}/{task}", source="tiny", arch=arch, task=task, inputs=dict(inputs))


def run(arch: str, task: str, **inputs: object) -> tuple[dict[str, torch.Tensor], object]:
    model = tiny(arch, task)
    x = make_inputs(model, model.config, entry(arch, task, **inputs), seed=0)
    with torch.no_grad():
        return x, model(**x)


def test_deterministic_per_seed_and_leaves_global_rng_alone() -> None:
    model = tiny("bert", "seq-cls")
    torch.manual_seed(7)
    state = torch.get_rng_state()
    a = make_inputs(model, model.config, entry("bert", "seq-cls"), seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    b = make_inputs(model, model.config, entry("bert", "seq-cls"), seed=3)
    c = make_inputs(model, model.config, entry("bert", "seq-cls"), seed=4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["input_ids"], c["input_ids"])


def test_text_inputs_respect_vocab_padding_and_types() -> None:
    x, out = run("bert", "seq-cls")
    cfg = tiny("bert", "seq-cls").config
    assert set(x) == {"input_ids", "attention_mask", "token_type_ids"}
    ids, mask = x["input_ids"], x["attention_mask"]
    assert ids.shape == (2, 16) and ids.dtype == torch.long
    assert int(ids.max()) < vocab_size(cfg)
    assert mask[0].all() and not mask[1, -4:].any() and mask[1, :-4].all(), "row 1 is padded"
    assert (ids[1, -4:] == cfg.pad_token_id).all()
    real = ids[mask.bool()]
    assert not torch.isin(real, torch.tensor([cfg.pad_token_id])).any(), "no pad ids inside the text"
    assert x["token_type_ids"][:, 8:].eq(1).all() and x["token_type_ids"][:, :8].eq(0).all()
    assert out.logits.shape == (2, 3)


def test_overrides_from_entry() -> None:
    x, _ = run("gpt2", "causal-lm", seq_len=5, batch_size=3, no_padding=True)
    assert x["input_ids"].shape == (3, 5) and x["attention_mask"].all()


def test_special_ids_avoided() -> None:
    model = tiny("llama", "causal-lm")
    x = make_inputs(model, model.config, entry("llama", "causal-lm", seq_len=512), seed=0)
    specials = {model.config.bos_token_id, model.config.eos_token_id}
    assert not torch.isin(x["input_ids"][0], torch.tensor(sorted(specials))).any()


def test_encoder_decoder_gets_decoder_ids() -> None:
    x, out = run("t5", "seq2seq-lm")
    cfg = tiny("t5", "seq2seq-lm").config
    assert x["decoder_input_ids"].shape == (2, 8)
    assert (x["decoder_input_ids"][:, 0] == cfg.decoder_start_token_id).all()
    assert out.logits.shape[:2] == (2, 8)


def test_bart_classification_rows_end_in_eos() -> None:
    x, out = run("bart", "seq-cls")
    eos = tiny("bart", "seq-cls").config.eos_token_id
    assert "decoder_input_ids" not in x
    lengths = x["attention_mask"].sum(-1)
    assert all(int(x["input_ids"][r, lengths[r] - 1]) == eos for r in range(2))
    assert out.logits.shape == (2, 3)


def test_multiple_choice_shape() -> None:
    x, out = run("bert", "multiple-choice")
    assert x["input_ids"].shape == (2, 2, 16) and x["attention_mask"].shape == (2, 2, 16)
    assert out.logits.shape == (2, 2)


def test_layout_bbox() -> None:
    x, _ = run("layoutlm", "token-cls")
    box = x["bbox"]
    assert box.shape == (2, 16, 4)
    assert (box[..., 2] >= box[..., 0]).all() and (box[..., 3] >= box[..., 1]).all()
    assert int(box.max()) < tiny("layoutlm", "token-cls").config.max_2d_position_embeddings


def test_image_inputs() -> None:
    x, out = run("vit", "image-cls")
    cfg = tiny("vit", "image-cls").config
    assert x["pixel_values"].shape == (2, cfg.num_channels, cfg.image_size, cfg.image_size)
    assert out.logits.shape == (2, 3)


def test_dual_encoder_gets_both_modalities() -> None:
    model = tiny("clip", "base")
    assert default_recipe(model, model.config) == "text+image"
    x, out = run("clip", "base")
    assert {"input_ids", "pixel_values", "attention_mask"} <= set(x)
    assert out.logits_per_image.shape == (2, 2)


def test_video_inputs() -> None:
    x, out = run("videomae", "video-cls")
    assert x["pixel_values"].dim() == 5
    assert out.logits.shape == (2, 3)


@pytest.mark.parametrize("arch, task, name, rank", [
    ("wav2vec2", "ctc", "input_values", 2),
    ("whisper", "speech-seq2seq", "input_features", 3),
    ("speech_to_text", "speech-seq2seq", "input_features", 3),
])
def test_audio_inputs(arch: str, task: str, name: str, rank: int) -> None:
    x, out = run(arch, task)
    assert x[name].dim() == rank and x[name].is_floating_point()
    assert torch.isfinite(output_tensors(out)["logits"]).all()


def test_whisper_features_fill_the_encoder() -> None:
    cfg = tiny("whisper", "speech-seq2seq").config
    x, _ = run("whisper", "speech-seq2seq")
    assert x["input_features"].shape == (2, cfg.num_mel_bins, 2 * cfg.max_source_positions)


def test_recipe_override_and_unknown_recipe() -> None:
    x, _ = run("encodec", "base", recipe="audio-3d", audio_len=3200)
    assert x["input_values"].shape == (2, 1, 3200)
    model = tiny("bert", "base")
    with pytest.raises(ValueError, match="unknown input recipe"):
        make_inputs(model, model.config, entry("bert", "base", recipe="smell"))


def test_time_series() -> None:
    x, out = run("time_series_transformer", "base")
    assert {"past_values", "past_time_features", "past_observed_mask"} <= set(x)
    assert torch.isfinite(out.last_hidden_state).all()


def test_output_tensors_flattens_nested_outputs() -> None:
    model = tiny("bert", "base")
    x = make_inputs(model, model.config, entry("bert", "base"))
    with torch.no_grad():
        out = model(**x, output_hidden_states=True)
    flat = output_tensors(out)
    assert "last_hidden_state" in flat and "pooler_output" in flat
    n_layers = model.config.num_hidden_layers
    assert [k for k in flat if k.startswith("hidden_states.")] == [f"hidden_states.{i}" for i in range(n_layers + 1)]


def test_output_tensors_structures_and_exactness() -> None:
    t = torch.ones(2)
    ids = torch.arange(3)
    out = output_tensors({
        "a": t, "skip": None, "text": "x", "n": 3,
        "pair": (t, [ids, None]),
        "model_output": BaseModelOutput(last_hidden_state=t),
    })
    assert set(out) == {"a", "pair.0", "pair.1.0", "model_output.last_hidden_state"}
    assert needs_exact(out["pair.1.0"]) and not needs_exact(out["a"])
    assert needs_exact(torch.tensor([True])) and not needs_exact(torch.zeros(1, dtype=torch.complex64))
    assert output_tensors(t) == {"output": t}
    assert set(output_tensors((t, t))) == {"0", "1"}


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl", "idefics3"])
def test_vlm_inputs_carry_one_image_token_per_feature(arch: str) -> None:
    model = tiny(arch, "image-text-to-text")
    assert default_recipe(model, model.config) == "vlm"
    x, out = run(arch, "image-text-to-text")
    image_token = model.config.image_token_id
    n_img = int((x["input_ids"][0] == image_token).sum())
    assert n_img > 0 and (x["input_ids"] == image_token).sum(-1).tolist() == [n_img, n_img]
    assert x["attention_mask"].shape == x["input_ids"].shape
    assert out.logits.shape[:2] == x["input_ids"].shape


def test_patches_recipe_for_standalone_vision_towers() -> None:
    x, out = run("qwen2_5_vl_vision", "base")
    assert set(x) == {"hidden_states", "grid_thw"} and x["grid_thw"].tolist() == [[1, 8, 8], [1, 8, 8]]
    assert x["hidden_states"].shape[0] == 2 * 8 * 8
    assert torch.isfinite(output_tensors(out)["last_hidden_state"]).all()


def test_audio_spectrogram_recipe() -> None:
    x, out = run("audio-spectrogram-transformer", "audio-cls")
    cfg = tiny("audio-spectrogram-transformer", "audio-cls").config
    assert x["input_values"].shape == (2, cfg.max_length, cfg.num_mel_bins)
    assert out.logits.shape == (2, 3)
