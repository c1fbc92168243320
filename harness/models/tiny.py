"""Tiny models: every (architecture, head) pair transformers registers, built at toy size.

Real checkpoints are big and need the network. So for a model type we take transformers' default
config, shrink it (`shrink.py`), adapt it to the head, and instantiate it with seeded random weights:
every process builds bit-identical models without any files. This is the only place tiny models are
built; the runner, the zoo generator, the collectives benchmark and the scripts all come here.
"""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from harness.models.heads import auto_class, head_mapping
from harness.models.shrink import NUM_LABELS, OVERRIDES, VOCAB, is_token_key, shrink_dict

if TYPE_CHECKING:  # transformers and torch are imported lazily: listing heads must not cost an import
    import torch
    from transformers import PretrainedConfig

def _collect_token_ids(d: dict[str, Any], found: set[int]) -> None:
    for key, value in d.items():
        if not isinstance(key, str) or key in {"id2label", "label2id"}:
            continue
        if isinstance(value, dict):
            _collect_token_ids(value, found)
        elif is_token_key(key.lower()) or key in {"suppress_tokens", "begin_suppress_tokens"}:
            vals = value if isinstance(value, list) else [value]
            found.update(x for x in vals if isinstance(x, int) and not isinstance(x, bool) and x >= VOCAB)


def _remap_token_ids(d: dict[str, Any], mapping: dict[int, int]) -> None:
    for key, value in d.items():
        if not isinstance(key, str) or key in {"id2label", "label2id"}:
            continue
        if isinstance(value, dict):
            _remap_token_ids(value, mapping)
        elif is_token_key(key.lower()) or key in {"suppress_tokens", "begin_suppress_tokens"}:
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
    shrink_dict(d)
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



@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch, Python and NumPy for a model's construction; every RNG is restored afterwards.

    A few initialisers draw from Python's or NumPy's RNG instead of torch's, so all three are seeded;
    callers' own randomness is unaffected and two builds with one seed give identical weights."""
    import numpy as np
    import torch

    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed)
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


def build_from_config(task: str, config: Any, *, seed: int = 0, **kwargs: Any) -> torch.nn.Module:
    """`task`'s Auto class instantiated from `config` with seeded random weights, in eval mode."""
    with seeded(seed):
        model = auto_class(task).from_config(config, **kwargs)
    return model.eval()


def build_tiny(
    arch: str,
    task: str,
    *,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    attn_implementation: str | None = None,
) -> torch.nn.Module:
    """The tiny `arch` model with head `task` and seeded random weights (fp32 unless `dtype`), eval mode."""
    import torch

    kwargs: dict[str, Any] = {"dtype": dtype or torch.float32}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    return build_from_config(task, tiny_config(arch, task), seed=seed, **kwargs)
