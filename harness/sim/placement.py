"""Placement: which process a sim device belongs to, and what processes sharing one share.

A young accelerator is one process's: TorchTPU runs one process per chip, and a second process that
opens a held chip is told "TPU in use by process N". sim does the same by default. The first process
that *uses* a device (allocates on it, runs a kernel on it, asks its free memory) holds it until that
process exits; any other process that uses it gets, at that first use and at once::

    RuntimeError: sim:0 is in use by process 1234 (sim's devices are exclusive: ...)

Switches (env vars, read at a device's first use in each process, so set them for every process):

- ``PORTHARNESS_SIM_SHARING``: ``exclusive`` (default) or ``shared``. A shared device takes any number
  of processes that all set ``shared`` (a process that did not is refused, as is a sharing process by an
  exclusive holder), and is then one device:

  - its memory is **one budget**: an allocation beyond what the other processes left raises
    `torch.OutOfMemoryError` naming each co-tenant's use ("Process 1234 has 48.00 MiB memory in use"),
    and ``mem_get_info`` reports the device's free memory after every process's use;
    ``memory_allocated`` and ``max_memory_allocated`` stay this process's own, as on CUDA;
  - its kernels **take turns** (the cost model): a device runs one kernel at a time, whichever process
    launched it; a process whose kernel finds the device busy waits (asleep) until it is free, and who
    goes next is the OS's choice among the waiters, not a fixed rotation. What a kernel costs on the
    host (sim's device) is unchanged; a process's step takes longer by the time its kernels wait, so K
    processes running kernels back to back take up to K times as long each (less where their Python
    between kernels overlaps the others' kernels), as time-slicing a GPU between processes does.
    Copies to and from the device take turns too. Unshared devices pay one atomic load per kernel.
- ``PORTHARNESS_SIM_VISIBLE_DEVICES``: as ``CUDA_VISIBLE_DEVICES``, the devices this process sees, in
  its own order (``1,0``: its sim:0 is device 1). A value naming no device fails the import.
- ``PORTHARNESS_SIM_MEMORY_FRACTION`` (or `set_per_process_memory_fraction`, as torch.cuda's): the share
  of a device's memory this process may allocate; beyond it, `torch.OutOfMemoryError` says so.
- ``PORTHARNESS_SIM_NAMESPACE``: which simulated host the devices belong to (default: one per user).
  Processes in different namespaces never see each other's devices (the tests give each test its own).

Nothing is left behind: ownership is an abstract Unix socket per process and device (no file), a shared
device's ledger a memfd its processes map (not in /dev/shm); the kernel releases both when a process
dies, kill -9 included, and a dead process's bytes are taken off the budget when they stand in the way
(``csrc/placement.cpp``). Linux only; elsewhere every process has every device to itself.
"""

from __future__ import annotations

import os

import torch

from .indices import MAX_DEVICES, VISIBLE_ENV, _index_of, visible_devices
from .native import ext
from .switch import Switch

SHARING_ENV = "PORTHARNESS_SIM_SHARING"
NAMESPACE_ENV = "PORTHARNESS_SIM_NAMESPACE"
FRACTION_ENV = "PORTHARNESS_SIM_MEMORY_FRACTION"
MODES = ("exclusive", "shared")

__all__ = ["FRACTION_ENV", "MODES", "NAMESPACE_ENV", "SHARING_ENV", "VISIBLE_ENV", "get_per_process_memory_fraction",
           "holders", "physical_index", "set_per_process_memory_fraction", "sharing", "tenants", "visible_devices"]

DeviceLike = torch.device | str | int | None


def sharing() -> str:
    """``exclusive`` or ``shared``: how this process will take a device it has not used yet."""
    raw = os.environ.get(SHARING_ENV, "").strip() or "exclusive"
    if raw not in MODES:
        raise ValueError(f"{SHARING_ENV}={raw!r}: expected {' or '.join(MODES)}")
    return raw


def _parse_fraction(raw: object, what: str) -> float:
    try:
        f = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        f = -1.0
    if not 0.0 < f <= 1.0:
        raise ValueError(f"{what}={raw!r}: expected a fraction of the device's memory, above 0 and at most 1")
    return f


def _env_fraction() -> float:
    raw = os.environ.get(FRACTION_ENV, "").strip()
    return _parse_fraction(raw, FRACTION_ENV) if raw else 1.0


_fractions: Switch[dict[int, float]] = Switch(lambda fr: [ext.set_fraction(i, f) for i, f in fr.items()],
                                              dict.fromkeys(range(MAX_DEVICES), _env_fraction()))


def set_per_process_memory_fraction(fraction: float, device: DeviceLike = None) -> None:
    """At most ``fraction`` of `device`'s memory (default: the current device) for this process, as
    `torch.cuda.set_per_process_memory_fraction`; 1 lifts the cap."""
    f = _parse_fraction(fraction, "fraction")
    _fractions.set({**_fractions.get(), _index_of(device): f})


def get_per_process_memory_fraction(device: DeviceLike = None) -> float:
    return _fractions.get()[_index_of(device)]


def physical_index(device: DeviceLike = None) -> int:
    """The simulated device behind this process's `device` (they differ under the visibility variable)."""
    return int(ext.physical_index(_index_of(device)))


def holders(device: DeviceLike = None) -> list[tuple[int, str]]:
    """(pid, ``exclusive`` | ``shared``) of every process holding `device`, this one included; asking
    does not take the device."""
    return [(int(p), str(m)) for p, m in ext.holders(physical_index(device))]


def tenants(device: DeviceLike = None) -> dict[int, int]:
    """pid -> bytes of device memory, for every process sharing `device` (empty unless this process
    shares it)."""
    return {int(p): int(b) for p, b in ext.tenants(_index_of(device))}


sharing()  # a bad value fails the import, as the other switches' do
