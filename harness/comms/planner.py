"""`ShapedCollectives`: each collective of a process group, planned into messages as the settings say.

A planner serves one group: it holds the group's transport (a gloo or nccl ``Backend`` on the group's
store) and turns every collective into a plan of messages (`settings.pieces`, per-host stages), then
returns a ``torch.futures.Future`` that completes, with the caller's tensors as its value, once the
last message has. Something that is a process group wraps it: `shaped.ShapedProcessGroup` in Python
(``shaped_gloo`` / ``shaped_nccl``), or a native c10d backend that calls these methods (``sim``'s), so
DeviceMesh, DTensor, FSDP2 and the functional collectives reach the same plans.

Shaped by the settings (`settings.py`): ``allreduce`` (DDP's reducer), ``allreduce_coalesced``,
``broadcast``, ``allgather`` / ``all_gather_single`` (``all_gather_into_tensor``, FSDP2's unshard),
``reduce_scatter`` / ``reduce_scatter_single`` (``reduce_scatter_tensor``, FSDP2's gradients), the
coalesced tensor forms (packed into buckets of ``bucket_mb``), and ``all_to_all_single`` (skinny and the
message cap split it into per-peer messages; per-host placement does not reroute it). Passed straight to
the transport: ``reduce``, ``gather``, ``scatter``, ``alltoall``, ``send``/``recv``, ``barrier``.
``ReduceOp.AVG`` is planned as a SUM and a division (gloo's stages would average twice).

Modelling choices worth knowing when reading numbers: skinny pieces and per-host stages run
synchronously (a call returns when its last message is done, so DDP and FSDP2 cannot overlap them with
compute); fused and capped messages are issued asynchronously and complete through the future, as on
nccl. Host groups are made lazily, member-only, from the group's store (``PrefixStore``), not with
``dist.new_group``: the creator runs before the default group exists, and ``new_group`` would need
every rank of the world. With ``check`` on, each collective first exchanges a small fingerprint (op,
sizes, dtypes: one tiny allgather) so a mismatch is an error naming both ranks, not a gloo abort.

This module depends only on torch; nothing here knows about a device backend or the harness runner.
"""

from __future__ import annotations

import datetime
import functools
import time
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from harness.comms.peers import Peers, fingerprint, mismatch
from harness.comms.settings import get_collective_settings, pieces
from harness.comms.stages import Stages
from harness.comms.transport import flat_view, opts_like

OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "gather", "scatter",
       "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single", "all_to_all", "barrier",
       "all_reduce_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced")
_CODE = {op: i for i, op in enumerate(OPS)}
# group name -> the planner of this process's rank in it, for groups a native backend plans here
_BY_GROUP: weakref.WeakValueDictionary[str, ShapedCollectives] = weakref.WeakValueDictionary()


def for_group(group: dist.ProcessGroup) -> ShapedCollectives | None:
    """The planner behind `group` (a Python shaped group's, or one a native backend registered), else None."""
    planner = getattr(group, "planner", None)
    if isinstance(planner, ShapedCollectives):
        return planner
    try:
        return _BY_GROUP.get(group.group_name)
    except RuntimeError:  # a Python group has no name
        return None


class Misuse(RuntimeError):
    """A collective the caller got wrong (a tensor the group cannot take, ranks that disagree): raised as it is,
    never blamed on a peer. A RuntimeError, as c10d's own usage errors are."""


COLLECTIVES: set[str] = set()  # every collective a planner serves, by the name c10d's Backend gives it


def _collective(op: str) -> Callable:
    """A planner method: transport failures raised while planning come back naming the failed peer."""
    COLLECTIVES.add(op)

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(self: ShapedCollectives, *args: object) -> torch.futures.Future:
            if op in self.lacking:  # c10d's own words for a backend without this collective
                raise RuntimeError(f"Backend {self.label} does not support {op}")
            t0 = time.perf_counter()
            try:
                return fn(self, *args)
            except (Misuse, ValueError, TypeError, dist.DistBackendError):
                raise
            except RuntimeError as exc:
                raise self.peers.explain(op, exc) from exc
            finally:  # serialised pieces whole, asynchronous messages until issued: a step's share in collectives
                self.busy_s += time.perf_counter() - t0

        return run

    return wrap


