"""The tiny zoo: every (architecture, head) pair transformers can build, shrunk to toy size.

Real checkpoints are big and need the network; portability bugs almost never depend on the
width of a model, only on its operators and control flow.  So for every model type in
transformers' own registry we take the default config, shrink every size field (recursively,
through nested sub-configs) and instantiate each Auto head that exists for it.  Weights are
random but seeded, so every process builds bit-identical models.

``generate()`` tries every candidate in a child process (a model may segfault, hang or
allocate gigabytes), keeps those whose CPU forward works and writes ``model_lists/tiny-zoo.csv``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # transformers is imported lazily: listing heads must not cost an import
    from transformers import PretrainedConfig

    from harness.models.model_list import ModelEntry

# ----------------------------------------------------------------------------------------------
# Heads: task name used in model lists -> (mapping in modeling_auto, Auto class)
# ----------------------------------------------------------------------------------------------

HEADS: dict[str, tuple[str, str]] = {
    "base": ("MODEL_MAPPING_NAMES", "AutoModel"),
    "pretraining": ("MODEL_FOR_PRETRAINING_MAPPING_NAMES", "AutoModelForPreTraining"),
    "causal-lm": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
    "masked-lm": ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),
    "seq2seq-lm": ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM"),
    "seq-cls": ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForSequenceClassification"),
    "token-cls": ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "AutoModelForTokenClassification"),
    "qa": ("MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", "AutoModelForQuestionAnswering"),
    "multiple-choice": ("MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES", "AutoModelForMultipleChoice"),
    "next-sentence": (
        "MODEL_FOR_NEXT_SENTENCE_PREDICTION_MAPPING_NAMES",
        "AutoModelForNextSentencePrediction",
    ),
    "text-encoding": ("MODEL_FOR_TEXT_ENCODING_MAPPING_NAMES", "AutoModelForTextEncoding"),
    "image-cls": ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification"),
    "masked-image-modeling": (
        "MODEL_FOR_MASKED_IMAGE_MODELING_MAPPING_NAMES",
        "AutoModelForMaskedImageModeling",
    ),
    "semantic-seg": ("MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES", "AutoModelForSemanticSegmentation"),
    "universal-seg": ("MODEL_FOR_UNIVERSAL_SEGMENTATION_MAPPING_NAMES", "AutoModelForUniversalSegmentation"),
    "depth": ("MODEL_FOR_DEPTH_ESTIMATION_MAPPING_NAMES", "AutoModelForDepthEstimation"),
    "object-detection": ("MODEL_FOR_OBJECT_DETECTION_MAPPING_NAMES", "AutoModelForObjectDetection"),
    "backbone": ("MODEL_FOR_BACKBONE_MAPPING_NAMES", "AutoBackbone"),
    "video-cls": ("MODEL_FOR_VIDEO_CLASSIFICATION_MAPPING_NAMES", "AutoModelForVideoClassification"),
    "zero-shot-image-cls": (
        "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES",
        "AutoModelForZeroShotImageClassification",
    ),
    "image-text-to-text": ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "AutoModelForImageTextToText"),
    "audio-cls": ("MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", "AutoModelForAudioClassification"),
    "audio-frame-cls": (
        "MODEL_FOR_AUDIO_FRAME_CLASSIFICATION_MAPPING_NAMES",
        "AutoModelForAudioFrameClassification",
    ),
    "audio-xvector": ("MODEL_FOR_AUDIO_XVECTOR_MAPPING_NAMES", "AutoModelForAudioXVector"),
    "ctc": ("MODEL_FOR_CTC_MAPPING_NAMES", "AutoModelForCTC"),
    "speech-seq2seq": ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "AutoModelForSpeechSeq2Seq"),
    "time-series-prediction": (
        "MODEL_FOR_TIME_SERIES_PREDICTION_MAPPING_NAMES",
        "AutoModelForTimeSeriesPrediction",
    ),
}


def auto_class(task: str) -> Any:
    """The transformers Auto class for a head name (e.g. ``causal-lm`` -> AutoModelForCausalLM)."""
    if task not in HEADS:
        raise KeyError(f"unknown task {task!r}; known tasks: {', '.join(sorted(HEADS))}")
    import transformers
    from transformers.models.auto import modeling_auto

    name = HEADS[task][1]
    return getattr(modeling_auto, name, None) or getattr(transformers, name)


def head_mapping(task: str) -> dict[str, str]:
    """model_type -> model class name for one head, straight from transformers' registry."""
    from transformers.models.auto import modeling_auto

    return dict(getattr(modeling_auto, HEADS[task][0], {}))


