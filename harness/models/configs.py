"""Reading transformers configs: an attribute may live on the config or on any nested sub-config.

Multimodal and encoder-decoder configs nest their text/vision/audio parts (``text_config``,
``vision_config``, ``encoder``...), so "the vocab size" or "the image size" is looked up through
them in a fixed order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

_SUBCONFIG_ORDER = ("vision_config", "text_config", "audio_config", "encoder", "decoder", "backbone_config")




def _subconfigs(config: Any) -> list[Any]:
    from transformers import PretrainedConfig

    subs = []
    names = list(_SUBCONFIG_ORDER) + sorted(getattr(config, "sub_configs", {}) or {})
    for name in dict.fromkeys(names):
        sub = getattr(config, name, None)
        if isinstance(sub, PretrainedConfig):
            subs.append(sub)
    return subs


def _walk(config: Any, prefer: str | None = None) -> Iterator[Any]:
    """The config, then its sub-configs breadth-first (``prefer`` first, e.g. ``vision_config``)."""
    queue = [config]
    seen: set[int] = set()
    while queue:
        cfg = queue.pop(0)
        if id(cfg) in seen:
            continue
        seen.add(id(cfg))
        yield cfg
        subs = _subconfigs(cfg)
        if prefer:
            subs.sort(key=lambda s: 0 if getattr(cfg, prefer, None) is s else 1)
        queue.extend(subs)


def find_attr(config: Any, *names: str, prefer: str | None = None, default: Any = None) -> Any:
    """First non-None attribute among ``names`` in ``config`` or its nested sub-configs."""
    order = list(_walk(config, prefer))
    if prefer:
        pref = getattr(config, prefer, None)
        if pref is not None:
            order = list(_walk(pref)) + order
    for cfg in order:
        for name in names:
            value = getattr(cfg, name, None)
            if value is not None:
                return value
    return default


def special_ids(config: Any) -> set[int]:
    ids: set[int] = set()
    for cfg in _walk(config):
        for key, value in vars(cfg).items():
            if not isinstance(key, str) or not key.endswith(("token_id", "token_index", "token_ids")):
                continue
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, int) and not isinstance(v, bool):
                    ids.add(v)
    return ids


def text_config(config: Any) -> Any:
    try:
        return config.get_text_config(decoder=True)
    except (AttributeError, TypeError, ValueError):
        return config


def vocab_size(config: Any) -> int:
    """The text vocab size tokens must stay below."""
    text = text_config(config)
    v = getattr(text, "vocab_size", None) or find_attr(config, "vocab_size", prefer="text_config")
    return int(v) if v else 1024


def as_hw(value: Any, fallback: int) -> tuple[int, int]:
    if isinstance(value, (list, tuple)) and len(value) >= 2:
        return int(value[0]), int(value[1])
    if isinstance(value, int):
        return value, value
    return fallback, fallback


# ----------------------------------------------------------------------------------------------
# options
# ----------------------------------------------------------------------------------------------
