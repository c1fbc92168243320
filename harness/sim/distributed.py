"""The ``sim`` c10d backend: collectives on `sim` tensors, with the communication settings real backends ship.

Importing this module registers ``sim`` (and the ``shaped_gloo`` / ``shaped_nccl`` backends of
`harness.comms.shaped`), so ``dist.init_process_group("sim", ...)`` followed by ``dist.all_reduce`` or
``DistributedDataParallel`` on `sim` tensors works as on ``nccl``. Underneath it is gloo on the host
tensors behind the sim tensors, shaped by `harness.comms.settings` (skinny collectives, buckets, a
message cap, per-host placement: env vars and API re-exported here as sim switches like the others).

Use::

    import torch, torch.distributed as dist
    import harness.sim.distributed as simdist  # after torch: registers the backends
    dist.init_process_group("sim", store=store, rank=rank, world_size=world)
    t = torch.ones(4).to(f"sim:{rank % harness.sim.device_count()}")
    with simdist.collective_settings(simdist.parse_setting("skinny")):
        dist.all_reduce(t)

DDP trains on any sim device (``sim:{rank % device_count}``), and ``model.to("sim")`` keeps tied
weights tied (GPT-2's ``lm_head``/``wte``), as on a real accelerator.

This module depends only on torch, `harness.sim` and `harness.comms` (torch only).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from harness.comms.planner import ShapedCollectives
from harness.comms.settings import (  # noqa: F401  the sim switches, re-exported
    BUCKET_MB_ENV,
    DEFAULT_BUCKET_MB,
    DEFAULT_RANKS_PER_HOST,
    DEFAULT_SKINNY_BYTES,
    MAX_MESSAGE_ENV,
    PLACEMENT_ENV,
    PLACEMENTS,
    RANKS_PER_HOST_ENV,
    SETTING_GRAMMAR,
    SKINNY_BYTES_ENV,
    SKINNY_ENV,
    CollectiveSettings,
    collective_settings,
    get_collective_settings,
    parse_setting,
    parse_size,
    pieces,
    set_collective_settings,
    settings_from_env,
)
from harness.comms.shaped import ShapedProcessGroup, make_transport  # noqa: F401

from .native import ext
from .tensor import inner

BACKEND_NAME = "sim"


def _unwrap_sim(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != BACKEND_NAME:
        raise RuntimeError(
            f"the sim process group got a tensor on {t.device}; collectives on the 'sim' backend need sim "
            "tensors (move it with .to('sim'), as nccl needs cuda tensors)"
        )
    return inner(t)


def _create(opts: c10d._DistributedBackendOptions, backend_options: object = None):
    """The creator c10d calls for each group on sim: a native backend over a planner of this group's ranks."""
    planner = ShapedCollectives(
        opts.store, opts.group_rank, opts.group_size, opts.timeout, transport="gloo", unwrap=_unwrap_sim,
        members=list(opts.global_ranks_in_group) or None, label=f"sim group {opts.group_id!r}", check=True,
        group_name=opts.group_id,
    )
    return ext.planned_backend(planner, opts.group_rank, opts.group_size, BACKEND_NAME)


def register() -> None:
    """Register the ``sim`` c10d backend (idempotent)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=[BACKEND_NAME])


register()