def model_types() -> list[str]:
    """Every model type transformers knows (CONFIG_MAPPING is lazy, so read its names)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return sorted(CONFIG_MAPPING_NAMES)


def candidates() -> list[tuple[str, str]]:
    """All (model_type, task) pairs that transformers registers, sorted."""
    known = set(model_types())
    out = []
    for task in HEADS:
        for mt in head_mapping(task):
            if mt in known:
                out.append((mt, task))
    return sorted(set(out))


# ----------------------------------------------------------------------------------------------
# Shrinking configs
# ----------------------------------------------------------------------------------------------

HIDDEN = 64
HEADS_N = 4
HEAD_DIM = 16
INTERMEDIATE = 128
LAYERS = 2
VOCAB = 1024
MAX_POSITIONS = 128
IMAGE_SIZE = 64
PATCH_SIZE = 8
MEL_BINS = 16
NUM_LABELS = 3
EXPERTS = 4
MAX_PARAMS = 5_000_000

# Per-model fixes applied after the generic shrink (dotted keys reach into sub-configs).  Each
# exists because the generic rules break an invariant that model's config or code relies on.
OVERRIDES: dict[str, dict[str, Any]] = {
    "distilbert": {"id2label": {"0": "LABEL_0", "1": "LABEL_1"}, "label2id": {"LABEL_0": 0, "LABEL_1": 1}},
    "reformer": {
        "axial_pos_embds_dim": [32, 32],
        "axial_pos_shape": [8, 16],
        "local_attn_chunk_length": 8,
        "lsh_attn_chunk_length": 8,
        "num_buckets": 4,
    },
    "esm": {"vocab_size": 33, "pad_token_id": 1, "mask_token_id": 32},
    "wav2vec2-bert": {"vocab_size": 32},
    "wav2vec2-conformer": {"vocab_size": 32},
    "time_series_transformer": {"prediction_length": 4, "context_length": 8},
    "informer": {"prediction_length": 4, "context_length": 8},
    "autoformer": {"prediction_length": 4, "context_length": 8, "label_length": 4},
    "cvt": {"depth": [1, 2, 3]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "deepseek_ocr2": {
        "text_config.mlp_layer_types": ["dense", "sparse"],
        "text_config.num_experts_per_tok": 2,
    },
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    "hiera": {"decoder_hidden_size": 64, "decoder_depth": 1, "decoder_num_heads": 1},
    "chameleon": {"vocabulary_map": {"<image>": 1000}},
    "emu3": {"vocabulary_map": {"<image>": 1000}},
    "xmod": {"default_language": "en_XX"},
    "vipllava": {"vision_feature_layers": [-2, -1]},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "dac": {"encoder_hidden_size": 8},
    "efficientnet": {"width_coefficient": 1.0, "depth_coefficient": 1.0, "hidden_dim": 1280},
    "lilt": {"hidden_size": 96},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
}

_LAYER_KEY = re.compile(
    r"^(num_hidden_layers|num_layers|n_layers?|num_decoder_layers|num_encoder_layers|encoder_layers|"
    r"decoder_layers|depth|num_blocks|num_[a-z_]*_layers|[a-z_]*_num_layers)$"
)
_LAYER_KEY_EXCLUDE = ("feat_extract", "nextn", "kv_shared", "conv_pos", "codevector")
_PER_STAGE_DEPTH = re.compile(
    r"(depths?|num_res_blocks|stage_num_blocks|stage_numb_of_layers|num_blocks|layers|repeats|blocks_per_stage)$"
)
_CHANNEL_LIST = re.compile(
    r"(hidden_sizes|channels|dims|conv_dim|tdnn_dim|hidden_dim|embed_dim|num_features|widths|channel_list|"
    r"dim_per_stage|channels_per_stage)$"
)
_EXPERT_KEYS = {"num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts", "n_experts"}
_TOPK_KEYS = {
    "num_experts_per_tok",
    "moe_topk",
    "num_experts_per_token",
    "moe_k",
    "top_k",
    "num_selected_experts",
}
_NO_TOUCH = ("kernel", "stride", "window", "dilation", "padding", "max_", "ratio", "multiple", "groups")


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, v).bit_length() - 1)


def _is_token_key(key: str) -> bool:
    return key.endswith(("token_id", "token_index", "token_ids")) or key in {"decoder_start_token_id"}


def _shrink_int(key: str, v: int, heads_ctx: dict[str, int]) -> int:
    """New value for one integer config field; unchanged when no rule knows the field."""
    k = key.lower()
    if _is_token_key(k):
        return v
    if ("vocab_size" in k or k.endswith("_vocab")) and not k.startswith("type"):
        return min(v, VOCAB)
    if k.endswith("filters"):  # SEANet-style codecs double channels per stage from here
        return min(v, 8)
    if k in {"num_latents", "num_self_attends_per_block"}:
        return min(v, 16 if k == "num_latents" else LAYERS)
    if k in {"d_latents", "lru_width"}:
        return min(v, HIDDEN)
    if k in {"attention_window", "rotary_dim"}:
        return min(v, 8 if k == "attention_window" else HEAD_DIM)
    if _LAYER_KEY.match(k) and not any(x in k for x in _LAYER_KEY_EXCLUDE):
        return min(v, LAYERS)
    if k.endswith("heads") or k in {"n_head", "num_head"}:
        if "key_value" in k or "kv" in k:
            orig_heads = heads_ctx.get("orig_heads", v)
            new_heads = heads_ctx.get("new_heads", HEADS_N)
            if v == 1:
                return 1
            return max(1, new_heads // 2) if v < orig_heads else new_heads
        return _pow2_floor(min(v, HEADS_N))
    if k == "qk_rope_head_dim":
        return min(v, 8)
    if k.endswith(("head_dim", "head_size")) or k in {"d_kv", "attention_head_dim", "d_head"}:
        return min(v, HEAD_DIM)
    if k in {"kv_lora_rank", "q_lora_rank"}:
        return min(v, 32)
    if k in _EXPERT_KEYS:
        return min(v, EXPERTS)
    if k in _TOPK_KEYS:
        return min(v, 2)
    if k in {"n_group", "topk_group"}:
        return 1
    if k in {"n_shared_experts", "num_shared_experts"}:
        return min(v, 1)
    if "intermediate" in k or "ffn" in k or k in {"d_ff", "n_inner", "mlp_dim", "d_inner"}:
        return min(v, INTERMEDIATE // 2 if ("moe" in k or "expert" in k) else INTERMEDIATE)
    if "position" in k and "type" not in k:
        return min(v, MAX_POSITIONS)
    if k.endswith("image_size") or k in {"img_size"}:
        return min(v, IMAGE_SIZE)
    if k.endswith("patch_size") and "temporal" not in k:
        return min(v, PATCH_SIZE)
    if k in {"num_mel_bins", "n_mels", "feature_size", "input_feat_per_channel", "num_mel_filters"}:
        return min(v, MEL_BINS)
    if k in {"codebook_size", "num_embeddings", "num_codevectors_per_group", "codebook_vocab_size"}:
        return min(v, 64)
    if k == "mm_tokens_per_image":  # pooled image tokens must tile the patch grid
        return min(v, 16)
    if k == "num_queries":
        return min(v, 16)
    if k == "sliding_window":
        return min(v, 8)
    if k == "num_groups":
        return min(v, 8)
    if k.endswith("groups") and v > HIDDEN:
        return HIDDEN
    if any(x in k for x in _NO_TOUCH):
        return v
    if (
        "hidden" in k
        or k.endswith(("_dim", "embd", "embed", "d_model", "_size_per_layer_input"))
        or k in {"dim", "d_model", "embedding_size", "proj_size", "projection_size", "classifier_proj_size"}
        or "channel" in k
        or "filters" in k
        or "bottleneck" in k
    ):
        return min(v, HIDDEN)
    return v


def _is_subconfig(key: str, value: Any) -> bool:
    if not isinstance(value, dict):
        return False
    if "model_type" in value:
        return True
    return (
        key.endswith("config")
        and key not in {"quantization_config"}
        and any(isinstance(x, int) and not isinstance(x, bool) for x in value.values())
    )


def _layer_count(d: dict[str, Any]) -> tuple[str | None, int | None]:
    for key in (
        "num_hidden_layers",
        "num_layers",
        "n_layer",
        "n_layers",
        "decoder_layers",
        "encoder_layers",
        "depth",
    ):
        v = d.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            return key, v
    return None, None


def _shrink_dict(d: dict[str, Any]) -> dict[str, Any]:
    """Shrink one (sub-)config dict in place and return it."""
    for key, value in list(d.items()):
        if not isinstance(key, str) or key in {"id2label", "label2id"}:
            continue
        if _is_subconfig(key, value):
            _shrink_dict(value)
            if key == "per_layer_config":
                for sub in value.values():
                    if isinstance(sub, dict):
                        _shrink_dict(sub)
        elif (
            isinstance(value, list)
            and value
            and all(isinstance(x, dict) and "model_type" in x for x in value)
        ):
            for x in value:
                _shrink_dict(x)

    layer_key, old_layers = _layer_count(d)
    heads_key = next(
        (
            k
            for k in ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads")
            if isinstance(d.get(k), int)
        ),
        None,
    )
    heads_ctx: dict[str, int] = {}
    if heads_key:
        heads_ctx = {"orig_heads": d[heads_key], "new_heads": _shrink_int(heads_key, d[heads_key], {})}

    # Channel lists are capped like scalar widths (not scaled): "stage 4 of the backbone has as many
    # channels as the neck's input" is the common invariant, and capping keeps such equalities.
    channel_lists = [k for k, v in d.items() if isinstance(k, str) and _is_int_list(v) and v
                     and _CHANNEL_LIST.search(k.lower())]
    rope_equal = isinstance(d.get("head_dim"), int) and d.get("head_dim") == d.get("qk_rope_head_dim")

    for key, value in list(d.items()):
        if not isinstance(key, str) or key in {"id2label", "label2id"}:
            continue
        k = key.lower()
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int):
            d[key] = _shrink_int(key, value, heads_ctx)
        elif (
            isinstance(value, list)
            and value
            and all(isinstance(x, int) and not isinstance(x, bool) for x in value)
        ):
            if _is_token_key(k):
                continue
            if k.endswith("image_size") or k in {"img_size", "input_size"} and len(value) in (2, 3):
                d[key] = [min(x, IMAGE_SIZE) if x > 3 else x for x in value]
                continue
            if key in channel_lists:
                d[key] = [min(x, HIDDEN) for x in value]
            elif "intermediate" in k:
                d[key] = [min(x, INTERMEDIATE) for x in value]
            elif k == "attention_window":
                d[key] = [min(x, 8) for x in value]
            elif _PER_STAGE_DEPTH.search(k):
                d[key] = [min(x, 1) for x in value]
            elif k.endswith("heads"):
                d[key] = [_pow2_floor(x) for x in value]

    new_layers = d.get(layer_key) if layer_key else None
    if old_layers and new_layers is not None and new_layers < old_layers:
        _fix_per_layer_fields(d, layer_key, old_layers, new_layers)
    if rope_equal:  # DeepSeek-style MLA: head_dim is the rotary part
        d["head_dim"] = d["qk_rope_head_dim"]
    _fill_and_fix(d)
    return d


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value)


def _pick_layers(d: dict[str, Any], old: int, new: int) -> list[int]:
    """Which of the ``old`` layers to keep: every distinct kind of layer first, then the earliest.

    Per-layer lists (``layer_types``, ``mlp_layer_types``), layer-index lists (``mlp_only_layers``,
    ``global_attn_indexes``) and ``per_layer_config`` all describe layer kinds; keeping one layer of
    each kind preserves e.g. "at least one full-attention layer" and exercises every code path.
    """
    per_layer = [
        v
        for k, v in d.items()
        if isinstance(k, str)
        and isinstance(v, list)
        and len(v) == old
        and v
        and not isinstance(v[0], (dict, list))
    ]
    index_lists = [
        set(v)
        for k, v in d.items()
        if isinstance(k, str)
        and _is_int_list(v)
        and v
        and any(x in k.lower() for x in ("layer", "index", "idx"))
        and len(v) != old
    ]
    plc = d.get("per_layer_config")
    special = {int(x) for x in plc} if isinstance(plc, dict) else set()

    def signature(i: int) -> tuple[Any, ...]:
        return (tuple(str(v[i]) for v in per_layer), tuple(i in s for s in index_lists), i in special)

    picked: list[int] = []
    seen: set[tuple[Any, ...]] = set()
    for i in range(old):
        sig = signature(i)
        if sig not in seen and len(picked) < max(new, 4):
            seen.add(sig)
            picked.append(i)
    for i in range(old):
        if len(picked) >= new:
            break
        if i not in picked:
            picked.append(i)
    return sorted(picked)


def _fix_per_layer_fields(d: dict[str, Any], layer_key: str, old: int, new: int) -> None:
    """Keep per-layer lists, layer indices and backbone out_indices consistent with fewer layers."""
    if isinstance(d.get("out_indices"), list) and d.get("stage_names") and len(d["stage_names"]) == old + 1:
        picks = d["out_indices"]
        new = max(new, len(picks))
        d[layer_key] = new
        d["out_indices"] = [i if i < 0 else new - len(picks) + 1 + j for j, i in enumerate(picks)]
        d.pop("out_features", None)
        d.pop("stage_names", None)
        keep = list(range(new))
    else:
        fixed_count = [k for k, v in d.items() if isinstance(k, str) and _is_int_list(v) and len(v) > 1
                       and ("out_indices" in k or "feature_layer" in k)]
        if fixed_count:
            # multi-scale heads consume exactly len(out_indices) feature maps: keep that many layers
            new = max(new, max(len(d[k]) for k in fixed_count))
            keep = list(range(new))
            for k in fixed_count:
                n = len(d[k])
                d[k] = [i if i < 0 else new - n + j for j, i in enumerate(d[k])]
        else:
            keep = _pick_layers(d, old, new)
        d[layer_key] = len(keep)
    position = {old_i: new_i for new_i, old_i in enumerate(keep)}
    for key, value in list(d.items()):
        if not isinstance(key, str) or key == layer_key:
            continue
        k = key.lower()
        if isinstance(value, list) and len(value) == old and value and not isinstance(value[0], dict):
            d[key] = [value[i] for i in keep]
        elif _is_int_list(value) and value and any(x in k for x in ("layer", "index", "idx")) and not (
            "out_indices" in k or "feature_layer" in k
        ):
            d[key] = [position[x] for x in value if x in position]
        elif key == "per_layer_config" and isinstance(value, dict):
            d[key] = {f"{position[int(x)]:02d}": v for x, v in value.items() if int(x) in position}
    n = len(keep)
    for key in ("first_k_dense_replace", "max_window_layers", "num_kv_shared_layers", "num_dense_layers"):
        if isinstance(d.get(key), int) and not isinstance(d.get(key), bool) and d[key] > n // 2:
            d[key] = (
                n // 2 if key in ("num_kv_shared_layers", "first_k_dense_replace", "num_dense_layers") else n
            )


def _fill_and_fix(d: dict[str, Any]) -> None:
    """Repair fields whose defaults are None/inconsistent once sizes have changed."""
    hidden = d.get("hidden_size") if isinstance(d.get("hidden_size"), int) else None
    heads = d.get("num_attention_heads") if isinstance(d.get("num_attention_heads"), int) else None
    if "head_dim" in d and d["head_dim"] is None and hidden and heads:
        d["head_dim"] = hidden // heads
    if "num_key_value_heads" in d and d["num_key_value_heads"] is None and heads:
        d["num_key_value_heads"] = heads
    if "num_experts_per_tok" in d and d["num_experts_per_tok"] is None and any(
        isinstance(d.get(x), int) for x in _EXPERT_KEYS
    ):
        d["num_experts_per_tok"] = 2
    if "sliding_window" in d and d["sliding_window"] is None and "sliding_attention" in (d.get("layer_types") or []):
        d["sliding_window"] = 8
    # LayoutLMv2/v3: 4 coordinate + 2 shape embeddings are concatenated into hidden_size
    if isinstance(d.get("coordinate_size"), int) and isinstance(d.get("shape_size"), int) and hidden:
        d["coordinate_size"], d["shape_size"] = hidden // 8, hidden // 4
    head_dim = (
        d.get("head_dim")
        if isinstance(d.get("head_dim"), int)
        else (hidden // heads if hidden and heads else None)
    )
    rope = d.get("rope_parameters")
    rope_dicts = [rope] if isinstance(rope, dict) else []
    if isinstance(rope, dict):
        rope_dicts += [v for v in rope.values() if isinstance(v, dict)]
    rotary = d.get("qk_rope_head_dim") if isinstance(d.get("qk_rope_head_dim"), int) else head_dim
    max_pos = d.get("max_position_embeddings")
    for r in rope_dicts:
        original = r.get("original_max_position_embeddings")
        if isinstance(original, int) and isinstance(max_pos, int) and original > max_pos:
            r["original_max_position_embeddings"] = max_pos  # llama3/yarn scaling expects <= max
        sec = r.get("mrope_section")
        if _is_int_list(sec) and sec and rotary:
            half = int(rotary * r.get("partial_rotary_factor", 1.0)) // 2
            scaled = [max(1, x * half // sum(sec)) for x in sec]
            scaled[0] += half - sum(scaled)
            r["mrope_section"] = scaled
    if isinstance(d.get("qk_head_dim"), int) and isinstance(d.get("qk_nope_head_dim"), int) and rotary:
        d["qk_head_dim"] = d["qk_nope_head_dim"] + rotary
    # Mamba-2 style: heads * head_dim must equal expand * hidden
    for nh, hd, ex in (
        ("num_heads", "head_dim", "expand"),
        ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
        ("n_mamba_heads", "mamba_headdim", "mamba_expand"),
    ):
        if hidden and all(isinstance(d.get(x), int) for x in (nh, hd, ex)) and (nh != "num_heads" or "state_size" in d):
            inner = d[ex] * hidden
            if isinstance(d.get("mamba_d_ssm"), int):
                d["mamba_d_ssm"] = inner
            d[hd] = inner // d[nh]
    if isinstance(d.get("n_groups"), int) and d["n_groups"] > 1:
        d["n_groups"] = 1


def _collect_token_ids(d: dict[str, Any], found: set[int]) -> None:
    for key, value in d.items():
        if not isinstance(key, str) or key in {"id2label", "label2id"}:
            continue
        if isinstance(value, dict):
            _collect_token_ids(value, found)
        elif _is_token_key(key.lower()) or key in {"suppress_tokens", "begin_suppress_tokens"}:
            vals = value if isinstance(value, list) else [value]
            found.update(x for x in vals if isinstance(x, int) and not isinstance(x, bool) and x >= VOCAB)


def _remap_token_ids(d: dict[str, Any], mapping: dict[int, int]) -> None:
    for key, value in d.items():
        if not isinstance(key, str) or key in {"id2label", "label2id"}:
            continue
        if isinstance(value, dict):
            _remap_token_ids(value, mapping)
        elif _is_token_key(key.lower()) or key in {"suppress_tokens", "begin_suppress_tokens"}:
            if isinstance(value, list):
                d[key] = [mapping.get(x, x) if isinstance(x, int) else x for x in value]
            elif isinstance(value, int) and not isinstance(value, bool):
                d[key] = mapping.get(value, value)


def _set_dotted(d: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        d = d.setdefault(p, {})
    d[last] = value


def _replace_timm_backbones(d: dict[str, Any]) -> None:
    """DETR-style defaults use a timm ResNet; swap in transformers' own ResNet (timm is optional)."""
    from transformers import ResNetConfig

    for key, value in list(d.items()):
        if isinstance(value, dict) and value.get("model_type") == "timm_backbone":
            resnet = ResNetConfig(out_indices=value.get("out_indices") or [4]).to_dict()
            resnet.pop("transformers_version", None)
            d[key] = resnet
        elif isinstance(value, dict):
            _replace_timm_backbones(value)


