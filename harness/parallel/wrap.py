"""A model spread over a mesh as its spec says, the way users of PyTorch's distributed stack do it.

- ``ddp``: `DistributedDataParallel` around the model (only a training step has anything to reduce: in
  inference and decoding every rank runs its own replica, as a DDP job's ranks do);
- ``fsdp``: FSDP2 (`fully_shard`) on each block of the model's outermost layer stacks (the children of each
  `nn.ModuleList` not inside another block: a block that holds a stack of its own, as T5's and ConvNeXt's
  do, is one unit), then on the root, over the data-parallel dimension. 0-d parameters (CLIP's
  ``logit_scale``), which FSDP2 cannot shard, stay whole on every rank: every rank steps on the same batch,
  so their local gradients are the reduced ones;
- ``tp``: transformers' own tensor-parallel plan (``from_pretrained(..., tp_plan="auto")``), loaded by the
  rank (`rank.load_model`); a 2-D spec is transformers' own too (``DistributedConfig(tp_size, fsdp_size)``, or
  ``dp_replicate_size`` for ddp), as its users train: here only what wraps a 1-D data-parallel model.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.parallel.spec import ParallelSpec


def tp_plan(config: Any) -> dict[str, str]:
    """The model family's tensor-parallel plan (``base_model_tp_plan``, its text config's for a multimodal
    one); {} when it declares none."""
    for c in (config, getattr(config, "get_text_config", lambda: None)()):
        plan = getattr(c, "base_model_tp_plan", None) if c is not None else None
        if plan:
            return dict(plan)
    return {}


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's layer blocks: the children of each outermost `nn.ModuleList` (transformer layers, encoder
    blocks, a vision model's stages). Sharding a block inside another sharded block would shard its
    parameters twice ("Cannot concatenate overlapping meshes")."""
    out: list[torch.nn.Module] = []
    taken: list[str] = []
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.ModuleList) or any(name.startswith(t + ".") for t in taken):
            continue
        for child_name, child in m.named_children():
            if child not in out:
                out.append(child)
                taken.append(f"{name}.{child_name}" if name else child_name)
    return out


def wrap(model: torch.nn.Module, spec: ParallelSpec, mesh: Any, *, training: bool, device: torch.device
         ) -> torch.nn.Module:
    """`model` (already tensor-parallel where the spec says so) wrapped for its data-parallel dimension."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if mesh.ndim > 1 or isinstance(model, FSDPModule):
        return model  # a 2-D spec: transformers' DistributedConfig applied the data-parallel dimension on loading
    dp = mesh
    if "fsdp" in spec.kinds:
        whole = {p for p in model.parameters() if p.dim() == 0} or None
        for block in blocks(model):
            fully_shard(block, mesh=dp, ignored_params=whole)
        fully_shard(model, mesh=dp, ignored_params=whole)
        return model
    if "ddp" in spec.kinds and training:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=None, process_group=dp.get_group(), broadcast_buffers=False)
    return model


def unwrap_names(out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Output names as one device's model has them (DDP prefixes its module's parameters with ``module.``)."""
    return {k.replace("/module.", "/", 1) if "/module." in k else k: v for k, v in out.items()}


def planless(entries: list[Any]) -> tuple[list[str], list[str]]:
    """(models whose family declares no tensor-parallel plan, models that cannot be told without loading them:
    a hub checkpoint's config is not fetched to answer). A tiny build's config is made here, a local
    checkpoint's read from its directory."""
    from harness.models.tiny import tiny_config

    without, unknown = [], []
    for e in entries:
        try:
            if e.source == "tiny":
                config = tiny_config(e.arch, e.task)
            elif e.source == "local":
                from transformers import AutoConfig

                config = AutoConfig.from_pretrained(e.path or e.id, trust_remote_code=bool(e.trust_remote_code))
            else:
                unknown.append(e.id)
                continue
        except Exception:
            unknown.append(e.id)
            continue
        if not tp_plan(config):
            without.append(e.id)
    return without, unknown
