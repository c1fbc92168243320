"""Streams and events on sim, shaped like `torch.cuda`'s, for libraries that schedule work on them.

Every sim kernel has finished when its Python call returns, so ordering between streams holds
trivially: a stream is always idle, an event has completed as soon as it is recorded, and
synchronizing or waiting does nothing. What is tracked, per thread and device as on CUDA, is which
stream is current (the native device guard keeps it, so `torch.Stream`/`torch.Event` with
``device="sim"`` and `torch.accelerator`'s stream calls see the same state). Events remember when
they were recorded, so ``start.elapsed_time(end)`` measures host time between two records.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .indices import _index_of
from .native import ext

_PRIVATEUSE1 = int(torch._C._autograd.DeviceType.PrivateUse1)

DeviceLike = torch.device | str | int | None


class Stream(torch.Stream):
    """A stream on a sim device: ``torch.sim.Stream()``, ``torch.sim.Stream("sim:1")``."""

    def __new__(cls, device: DeviceLike = None, priority: int = 0, **kwargs: int) -> Stream:
        if "stream_id" in kwargs:  # an existing stream, by id (how current_stream builds one)
            return super().__new__(cls, priority=priority, **kwargs)
        return super().__new__(cls, device=torch.device("sim", _index_of(device)), priority=priority)

    def __enter__(self) -> Stream:
        self._prev = current_stream(self.device_index)
        set_stream(self)
        return self

    def __exit__(self, *exc: object) -> None:
        set_stream(self._prev)


def Event(  # noqa: N802  torch.cuda.Event's spelling; a plain torch.Event (torch checks the exact type)
    enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, device: DeviceLike = None
) -> torch.Event:
    """An event on a sim device; completes when recorded (kernels are synchronous)."""
    return torch.Event(device=torch.device("sim", _index_of(device)), enable_timing=enable_timing,
                       blocking=blocking, interprocess=interprocess)


def _stream(idx: int, stream_id: int) -> Stream:
    return Stream(stream_id=stream_id, device_index=idx, device_type=_PRIVATEUSE1)


def current_stream(device: DeviceLike = None) -> Stream:
    """This thread's current stream on `device` (the default stream unless one was set)."""
    idx = _index_of(device)
    return _stream(idx, ext.current_stream(idx))


def default_stream(device: DeviceLike = None) -> Stream:
    return _stream(_index_of(device), 0)


def set_stream(stream: torch.Stream) -> None:
    """Make `stream` current on its device for this thread."""
    if stream.device_type != _PRIVATEUSE1:
        raise ValueError(f"expected a sim stream, got one on {stream.device}")
    ext.set_stream(stream.device_index, stream.stream_id)


@contextmanager
def stream(s: torch.Stream | None) -> Iterator[None]:
    """Run the block with `s` as the current stream of its device (no-op for None, as on CUDA)."""
    if s is None:
        yield
        return
    prev = current_stream(s.device_index)
    set_stream(s)
    try:
        yield
    finally:
        set_stream(prev)


StreamContext = stream