def _add_implicit_rope_sections(d: dict[str, Any], config: Any) -> None:
    """Write out the modelling code's default ``mrope_section`` so shrinking can rescale it.

    Qwen2-VL-style models fall back to ``[16, 24, 24]`` (for head_dim 128) when the config has
    no ``mrope_section``; such config classes list it in ``ignore_keys_at_rope_validation``.
    """
    rope = d.get("rope_parameters")
    flat = isinstance(rope, dict) and ("rope_type" in rope or "rope_theta" in rope)
    if "mrope_section" in getattr(type(config), "ignore_keys_at_rope_validation", ()) and flat:
        rope.setdefault("mrope_section", [16, 24, 24])
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and isinstance(d.get(key), dict):
            _add_implicit_rope_sections(d[key], sub)


def shrink_config_dict(model_type: str) -> dict[str, Any]:
    """The shrunk config of ``model_type`` as a plain dict (what ``shrink_config`` instantiates)."""
    from transformers import AutoConfig

    with _quiet_transformers():  # some default configs warn about their own defaults
        default = AutoConfig.for_model(model_type)
    d = copy.deepcopy(default.to_dict())
    _add_implicit_rope_sections(d, default)
    _replace_timm_backbones(d)
    _shrink_dict(d)
    big = set()
    _collect_token_ids(d, big)
    # special ids beyond the shrunk vocab move to its top end, keeping them distinct
    mapping = {old: VOCAB - 1 - i for i, old in enumerate(sorted(big))}
    _remap_token_ids(d, mapping)
    d["id2label"] = {str(i): f"LABEL_{i}" for i in range(NUM_LABELS)}
    d["label2id"] = {f"LABEL_{i}": i for i in range(NUM_LABELS)}
    for dotted, value in OVERRIDES.get(model_type, {}).items():
        _set_dotted(d, dotted, value)
    d.pop("transformers_version", None)
    return d


