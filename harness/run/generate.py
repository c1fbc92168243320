"""Greedy decoding, the unit generate mode compares: transformers' own `generate()` with a KV cache.

- The prompt is the model's seeded inputs, a decoder-only prompt left-padded as batched serving pads it
  (its padded row's mask, positions and cache slots then move every step); an encoder-decoder starts its
  decoder from its start token (the encoder takes the inputs as they are).
- Decoding is greedy (`do_sample=False`, one beam) for exactly `new_tokens` tokens: end-of-sequence is
  switched off, so every row decodes every step on every side. The model's own logits processors stay
  (BART's no-repeat n-grams, Whisper's suppressed tokens): they are part of what `generate()` runs.
- ``cache="static"`` asks for transformers' StaticCache (``cache_implementation="static"``: preallocated
  tensors written in place with `index_copy_`, the path compiled decoders use); ``dynamic`` is the
  default DynamicCache (the cache grows by `cat` along the sequence). Models with a cache of their own
  (Mamba, RWKV) get it either way: `cache_kind` says which one `generate()` used.
- Step k's logits are the model's raw next-token logits (its own dtype, before any processor: fp64 on
  the oracle), read by a forward hook: step 0 is the prompt's forward, step k >= 1 feeds one token
  through the cache.
- Teacher forcing (`TeacherForced`): a last logits processor forces the reference's token at every
  step, so the target decodes along the reference's tokens (one flipped near-tie cannot cascade) and
  its step-k logits are judged against the reference's step-k logits by the usual rule.
- Free running (`agreement`): the target's own greedy tokens against the reference's; at the first
  divergent step, the reference's top-2 logit margin against the declared envelope there (twice the
  largest logit error the declared precision itself makes at that step, times the rule's multiplier, plus
  its floor), so a flip inside the envelope reads "near-tie"; one outside it, or at a step whose
  teacher-forced logits are themselves beyond the bound, reads "bug".
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from harness.models.outputs import on_host
from harness.results.draft import RowDraft
from harness.results.rows import output_step, step_output
from harness.run.compare import (
    TensorCheck,
    _multiplier,  # the rule's m (3 for small or half-precision outputs, else 2)
)

_NOT_PROMPT = ("decoder_input_ids", "decoder_attention_mask", "labels")


def not_generative(model: torch.nn.Module) -> str:
    """Why `generate()` cannot decode with this model ("" when it can)."""
    can = getattr(model, "can_generate", None)
    if can is None or not can():
        return f"{type(model).__name__} has no generation head (transformers' can_generate() is False)"
    return ""


def prompt(model: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
    """`inputs` as a decoding prompt: no decoder inputs or labels; a decoder-only prompt left-padded."""
    out = {k: v for k, v in inputs.items() if k not in _NOT_PROMPT}
    mask = out.get("attention_mask")
    if getattr(model.config, "is_encoder_decoder", False) or not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return out
    shifts = (mask.shape[1] - mask.sum(-1)).tolist()  # right padding per row
    for row, n in enumerate(shifts):
        if n <= 0 or bool(mask[row, -n:].any()):
            continue  # unpadded, or not padded at the end
        for k, v in out.items():
            if isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dim() >= 2 and v.shape[:2] == mask.shape:
                v = out[k] = v.clone() if v is inputs.get(k) else v
                v[row] = torch.roll(v[row], shifts=n, dims=0)
    return out


@dataclass
class Decoded:
    tokens: torch.Tensor  # (batch, new_tokens) int64, on the CPU
    logits: list[torch.Tensor]  # per step: (batch, vocab), the model's dtype, on the CPU
    cache_kind: str  # the cache class generate() decoded with ("" when none)


class _Force:
    """A logits processor that leaves only the given token per row and step (teacher forcing). Step 0 is
    its first call: the sequence generate() starts from is its own business (BLIP trims the prompt)."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens, self.start = tokens, -1

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.start < 0:
            self.start = input_ids.shape[1]
        k = input_ids.shape[1] - self.start
        forced = self.tokens[:, k : k + 1].to(scores.device)
        return torch.full_like(scores, -math.inf).scatter(1, forced, 0.0)


def _config(model: torch.nn.Module, new_tokens: int, cache: str) -> Any:
    # eos_token_id=[]: no token ends a row (None would be filled in from the model's own config)
    gc = copy.deepcopy(model.generation_config)
    pad = gc.pad_token_id if gc.pad_token_id is not None else 0
    gc.update(max_new_tokens=new_tokens, min_new_tokens=None, max_length=None, do_sample=False, num_beams=1,
              num_return_sequences=1, eos_token_id=[], pad_token_id=pad, use_cache=True, return_dict_in_generate=True,
              output_logits=False, output_scores=False, cache_implementation="static" if cache == "static" else None)
    return gc


def decode(model: torch.nn.Module, inputs: dict[str, Any], new_tokens: int, cache: str,
           force: torch.Tensor | None = None, seen: dict[int, list[torch.Tensor]] | None = None) -> Decoded:
    """Greedy decoding of `new_tokens` tokens (along `force`'s tokens, (batch, new_tokens), when given);
    `seen` (filled while it runs) gets each generating module's logits, step by step."""
    from transformers import LogitsProcessorList

    # The logits of the module generate() really steps: the model itself, or a generating part of it
    # (BLIP's generate() runs its text decoder's).
    seen = {} if seen is None else seen
    handles = [m.register_forward_hook(_recorder(seen.setdefault(i, []))) for i, m in enumerate(_generators(model))]
    processors = LogitsProcessorList([_Force(force)] if force is not None else [])
    try:
        with torch.no_grad():
            result = model.generate(**inputs, generation_config=_config(model, new_tokens, cache),
                                    logits_processor=processors)
    finally:
        for h in handles:
            h.remove()
    logits = next((steps for steps in seen.values() if steps), [])
    tokens = on_host(result.sequences[:, -new_tokens:])
    if tokens.shape[1] != new_tokens or len(logits) != new_tokens:
        raise RuntimeError(f"generate() decoded {tokens.shape[1]} tokens in {len(logits)} forwards, "
                           f"expected {new_tokens} of each")
    return Decoded(tokens, logits, _cache_kind(getattr(result, "past_key_values", None)))


