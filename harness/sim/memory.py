"""Simulated device memory: per-device accounting, a configurable size, and out-of-memory errors.

A sim storage is host memory from sim's `c10::DeviceAllocator` (or a CPU kernel's output adopted
without a copy), counted on its device until it is freed (``csrc/allocator.cpp``). Views share their
base's count, as on a real device. Nothing is cached, so "reserved" equals "allocated" and
`empty_cache` has nothing to return.

Each device has a memory size; an allocation that would exceed it raises `torch.OutOfMemoryError`
("sim:N out of memory ...") the way a real device does, so OOM handling can be tested without a
big machine. The default size is the host's physical memory (sim memory is host memory).

Switch: env ``PORTHARNESS_SIM_MEMORY_MB`` (all devices), `set_memory_size()` (one or all
devices), or the `memory_size()` context manager. A device several processes share (``placement``) has
one size and one budget: every process's allocations count against it.

The statistics are what `torch.accelerator.memory_allocated/memory_stats/...` report (through the
DeviceAllocator in ``native``); the functions here are the `torch.sim` module's versions of them.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from contextlib import AbstractContextManager
from typing import Any

import torch

from .indices import MAX_DEVICES, _index_of
from .native import ext
from .switch import Switch

MEMORY_ENV = "PORTHARNESS_SIM_MEMORY_MB"

DeviceLike = torch.device | str | int | None


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 64 << 30


def _parse_mb(raw: str) -> int:
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not mb > 0:
        raise ValueError(f"{MEMORY_ENV}={raw!r}: expected a positive device memory size in MiB")
    return int(mb * (1 << 20))


def _default_size() -> int:
    raw = os.environ.get(MEMORY_ENV, "").strip()
    return _parse_mb(raw) if raw else _host_memory()


# Every device's simulated memory size, in bytes (device index -> bytes).
_switch: Switch[dict[int, int]] = Switch(lambda sizes: [ext.set_limit(i, b) for i, b in sizes.items()],
                                         dict.fromkeys(range(MAX_DEVICES), _default_size()))


def _indices(device: DeviceLike | str) -> list[int]:
    return list(range(MAX_DEVICES)) if device == "all" else [_index_of(device)]


def _sized(size_mb: float | None, device: DeviceLike | str) -> dict[int, int]:
    size = _default_size() if size_mb is None else _parse_mb(str(size_mb))
    return {**_switch.get(), **dict.fromkeys(_indices(device), size)}


def set_memory_size(size_mb: float | None, device: DeviceLike | str = "all") -> None:
    """Simulated memory of `device` (default: every device) in MiB; None restores the default (env
    var, else host memory). Live tensors stay; the next allocation that does not fit raises."""
    _switch.set(_sized(size_mb, device))


def get_memory_size(device: DeviceLike = None) -> int:
    """Total simulated memory of `device`, in bytes."""
    return ext.stats(_index_of(device))[7]


def memory_size(size_mb: float | None, device: DeviceLike | str = "all") -> AbstractContextManager[None]:
    """Run the block with another simulated memory size (restored after, on the devices it set)."""
    indices = _indices(device)
    return _switch.scoped(_sized(size_mb, device),
                          lambda prev, now: {**now, **{i: prev[i] for i in indices}})


# --- the torch.sim / torch.cuda-style memory API ---------------------------------------------------


def memory_allocated(device: DeviceLike = None) -> int:
    """Bytes of sim memory held by live tensors on `device`."""
    return ext.stats(_index_of(device))[0]


def max_memory_allocated(device: DeviceLike = None) -> int:
    """Peak of `memory_allocated` since start or the last `reset_peak_memory_stats`."""
    return ext.stats(_index_of(device))[1]


memory_reserved = memory_allocated  # no caching allocator: what is reserved is allocated
max_memory_reserved = max_memory_allocated


def reset_peak_memory_stats(device: DeviceLike = None) -> None:
    ext.reset_peak(_index_of(device))


def reset_max_memory_allocated(device: DeviceLike = None) -> None:
    reset_peak_memory_stats(device)


def reset_accumulated_memory_stats(device: DeviceLike = None) -> None:
    ext.reset_accumulated(_index_of(device))


def memory_stats(device: DeviceLike = None) -> OrderedDict[str, Any]:
    """The keys of `torch.cuda.memory_stats` that sim tracks (``all`` pool only), sorted."""
    cur, peak, allocated, freed, blocks, blocks_peak, ooms, _limit = ext.stats(_index_of(device))
    out: dict[str, int] = {"num_ooms": ooms, "num_alloc_retries": 0}
    for key in ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes"):
        out.update({f"{key}.all.current": cur, f"{key}.all.peak": peak,
                    f"{key}.all.allocated": allocated, f"{key}.all.freed": freed})
    for key in ("allocation", "segment", "active"):
        out.update({f"{key}.all.current": blocks, f"{key}.all.peak": blocks_peak})
    return OrderedDict(sorted(out.items()))


def mem_get_info(device: DeviceLike = None) -> tuple[int, int]:
    """(free, total) simulated bytes on `device`, like `torch.cuda.mem_get_info`: on a shared device what
    every process using it left (``placement``). Asking is a use of the device, as on CUDA."""
    free, total = ext.mem_info(_index_of(device))
    return int(free), int(total)


def empty_cache() -> None:
    """Free cached memory: sim caches no device memory (what is freed goes back at once), only the
    bf16-rounded copies of parameters that ``default`` precision multiplies with (host memory)."""
    ext.clear_round_cache()


