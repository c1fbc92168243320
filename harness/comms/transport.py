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

    def __init__(self, serial: bool, counter: object = None) -> None:
        self.serial = serial
        self.works: list = []
        self._counter = counter  # an object whose ``sent`` counts the messages issued

    def add(self, work) -> None:
        if self._counter is not None:
            self._counter.sent += 1
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
    """Which emulated host each member of a group sits on under per-host placement.

    ``members`` are the global ranks of the group's ranks (group rank i is ``members[i]``): a host holds
    the global ranks ``[h * per_host, (h + 1) * per_host)``, so a subgroup (a DeviceMesh dimension) is
    placed where its ranks really are, not as if it were a world of its own. Every host holding members
    of the group must hold as many of them (the leaders' stage moves equal blocks); `check` says so.
    """

    members: tuple[int, ...]
    rank: int  # this process's group rank
    per_host: int

    @property
    def world(self) -> int:
        return len(self.members)

    def host_of(self, group_rank: int) -> int:
        return self.members[group_rank] // self.per_host

    @property
    def groups(self) -> list[list[int]]:
        """The group ranks on each host holding members, hosts in order, ranks in group order."""
        by: dict[int, list[int]] = {}
        for r in range(self.world):
            by.setdefault(self.host_of(r), []).append(r)
        return [by[h] for h in sorted(by)]

    @property
    def host(self) -> int:
        """This rank's host, as an index into `groups`."""
        return next(i for i, g in enumerate(self.groups) if self.rank in g)

    @property
    def local(self) -> int:
        return self.groups[self.host].index(self.rank)

    @property
    def n_hosts(self) -> int:
        return len(self.groups)

    @property
    def here(self) -> int:
        """Members on each host (equal everywhere, see `check`)."""
        return len(self.groups[0])

    @property
    def order(self) -> list[int]:
        """Group ranks host by host: the row order of the buffers the hierarchical plans move."""
        return [r for g in self.groups for r in g]

    def leader(self, host: int) -> int:
        return self.groups[host][0]

    def check(self) -> None:
        sizes = {len(g) for g in self.groups}
        if len(sizes) > 1:
            raise ValueError(
                f"per-host placement with {self.per_host} ranks per host needs as many ranks of a group on every "
                f"host; group of global ranks {list(self.members)} has {[len(g) for g in self.groups]} per host"
            )


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
