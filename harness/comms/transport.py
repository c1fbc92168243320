"""The wire under the settings: c10d transports, and the messages a shaped collective is planned into."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d


def opts_like(cls: type, src: object | None, **fields: object) -> object:
    o = cls()
    if src is not None:
        if hasattr(src, "reduceOp") and hasattr(o, "reduceOp"):
            o.reduceOp = src.reduceOp
        if hasattr(src, "timeout"):
            o.timeout = src.timeout
    for k, v in fields.items():
        setattr(o, k, v)
    return o


class Messages:
    """Issues the messages of one stage; serial (skinny) waits each one before issuing the next."""

    def __init__(self, serial: bool) -> None:
        self.serial = serial
        self.works: list = []

    def add(self, work) -> None:
        if self.serial:
            work.wait()
        else:
            self.works.append(work)

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works = []


@dataclass(frozen=True)
class Hosts:
    """Which emulated host a rank sits on under per-host placement."""

    world: int
    rank: int
    per_host: int

    @property
    def host(self) -> int:
        return self.rank // self.per_host

    @property
    def local(self) -> int:
        return self.rank % self.per_host

    @property
    def n_hosts(self) -> int:
        return self.world // self.per_host

    def first(self, host: int) -> int:
        return host * self.per_host


def flat_view(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(
            f"collective on a non-contiguous tensor (shape {tuple(t.shape)}, stride {t.stride()}); "
            "pass a contiguous tensor, as nccl requires"
        )
    return t.view(-1)




def make_transport(kind: str, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta):
    """A c10d ``Backend`` of ``kind`` ('gloo' or 'nccl') over ``store``: the wire under the settings."""
    if kind == "gloo":
        return c10d.ProcessGroupGloo(store, rank, size, timeout)
    if kind == "nccl":
        nccl = getattr(c10d, "ProcessGroupNCCL", None)
        if nccl is None:
            raise RuntimeError("this torch build has no NCCL; use --target cpu or sim")
        opts = nccl.Options()
        opts._timeout = timeout
        return nccl(store, rank, size, opts)
    raise ValueError(f"unknown transport {kind!r}; expected gloo or nccl")
