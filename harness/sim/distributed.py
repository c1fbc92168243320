"""The ``sim`` c10d backend: collectives on `sim` tensors, with the communication settings real backends ship.

Importing `harness.sim` registers ``sim`` for sim tensors, so ``dist.init_process_group("sim")`` (env
rendezvous under torchrun, or ``store=``/``rank=``/``world_size=`` by hand) and then ``dist.all_reduce``,
DDP, ``init_device_mesh("sim", ...)`` (which picks ``sim`` by itself when no group exists), DTensor, FSDP2
(``fully_shard``), tensor parallel (``parallelize_module``) and the functional collectives, eager or
under ``torch.compile``, work as on ``nccl``. The group's backend is native (``csrc/backend.cpp``: c10d
keeps a group's name on its backends, and DeviceMesh and the functional collectives find groups by
name); each collective is planned by `harness.comms.planner.ShapedCollectives`: gloo on the host memory
behind the sim tensors, shaped by `harness.comms.settings` (skinny collectives, buckets, a message cap,
per-host placement: env vars and API re-exported here as sim switches like the others).

Use::

    import torch, torch.distributed as dist
    import harness.sim  # registers the device and this backend
    dist.init_process_group("sim")  # torchrun; or store=, rank=, world_size= by hand
    torch.sim.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # or let init_device_mesh bind it
    with harness.sim.distributed.collective_settings(harness.sim.distributed.parse_setting("skinny")):
        dist.all_reduce(torch.ones(4, device="sim"))

Wrong use fails, it does not hang:

- a CPU tensor given to the sim group: c10d's own error, as a cuda group gives ("No backend type
  associated with device type cpu");
- ranks that disagree (other collectives, sizes or dtypes): each collective first compares a small
  fingerprint across the group (``PORTHARNESS_SIM_CHECK_COLLECTIVES``, default 1; one extra tiny
  allgather per collective, so benchmarks turn it off with ``planner.check = False``), and every rank raises
  "Detected mismatch between collectives on ranks" naming both; off, gloo aborts the process that
  receives more bytes than it expected;
- a rank that dies: its peers' collective fails (at once, or at the group's timeout) with a
  ``DistBackendError`` naming the dead rank and its pid;
- exclusive devices (``PORTHARNESS_SIM_EXCLUSIVE=1``, NCCL's rule: one rank per device): a world larger
  than sim's device count fails at ``init_process_group``, two ranks on one device fail at their first
  collective ("Duplicate sim device"), and a tensor on another device than the one a rank's first
  collective used fails ("Tensor found on device ..."), as on a NCCL group bound to a device.
  Off (the default), ranks may share devices (``sim:{rank % device_count}``).

A young chip's process group may lack collectives: ``PORTHARNESS_SIM_LACKS_COLLECTIVES`` (comma-separated
planner names, e.g. ``reduce_scatter_tensor,all_to_all_single``) makes sim's refuse them with c10d's own
words for a backend without one ("Backend sim does not support reduce_scatter_tensor").

This module depends only on torch, `harness.sim` and `harness.comms` (torch only).
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from harness.comms.planner import COLLECTIVES, Misuse, ShapedCollectives
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

from .indices import DEVICE_COUNT_ENV
from .native import ext
from .tensor import inner

BACKEND_NAME = "sim"


CHECK_ENV = "PORTHARNESS_SIM_CHECK_COLLECTIVES"
EXCLUSIVE_ENV = "PORTHARNESS_SIM_EXCLUSIVE"
LACKS_ENV = "PORTHARNESS_SIM_LACKS_COLLECTIVES"


def _flag(name: str, default: str) -> bool:
    raw = os.environ.get(name, default).strip().lower()
    if raw not in ("0", "1", "true", "false", "yes", "no", ""):
        raise ValueError(f"{name}={raw!r}: expected 0 or 1")
    return raw in ("1", "true", "yes")


def _unwrap_sim(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != BACKEND_NAME:
        raise Misuse(
            f"the sim process group got a tensor on {t.device}; collectives on the 'sim' backend need sim "
            "tensors (move it with .to('sim'), as nccl needs cuda tensors)"
        )
    return inner(t)


class _Exclusive:
    """One device per rank: the first collective of a group tells each rank the others' devices."""

    def __init__(self, store: dist.Store, rank: int, members: list[int], timeout: datetime.timedelta) -> None:
        self._store, self._rank, self._members, self._timeout = store, rank, members, timeout
        self.index: int | None = None

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        host = _unwrap_sim(t)
        index = t.device.index if t.device.index is not None else torch.sim.current_device()
        if self.index is None:
            self._claim(index)
        if index != self.index:
            raise Misuse(
                f"Tensor found on device sim:{index} but rank {self._members[self._rank]}'s sim backend is constrained "
                f"to sim:{self.index}, the device of its first collective ({EXCLUSIVE_ENV}=1: one device per rank)"
            )
        return host

    def _claim(self, index: int) -> None:
        me = f"{socket.gethostname()} {index}"
        self._store.set(f"portharness/simdev/{self._rank}", me)
        keys = [f"portharness/simdev/{r}" for r in range(len(self._members))]
        self._store.wait(keys, self._timeout)
        for r, key in enumerate(keys):
            if r != self._rank and self._store.get(key).decode() == me:
                a, b = sorted((self._members[r], self._members[self._rank]))
                raise Misuse(
                    f"Duplicate sim device detected: rank {a} and rank {b} both on sim:{index} ({EXCLUSIVE_ENV}=1: "
                    "one rank per device, as NCCL requires); bind each rank to its own device "
                    "(torch.sim.set_device(LOCAL_RANK)) or let init_device_mesh do it"
                )
        self.index = index


