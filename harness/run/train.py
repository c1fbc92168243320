"""One deterministic training step, the unit train mode compares: the loss, every parameter's gradient,
and every parameter's update under two optimizers.

- Dropout is off by p = 0 with everything else in train mode (BatchNorm uses batch statistics, MoE
  routers and LayerDrop see `training=True`). Eval-mode dropout modules would not reach functional
  dropout, which most attention code calls with a probability it keeps as a float
  (``dropout=self.attention_dropout if self.training else 0.0``), so those floats are zeroed too, on
  the modules and on their configs, with stochastic depth, LayerDrop, router jitter and SpecAugment
  masking. What randomness is left is found, not assumed: the reference runs the step twice under
  different seeds, and a step whose result depends on the seed is `ref_nondeterministic`.
- The loss is the head's own (seeded labels from `harness.models.labels`), so the loss kernels run on
  the target as well; a head without labels uses a fixed reduction: sum over the float outputs of
  mean(output * w), w a seeded N(0, 1) tensor of the output's shape (a random projection: a plain sum
  gives softmax-normalised outputs no gradient at all).
- Backward, then SGD (momentum 0.9) and AdamW (weight decay 0.01), lr 1e-3, each from the same
  gradients and starting parameters. The *update* (after - before) is compared, not the parameter
  after the step: an update of 1e-3 on weights of size 1e-1 would hide in the weight's own digits.
  The target's updates are judged against the same optimizers replayed on the CPU from the target's
  own gradients (`replay_updates`): the gradients have their own verdict, and AdamW's first step,
  lr * g / (|g| + eps), would turn a gradient's last bits near eps into lr-sized differences.
- Under ``--amp`` the forward and the loss run inside the step's autocast region (the backward and the
  optimizers outside it, as PyTorch's AMP recipe has it); fp16 scales the loss with
  ``torch.amp.GradScaler(<device>)``, reports the unscaled gradients, and lets the scaler skip both
  optimizer steps when a gradient is inf/NaN (``amp/step_skipped``: judged against the reference's own
  decision, not as an output).
- The step leaves the model as it found it (parameters, buffers, no gradients): it can run again,
  under a dispatch mode (the declared-precision emulation, the op check), on any copy.
"""

from __future__ import annotations

import math
import re
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from harness.backends.contracts import amp_dtype, autocast_region
from harness.models.outputs import on_host, output_tensors
from harness.results.draft import RowDraft
from harness.run.compare import TensorCheck

LR = 1e-3
MOMENTUM = 0.9
WEIGHT_DECAY = 0.01
OPTIMIZERS = ("sgd", "adamw")
SKIPPED = "amp/step_skipped"  # 1 when the fp16 loss scaler skipped the optimizer steps (inf/NaN gradients)
# Float settings that draw random numbers in train mode (dropout probabilities, stochastic depth,
# LayerDrop, router jitter, SpecAugment masking), on modules and configs alike.
_RANDOM = re.compile(r"dropout|drop_prob|drop_path|pdrop|layerdrop|layer_drop|jitter|mask_time_prob|"
                     r"mask_feature_prob")


# What prepare() zeroed on each config (by id; the config held weakly): `as_loaded` puts it back.
_ZEROED: dict[int, tuple[weakref.ref, dict[str, float]]] = {}


def _zero_random_floats(obj: Any, seen: set[int]) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    for name, value in list(vars(obj).items()):
        if isinstance(value, float) and not isinstance(value, bool) and value > 0 and _RANDOM.search(name):
            setattr(obj, name, 0.0)
            if type(obj).__name__.endswith("Config"):
                key = id(obj)
                ref, zeroed = _ZEROED.get(key, (None, {}))
                if ref is None or ref() is not obj:
                    zeroed = {}
                    _ZEROED[key] = (weakref.ref(obj, lambda _, k=key: _ZEROED.pop(k, None)), zeroed)
                zeroed[name] = value
        elif type(value).__name__.endswith("Config") and hasattr(value, "to_dict"):  # sub-configs
            _zero_random_floats(value, seen)


def prepare(model: torch.nn.Module) -> torch.nn.Module:
    """Train mode with every source of randomness we know of switched off (in place)."""
    model.train()
    seen: set[int] = set()
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.p = 0.0
        _zero_random_floats(m, seen)
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            _zero_random_floats(config, seen)
    return model