class _Options(c10d.Backend.Options):
    """A planned backend's options: c10d's, copyable (``split_group`` deep-copies its parent's)."""

    def __deepcopy__(self, memo: dict) -> _Options:
        return _Options(self.backend, self._timeout)


def _is_avg(opts: object) -> bool:
    return opts is not None and getattr(opts, "reduceOp", None) == dist.ReduceOp.AVG


class ShapedCollectives(Stages):
    """Plans each collective of one group over `transport` ('gloo' or 'nccl') as the settings say.

    ``unwrap`` maps a caller tensor to the tensor the transport sees (a device backend's host view, the
    identity for CPU/CUDA; it raises for a tensor the group cannot take); ``members`` are the group's
    global ranks (per-host placement puts them on their hosts); ``label`` names the group in errors.
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
        members: Sequence[int] | None = None,
        label: str = "shaped_gloo",
        check: bool = False,
    ) -> None:
        super().__init__(store, rank, size, timeout, transport, members or range(size))
        self._unwrap = unwrap
        self.check = check
        self.label = label
        self.peers = Peers(store, rank, self.members, label)
        # how a split of this group makes its planner: (store, rank, size, timeout, members) -> planner
        self.factory: Callable[..., ShapedCollectives] | None = None
        self.lacking: frozenset[str] = frozenset()  # collectives this backend does not have (a young chip's)

    # -- plumbing -------------------------------------------------------------------------------

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    @property
    def transport(self):
        """The group-sized transport backend (gloo/nccl): for barriers and timing outside the settings."""
        return self._world

    def named(self, group_name: str) -> None:
        """The group got its name (c10d names a group after making its backend): errors and `for_group` use it."""
        self.peers.label = f"{self.label} group {group_name!r}"
        _BY_GROUP[group_name] = self

    def split(self, store: dist.Store, ranks: list[int], timeout_s: float) -> ShapedCollectives:
        """The planner of this rank in the subgroup of group ranks ``ranks`` (``dist.split_group``, which DeviceMesh
        uses once ``init_process_group`` bound a device), over ``store``."""
        members = [self.members[r] for r in ranks]
        args = (store, ranks.index(self._rank), len(ranks), datetime.timedelta(seconds=timeout_s), members)
        if self.factory is not None:
            return self.factory(*args)
        return ShapedCollectives(*args[:4], transport=self._kind, unwrap=self._unwrap, members=members,
                                 label=self.label, check=self.check)

    def options(self) -> c10d.Backend.Options:
        """The backend's options as ``dist.split_group`` reads them (it deep-copies them)."""
        return _Options(self.label, self._timeout)

    def shutdown(self) -> None:
        for g in [self._world, *self._sub.values()]:
            try:
                g.shutdown()
            except (RuntimeError, AttributeError):
                pass

    def _host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [self._unwrap(t) for t in tensors]

    def _verify(self, op: str, tensors: Sequence[torch.Tensor], splits: tuple | None = None) -> None:
        """With ``check`` on: every rank runs `op` on the same sizes and dtypes, or all raise, naming who differs."""
        if not self.check or self._size == 1:
            return
        mine = fingerprint(_CODE[op], tensors, self._size, splits)
        rows = [torch.empty_like(mine) for _ in range(self._size)]
        self._world.allgather([rows], [mine], c10d.AllgatherOptions()).wait()
        problem = mismatch(OPS, [r.tolist() for r in rows], self.peers)
        if problem:
            raise Misuse(f"Detected mismatch between collectives on ranks ({self.peers.label}): {problem}")

    def _finish(self, op: str, pending: list, result: list, after: Callable[[], None] | None = None):
        """A future whose value is ``result`` (the caller's tensors) once ``pending`` and then ``after`` are done."""
        futs = []
        for w in pending:
            try:
                futs.append(w.get_future())
            except RuntimeError:  # some gloo works (reduce_scatter) have no future: complete it here
                w.wait()
        if not futs:
            if after is not None:
                after()
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(result)
            return fut

        peers = self.peers  # not self: the last reference to a planner must not die on a transport's thread

        def _then(f: torch.futures.Future) -> list:
            try:
                for sub in f.value():
                    sub.value()  # re-raises a failed message
            except RuntimeError as exc:
                raise peers.explain(op, exc) from exc
            if after is not None:
                after()
            return result

        return torch.futures.collect_all(futs).then(_then)

    def _averaged(self, opts, host: Sequence[torch.Tensor]):
        """``(opts, after)``: AVG becomes a SUM over the stages, then a division of ``host`` by the group size."""
        if not _is_avg(opts):
            return opts, None
        summed = opts_like(type(opts), opts, reduceOp=dist.ReduceOp.SUM)
        for field in ("rootRank", "rootTensor"):
            if hasattr(opts, field):
                setattr(summed, field, getattr(opts, field))

        size = self._size

        def divide() -> None:
            for t in host:
                if t.is_floating_point() or t.is_complex():
                    t.div_(size)
                else:
                    t.div_(size, rounding_mode="trunc")

        return summed, divide

    # -- all_reduce, broadcast --------------------------------------------------------------------

    @_collective("all_reduce")
    def allreduce(self, tensors: list[torch.Tensor], opts: c10d.AllreduceOptions | None = None):
        """In-place all_reduce of each tensor, split/staged by the settings; what DDP's reducer calls."""
        host = self._host(tensors)
        self._verify("all_reduce", host)
        opts, after = self._averaged(opts, host)
        return self._finish("all_reduce", self._allreduce_host(host, opts, get_collective_settings()),
                            list(tensors), after)

    @_collective("all_reduce_coalesced")
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: c10d.AllreduceCoalescedOptions | None = None):
        """Pack tensors into buckets of ``bucket_mb`` (0: none), one allreduce per bucket."""
        s = get_collective_settings()
        host = self._host(tensors)
        self._verify("all_reduce_coalesced", host)
        opts, after = self._averaged(opts, host)
        for bucket in self._buckets(host, s):
            flat = torch._utils._flatten_dense_tensors(bucket) if len(bucket) > 1 else bucket[0]
            for w in self._allreduce_host([flat], opts, s):
                w.wait()
            if len(bucket) > 1:
                for dst, src in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket), strict=True):
                    dst.copy_(src)
        return self._finish("all_reduce_coalesced", [], list(tensors), after)

    @_collective("broadcast")
    def broadcast(self, tensors: list[torch.Tensor], opts: c10d.BroadcastOptions | None = None):
        """Broadcast from ``opts.rootRank`` (DDP's initial state sync, DTensor's distribute_tensor)."""
        s = get_collective_settings()
        root = opts.rootRank if opts is not None else 0
        host = self._host(tensors)
        self._verify("broadcast", host)
        pending = [w for t in host for w in self._broadcast_one(flat_view(t), root, opts, s)]
        return self._finish("broadcast", pending, list(tensors))

    # -- all_gather ---------------------------------------------------------------------------------

    @_collective("all_gather")
    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: c10d.AllgatherOptions | None = None):
        """List all_gather: ``output_tensors[i][r]`` gets rank r's ``input_tensors[i]``."""
        s = get_collective_settings()
        ins = self._host(input_tensors)
        self._verify("all_gather", ins)
        pending: list = []
        for outs, t in zip(output_tensors, ins, strict=True):
            pending += self._allgather_one(self._host(outs), flat_view(t), opts, s)
        return self._finish("all_gather", pending, [t for outs in output_tensors for t in outs])

    @_collective("all_gather_into_tensor")
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: c10d.AllgatherOptions | None = None):
        """``all_gather_into_tensor``: rank r's input lands in row r of ``output``."""
        out, flat = flat_view(self._unwrap(output)), flat_view(self._unwrap(input))
        if out.numel() != flat.numel() * self._size:
            raise ValueError(
                f"all_gather_into_tensor: output has {out.numel()} elements, expected world size "
                f"{self._size} x input {flat.numel()}"
            )
        self._verify("all_gather_into_tensor", [flat])
        rows = list(out.view(self._size, -1))
        return self._finish("all_gather_into_tensor", self._allgather_one(rows, flat, opts, get_collective_settings()),
                            [output])

    @_collective("all_gather_into_tensor_coalesced")
    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: c10d.AllgatherOptions | None = None):
        """Several ``all_gather_into_tensor`` at once, packed into buckets of ``bucket_mb`` (0: one each)."""
        s = get_collective_settings()
        outs, ins = [flat_view(t) for t in self._host(outputs)], [flat_view(t) for t in self._host(inputs)]
        self._verify("all_gather_into_tensor_coalesced", ins)
        by_id = {id(t): i for i, t in enumerate(ins)}
        for bucket in self._buckets(ins, s):
            idx = [by_id[id(t)] for t in bucket]
            packed = torch.cat(bucket) if len(bucket) > 1 else bucket[0]
            full = packed.new_empty(self._size * packed.numel())
            rows = list(full.view(self._size, -1))
            for w in self._allgather_one(rows, packed, opts, s):
                w.wait()
            at = 0
            for i in idx:
                n = ins[i].numel()
                outs[i].view(self._size, n).copy_(full.view(self._size, -1)[:, at : at + n])
                at += n
        return self._finish("all_gather_into_tensor_coalesced", [], list(outputs))

    # -- reduce_scatter -----------------------------------------------------------------------------

    @_collective("reduce_scatter")
    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: c10d.ReduceScatterOptions | None = None):
        """List reduce_scatter: rank r gets the reduction of everyone's ``input_tensors[0][r]``."""
        s = get_collective_settings()
        outs = self._host(output_tensors)
        self._verify("reduce_scatter", outs)
        opts, after = self._averaged(opts, outs)
        pending: list = []
        for t, ins in zip(outs, input_tensors, strict=True):
            pending += self._reduce_scatter_one(flat_view(t), [flat_view(i) for i in self._host(ins)], opts, s)
        return self._finish("reduce_scatter", pending, list(output_tensors), after)

    @_collective("reduce_scatter_tensor")
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: c10d.ReduceScatterOptions | None = None):
        """``reduce_scatter_tensor``: rank r gets the reduction of row r of everyone's ``input``."""
        out, flat = flat_view(self._unwrap(output)), flat_view(self._unwrap(input))
        if flat.numel() != out.numel() * self._size:
            raise ValueError(
                f"reduce_scatter_tensor: input has {flat.numel()} elements, expected world size "
                f"{self._size} x output {out.numel()}"
            )
        self._verify("reduce_scatter_tensor", [out])
        opts, after = self._averaged(opts, [out])
        rows = list(flat.view(self._size, -1))
        pending = self._reduce_scatter_one(out, rows, opts, get_collective_settings())
        return self._finish("reduce_scatter_tensor", pending, [output], after)

    @_collective("reduce_scatter_tensor_coalesced")
    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: c10d.ReduceScatterOptions | None = None):
        """Several ``reduce_scatter_tensor`` at once, packed into buckets of ``bucket_mb`` (0: one each)."""
        s = get_collective_settings()
        outs, ins = [flat_view(t) for t in self._host(outputs)], [flat_view(t) for t in self._host(inputs)]
        self._verify("reduce_scatter_tensor_coalesced", outs)
        opts, after = self._averaged(opts, outs)
        by_id = {id(t): i for i, t in enumerate(outs)}
        for bucket in self._buckets(outs, s):
            idx = [by_id[id(t)] for t in bucket]
            packed = torch.cat([ins[i].view(self._size, -1) for i in idx], dim=1)  # row r: every input's row r
            out = packed.new_empty(packed.shape[1])
            for w in self._reduce_scatter_one(out, list(packed), opts, s):
                w.wait()
            at = 0
            for i in idx:
                n = outs[i].numel()
                outs[i].copy_(out[at : at + n])
                at += n
        return self._finish("reduce_scatter_tensor_coalesced", [], list(outputs), after)

    # -- all_to_all -----------------------------------------------------------------------------------

    @_collective("all_to_all_single")
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: c10d.AllToAllOptions | None = None):
        """``all_to_all_single``: fused, one transport alltoall; skinny or capped, per-peer messages of the limit."""
        out, inp = self._unwrap(output), self._unwrap(input)
        splits = (list(input_split_sizes), list(output_split_sizes)) if input_split_sizes else None
        self._verify("all_to_all_single", [inp], splits)
        s = get_collective_settings()
        limit = s.message_limit()
        if limit == 0:
            self.sent += 1
            work = self._world.alltoall_base(out, inp, output_split_sizes, input_split_sizes,
                                             opts or c10d.AllToAllOptions())
            return self._finish("all_to_all_single", [work], [output])
        send, recv = self._chunks(flat_view(inp), input_split_sizes), self._chunks(flat_view(out), output_split_sizes)
        recv[self._rank].copy_(send[self._rank])
        for d in range(1, self._size):
            to, frm = (self._rank + d) % self._size, (self._rank - d) % self._size
            out_p = pieces(send[to].numel(), send[to].element_size(), limit) if send[to].numel() else []
            in_p = pieces(recv[frm].numel(), recv[frm].element_size(), limit) if recv[frm].numel() else []
            for k in range(max(len(out_p), len(in_p))):
                works = []
                if k < len(out_p):
                    self.sent += 1
                    works.append(self._world.send([send[to][out_p[k][0] : out_p[k][1]]], to, k))
                if k < len(in_p):
                    works.append(self._world.recv([recv[frm][in_p[k][0] : in_p[k][1]]], frm, k))
                for w in works:
                    w.wait()
        return self._finish("all_to_all_single", [], [output])

    def _chunks(self, flat: torch.Tensor, splits: Sequence[int]) -> list[torch.Tensor]:
        """A flat buffer's per-rank chunks (rows of the first dimension, ``splits`` or equal)."""
        if not splits:
            return list(flat.view(self._size, -1)) if flat.numel() else [flat] * self._size
        total = sum(splits)
        row = flat.numel() // total if total else 0
        out, at = [], 0
        for n in splits:
            out.append(flat[at * row : (at + n) * row])
            at += n
        return out

    # -- pass-through (not shaped by the settings) ----------------------------------------------------

    def _through(self, op: str, work, result: list):
        self.sent += 1
        return self._finish(op, [work], result)

    @_collective("reduce")
    def reduce(self, tensors, opts=None):
        host = self._host(tensors)
        self._verify("reduce", host)
        opts, after = self._averaged(opts or c10d.ReduceOptions(), host)
        root = opts.rootRank
        work = self._world.reduce(host, opts)
        return self._finish("reduce", [work], list(tensors), after if self._rank == root else None)

    @_collective("gather")
    def gather(self, output_tensors, input_tensors, opts=None):
        ins = self._host(input_tensors)
        self._verify("gather", ins)
        outs = [self._host(o) for o in output_tensors]
        work = self._world.gather(outs, ins, opts or c10d.GatherOptions())
        return self._through("gather", work, [t for o in output_tensors for t in o])

    @_collective("scatter")
    def scatter(self, output_tensors, input_tensors, opts=None):
        outs = self._host(output_tensors)
        self._verify("scatter", outs)
        ins = [self._host(i) for i in input_tensors]
        work = self._world.scatter(outs, ins, opts or c10d.ScatterOptions())
        return self._through("scatter", work, list(output_tensors))

    @_collective("all_to_all")
    def alltoall(self, output_tensors, input_tensors, opts=None):
        ins = self._host(input_tensors)
        self._verify("all_to_all", ins)
        work = self._world.alltoall(self._host(output_tensors), ins, opts or c10d.AllToAllOptions())
        return self._through("all_to_all", work, list(output_tensors))

    @_collective("send")
    def send(self, tensors, dst_rank, tag=0):
        return self._through("send", self._world.send(self._host(tensors), dst_rank, tag), list(tensors))

    @_collective("recv")
    def recv(self, tensors, src_rank, tag=0):
        return self._through("recv", self._world.recv(self._host(tensors), src_rank, tag), list(tensors))

    @_collective("barrier")
    def barrier(self, opts: c10d.BarrierOptions | None = None):
        """A transport barrier (never shaped: nothing to split)."""
        return self._through("barrier", self._world.barrier(opts_like(c10d.BarrierOptions, opts)), [])