def _generators(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model, then its submodules that can generate, outermost first."""
    return [model] + [m for m in model.modules() if m is not model and getattr(type(m), "can_generate", None)
                      and type(m).can_generate()]


def _recorder(into: list[torch.Tensor]) -> Callable[..., None]:
    def hook(_module: Any, _args: Any, output: Any) -> None:
        out = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
        if isinstance(out, torch.Tensor):
            into.append(on_host(out[:, -1]))

    return hook


def _cache_kind(cache: Any) -> str:
    if cache is None:
        return ""
    inner = getattr(cache, "self_attention_cache", None)
    return type(inner if inner is not None else cache).__name__


def uses_static_cache(kind: str) -> bool:
    return kind.startswith("Static")


class TeacherForced:
    """The step: decode along `tokens`, each step's logits as a named output. While it runs, `now()` is
    the decoding step running (the steps whose logits came out so far: an encoder's or a vision tower's
    forward before the first step's logits is step 0's), so the op check can say where a kernel failed."""

    def __init__(self, new_tokens: int, cache: str, tokens: torch.Tensor) -> None:
        self.new_tokens, self.cache, self.tokens = new_tokens, cache, tokens
        self._seen: dict[int, list[torch.Tensor]] = {}

    def __call__(self, model: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
        self._seen = {}
        run = decode(model, inputs, self.new_tokens, self.cache, force=self.tokens, seen=self._seen)
        return {step_output(k): t for k, t in enumerate(run.logits)}

    def now(self) -> int | None:
        return next((len(steps) for steps in self._seen.values() if steps), 0) if self._seen else None


def free_running(new_tokens: int, cache: str) -> Callable[[torch.nn.Module, dict[str, Any]], torch.Tensor]:
    """The target's own greedy tokens."""
    return lambda model, inputs: decode(model, inputs, new_tokens, cache).tokens


def step_fields(checks: Mapping[str, TensorCheck]) -> RowDraft:
    """The first step whose logits are outside the envelope that decides the verdict (None: none)."""
    steps = sorted(((k, c) for name, c in checks.items() if (k := output_step(name)) is not None), key=lambda s: s[0])
    bad = next((k for k, c in steps if not c.ok_declared), None)
    return RowDraft(first_drift_step=bad)


def agreement(ref_tokens: torch.Tensor, target_tokens: torch.Tensor, ref: dict[str, torch.Tensor],
              oracle: dict[str, torch.Tensor] | None, expected: dict[str, torch.Tensor] | None,
              floor: float, step_ok: dict[str, bool] | None = None) -> RowDraft:
    """Row fields for the free-running tokens: matched steps, the first divergent step, and there the
    reference's top-2 margin against the declared envelope: "near-tie" inside it, "bug" outside it, or
    where that step's teacher-forced logits (`step_ok`: output name -> within the verdict's envelope) are
    themselves beyond the bound."""
    same = (ref_tokens == target_tokens).all(dim=0).tolist()
    first = next((k for k, s in enumerate(same) if not s), None)
    out = RowDraft(tokens_matched=len(same) if first is None else first, first_divergent_step=first,
                   target_tokens=target_tokens.tolist())
    if first is None:
        return out
    row = int(torch.nonzero(ref_tokens[:, first] != target_tokens[:, first])[0, 0])
    logits = ref[step_output(first)]
    top = torch.topk(logits[row].double(), 2).values
    margin = (top[0] - top[1]).item()
    # What the declared precision itself moves a logit by at this step (the fp32 reference's own error
    # where the contract is exact): the two top logits may each move that far, times the rule's multiplier.
    declared = (expected or ref).get(step_output(first), logits)
    truth = oracle.get(step_output(first)) if oracle else None
    err = (declared[row].double() - truth[row].double()).abs() if truth is not None else torch.zeros(1)
    finite = err[torch.isfinite(err)]
    envelope = 2 * (_multiplier(logits) * (finite.max().item() if finite.numel() else 0.0) + floor)
    tie = margin <= envelope and (step_ok or {}).get(step_output(first), True)
    out.update(divergence_margin=margin, divergence_envelope=envelope, divergence="near-tie" if tie else "bug")
    return out


def tokenizer_for(entry: Any) -> Any:
    """The checkpoint's tokenizer (None: a tiny build, which has none, or one that cannot be loaded); the
    model page shows decoded tokens with it. Never fails the row: the ids stay."""
    if getattr(entry, "source", "") == "tiny":
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(entry.path or entry.id, revision=entry.revision or None,
                                             trust_remote_code=bool(entry.trust_remote_code))
    except Exception:  # no tokenizer files, an offline hub: the strip shows ids
        return None


def token_text(tokenizer: Any, *token_lists: list[list[int]]) -> dict[str, str]:
    """Each token id in the decoded rows -> its text as the tokenizer decodes it alone ({} without one)."""
    if tokenizer is None:
        return {}
    ids = sorted({int(t) for rows in token_lists for row in rows for t in row})
    try:
        return {str(i): tokenizer.decode([i]) for i in ids}
    except Exception:
        return {}