@contextmanager
def as_loaded(model: torch.nn.Module) -> Iterator[None]:
    """`model`'s configs with the random settings `prepare` zeroed as they were loaded, for saving a checkpoint
    that rebuilds the same modules (wav2vec2 makes ``masked_spec_embed`` only while ``mask_time_prob`` > 0);
    zeroed again after."""
    configs, todo, seen = [], [getattr(model, "config", None)], set()
    while todo:
        c = todo.pop()
        if c is None or id(c) in seen or not hasattr(c, "to_dict"):
            continue
        seen.add(id(c))
        ref, zeroed = _ZEROED.get(id(c), (None, {}))
        if ref is not None and ref() is c:
            configs.append((c, zeroed))
        todo.extend(v for v in vars(c).values() if type(v).__name__.endswith("Config"))
    for c, zeroed in configs:
        for name, value in zeroed.items():
            setattr(c, name, value)
    try:
        yield
    finally:
        for c, zeroed in configs:
            for name in zeroed:
                setattr(c, name, 0.0)


def _loss(out: Any, use_model_loss: bool, seed: int) -> torch.Tensor:
    if use_model_loss:
        loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
        if isinstance(loss, torch.Tensor):
            return loss
        raise ValueError("the head returned no loss for its labels")
    g = torch.Generator().manual_seed(seed + 104729)
    total = None
    for name, t in sorted(output_tensors(out).items()):
        if name == "loss" or not t.is_floating_point() or not t.requires_grad or t.numel() == 0:
            continue
        w = torch.randn(tuple(t.shape), generator=g).to(device=t.device, dtype=t.dtype)
        term = (t * w).mean()
        total = term if total is None else total + term
    if total is None:
        raise ValueError("no float output depends on the parameters: nothing to train")
    return total