def shrink_config(model_type: str) -> PretrainedConfig:
    """A tiny, deterministic config for ``model_type`` (hidden ~64, 2 layers, vocab 1024, ...).

    Built from transformers' default config so every architecture-specific field keeps a legal
    value; only sizes change.  Raises whatever transformers raises when the result is invalid.
    """
    from transformers import CONFIG_MAPPING

    shrunk = shrink_config_dict(model_type)
    with _quiet_transformers():
        return CONFIG_MAPPING[model_type].from_dict(shrunk)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _adapt_config_to_task(config: Any, task: str) -> None:
    """Head-specific config needs.

    QA heads split exactly 2 logits; batched seq-cls needs a pad token to find each row's end;
    encoder-decoders shift labels with decoder_start_token_id; encoder models used as causal LMs
    need is_decoder for the causal mask.
    """
    if task == "qa":
        config.num_labels = 2
    if task == "causal-lm" and getattr(config, "is_decoder", None) is False and not getattr(
        config, "is_encoder_decoder", False
    ):
        config.is_decoder = True  # BERT-style encoders as causal LMs: causal mask, as intended
    if (
        getattr(config, "is_encoder_decoder", False)
        and getattr(config, "decoder_start_token_id", None) is None
    ):
        pad = getattr(config, "pad_token_id", None)
        config.decoder_start_token_id = pad if isinstance(pad, int) else 0
    if task == "seq-cls":
        for cfg in (config, getattr(config, "text_config", None)):
            if cfg is not None and getattr(cfg, "pad_token_id", 0) is None:
                eos = getattr(cfg, "eos_token_id", None)
                eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
                cfg.pad_token_id = eos if isinstance(eos, int) else 0