def _planner(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, members: list[int],
             world: bool = False) -> ShapedCollectives:
    """The planner of one rank of one sim group (``world``: the default group, whose size the devices bound)."""
    unwrap = _unwrap_sim
    if _flag(EXCLUSIVE_ENV, "0"):
        count = torch.sim.device_count()
        if world and size > count:
            raise RuntimeError(
                f"world size {size} is larger than sim's {count} devices, and devices are exclusive "
                f"({EXCLUSIVE_ENV}=1: one rank per device, as NCCL requires); run at most {count} ranks or set "
                f"{DEVICE_COUNT_ENV}={size}"
            )
        unwrap = _Exclusive(store, rank, members, timeout)
    planner = ShapedCollectives(store, rank, size, timeout, transport="gloo", unwrap=unwrap, members=members,
                                label=BACKEND_NAME, check=_flag(CHECK_ENV, "1"))
    planner.factory = _planner  # a split group (DeviceMesh after init_process_group(device_id=...)) is one too
    planner.lacking = _lacking()
    return planner


def _lacking() -> frozenset[str]:
    """The collectives ``PORTHARNESS_SIM_LACKS_COLLECTIVES`` takes away (ValueError for a name sim has none of)."""
    names = frozenset(n.strip() for n in os.environ.get(LACKS_ENV, "").split(",") if n.strip())
    if unknown := sorted(names - COLLECTIVES):
        raise ValueError(f"{LACKS_ENV}: no collective named {', '.join(unknown)}; e.g. all_reduce, "
                         "all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single")
    return names


def _create(opts: c10d._DistributedBackendOptions, backend_options: object = None):
    """The creator c10d calls for each group on sim: a native backend over a planner of this group's ranks."""
    members = list(opts.global_ranks_in_group) or list(range(opts.group_size))
    planner = _planner(opts.store, opts.group_rank, opts.group_size, opts.timeout, members,
                       world=not opts.global_ranks_in_group)
    return ext.planned_backend(planner, opts.group_rank, opts.group_size, BACKEND_NAME, opts.timeout)


def register() -> None:
    """Register the ``sim`` c10d backend (idempotent)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=[BACKEND_NAME])


register()
