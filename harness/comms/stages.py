"""The stages under a shaped collective: messages of the settings' size on one transport, and the
per-host plans (reduce on the host, the leaders' collective, back to the host) built from them.

`Stages` is the part of `planner.ShapedCollectives` that moves host tensors; every ``*_one`` method plans
one flat tensor of a collective under settings ``s`` and returns the transport works still pending (fused
per-device messages complete asynchronously; skinny pieces and per-host stages have completed already).

This module depends only on torch.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from harness.comms.settings import CollectiveSettings, pieces
from harness.comms.transport import Hosts, Messages, flat_view, make_transport, opts_like


class Stages:
    """Transports of one group (the group's own and, made on first use, per-host ones) and the plans on them."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, transport: str,
                 members: Sequence[int]) -> None:
        self._store = store
        self._rank, self._size = rank, size
        self._timeout = timeout
        self._kind = transport
        self.members = tuple(members)
        self._world = make_transport(transport, store, rank, size, timeout)
        self._sub: dict[tuple, object] = {}
        self._lock = threading.Lock()
        self.sent = 0  # messages issued on the transports (what the settings multiply), for measurements
        self.busy_s = 0.0  # seconds in the planner's collective calls (harness.parallel.timing: the share)

    def _subgroup(self, key: tuple, ranks: Sequence[int]):
        """Member-only transport over group ranks ``ranks``, made on first use (all members reach it together)."""
        with self._lock:
            g = self._sub.get(key)
            if g is None:
                prefix = "portharness/" + "/".join(map(str, key))
                g = make_transport(
                    self._kind, dist.PrefixStore(prefix, self._store), list(ranks).index(self._rank), len(ranks),
                    self._timeout,
                )
                self._sub[key] = g
            return g

    def _hosts(self, s: CollectiveSettings) -> Hosts:
        h = Hosts(self.members, self._rank, s.ranks_per_host)
        h.check()
        return h

    def _intra(self, h: Hosts):
        if h.here == 1:
            return None
        members = h.groups[h.host]
        return self._subgroup(("host", h.per_host, *members), members)

    def _leaders(self, h: Hosts):
        if h.n_hosts == 1 or h.local != 0:
            return None
        leaders = [h.leader(i) for i in range(h.n_hosts)]
        return self._subgroup(("leaders", h.per_host, *leaders), leaders)

    # -- stage primitives (host tensors, one transport, settings-shaped messages) ----------------

    def _stage_allreduce(self, g, flat: torch.Tensor, opts, s: CollectiveSettings) -> Messages:
        m = Messages(s.skinny, self)
        for a, b in pieces(flat.numel(), flat.element_size(), s.message_limit()):
            m.add(g.allreduce([flat[a:b]], opts_like(c10d.AllreduceOptions, opts)))
        return m

    def _stage_reduce(self, g, flat: torch.Tensor, root: int, opts, s: CollectiveSettings) -> Messages:
        m = Messages(s.skinny, self)
        for a, b in pieces(flat.numel(), flat.element_size(), s.message_limit()):
            m.add(g.reduce([flat[a:b]], opts_like(c10d.ReduceOptions, opts, rootRank=root, rootTensor=0)))
        return m

    def _stage_broadcast(self, g, flat: torch.Tensor, root: int, opts, s: CollectiveSettings) -> Messages:
        m = Messages(s.skinny, self)
        for a, b in pieces(flat.numel(), flat.element_size(), s.message_limit()):
            m.add(g.broadcast([flat[a:b]], opts_like(c10d.BroadcastOptions, opts, rootRank=root, rootTensor=0)))
        return m

    def _stage_allgather(self, g, outs: list[torch.Tensor], flat: torch.Tensor, opts, s) -> Messages:
        m = Messages(s.skinny, self)
        for a, b in pieces(flat.numel(), flat.element_size(), s.message_limit()):
            m.add(g.allgather([[o[a:b] for o in outs]], [flat[a:b]], opts_like(c10d.AllgatherOptions, opts)))
        return m

    def _stage_reduce_scatter(self, g, out: torch.Tensor, ins: list[torch.Tensor], opts, s) -> Messages:
        m = Messages(s.skinny, self)
        for a, b in pieces(out.numel(), out.element_size(), s.message_limit()):
            m.add(
                g.reduce_scatter([out[a:b]], [[i[a:b] for i in ins]], opts_like(c10d.ReduceScatterOptions, opts))
            )
        return m

    def _stage_gather(self, g, outs: list[torch.Tensor] | None, flat: torch.Tensor, root: int, s) -> Messages:
        m = Messages(s.skinny, self)
        for a, b in pieces(flat.numel(), flat.element_size(), s.message_limit()):
            o = [[x[a:b] for x in outs]] if outs is not None else []
            m.add(g.gather(o, [flat[a:b]], opts_like(c10d.GatherOptions, None, rootRank=root)))
        return m

    def _stage_scatter(self, g, out: torch.Tensor, ins: list[torch.Tensor] | None, root: int, s) -> Messages:
        m = Messages(s.skinny, self)
        for a, b in pieces(out.numel(), out.element_size(), s.message_limit()):
            i = [[x[a:b] for x in ins]] if ins is not None else []
            m.add(g.scatter([out[a:b]], i, opts_like(c10d.ScatterOptions, None, rootRank=root)))
        return m

    def _broadcast_one(self, flat: torch.Tensor, root: int, opts, s: CollectiveSettings) -> list:
        if s.placement == "per-device":
            return self._stage_broadcast(self._world, flat, root, opts, s).works
        h = self._hosts(s)
        src_host = next(i for i, g in enumerate(h.groups) if root in g)
        src_local = h.groups[src_host].index(root)
        intra, leaders = self._intra(h), self._leaders(h)
        if intra is not None and h.host == src_host and src_local != 0:
            self._stage_broadcast(intra, flat, src_local, opts, s).wait()
        if leaders is not None:
            self._stage_broadcast(leaders, flat, src_host, opts, s).wait()
        if intra is not None and (h.host != src_host or src_local == 0):
            self._stage_broadcast(intra, flat, 0, opts, s).wait()
        return []

    def _allreduce_host(self, host: list[torch.Tensor], opts, s: CollectiveSettings) -> list:
        pending: list = []
        for t in host:
            flat = flat_view(t)
            if s.placement == "per-device":
                pending += self._stage_allreduce(self._world, flat, opts, s).works
                continue
            h = self._hosts(s)
            intra, leaders = self._intra(h), self._leaders(h)
            if intra is not None:
                self._stage_reduce(intra, flat, 0, opts, s).wait()
            if leaders is not None:
                self._stage_allreduce(leaders, flat, opts, s).wait()
            if intra is not None:
                self._stage_broadcast(intra, flat, 0, opts, s).wait()
        return pending

    @staticmethod
    def _buckets(host: Sequence[torch.Tensor], s: CollectiveSettings) -> list[list[int]]:
        """Consecutive tensors of one dtype, up to ``bucket_bytes`` each (0: one tensor per bucket)."""
        cap = s.bucket_bytes
        buckets: list[list[torch.Tensor]] = []
        size = 0
        for t in host:
            nbytes = t.numel() * t.element_size()
            if not buckets or cap == 0 or size + nbytes > cap or buckets[-1][0].dtype != t.dtype:
                buckets.append([])
                size = 0
            buckets[-1].append(t)
            size += nbytes
        return buckets

    def _allgather_one(self, outs: list[torch.Tensor], flat: torch.Tensor, opts, s) -> list:
        outs = [flat_view(o) for o in outs]
        if s.placement == "per-device":
            return self._stage_allgather(self._world, outs, flat, opts, s).works
        h = self._hosts(s)
        intra, leaders = self._intra(h), self._leaders(h)
        n = flat.numel()
        full = flat.new_empty(h.world * n)  # rows host by host (h.order)
        rows = list(full.view(h.world, n)) if n else [full[:0]] * h.world
        first = h.host * h.here
        if intra is not None:
            local_rows = rows[first : first + h.here] if h.local == 0 else None
            self._stage_gather(intra, local_rows, flat, 0, s).wait()
        else:
            rows[first].copy_(flat)
        if leaders is not None:
            blocks = list(full.view(h.n_hosts, h.here * n))
            self._stage_allgather(leaders, blocks, blocks[h.host].clone(), opts, s).wait()
        if intra is not None:
            self._stage_broadcast(intra, full, 0, opts, s).wait()
        for pos, r in enumerate(h.order):
            outs[r].copy_(rows[pos])
        return []

    def _reduce_scatter_one(self, out: torch.Tensor, ins: list[torch.Tensor], opts, s) -> list:
        if s.placement == "per-device":
            return self._stage_reduce_scatter(self._world, out, ins, opts, s).works
        h = self._hosts(s)
        intra, leaders = self._intra(h), self._leaders(h)
        n = out.numel()
        full = torch.cat([ins[r] for r in h.order]) if ins else out.new_empty(0)  # rows host by host
        if intra is not None:
            self._stage_reduce(intra, full, 0, opts, s).wait()
        host_rows = None
        if h.local == 0:
            if leaders is not None:
                block = full.new_empty(h.here * n)
                blocks = list(full.view(h.n_hosts, h.here * n))
                self._stage_reduce_scatter(leaders, block, blocks, opts, s).wait()
            else:
                block = full[h.host * h.here * n : (h.host + 1) * h.here * n]
            host_rows = list(block.view(h.here, n)) if n else [block[:0]] * h.here
        if intra is not None:
            self._stage_scatter(intra, out, host_rows, 0, s).wait()
        else:
            out.copy_(host_rows[0])
        return []
