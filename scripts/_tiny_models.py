"""Tiny transformers models plus matching inputs, shared by the sim scripts (profile builder, benchmark).

Why not the runner's model lists: these scripts must be reproducible on their own, from nothing but
torch + transformers, so the models are built from ``AutoConfig.for_model(model_type)`` with every
size shrunk (by ``harness.zoo.shrink_config`` when that module exists, otherwise by the small
fallback below), with seeded random weights, and fed seeded random inputs of the right kind.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

BATCH = 2
SEQ = 8
AUDIO_SAMPLES = 8000


def shrunk_config(model_type: str) -> Any:
    """A tiny config for `model_type`: ``harness.zoo.shrink_config`` if present, else a few fixed sizes."""
    try:
        from harness.models.zoo import shrink_config
    except ImportError:
        shrink_config = None
    if shrink_config is not None:
        return shrink_config(model_type)
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type)
    for key, value in {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1024,
        "d_model": 64,
        "d_ff": 128,
        "num_layers": 2,
        "encoder_layers": 2,
        "decoder_layers": 2,
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "image_size": 64,
        "patch_size": 8,
    }.items():
        if isinstance(getattr(cfg, key, None), int):
            setattr(cfg, key, value)
    return cfg


_AUTO = {
    "base": "AutoModel",
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "seq-cls": "AutoModelForSequenceClassification",
    "token-cls": "AutoModelForTokenClassification",
    "qa": "AutoModelForQuestionAnswering",
    "multiple-choice": "AutoModelForMultipleChoice",
    "image-cls": "AutoModelForImageClassification",
    "semantic-seg": "AutoModelForSemanticSegmentation",
    "ctc": "AutoModelForCTC",
    "audio-cls": "AutoModelForAudioClassification",
    "speech-seq2seq": "AutoModelForSpeechSeq2Seq",
    "depth": "AutoModelForDepthEstimation",
    "backbone": "AutoBackbone",
}


def auto_class(task: str) -> Any:
    """The Auto class for a head name (``harness.zoo.auto_class`` when that module exists)."""
    try:
        from harness.models.zoo import auto_class as zoo_auto_class
    except ImportError:
        import transformers

        return getattr(transformers, _AUTO[task])
    return zoo_auto_class(task)


def build(model_type: str, task: str, seed: int = 0) -> torch.nn.Module:
    """The shrunk `model_type` with the `task` head, seeded random weights, in eval mode, on CPU."""
    cfg = shrunk_config(model_type)
    torch.manual_seed(seed)
    return auto_class(task).from_config(copy.deepcopy(cfg)).eval()


def _sub(cfg: Any, *names: str) -> Any:
    for n in names:
        sub = getattr(cfg, n, None)
        if sub is not None:
            return sub
    return cfg


def _get(cfg: Any, names: tuple[str, ...], default: int) -> int:
    for n in names:
        v = getattr(cfg, n, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        if isinstance(v, (list, tuple)) and v and isinstance(v[0], int):
            return v[0]
    return default


def make_inputs(model: torch.nn.Module, task: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded CPU inputs for one forward of `model` (text ids, pixels, waveforms or log-mel features)."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    main = getattr(model, "main_input_name", "input_ids")
    out: dict[str, torch.Tensor] = {}
    if main == "input_ids":
        text = _sub(cfg, "text_config")
        vocab = _get(text, ("vocab_size",), 1024)
        shape = (BATCH, 2, SEQ) if task == "multiple-choice" else (BATCH, SEQ)
        out["input_ids"] = torch.randint(4, max(5, min(vocab, 1000)), shape, generator=g)
        out["attention_mask"] = torch.ones(shape, dtype=torch.long)
        if getattr(cfg, "is_encoder_decoder", False):
            out["decoder_input_ids"] = torch.randint(
                4, max(5, min(vocab, 1000)), (BATCH, SEQ - 2), generator=g
            )
    elif main == "pixel_values":
        vis = _sub(cfg, "vision_config", "backbone_config")
        size = _get(vis, ("image_size", "input_size", "img_size"), 64)
        chans = _get(vis, ("num_channels", "in_channels", "input_channels"), 3)
        out["pixel_values"] = torch.randn(BATCH, chans, size, size, generator=g)
        if "input_ids" in model.forward.__code__.co_varnames and hasattr(cfg, "text_config"):
            vocab = _get(cfg.text_config, ("vocab_size",), 1024)
            out["input_ids"] = torch.randint(4, max(5, min(vocab, 1000)), (BATCH, SEQ), generator=g)
    elif main == "input_values":
        out["input_values"] = torch.randn(BATCH, AUDIO_SAMPLES, generator=g)
    elif main == "input_features":
        mels = _get(cfg, ("num_mel_bins", "feature_size", "input_feat_per_channel"), 16)
        positions = _get(cfg, ("max_source_positions",), 64)
        if cfg.model_type == "whisper":
            out["input_features"] = torch.randn(BATCH, mels, 2 * positions, generator=g)
        else:
            chans = _get(cfg, ("input_channels",), 1)
            out["input_features"] = torch.randn(BATCH, 32, mels * chans, generator=g)
        out["decoder_input_ids"] = torch.randint(4, 100, (BATCH, SEQ - 2), generator=g)
    else:
        raise ValueError(f"no input recipe for main input {main!r} ({type(model).__name__})")
    return out


def first_tensor(out: Any) -> torch.Tensor:
    """The first floating tensor of a model output (logits / last_hidden_state / ...)."""
    if isinstance(out, torch.Tensor):
        return out
    values = out.values() if isinstance(out, dict) else out.to_tuple() if hasattr(out, "to_tuple") else out
    for v in values:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v
        if isinstance(v, (tuple, list, dict)) or hasattr(v, "to_tuple"):
            try:
                return first_tensor(v)
            except ValueError:
                continue
    raise ValueError("model output has no floating tensor")


def to_device(inputs: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in inputs.items()}
