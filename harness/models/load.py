"""Loading a model-list entry into an eval-mode CPU model.

``tiny`` entries are built from the shrunk config under a fixed seed, so every process (the CPU
reference, the target run, a retry) gets bit-identical weights without any files.  ``hub`` and
``local`` entries go through ``from_pretrained``.  Failures become ``LoadError`` subclasses with
a message that says what to do, because "could not load" is the most common outcome on a new
machine (no network, no cache, remote code).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from harness.models.heads import auto_class
from harness.models.model_list import ModelEntry
from harness.models.tiny import build_tiny


class LoadError(RuntimeError):
    """The model could not be loaded; the original exception is chained as ``__cause__``."""


class ModelNotFoundError(LoadError):
    """Unknown hub id, missing revision or missing local path."""


class HubUnreachableError(LoadError):
    """No network (or offline mode) and nothing cached for this id."""


class RemoteCodeRequiredError(LoadError):
    """The checkpoint needs ``trust_remote_code`` but the entry does not allow it."""


class AttentionUnsupportedError(LoadError):
    """The requested ``attn_implementation`` (e.g. flex_attention) is not supported by this model."""


@dataclass
class LoadedModel:
    """A ready model plus what the later stages need to know about it."""

    model: torch.nn.Module
    config: Any
    entry: ModelEntry
    load_time_s: float
    lazy: frozenset[tuple[str, str]] = frozenset()  # `lazy_slots`, as loaded


def lazy_slots(model: torch.nn.Module) -> frozenset[tuple[str, str]]:
    """(module, attribute) of every plain attribute that is None: where a forward may cache a tensor it built
    lazily (Mimi's codebook keeps `_embed` so), which `.to(device)` does not move, being no buffer."""
    return frozenset((name, k) for name, mod in model.named_modules() for k, v in vars(mod).items() if v is None)


def forget_lazy(model: torch.nn.Module, slots: frozenset[tuple[str, str]]) -> list[str]:
    """Empty again the lazy slots a forward filled with a tensor (the CPU reference's, before the model moves to
    the target, which would otherwise get the CPU's tensor: a crash no fresh load on the device has). Returns
    their names."""
    mods = dict(model.named_modules())
    reset = []
    for name, k in sorted(slots):
        mod = mods.get(name)
        if mod is not None and isinstance(vars(mod).get(k), torch.Tensor):
            setattr(mod, k, None)
            reset.append(f"{name}.{k}" if name else k)
    return reset


def hf_cache_dir() -> str | None:
    """``$PORTHARNESS_HF_CACHE`` if set, else None (transformers' standard cache)."""
    return os.environ.get("PORTHARNESS_HF_CACHE") or None


def _offline() -> bool:
    # read at call time: huggingface_hub caches the variable at import
    return any(
        os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _classify(exc: BaseException, entry: ModelEntry, attn_implementation: str | None) -> LoadError:
    """Turn whatever transformers / huggingface_hub raised into an actionable LoadError."""
    from huggingface_hub import errors as hf_errors

    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    text = " | ".join(str(x) for x in chain)
    low = text.lower()
    where = entry.path if entry.source == "local" else entry.id

    def has(cls: type) -> bool:
        return any(isinstance(x, cls) for x in chain)

    if has(hf_errors.GatedRepoError):
        return LoadError(
            f"{where}: the repository is gated; accept its licence on huggingface.co and log in "
            f"(`huggingface-cli login`) or pre-download it"
        )
    if has(hf_errors.RepositoryNotFoundError) or "is not a valid model identifier" in low:
        return ModelNotFoundError(f"{where}: no such model on the hub (or it is private); check the id")
    if has(hf_errors.RevisionNotFoundError) or "invalid git identifier" in low:
        return ModelNotFoundError(
            f"{where}: revision {entry.revision!r} not found; check the revision column"
        )
    if "trust_remote_code" in low and not entry.trust_remote_code:
        return RemoteCodeRequiredError(
            f"{where}: this checkpoint ships its own modelling code; set trust_remote_code=true in the model "
            f"list if you trust it"
        )
    if has(hf_errors.LocalEntryNotFoundError) or "couldn't connect" in low or "offline" in low:
        return HubUnreachableError(
            f"{where}: not in the local cache and the hub cannot be reached"
            f"{' (HF_HUB_OFFLINE is set)' if _offline() else ''}; set HF_HUB_OFFLINE=0 or pre-download with "
            f"`huggingface-cli download {entry.id}`"
        )
    unsupported = "does not support an attention implementation" in low or (
        attn_implementation is not None and attn_implementation in text and "support" in low
    )
    if attn_implementation and unsupported:
        return AttentionUnsupportedError(
            f"{where}: attn_implementation={attn_implementation!r} is not supported by this model: {chain[0]}"
        )
    return LoadError(f"{where}: could not load ({type(exc).__name__}: {str(exc)[:500]})")


def _from_pretrained(
    entry: ModelEntry, name: str, dtype: torch.dtype | str, attn_implementation: str | None
) -> Any:
    kwargs: dict[str, Any] = {
        "dtype": dtype,
        "trust_remote_code": entry.trust_remote_code,
    }
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if entry.source == "hub":
        kwargs["revision"] = entry.revision
        kwargs["cache_dir"] = hf_cache_dir()
        if _offline():
            kwargs["local_files_only"] = True
    return auto_class(entry.task).from_pretrained(name, **kwargs)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_dtype(dtype: str | torch.dtype | None) -> torch.dtype | str:
    """`--dtype` as transformers takes it: fp32 (the default: the reference is fp32), bf16, fp16, or
    ``auto`` (the checkpoint's own ``torch_dtype``)."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)} or auto")
    return DTYPES[dtype]


def load_model(
    entry: ModelEntry,
    *,
    seed: int = 0,
    dtype: str | torch.dtype | None = None,
    attn_implementation: str | None = None,
) -> LoadedModel:
    """Load ``entry`` as an eval-mode model on CPU, in `dtype` (see `load_dtype`).

    Sharded and single-file safetensors (memory-mapped by transformers, so only one copy of the weights
    is ever built), ``.bin`` checkpoints, local save_pretrained directories and hub ids (through the
    huggingface_hub cache) all go through ``from_pretrained``. ``attn_implementation`` ("eager", "sdpa",
    "flex_attention", ...) is passed to transformers, which applies it to every sub-config. Raises
    LoadError (or a subclass) on failure.
    """
    dtype = load_dtype(dtype)
    t0 = time.perf_counter()
    try:
        if entry.source == "tiny":
            model = build_tiny(
                entry.arch, entry.task, seed=seed, dtype=torch.float32 if dtype == "auto" else dtype,
                attn_implementation=attn_implementation,
            )
        elif entry.source == "local":
            if not entry.path or not os.path.isdir(entry.path):
                raise ModelNotFoundError(
                    f"{entry.id}: local path {entry.path!r} is not a directory; fix the path column"
                )
            if not os.path.isfile(os.path.join(entry.path, "config.json")):
                raise ModelNotFoundError(
                    f"{entry.path}: no config.json there; point path at a directory "
                    f"written by save_pretrained"
                )
            model = _from_pretrained(entry, entry.path, dtype, attn_implementation)
        elif entry.source == "hub":
            model = _from_pretrained(entry, entry.id, dtype, attn_implementation)
        else:
            raise LoadError(f"{entry.id}: unknown source {entry.source!r}")
    except LoadError:
        raise
    except Exception as exc:  # transformers raises OSError/ValueError/ImportError/... for everything
        raise _classify(exc, entry, attn_implementation) from exc
    model = model.to("cpu").eval()
    return LoadedModel(model=model, config=model.config, entry=entry, load_time_s=time.perf_counter() - t0,
                       lazy=lazy_slots(model))
