"""Shrinking a transformers config to toy size: the per-field rules.

Portability bugs almost never depend on the width of a model, only on its operators and control flow,
so every size field of a default config (recursively, through nested sub-configs) is capped: hidden ~64,
2 layers, vocab 1024 and so on. Per-layer lists and layer indices are kept consistent with fewer
layers, and `OVERRIDES` repairs the few models whose invariants the generic rules break.
`harness.models.tiny` applies these rules to a whole config.
"""

from __future__ import annotations

import re
from typing import Any

HIDDEN = 64
ATTENTION_HEADS = 4
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


def is_token_key(key: str) -> bool:
    return key.endswith(("token_id", "token_index", "token_ids")) or key in {"decoder_start_token_id"}


def _shrink_int(key: str, v: int, heads_ctx: dict[str, int]) -> int:
    """New value for one integer config field; unchanged when no rule knows the field."""
    k = key.lower()
    if is_token_key(k):
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
            new_heads = heads_ctx.get("new_heads", ATTENTION_HEADS)
            if v == 1:
                return 1
            return max(1, new_heads // 2) if v < orig_heads else new_heads
        return _pow2_floor(min(v, ATTENTION_HEADS))
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


def shrink_dict(d: dict[str, Any]) -> dict[str, Any]:
    """Shrink one (sub-)config dict in place and return it."""
    for key, value in list(d.items()):
        if not isinstance(key, str) or key in {"id2label", "label2id"}:
            continue
        if _is_subconfig(key, value):
            shrink_dict(value)
            if key == "per_layer_config":
                for sub in value.values():
                    if isinstance(sub, dict):
                        shrink_dict(sub)
        elif (
            isinstance(value, list)
            and value
            and all(isinstance(x, dict) and "model_type" in x for x in value)
        ):
            for x in value:
                shrink_dict(x)

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
            if is_token_key(k):
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

