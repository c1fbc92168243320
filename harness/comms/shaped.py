"""`ShapedProcessGroup`: any c10d transport (gloo, nccl), with each collective shaped by the settings.

How: a Python ``dist.ProcessGroup`` subclass (torch 2.13 cannot construct a ``c10d.Backend`` from
Python, but a ``ProcessGroup`` subclass returned by an ``extended_api`` creator replaces the whole group
and its virtual methods are reachable from C++, which is what DDP's reducer calls). Each collective is
turned into a plan of messages on a *transport* (a gloo or nccl ``Backend``), like PyTorch's OpenReg
``ProcessGroupOCCL`` over gloo. Importing this module registers ``shaped_gloo`` / ``shaped_nccl`` for
CPU / CUDA tensors; a device backend registers its own name with `register` and an ``unwrap`` that
hands the transport host tensors (`harness.sim.distributed` does, for ``sim``).

Modelling choices worth knowing when reading numbers: skinny pieces and per-host stages run
synchronously (a call returns when its last message is done, so DDP cannot overlap them with backward
compute); fused and capped messages are issued asynchronously and complete through a future, as on
nccl. Host groups are created lazily, member-only, from the group's store (``PrefixStore``), not with
``dist.new_group``: the creator runs before the default group exists and ``new_group`` would need
every rank of the world to take part. Shaped by the settings: ``allreduce``,
``allreduce_coalesced``, ``broadcast``, ``allgather`` / ``all_gather_single`` (``all_gather_into_tensor``),
``reduce_scatter`` / ``reduce_scatter_single`` (``reduce_scatter_tensor``). Passed straight to the
transport, unshaped: ``reduce``, ``gather``, ``scatter``, ``alltoall``, ``all_to_all_single``,
``send``/``recv``, ``barrier``.

This module depends only on torch; nothing here knows about a device backend or the harness runner.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from harness.comms.settings import CollectiveSettings, get_collective_settings, pieces
from harness.comms.transport import Hosts, Messages, flat_view, make_transport, opts_like


class _FutureWork(dist.Work):
    """The Work a shaped collective returns: done when its future is, and ``wait()`` raises its error.

    ``c10d._create_work_from_future`` would do, except that its ``wait()`` returns True even when the
    future failed: a blocking ``dist.all_reduce`` whose peer died mid-message then returned normally,
    leaving stale data in the caller's tensor. Blocking calls wait here; DDP's reducer and async callers
    use the future, which carries the error either way.
    """

    def __init__(self, fut: torch.futures.Future) -> None:
        super().__init__()
        self._fut = fut

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        self._fut.wait()  # raises the first failed message's error
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def get_future(self) -> torch.futures.Future:
        return self._fut


class ShapedProcessGroup(dist.ProcessGroup):
    """A process group that runs each collective as a plan of messages shaped by `CollectiveSettings`.

    ``unwrap`` maps a caller tensor to the tensor the transport sees (`inner` for sim tensors, the
    identity for CPU/CUDA); results are written in place into the caller's tensors and the returned
    work's future holds the caller's tensors, as DDP's reducer expects.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        *,
        transport: str = "gloo",
        unwrap: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
        name: str = "shaped_gloo",
    ) -> None:
        super().__init__(rank, size)
        self._store = store
        self._timeout = timeout
        self._kind = transport
        self._unwrap = unwrap
        self._name = name
        self._world = make_transport(transport, store, rank, size, timeout)
        self._sub: dict[tuple, object] = {}
        self._lock = threading.Lock()

    # -- plumbing -------------------------------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 (c10d's name)
        return self._name

    @property
    def transport(self):
        """The world-sized transport backend (gloo/nccl): for barriers and timing outside the settings."""
        return self._world

    def _subgroup(self, key: tuple, ranks: Sequence[int]):
        """Member-only transport over ``ranks``, created on first use (all members reach it together)."""
        with self._lock:
            g = self._sub.get(key)
            if g is None:
                prefix = "portharness/" + "/".join(map(str, key))
                g = make_transport(
                    self._kind,
                    dist.PrefixStore(prefix, self._store),
                    list(ranks).index(self.rank()),
                    len(ranks),
                    self._timeout,
                )
                self._sub[key] = g
            return g

    def _hosts(self, s: CollectiveSettings) -> Hosts:
        if self.size() % s.ranks_per_host:
            raise ValueError(
                f"per-host placement with {s.ranks_per_host} ranks per host needs a world size divisible "
                f"by {s.ranks_per_host}, got {self.size()}"
            )
        return Hosts(self.size(), self.rank(), s.ranks_per_host)

    def _intra(self, h: Hosts):
        if h.per_host == 1:
            return None
        first = h.first(h.host)
        return self._subgroup(("host", h.per_host, h.host), range(first, first + h.per_host))

    def _leaders(self, h: Hosts):
        if h.n_hosts == 1 or h.local != 0:
            return None
        return self._subgroup(("leaders", h.per_host), [h.first(i) for i in range(h.n_hosts)])

    def _host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [self._unwrap(t) for t in tensors]

    def _finish(self, pending: list, result: list):
        """A Work whose future yields ``result`` (the caller's tensors) once ``pending`` is done."""
        futs = []
        for w in pending:
            try:
                futs.append(w.get_future())
            except RuntimeError:  # some gloo works (reduce_scatter) have no future: complete it here
                w.wait()
        if not futs:
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(result)
            return _FutureWork(fut)
        done = torch.futures.collect_all(futs)

        def _then(f: torch.futures.Future) -> list:
            for sub in f.value():
                sub.value()  # re-raises a failed message
            return result

        return _FutureWork(done.then(_then))

    # -- stage primitives (host tensors, one transport, settings-shaped messages) ----------------

    def _stage_allreduce(self, g, flat: torch.Tensor, opts, s: CollectiveSettings) -> Messages:
        m = Messages(s.skinny)
        for a, b in pieces(flat.numel(), flat.element_size(), s.message_limit()):
            m.add(g.allreduce([flat[a:b]], opts_like(c10d.AllreduceOptions, opts)))
        return m

    def _stage_reduce(self, g, flat: torch.Tensor, root: int, opts, s: CollectiveSettings) -> Messages:
        m = Messages(s.skinny)
        for a, b in pieces(flat.numel(), flat.element_size(), s.message_limit()):
            m.add(g.reduce([flat[a:b]], opts_like(c10d.ReduceOptions, opts, rootRank=root, rootTensor=0)))
        return m

    def _stage_broadcast(self, g, flat: torch.Tensor, root: int, opts, s: CollectiveSettings) -> Messages:
        m = Messages(s.skinny)
        for a, b in pieces(flat.numel(), flat.element_size(), s.message_limit()):
            m.add(g.broadcast([flat[a:b]], opts_like(c10d.BroadcastOptions, opts, rootRank=root, rootTensor=0)))
        return m

    def _stage_allgather(self, g, outs: list[torch.Tensor], flat: torch.Tensor, opts, s) -> Messages:
        m = Messages(s.skinny)
        for a, b in pieces(flat.numel(), flat.element_size(), s.message_limit()):
            m.add(g.allgather([[o[a:b] for o in outs]], [flat[a:b]], opts_like(c10d.AllgatherOptions, opts)))
        return m

    def _stage_reduce_scatter(self, g, out: torch.Tensor, ins: list[torch.Tensor], opts, s) -> Messages:
        m = Messages(s.skinny)
        for a, b in pieces(out.numel(), out.element_size(), s.message_limit()):
            m.add(
                g.reduce_scatter([out[a:b]], [[i[a:b] for i in ins]], opts_like(c10d.ReduceScatterOptions, opts))
            )
        return m

    def _stage_gather(
        self, g, outs: list[torch.Tensor] | None, flat: torch.Tensor, root: int, s
    ) -> Messages:
        m = Messages(s.skinny)
        for a, b in pieces(flat.numel(), flat.element_size(), s.message_limit()):
            o = [[x[a:b] for x in outs]] if outs is not None else []
            m.add(g.gather(o, [flat[a:b]], opts_like(c10d.GatherOptions, None, rootRank=root)))
        return m

    def _stage_scatter(self, g, out: torch.Tensor, ins: list[torch.Tensor] | None, root: int, s) -> Messages:
        m = Messages(s.skinny)
        for a, b in pieces(out.numel(), out.element_size(), s.message_limit()):
            i = [[x[a:b] for x in ins]] if ins is not None else []
            m.add(g.scatter([out[a:b]], i, opts_like(c10d.ScatterOptions, None, rootRank=root)))
        return m

    # -- collectives ----------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: c10d.AllreduceOptions | None = None) -> c10d.Work:
        """In-place all_reduce of each tensor, split/staged by the settings; what DDP's reducer calls."""
        return self._finish(self._allreduce_host(self._host(tensors), opts, get_collective_settings()), list(tensors))

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

    def allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: c10d.AllreduceCoalescedOptions | None = None
    ) -> c10d.Work:
        """Pack tensors into buckets of ``bucket_mb`` (0: none), one allreduce per bucket."""
        s = get_collective_settings()
        host = self._host(tensors)
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
        for bucket in buckets:
            flat = torch._utils._flatten_dense_tensors(bucket) if len(bucket) > 1 else bucket[0]
            for w in self._allreduce_host([flat], opts, s):
                w.wait()
            if len(bucket) > 1:
                for dst, src in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket), strict=True):
                    dst.copy_(src)
        return self._finish([], list(tensors))

    def broadcast(self, tensors: list[torch.Tensor], opts: c10d.BroadcastOptions | None = None) -> c10d.Work:
        """Broadcast from ``opts.rootRank`` (DDP's initial state sync and per-forward buffer sync)."""
        s = get_collective_settings()
        root = opts.rootRank if opts is not None else 0
        pending: list = []
        for t in self._host(tensors):
            flat = flat_view(t)
            if s.placement == "per-device":
                pending += self._stage_broadcast(self._world, flat, root, opts, s).works
                continue
            h = self._hosts(s)
            src = Hosts(h.world, root, h.per_host)
            intra, leaders = self._intra(h), self._leaders(h)
            if intra is not None and h.host == src.host and src.local != 0:
                self._stage_broadcast(intra, flat, src.local, opts, s).wait()
            if leaders is not None:
                self._stage_broadcast(leaders, flat, src.host, opts, s).wait()
            if intra is not None and (h.host != src.host or src.local == 0):
                self._stage_broadcast(intra, flat, 0, opts, s).wait()
        return self._finish(pending, list(tensors))

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: c10d.AllgatherOptions | None = None,
    ) -> c10d.Work:
        """List all_gather (DDP checks parameter shapes across ranks with it)."""
        s = get_collective_settings()
        pending: list = []
        for outs, t in zip(output_tensors, input_tensors, strict=True):
            pending += self._allgather_one(self._host(outs), flat_view(self._unwrap(t)), opts, s)
        return self._finish(pending, list(output_tensors))

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: c10d.AllgatherOptions | None = None
    ) -> c10d.Work:
        """``all_gather_into_tensor``: rank r's input lands in row r of ``output``."""
        s = get_collective_settings()
        out = flat_view(self._unwrap(output))
        flat = flat_view(self._unwrap(input))
        if out.numel() != flat.numel() * self.size():
            raise ValueError(
                f"all_gather_into_tensor: output has {out.numel()} elements, expected world size "
                f"{self.size()} x input {flat.numel()}"
            )
        rows = list(out.view(self.size(), -1))
        return self._finish(self._allgather_one(rows, flat, opts, s), [output])

    def _allgather_one(self, outs: list[torch.Tensor], flat: torch.Tensor, opts, s) -> list:
        outs = [flat_view(o) for o in outs]
        if s.placement == "per-device":
            return self._stage_allgather(self._world, outs, flat, opts, s).works
        h = self._hosts(s)
        intra, leaders = self._intra(h), self._leaders(h)
        n = flat.numel()
        full = flat.new_empty(h.world * n)
        rows = list(full.view(h.world, n)) if n else [full[:0]] * h.world
        first = h.first(h.host)
        if intra is not None:
            local_rows = rows[first : first + h.per_host] if h.local == 0 else None
            self._stage_gather(intra, local_rows, flat, 0, s).wait()
        else:
            rows[first].copy_(flat)
        if leaders is not None:
            blocks = list(full.view(h.n_hosts, h.per_host * n))
            self._stage_allgather(leaders, blocks, blocks[h.host].clone(), opts, s).wait()
        if intra is not None:
            self._stage_broadcast(intra, full, 0, opts, s).wait()
        for o, r in zip(outs, rows, strict=True):
            o.copy_(r)
        return []

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: c10d.ReduceScatterOptions | None = None,
    ) -> c10d.Work:
        """List reduce_scatter: rank r gets the reduction of everyone's ``input_tensors[0][r]``."""
        s = get_collective_settings()
        pending: list = []
        for t, ins in zip(output_tensors, input_tensors, strict=True):
            pending += self._reduce_scatter_one(
                flat_view(self._unwrap(t)), [flat_view(i) for i in self._host(ins)], opts, s
            )
        return self._finish(pending, list(output_tensors))

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: c10d.ReduceScatterOptions | None = None
    ) -> c10d.Work:
        """``reduce_scatter_tensor``: rank r gets the reduction of row r of everyone's ``input``."""
        s = get_collective_settings()
        out = flat_view(self._unwrap(output))
        flat = flat_view(self._unwrap(input))
        if flat.numel() != out.numel() * self.size():
            raise ValueError(
                f"reduce_scatter_tensor: input has {flat.numel()} elements, expected world size "
                f"{self.size()} x output {out.numel()}"
            )
        rows = list(flat.view(self.size(), -1))
        return self._finish(self._reduce_scatter_one(out, rows, opts, s), [output])

    def _reduce_scatter_one(self, out: torch.Tensor, ins: list[torch.Tensor], opts, s) -> list:
        if s.placement == "per-device":
            return self._stage_reduce_scatter(self._world, out, ins, opts, s).works
        h = self._hosts(s)
        intra, leaders = self._intra(h), self._leaders(h)
        n = out.numel()
        full = torch.cat(ins) if ins else out.new_empty(0)
        if intra is not None:
            self._stage_reduce(intra, full, 0, opts, s).wait()
        first = h.first(h.host)
        if h.local == 0:
            if leaders is not None:
                block = full.new_empty(h.per_host * n)
                blocks = list(full.view(h.n_hosts, h.per_host * n))
                self._stage_reduce_scatter(leaders, block, blocks, opts, s).wait()
            else:
                block = full[first * n : (first + h.per_host) * n]
            host_rows = list(block.view(h.per_host, n)) if n else [block[:0]] * h.per_host
        if intra is not None:
            self._stage_scatter(intra, out, host_rows if h.local == 0 else None, 0, s).wait()
        else:
            out.copy_(host_rows[0])
        return []

    _allgather_base = all_gather_single  # the pre-2.10 names, still what some C++ callers use
    _reduce_scatter_base = reduce_scatter_single

    def barrier(self, opts: c10d.BarrierOptions | None = None) -> c10d.Work:
        """A transport barrier (never shaped: nothing to split)."""
        return self._world.barrier(opts if opts is not None else c10d.BarrierOptions())

    # -- pass-through (not shaped by the settings): so they work and fail clearly, not via dispatch --

    def _through(self, work, result: list):
        return self._finish([work], result)

    def reduce(self, tensors, opts=None):
        return self._through(
            self._world.reduce(self._host(tensors), opts or c10d.ReduceOptions()), list(tensors)
        )

    def gather(self, output_tensors, input_tensors, opts=None):
        outs = [self._host(o) for o in output_tensors]
        work = self._world.gather(outs, self._host(input_tensors), opts or c10d.GatherOptions())
        return self._through(work, list(output_tensors))

    def scatter(self, output_tensors, input_tensors, opts=None):
        ins = [self._host(i) for i in input_tensors]
        work = self._world.scatter(self._host(output_tensors), ins, opts or c10d.ScatterOptions())
        return self._through(work, list(output_tensors))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        work = self._world.alltoall_base(
            self._unwrap(output),
            self._unwrap(input),
            output_split_sizes,
            input_split_sizes,
            opts or c10d.AllToAllOptions(),
        )
        return self._through(work, [output])

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None):
        work = self._world.alltoall(
            self._host(output_tensors), self._host(input_tensors), opts or c10d.AllToAllOptions()
        )
        return self._through(work, list(output_tensors))

    def send(self, tensors, dst_rank, tag=0):
        return self._through(self._world.send(self._host(tensors), dst_rank, tag), list(tensors))

    def recv(self, tensors, src_rank, tag=0):
        return self._through(self._world.recv(self._host(tensors), src_rank, tag), list(tensors))


def _creator(name: str, transport: str, unwrap: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    def create(opts: c10d._DistributedBackendOptions, backend_options: object = None) -> ShapedProcessGroup:
        return ShapedProcessGroup(
            opts.store, opts.group_rank, opts.group_size, opts.timeout, transport=transport, unwrap=unwrap, name=name
        )

    return create


def register(
    name: str, transport: str, devices: list[str], unwrap: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
) -> None:
    """Register c10d backend `name`: `transport` shaped by the settings, for tensors on `devices` (idempotent)."""
    if name.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(name, _creator(name, transport, unwrap), extended_api=True, devices=devices)


register("shaped_gloo", "gloo", ["cpu"])
register("shaped_nccl", "nccl", ["cuda"])