def tiny_config(model_type: str, task: str) -> PretrainedConfig:
    """``shrink_config(model_type)`` plus what head ``task`` needs (labels, pad token, class choice)."""
    config = shrink_config(model_type)
    names = head_mapping(task).get(model_type)
    if isinstance(names, (list, tuple)) and names:
        # several classes registered for one head: transformers picks by config.architectures
        config.architectures = [names[0]]
    _adapt_config_to_task(config, task)
    return config


def count_params(task: str, config: PretrainedConfig) -> int:
    """Parameter count of ``task``'s model for ``config``, built on the meta device (no memory)."""
    import torch

    with torch.device("meta"):
        model = auto_class(task).from_config(copy.deepcopy(config))
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------
# Checking one candidate (runs inside a child process)
# ----------------------------------------------------------------------------------------------

# Recipes to try when the default one fails, keyed by main input name (or by the default recipe).
# The one that works is written into the list entry's ``inputs`` so later runs don't search.
_ALT_RECIPES = {
    "input_values": ("audio", "audio-3d", "audio-spec"),
    "input_features": ("features-bft", "features-btf"),
    "pixel_values": ("image", "text+image", "video"),
    "input_ids": ("text", "text+image"),
    "vlm": ("text",),
}


def _modality(config: Any, recipe: str) -> str:
    has_vision = any(
        getattr(config, k, None) is not None for k in ("vision_config", "visual", "image_config")
    )
    has_audio = getattr(config, "audio_config", None) is not None
    if (has_vision or has_audio) and recipe in ("text", "text+image") or recipe in ("text+image", "vlm"):
        return "multimodal"
    return {
        "text": "text",
        "image": "vision",
        "video": "vision",
        "audio": "audio",
        "audio-3d": "audio",
        "features-bft": "audio",
        "features-btf": "audio",
        "audio-spec": "audio",
        "patches": "vision",
        "time-series": "time-series",
    }[recipe]


