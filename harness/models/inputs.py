"""Deterministic example inputs for any transformers model.

The comparison stage runs the same inputs on CPU and on the target backend, so inputs must be
reproducible from ``seed`` alone (a local ``torch.Generator``; the global RNG is never touched)
and valid for the model: token ids below the vocab and away from special ids, an attention mask
with real padding (so masking code is exercised), image/audio sizes the conv stacks accept.

What to build is decided by a *recipe* (``RECIPES``; documented in model_lists/README.md).  By
default it follows from the model (``main_input_name``, forward signature, config); a model-list
entry may pin it (``{"recipe": "audio-3d"}``) together with sizes (``seq_len``, ``batch_size``,
``image_size``, ``num_frames``, ``audio_len``, ``num_choices``, ``decoder_seq_len``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from harness.models.configs import as_hw, find_attr, special_ids, text_config, vocab_size

RECIPES = (
    "text",
    "text+image",
    "image",
    "video",
    "audio",
    "audio-3d",
    "audio-spec",
    "features-bft",
    "features-btf",
    "time-series",
    "vlm",
    "patches",
)

DEFAULTS: dict[str, Any] = {
    "seq_len": 16,
    "decoder_seq_len": 8,
    "num_choices": 2,
    "audio_len": 19200,
    "feature_frames": 64,
}


def _entry_inputs(entry: Any) -> dict[str, Any]:
    if entry is None:
        return {}
    raw = getattr(entry, "inputs", None)
    return dict(raw) if isinstance(raw, dict) else {}


def _forward_params(model: torch.nn.Module) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return {}


def default_recipe(model: torch.nn.Module, config: Any) -> str:
    """The recipe implied by the model's main input and config."""
    main = getattr(model, "main_input_name", "input_ids")
    params = _forward_params(model)
    if _required(params, "grid_thw") or _required(params, "image_grid_thw"):
        return "patches"
    if "pixel_values" in params and _image_features_fn(model) is not None and isinstance(
        find_attr(config, "image_token_id", "image_token_index"), int
    ):
        return "vlm"
    if main in ("past_values",):
        return "time-series"
    if main == "input_values":
        spectrogram = find_attr(config, "max_length") is not None and find_attr(config, "num_mel_bins") is not None
        return "audio-spec" if spectrogram else "audio"
    if main == "input_features":
        whisper_like = (
            find_attr(config, "max_source_positions") is not None
            and find_attr(config, "num_mel_bins") is not None
        )
        return "features-bft" if whisper_like else "features-btf"
    if main in ("pixel_values_videos",):
        return "video"
    if main == "pixel_values":
        if (
            find_attr(config, "num_frames", "tubelet_size") is not None
            and "video" in type(model).__name__.lower()
        ):
            return "video"
        if "input_ids" in params and _required(params, "input_ids"):
            return "text+image"
        return "image"
    if (
        main == "input_ids"
        and "pixel_values" in params
        and getattr(config, "vision_config", None) is not None
        and getattr(config, "text_config", None) is not None
        and _looks_dual_encoder(model)
    ):
        return "text+image"
    return "text"


def _required(params: dict[str, inspect.Parameter], name: str) -> bool:
    p = params.get(name)
    return p is not None and p.default is inspect.Parameter.empty


def _looks_dual_encoder(model: torch.nn.Module) -> bool:
    """CLIP-style models need both modalities; VLM decoders run text-only by default."""
    return (
        any(hasattr(model, a) for a in ("text_projection", "visual_projection", "image_text_hidden_size"))
        or type(model).__name__.endswith(("Model", "ForImageTextRetrieval"))
        and hasattr(model, "logit_scale")
    )


# ----------------------------------------------------------------------------------------------
# builders
# ----------------------------------------------------------------------------------------------


