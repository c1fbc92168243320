"""Seeded labels for a training step: what each task head's own loss takes.

A training step is judged on the model's own loss where its head computes one (so the loss kernels --
cross-entropy, its log-softmax, regression losses -- run on the target too). Labels are reproducible
from the seed alone (a local generator, as for the inputs), valid for the head (class ids below
``num_labels``, positions inside the sequence) and ignore padded positions (-100) the way a data
collator does. A head without labels gets none: the step then uses a fixed reduction of the outputs
(`harness.run.train`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from harness.models.configs import vocab_size

# Heads that classify a whole example (one label per batch row) from `num_labels` classes.
_PER_EXAMPLE = ("seq-cls", "image-cls", "audio-cls", "video-cls")


def _accepts(model: torch.nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _batch(inputs: dict[str, Any]) -> int:
    first = next((v for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim() > 0), None)
    return int(first.shape[0]) if first is not None else 1


def _ignore_padding(labels: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
    mask = inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.shape == labels.shape:
        labels = labels.masked_fill(mask == 0, -100)
    return labels


def make_labels(model: torch.nn.Module, config: Any, task: str, inputs: dict[str, Any], *, seed: int = 0
                ) -> dict[str, torch.Tensor]:
    """Label tensors to add to ``inputs`` for ``task`` ({} when the head takes none we can build)."""
    accepts = _accepts(model)
    g = torch.Generator().manual_seed(seed + 7919)  # not the inputs' stream: labels are not a copy of them
    batch = _batch(inputs)
    ids = inputs.get("input_ids")
    num_labels = int(getattr(config, "num_labels", 2) or 2)
    if task in ("qa",) and {"start_positions", "end_positions"} <= accepts and isinstance(ids, torch.Tensor):
        seq = ids.shape[-1]
        return {"start_positions": torch.randint(0, seq, (batch,), generator=g),
                "end_positions": torch.randint(0, seq, (batch,), generator=g)}
    if "labels" not in accepts:
        return {}
    if task in ("causal-lm", "masked-lm") and isinstance(ids, torch.Tensor):
        return {"labels": _ignore_padding(ids.clone(), inputs)}  # causal LMs shift them internally
    if task in ("seq2seq-lm", "speech-seq2seq"):
        dec = inputs.get("decoder_input_ids")
        shape = tuple(dec.shape) if isinstance(dec, torch.Tensor) else (batch, 8)
        vocab = vocab_size(config)
        return {"labels": torch.randint(3 if vocab > 3 else 0, vocab, shape, generator=g)}
    if task == "token-cls" and isinstance(ids, torch.Tensor):
        return {"labels": _ignore_padding(torch.randint(0, num_labels, tuple(ids.shape), generator=g), inputs)}
    if task in _PER_EXAMPLE:
        if num_labels == 1:  # a regression head: MSE on float targets
            return {"labels": torch.randn(batch, generator=g)}
        return {"labels": torch.randint(0, num_labels, (batch,), generator=g)}
    if task == "multiple-choice":
        choices = int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.dim() == 3 else 2
        return {"labels": torch.randint(0, choices, (batch,), generator=g)}
    if task == "next-sentence":
        return {"labels": torch.randint(0, 2, (batch,), generator=g)}
    return {}