def _tags(config: Any, recipe: str, modality: str, forward_s: float) -> list[str]:
    from harness.models.inputs import find_attr

    tags = []
    if getattr(config, "is_encoder_decoder", False):
        tags.append("encoder-decoder")
    experts = find_attr(config, "num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
    if isinstance(experts, int) and experts > 1:
        tags.append("moe")
    if find_attr(config, "state_size", "mamba_d_state", "ssm_state_size") is not None:
        tags.append("ssm")
    if modality == "multimodal" and recipe == "text":
        tags.append("text-only")
    if forward_s > 0.5:
        tags.append("slow")
    return tags


def check_candidate(model_type: str, task: str, max_params: int = MAX_PARAMS) -> dict[str, Any]:
    """Build, feed and run one (model_type, task) on CPU; a dict describing what happened.

    ``status`` is ``ok`` or the failing stage (``config``, ``build``, ``too-big``, ``inputs``,
    ``forward``, ``nonfinite``, ``nondeterministic``, ``no-output``).
    """
    import torch

    from harness.models.inputs import default_recipe, make_inputs, output_tensors
    from harness.models.load import build_tiny
    from harness.models.model_list import ModelEntry

    out: dict[str, Any] = {"arch": model_type, "task": task}
    try:
        config = tiny_config(model_type, task)
    except Exception as e:  # noqa: BLE001 - any failure just excludes the candidate
        return {**out, "status": "config", "error": f"{type(e).__name__}: {e}"[:300]}
    try:
        n_params = count_params(task, config)
    except Exception as e:  # noqa: BLE001
        return {**out, "status": "build", "error": f"{type(e).__name__}: {e}"[:300]}
    out["params"] = n_params
    if n_params > max_params:
        return {**out, "status": "too-big", "error": f"{n_params} parameters > {max_params}"}
    try:
        model = build_tiny(model_type, task, seed=0)
    except Exception as e:  # noqa: BLE001
        return {**out, "status": "build", "error": f"{type(e).__name__}: {e}"[:300]}
    main = getattr(model, "main_input_name", "input_ids")
    first = default_recipe(model, model.config)
    alternatives = _ALT_RECIPES.get(first, ()) + _ALT_RECIPES.get(main, ())
    recipes = list(dict.fromkeys([first, *alternatives]))
    attempts: list[tuple[str, str]] = []  # (stage, error) of recipes that did not work
    for recipe in recipes:
        entry = ModelEntry(
            id=f"tiny/{model_type}/{task}",
            source="tiny",
            arch=model_type,
            task=task,
            inputs={} if recipe == first else {"recipe": recipe},
        )
        try:
            inputs = make_inputs(model, model.config, entry, seed=0)
        except Exception as e:  # noqa: BLE001
            attempts.append(("inputs", f"{recipe}: {type(e).__name__}: {e}"[:300]))
            continue
        try:
            with torch.no_grad():
                res1 = output_tensors(model(**inputs))
                t0 = time.perf_counter()
                res2 = output_tensors(model(**inputs))
                forward_s = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001
            attempts.append(("forward", f"{recipe}: {type(e).__name__}: {e}"[:300]))
            continue
        floats = {k: v for k, v in res1.items() if v.is_floating_point()}
        if not floats:
            attempts.append(("no-output", f"{recipe}: no floating-point outputs"))
            continue
        if any(not torch.isfinite(v).all() and torch.isnan(v).any() for v in floats.values()):
            return {**out, "status": "nonfinite", "error": f"{recipe}: NaN in CPU outputs"}
        if res1.keys() != res2.keys() or any(not torch.equal(res1[k], res2[k]) for k in res1):
            return {**out, "status": "nondeterministic", "error": f"{recipe}: two CPU forwards differ"}
        modality = _modality(model.config, recipe)
        return {
            **out,
            "status": "ok",
            "recipe": recipe,
            "default_recipe": recipe == first,
            "modality": modality,
            "forward_s": round(forward_s, 4),
            "tags": _tags(model.config, recipe, modality, forward_s),
            "outputs": sorted(res1)[:8],
            "attempts": attempts,
        }
    status, error = attempts[0] if attempts else ("inputs", "no input recipe applies")
    return {**out, "status": status, "error": error, "attempts": attempts}


def _worker(conn: Any, check: Any = None) -> None:
    """Child process loop: receive (model_type, task), send back ``check``'s dict (check_candidate)."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.disable(logging.WARNING)
    import torch

    torch.set_num_threads(1)
    while True:
        item = conn.recv()
        if item is None:
            return
        mt, task = item
        try:
            res = (check or check_candidate)(mt, task)
        except BaseException as e:  # noqa: BLE001 - report, never die silently
            res = {"arch": mt, "task": task, "status": "crash", "error": f"{type(e).__name__}: {e}"[:300]}
        conn.send(res)


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


@dataclass
class _Slot:
    proc: Any
    conn: Any
    item: tuple[str, str] | None = None
    started: float = 0.0
    done: int = 0


def run_candidates(
    items: list[tuple[str, str]],
    jobs: int = 2,
    timeout_s: float = 120.0,
    max_rss_mb: float = 6000.0,
    tasks_per_child: int = 40,
    progress: bool = True,
    check: Any = None,
) -> list[dict[str, Any]]:
    """Check candidates in child processes; a crash, hang or memory blow-up fails only that one.

    ``check`` (default ``check_candidate``) must be an importable top-level function: workers
    are spawned, not forked, so a parent that already initialised torch threads cannot deadlock
    them.  Workers are recycled after ``tasks_per_child`` candidates to bound leaked memory.
    """
    import multiprocessing as mp
    from multiprocessing.connection import wait

    ctx = mp.get_context("spawn")
    pending = list(items)
    results: list[dict[str, Any]] = []
    slots: list[_Slot] = []

    def start() -> _Slot:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(child, check), daemon=True)
        proc.start()
        child.close()
        return _Slot(proc=proc, conn=parent)

    def kill(slot: _Slot) -> None:
        if slot.proc.is_alive():
            slot.proc.kill()
        slot.proc.join(5)
        slot.conn.close()

    def feed(slot: _Slot) -> None:
        if pending:
            slot.item = pending.pop(0)
            slot.started = time.monotonic()
            slot.conn.send(slot.item)
        else:
            slot.item = None

    t_start = time.monotonic()
    for _ in range(max(1, min(jobs, len(pending)))):
        slot = start()
        slots.append(slot)
        feed(slot)
    while any(s.item for s in slots):
        busy = [s for s in slots if s.item]
        ready = wait([s.conn for s in busy] + [s.proc.sentinel for s in busy], timeout=0.5)
        for i, slot in enumerate(slots):
            if not slot.item:
                continue
            res = None
            if slot.conn in ready:
                try:
                    res = slot.conn.recv()
                except (EOFError, OSError):
                    res = None
            failed = None
            if res is None:
                if not slot.proc.is_alive():
                    failed = ("crash", f"worker died (exit code {slot.proc.exitcode})")
                elif time.monotonic() - slot.started > timeout_s:
                    failed = ("timeout", f"no result after {timeout_s:.0f}s")
                elif _rss_mb(slot.proc.pid) > max_rss_mb:
                    failed = ("memory", f"worker RSS above {max_rss_mb:.0f} MB")
                else:
                    continue
                res = {"arch": slot.item[0], "task": slot.item[1], "status": failed[0], "error": failed[1]}
            results.append(res)
            slot.done += 1
            if progress:
                n = len(results)
                print(
                    f"[{n}/{len(items)} {time.monotonic() - t_start:6.0f}s] {res['status']:>16} "
                    f"{res['arch']}/{res['task']}",
                    file=sys.stderr,
                    flush=True,
                )
            if failed or slot.done >= tasks_per_child:
                if not failed:
                    slot.conn.send(None)
                kill(slot)
                slot = slots[i] = start()
            feed(slot)
    for slot in slots:
        try:
            slot.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        kill(slot)
    return results


# ----------------------------------------------------------------------------------------------
# Writing the list
# ----------------------------------------------------------------------------------------------


def result_to_entry(res: dict[str, Any]) -> ModelEntry:
    """A ModelEntry for one kept candidate."""
    from harness.models.model_list import ModelEntry

    inputs = {} if res.get("default_recipe", True) else {"recipe": res["recipe"]}
    return ModelEntry(
        id=f"tiny/{res['arch']}/{res['task']}",
        source="tiny",
        arch=res["arch"],
        task=res["task"],
        modality=res["modality"],
        inputs=inputs,
        tags=tuple(res.get("tags", ())),
    )


def generate(
    out_path: str | os.PathLike[str],
    *,
    jobs: int = 2,
    limit: int | None = None,
    only: Iterable[str] | None = None,
    timeout_s: float = 120.0,
    report_path: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Check every candidate and write the kept ones to ``out_path``; returns the counts."""
    from harness.models.model_list import write_model_list

    items = candidates()
    if only:
        wanted = set(only)
        items = [c for c in items if c[0] in wanted or f"{c[0]}/{c[1]}" in wanted]
    if limit:
        items = items[:limit]
    t0 = time.monotonic()
    results = run_candidates(items, jobs=jobs, timeout_s=timeout_s)
    wall = time.monotonic() - t0
    results.sort(key=lambda r: f"tiny/{r['arch']}/{r['task']}")  # = sorted by id
    kept = [r for r in results if r["status"] == "ok"]
    entries = [result_to_entry(r) for r in kept]
    import transformers

    failed = Counter(r["status"] for r in results if r["status"] != "ok")
    counts = {
        "candidates": len(items),
        "kept": len(kept),
        "failed": dict(sorted(failed.items())),
        "architectures": len({r["arch"] for r in kept}),
        "wall_s": round(wall, 1),
        "transformers": transformers.__version__,
    }
    header = (
        f"tiny-zoo: generated by `portharness zoo` from transformers {transformers.__version__}.\n"
        f"Every row built from a shrunk default config and ran a CPU forward; regenerate, don't edit.\n"
        f"{counts['kept']} of {counts['candidates']} candidates kept, {counts['architectures']} architectures."
    )
    write_model_list(entries, out_path, header)
    if report_path:
        with open(report_path, "w") as f:
            json.dump({"counts": counts, "results": results}, f, indent=1, sort_keys=True)
    return counts


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.models.zoo --out model_lists/tiny-zoo.csv [--jobs N] [--limit N]``."""
    p = argparse.ArgumentParser(prog="python -m harness.models.zoo", description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", default=str(Path(__file__).resolve().parents[2] / "model_lists" / "tiny-zoo.csv")
    )
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2)))
    p.add_argument("--limit", type=int, default=None, help="only the first N candidates (for a quick look)")
    p.add_argument("--only", default=None, help="comma-separated model types or type/task pairs")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per candidate")
    p.add_argument("--report", default=None, help="write every candidate's result as JSON here")
    args = p.parse_args(argv)
    counts = generate(
        args.out,
        jobs=args.jobs,
        limit=args.limit,
        timeout_s=args.timeout,
        only=args.only.split(",") if args.only else None,
        report_path=args.report,
    )
    print(
        f"candidates: {counts['candidates']}  kept: {counts['kept']}  "
        f"architectures: {counts['architectures']}  wall: {counts['wall_s']}s"
    )
    for reason, n in counts["failed"].items():
        print(f"  failed {reason}: {n}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