def _optimizer(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def step_device(model: torch.nn.Module, inputs: dict[str, Any]) -> torch.device:
    """Where a step runs: its first tensor input's device, else its first parameter's."""
    for v in inputs.values():
        if isinstance(v, torch.Tensor):
            return v.device
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def train_step(model: torch.nn.Module, inputs: dict[str, Any], *, model_loss: bool, seed: int = 0,
               ) -> dict[str, torch.Tensor]:
    """``{"loss", "grad/<param>", "sgd/<param>", "adamw/<param>"}`` as CPU tensors, parameters in module
    order (and ``amp/step_skipped`` under fp16 autocast). `inputs` include the labels when `model_loss`
    (the head's own loss), else the fixed reduction is the loss. A parameter that gets no gradient has
    no ``grad/`` entry; `missing_grads` compares those."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters: there is no training step to compare")
    buffers = [(b, b.detach().clone()) for _, b in model.named_buffers()]
    start = [p.detach().clone() for _, p in params]
    device = step_device(model, inputs)
    scaler = torch.amp.GradScaler(device.type) if amp_dtype() is torch.float16 else None
    model.zero_grad(set_to_none=True)
    try:
        with torch.enable_grad():
            with autocast_region(device):
                out = model(**inputs)
                loss = _loss(out, model_loss, seed)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        result = {"loss": on_host(loss)}
        if scaler is None:
            result.update({f"grad/{n}": on_host(p.grad) for n, p in params if p.grad is not None})
        scaled = {n: p.grad.detach().clone() for n, p in params if p.grad is not None} if scaler is not None else {}
        with torch.no_grad():
            for i, name in enumerate(OPTIMIZERS):
                opt = _optimizer(name, [p for _, p in params])
                if scaler is None:
                    opt.step()
                else:  # each optimizer unscales the same scaled gradients, and the scaler may skip its step
                    for n, p in params:
                        p.grad = scaled[n].clone() if n in scaled else None
                    scaler.unscale_(opt)
                    if i == 0:
                        grads = {n: on_host(p.grad) for n, p in params if p.grad is not None}
                        result.update({f"grad/{n}": g for n, g in grads.items()})
                        finite = all(bool(torch.isfinite(g).all()) for g in grads.values())
                        result[SKIPPED] = torch.tensor(0 if finite else 1)
                    scaler.step(opt)
                for (n, p), p0 in zip(params, start, strict=True):
                    result[f"{name}/{n}"] = on_host(p.detach() - p0)
                    p.copy_(p0)
    finally:  # also when a step fails half-way (under the op check): later runs start from the same point
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for (_, p), p0 in zip(params, start, strict=True):
                p.copy_(p0)
            for b, b0 in buffers:
                b.copy_(b0)
        _detach_cached_state(model)
    return result


def _detach_cached_state(model: torch.nn.Module) -> None:
    """Detach tensors a forward left on its modules outside parameters and buffers (RecurrentGemma keeps
    its recurrent state as a plain attribute): with grad on they hold the step's graph, so the model
    could not be deep-copied for the target and would keep the whole graph alive."""
    for module in model.modules():
        for key, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                setattr(module, key, value.detach())


def replay_updates(model: torch.nn.Module, result: dict[str, torch.Tensor], dtype: torch.dtype | None = None
                   ) -> dict[str, torch.Tensor]:
    """The optimizers' updates recomputed on the CPU in `dtype` (default: each parameter's own, as the
    target stepped it) from `model`'s parameters (the starting point, on the CPU) and the gradients in
    `result` (the target's): what the target's optimizer step
    should have produced *given its own gradients*. Gradients are judged on their own; comparing the
    target's updates with the reference's would judge them twice, and AdamW's first step amplifies a
    gradient's last bits near its eps (d update / d g = lr / eps = 1e5) past any fair bound."""
    out: dict[str, torch.Tensor] = {}
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for opt in OPTIMIZERS:
        params = []
        for n, p in named:
            q = p.detach().to(device="cpu", dtype=dtype or p.dtype).clone()
            g = result.get(f"grad/{n}")
            q.grad = g.to(q.dtype) if g is not None else None
            params.append(q)
        start = [q.clone() for q in params]
        _optimizer(opt, params).step()
        out.update({f"{opt}/{n}": q - q0 for (n, _), q, q0 in zip(named, params, start, strict=True)})
    return out


def missing_grads(ref: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> list[str]:
    """Parameters with a gradient on the reference and none on the target, in module order."""
    return [k.removeprefix("grad/") for k in ref if k.startswith("grad/") and k not in target]


def train_metrics(ref: dict[str, torch.Tensor], target: dict[str, torch.Tensor], checks: Mapping[str, TensorCheck]
                  ) -> RowDraft:
    """Row fields: worst gradient ratio, the first parameter (module order) whose gradient is outside
    the envelope that decides the verdict, the gradient-norm ratio, the loss delta."""
    grads = [k for k in ref if k.startswith("grad/") and k in target]
    ratios = [r for k in grads if k in checks and (r := checks[k].rmse_ratio) is not None and math.isfinite(r)]
    bad = next((k for k in grads if k in checks and not checks[k].ok_declared), None)  # = ok without a contract
    norm_ref = torch.sqrt(sum((ref[k].double() ** 2).sum() for k in grads)) if grads else None
    norm_tgt = torch.sqrt(sum((target[k].double() ** 2).sum() for k in grads)) if grads else None
    loss_delta = (target["loss"].double() - ref["loss"].double()).item() if "loss" in target else None
    return RowDraft(
        grad_worst_ratio=max(ratios) if ratios else None,
        first_drift_param=bad.removeprefix("grad/") if bad else "",
        grad_norm_ratio=(norm_tgt / norm_ref).item() if norm_ref is not None and norm_ref > 0 else None,
        loss_delta=loss_delta,
    )


NOISE_FLOOR = 1e-2  # of a family's RMS: where a relative floor stops (see Tolerance.min_rms)


def family_floors(ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per output family (gradients, each optimizer's updates), NOISE_FLOOR times the RMS over all its
    tensors: fp32 noise in a gradient that cancels to zero scales with its neighbours', not with
    itself. Tensors above NOISE_FLOOR of their family's RMS keep their own relative floor."""
    sums: dict[str, list[float]] = {}
    for name, t in ref.items():
        family, _, rest = name.partition("/")
        if rest and t.is_floating_point() and t.numel():
            acc = sums.setdefault(family, [0.0, 0])
            acc[0] += torch.sum(torch.square(t.double())).item()
            acc[1] += t.numel()
    return {f: NOISE_FLOOR * math.sqrt(s / n) for f, (s, n) in sums.items()}
