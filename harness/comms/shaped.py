"""`ShapedProcessGroup`: any c10d transport (gloo, nccl) as a Python process group shaped by the settings.

How: a Python ``dist.ProcessGroup`` subclass returned by an ``extended_api`` creator replaces the whole
group, and its virtual methods are reachable from C++, which is what DDP's reducer calls. Each method
hands the collective to a `planner.ShapedCollectives` (the plans) and returns a Work on its future.
Importing this module registers ``shaped_gloo`` / ``shaped_nccl`` for CPU / CUDA tensors.

Limits of a Python group, which a native backend does not have (``sim``'s is one, over the same
planner): c10d keeps a group's name on its backends and a Python group has none, so DeviceMesh, DTensor,
FSDP2 and the functional collectives (which look groups up by name) do not work on these two; ``dist.*``
and DDP do.

This module depends only on torch; nothing here knows about a device backend or the harness runner.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from harness.comms.planner import ShapedCollectives
from harness.comms.transport import make_transport  # noqa: F401  re-exported: the wire under the settings


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
    """A process group whose collectives are planned by a `ShapedCollectives` (see the module docstring).

    ``unwrap`` maps a caller tensor to the tensor the transport sees (the identity for CPU/CUDA);
    results are written in place into the caller's tensors and the returned work's future holds the
    caller's tensors, as DDP's reducer expects.
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
        self._name = name
        self.planner = ShapedCollectives(store, rank, size, timeout, transport=transport, unwrap=unwrap, label=name)

    def getBackendName(self) -> str:  # noqa: N802 (c10d's name)
        return self._name

    @property
    def transport(self):
        """The world-sized transport backend (gloo/nccl): for barriers and timing outside the settings."""
        return self.planner.transport

    @property
    def _world(self):  # the tests swap in a recording transport here
        return self.planner._world

    @_world.setter
    def _world(self, value) -> None:
        self.planner._world = value

    def allreduce(self, tensors, opts=None):
        return _FutureWork(self.planner.allreduce(tensors, opts))

    def allreduce_coalesced(self, tensors, opts=None):
        return _FutureWork(self.planner.allreduce_coalesced(tensors, opts))

    def broadcast(self, tensors, opts=None):
        return _FutureWork(self.planner.broadcast(tensors, opts))

    def allgather(self, output_tensors, input_tensors, opts=None):
        fut = self.planner.allgather(output_tensors, input_tensors, opts)
        return _FutureWork(fut.then(lambda _f: list(output_tensors)))

    def all_gather_single(self, output, input, opts=None):
        return _FutureWork(self.planner.all_gather_single(output, input, opts))

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        return _FutureWork(self.planner.reduce_scatter(output_tensors, input_tensors, opts))

    def reduce_scatter_single(self, output, input, opts=None):
        return _FutureWork(self.planner.reduce_scatter_single(output, input, opts))

    _allgather_base = all_gather_single  # the pre-2.10 names, still what some C++ callers use
    _reduce_scatter_base = reduce_scatter_single

    def barrier(self, opts: c10d.BarrierOptions | None = None):
        return _FutureWork(self.planner.barrier(opts))

    def reduce(self, tensors, opts=None):
        return _FutureWork(self.planner.reduce(tensors, opts))

    def gather(self, output_tensors, input_tensors, opts=None):
        return _FutureWork(self.planner.gather(output_tensors, input_tensors, opts))

    def scatter(self, output_tensors, input_tensors, opts=None):
        return _FutureWork(self.planner.scatter(output_tensors, input_tensors, opts))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return _FutureWork(self.planner.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts))

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None):
        return _FutureWork(self.planner.alltoall(output_tensors, input_tensors, opts))

    def send(self, tensors, dst_rank, tag=0):
        return _FutureWork(self.planner.send(tensors, dst_rank, tag))

    def recv(self, tensors, src_rank, tag=0):
        return _FutureWork(self.planner.recv(tensors, src_rank, tag))


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