class _Ctx:
    def __init__(
        self, model: torch.nn.Module, config: Any, entry: Any, seed: int, batch_size: int, task: str | None
    ):
        self.model = model
        self.config = config
        self.user_opts = _entry_inputs(entry)
        self.opts = {**DEFAULTS, **self.user_opts}
        self.batch = int(self.opts.get("batch_size", batch_size))
        self.gen = torch.Generator().manual_seed(int(seed))
        self.params = _forward_params(model)
        self.task = task if task is not None else getattr(entry, "task", None)
        self.dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)

    def accepts(self, name: str) -> bool:
        return name in self.params

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.dtype)

    def randint(self, low: int, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(low, max(high, low + 1), shape, generator=self.gen)


def _token_ids(ctx: _Ctx, *shape: int, config: Any = None) -> torch.Tensor:
    config = config if config is not None else ctx.config
    vocab = int(ctx.opts.get("vocab_size", vocab_size(config)))
    specials = special_ids(config)
    allowed = [i for i in range(min(vocab, 4), vocab) if i not in specials] or list(range(vocab))
    table = torch.tensor(allowed, dtype=torch.long)
    return table[ctx.randint(0, len(allowed), *shape)]


def _text(ctx: _Ctx, out: dict[str, torch.Tensor]) -> None:
    cfg = ctx.config
    text_cfg = text_config(cfg)
    seq = int(ctx.opts["seq_len"])
    shape: tuple[int, ...] = (ctx.batch, seq)
    if ctx.task == "multiple-choice":
        shape = (ctx.batch, int(ctx.opts["num_choices"]), seq)
    ids = _token_ids(ctx, *shape)
    mask = torch.ones(shape, dtype=torch.long)
    if ctx.batch > 1 and not ctx.opts.get("no_padding"):
        pad_len = max(1, seq // 4)
        mask[1, ..., seq - pad_len :] = 0
        pad = getattr(text_cfg, "pad_token_id", None)
        if isinstance(pad, int) and 0 <= pad < vocab_size(cfg):
            ids[1, ..., seq - pad_len :] = pad
    out["input_ids"] = ids
    if ctx.accepts("attention_mask"):
        out["attention_mask"] = mask
    type_vocab = getattr(text_cfg, "type_vocab_size", None)
    if ctx.accepts("token_type_ids") and isinstance(type_vocab, int) and type_vocab > 0:
        tt = torch.zeros(shape, dtype=torch.long)
        if type_vocab > 1:
            tt[..., seq // 2 :] = 1
        out["token_type_ids"] = tt
    if ctx.accepts("bbox"):
        out["bbox"] = _bbox(ctx, shape)
    if ctx.task == "seq-cls" and getattr(cfg, "is_encoder_decoder", False):
        # BART/T5 classification heads pool the hidden state at each row's last <eos>
        eos = getattr(text_cfg, "eos_token_id", None)
        eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
        if isinstance(eos, int):
            lengths = mask.sum(-1)
            for row in range(ctx.batch):
                ids[row, int(lengths[row]) - 1] = eos
    if ctx.accepts("visual_feats"):  # LXMERT-style: pre-extracted region features
        boxes = 4
        out["visual_feats"] = ctx.randn(ctx.batch, boxes, int(find_attr(cfg, "visual_feat_dim", default=64)))
        pos_dim = int(find_attr(cfg, "visual_pos_dim", default=4))
        out["visual_pos"] = torch.rand(ctx.batch, boxes, pos_dim, generator=ctx.gen).to(ctx.dtype)
    _speech_decoder(ctx, out)


# heads that derive decoder inputs from input_ids themselves (T5/BART classification, QA)
_NO_DECODER_INPUTS = ("seq-cls", "qa", "token-cls", "multiple-choice")


def _decoder_ids(ctx: _Ctx) -> torch.Tensor:
    cfg = ctx.config
    dec_len = int(ctx.opts["decoder_seq_len"])
    dec_cfg = getattr(cfg, "decoder", None) or text_config(cfg)
    ids = _token_ids(ctx, ctx.batch, dec_len, config=dec_cfg if hasattr(dec_cfg, "vocab_size") else cfg)
    start = find_attr(cfg, "decoder_start_token_id", "bos_token_id", "pad_token_id")
    if isinstance(start, (list, tuple)):
        start = start[0] if start else None
    if isinstance(start, int) and 0 <= start < vocab_size(cfg):
        ids[:, 0] = start
    return ids


def _bbox(ctx: _Ctx, shape: tuple[int, ...]) -> torch.Tensor:
    limit = int(find_attr(ctx.config, "max_2d_position_embeddings", default=1024)) - 1
    limit = min(limit, 1000)
    x0 = ctx.randint(0, limit // 2, *shape)
    y0 = ctx.randint(0, limit // 2, *shape)
    w = ctx.randint(1, limit // 2, *shape)
    h = ctx.randint(1, limit // 2, *shape)
    return torch.stack([x0, y0, x0 + w, y0 + h], dim=-1)


def _image(ctx: _Ctx, out: dict[str, torch.Tensor]) -> None:
    cfg = ctx.config
    size = ctx.opts.get("image_size") or find_attr(
        cfg, "image_size", "img_size", "input_size", prefer="vision_config", default=64
    )
    h, w = as_hw(size, 64)
    if h < 8 or w < 8:
        h, w = 64, 64
    channels = int(
        ctx.opts.get("num_channels")
        or find_attr(cfg, "num_channels", "in_channels", "in_chans", prefer="vision_config", default=3)
    )
    if isinstance(channels, (list, tuple)):
        channels = channels[0]
    out["pixel_values"] = ctx.randn(ctx.batch, channels, h, w)
    if ctx.accepts("noise") and find_attr(cfg, "mask_ratio") is not None:
        # MAE-style random masking: pass the noise so the forward is deterministic
        patch = as_hw(find_attr(cfg, "patch_size", prefer="vision_config", default=16), 16)
        out["noise"] = torch.rand(ctx.batch, (h // patch[0]) * (w // patch[1]), generator=ctx.gen)
    if _required(ctx.params, "bool_masked_pos"):
        patch = as_hw(find_attr(cfg, "patch_size", prefer="vision_config", default=16), 16)
        n = (h // patch[0]) * (w // patch[1])
        out["bool_masked_pos"] = _half_mask(ctx, n)


def _half_mask(ctx: _Ctx, n: int) -> torch.Tensor:
    """(batch, n) bool mask with exactly half set in every row (MAE-style models need equal counts)."""
    mask = torch.zeros(ctx.batch, n, dtype=torch.bool)
    for row in range(ctx.batch):
        mask[row, torch.randperm(n, generator=ctx.gen)[: n // 2]] = True
    return mask


def _image_features_fn(model: torch.nn.Module) -> Any:
    inner = getattr(model, "model", None)
    return getattr(model, "get_image_features", None) or getattr(inner, "get_image_features", None)


def _count_image_tokens(features: Any, batch: int) -> int:
    """Feature vectors per image from whatever get_image_features returned."""
    if isinstance(features, dict):  # ModelOutput: projected features are pooler_output / image_embeds
        for key in ("pooler_output", "image_embeds", "last_hidden_state"):
            if features.get(key) is not None:
                features = features[key]
                break
    if isinstance(features, (list, tuple)):
        first = features[0]
        return int(first.shape[-2]) if first.dim() >= 2 else int(first.shape[0])
    if features.dim() == 3:
        return int(features.shape[0] * features.shape[1] // batch)
    return int(features.shape[0] // batch)


def _patchified_image(ctx: _Ctx, out: dict[str, torch.Tensor], extra: dict[str, torch.Tensor]) -> None:
    """Qwen2-VL style: flattened patches (n_patches, C * T * p * p) plus a (t, h, w) grid per image."""
    cfg = ctx.config
    patch = int(find_attr(cfg, "patch_size", prefer="vision_config", default=14))
    merge = int(find_attr(cfg, "spatial_merge_size", prefer="vision_config", default=2))
    temporal = int(find_attr(cfg, "temporal_patch_size", prefer="vision_config", default=1))
    channels = int(find_attr(cfg, "in_channels", "num_channels", prefer="vision_config", default=3))
    side = max(merge, (int(ctx.opts.get("grid", 8)) // merge) * merge)
    out["pixel_values"] = ctx.randn(ctx.batch * side * side, channels * temporal * patch * patch)
    extra["image_grid_thw"] = torch.tensor([[1, side, side]] * ctx.batch)


def _vlm(ctx: _Ctx, out: dict[str, torch.Tensor]) -> None:
    """Text with one image per row: as many image tokens as the vision tower yields features."""
    fn = _image_features_fn(ctx.model)
    image_token = find_attr(ctx.config, "image_token_id", "image_token_index")
    if fn is None or not isinstance(image_token, int):
        raise ValueError("recipe 'vlm' needs a model with get_image_features and an image token id")
    extra: dict[str, torch.Tensor] = {}
    fparams = inspect.signature(fn).parameters
    if "image_grid_thw" in fparams:
        _patchified_image(ctx, out, extra)
    else:
        _image(ctx, out)
    if "image_sizes" in fparams:
        h, w = out["pixel_values"].shape[-2:]
        extra["image_sizes"] = torch.tensor([[h, w]] * ctx.batch)
    with torch.no_grad():
        try:
            features = fn(pixel_values=out["pixel_values"], **extra)
        except (ValueError, RuntimeError):
            if out["pixel_values"].dim() != 4:
                raise
            # Idefics-style towers take (batch, images, C, H, W)
            out["pixel_values"] = out["pixel_values"].unsqueeze(1)
            features = fn(pixel_values=out["pixel_values"], **extra)
        n_img = _count_image_tokens(features, ctx.batch)
    _text(ctx, out)
    ids, mask = out["input_ids"], out.get("attention_mask")
    image_ids = torch.full((ctx.batch, n_img), image_token, dtype=ids.dtype)
    out["input_ids"] = torch.cat([image_ids, ids], dim=1)
    if mask is not None:
        out["attention_mask"] = torch.cat([torch.ones(ctx.batch, n_img, dtype=mask.dtype), mask], dim=1)
    if "token_type_ids" in out:
        out["token_type_ids"] = torch.cat([torch.zeros_like(image_ids), out["token_type_ids"]], dim=1)
    if ctx.accepts("mm_token_type_ids"):  # 0 = text, 1 = image (M-RoPE position layout)
        out["mm_token_type_ids"] = (out["input_ids"] == image_token).long()
    out.update({k: v for k, v in extra.items() if ctx.accepts(k)})


def _video(ctx: _Ctx, out: dict[str, torch.Tensor]) -> None:
    cfg = ctx.config
    frames = int(
        ctx.opts.get("num_frames") or find_attr(cfg, "num_frames", prefer="vision_config", default=8)
    )
    size = ctx.opts.get("image_size") or find_attr(cfg, "image_size", prefer="vision_config", default=64)
    h, w = as_hw(size, 64)
    channels = int(find_attr(cfg, "num_channels", prefer="vision_config", default=3))
    name = (
        "pixel_values_videos"
        if getattr(ctx.model, "main_input_name", "") == "pixel_values_videos"
        else "pixel_values"
    )
    out[name] = ctx.randn(ctx.batch, frames, channels, h, w)
    if ctx.accepts("bool_masked_pos") and ctx.task == "pretraining":
        patch = as_hw(find_attr(cfg, "patch_size", prefer="vision_config", default=16), 16)
        tubelet = int(find_attr(cfg, "tubelet_size", default=1))
        n = (frames // tubelet) * (h // patch[0]) * (w // patch[1])
        out["bool_masked_pos"] = _half_mask(ctx, n)


def _audio(ctx: _Ctx, out: dict[str, torch.Tensor], three_d: bool) -> None:
    length = int(ctx.opts["audio_len"])
    if three_d:
        channels = int(find_attr(ctx.config, "audio_channels", "channels", prefer="audio_config", default=1))
        out["input_values"] = ctx.randn(ctx.batch, channels, length)
    else:
        out["input_values"] = ctx.randn(ctx.batch, length)
    if ctx.accepts("attention_mask") and _feat_norm_uses_mask(ctx.config):
        mask = torch.ones(ctx.batch, length, dtype=torch.long)
        if ctx.batch > 1:
            mask[1, length - length // 4 :] = 0
        out["attention_mask"] = mask
    _speech_decoder(ctx, out)


def _audio_spectrogram(ctx: _Ctx, out: dict[str, torch.Tensor]) -> None:
    """AST-style: a (batch, frames, mel bins) spectrogram passed as input_values."""
    frames = int(find_attr(ctx.config, "max_length", default=64))
    bins = int(find_attr(ctx.config, "num_mel_bins", default=16))
    out["input_values"] = ctx.randn(ctx.batch, frames, bins)


def _feat_norm_uses_mask(config: Any) -> bool:
    # wav2vec2-base style (group norm) models were trained without attention masks
    return find_attr(config, "feat_extract_norm", default="layer") != "group"


def _features(ctx: _Ctx, out: dict[str, torch.Tensor], bins_first: bool) -> None:
    cfg = ctx.config
    frames = int(ctx.opts["feature_frames"])
    if bins_first:
        bins = int(find_attr(cfg, "num_mel_bins", "feature_size", prefer="audio_config", default=16))
        src = find_attr(cfg, "max_source_positions", prefer="audio_config")
        if isinstance(src, int) and "feature_frames" not in ctx.user_opts:
            frames = 2 * src
        feats = ctx.randn(ctx.batch, bins, frames)
    else:
        per_channel = find_attr(cfg, "input_feat_per_channel", prefer="audio_config")
        channels = find_attr(cfg, "input_channels", prefer="audio_config", default=1)
        dim = (
            per_channel * channels
            if isinstance(per_channel, int) and isinstance(channels, int)
            else find_attr(
                cfg, "feature_projection_input_dim", "feature_size", "num_mel_bins", "input_dim",
                prefer="audio_config", default=16,
            )
        )
        feats = ctx.randn(ctx.batch, frames, int(dim))
    out["input_features"] = feats
    # feature masks are always given; a plain attention_mask only when required (several audio
    # encoders take a pre-expanded float mask under that name)
    for name in ("input_features_mask", "audio_mel_mask", "attention_mask"):
        if ctx.accepts(name) and (_required(ctx.params, name) or name != "attention_mask"):
            mask = torch.ones(ctx.batch, frames, dtype=torch.long)
            if ctx.batch > 1:
                mask[1, frames - frames // 4 :] = 0
            out[name] = mask.bool() if name != "attention_mask" else mask
            break
    _speech_decoder(ctx, out)


def _speech_decoder(ctx: _Ctx, out: dict[str, torch.Tensor]) -> None:
    """decoder_input_ids for encoder-decoders (text or speech), unless the head derives them."""
    if not ctx.accepts("decoder_input_ids") or ctx.task in _NO_DECODER_INPUTS:
        return
    if getattr(ctx.config, "is_encoder_decoder", False) or _required(ctx.params, "decoder_input_ids"):
        out["decoder_input_ids"] = _decoder_ids(ctx)


def _time_series(ctx: _Ctx, out: dict[str, torch.Tensor]) -> None:
    cfg = ctx.config
    context = int(find_attr(cfg, "context_length", default=32))
    lags = find_attr(cfg, "lags_sequence")
    past = context + (max(lags) if lags else 0)
    channels = find_attr(cfg, "num_input_channels", "input_size", default=1)
    shape = (ctx.batch, past) if (channels == 1 and lags) else (ctx.batch, past, int(channels))
    out["past_values"] = ctx.randn(*shape)
    if ctx.accepts("past_time_features"):
        n_time = int(find_attr(cfg, "num_time_features", default=0)) + int(
            find_attr(cfg, "num_dynamic_real_features", default=0)
        )
        out["past_time_features"] = ctx.randn(ctx.batch, past, n_time)
    if ctx.accepts("past_observed_mask"):
        out["past_observed_mask"] = torch.ones(shape, dtype=torch.bool)
    pred = find_attr(cfg, "prediction_length")
    if ctx.accepts("future_values") and lags and isinstance(pred, int):
        fshape = (ctx.batch, pred) if len(shape) == 2 else (ctx.batch, pred, int(channels))
        out["future_values"] = ctx.randn(*fshape)
        if ctx.accepts("future_time_features"):
            n_time = out["past_time_features"].shape[-1] if "past_time_features" in out else 0
            out["future_time_features"] = ctx.randn(ctx.batch, pred, n_time)


def make_inputs(
    model: torch.nn.Module,
    config: Any,
    entry: Any = None,
    *,
    seed: int = 0,
    batch_size: int = 2,
    task: str | None = None,
) -> dict[str, torch.Tensor]:
    """CPU input tensors for ``model(**inputs)``, reproducible from ``seed``.

    ``entry`` (a ModelEntry or None) contributes ``inputs`` overrides and its ``task``; ``task``
    overrides the entry's.  Never touches the global RNG.
    """
    ctx = _Ctx(model, config, entry, seed, batch_size, task)
    recipe = ctx.opts.get("recipe") or default_recipe(model, config)
    if recipe not in RECIPES:
        raise ValueError(f"unknown input recipe {recipe!r}; expected one of {', '.join(RECIPES)}")
    out: dict[str, torch.Tensor] = {}
    if recipe in ("text", "text+image"):
        _text(ctx, out)
    if recipe in ("image", "text+image"):
        _image(ctx, out)
    if recipe == "video":
        _video(ctx, out)
    if recipe in ("audio", "audio-3d"):
        _audio(ctx, out, three_d=recipe == "audio-3d")
    if recipe == "audio-spec":
        _audio_spectrogram(ctx, out)
    if recipe in ("features-bft", "features-btf"):
        _features(ctx, out, bins_first=recipe == "features-bft")
    if recipe == "time-series":
        _time_series(ctx, out)
    if recipe == "vlm":
        _vlm(ctx, out)
    if recipe == "patches":  # a Qwen2-VL-style vision tower on its own
        extra: dict[str, torch.Tensor] = {}
        _patchified_image(ctx, out, extra)
        first = next((n for n in ("hidden_states", "pixel_values") if n in ctx.params), "pixel_values")
        out[first] = out.pop("pixel_values")
        grid = "grid_thw" if ctx.accepts("grid_thw") else "image_grid_thw"
        out[grid] = extra["image_grid_thw"]
    return out
