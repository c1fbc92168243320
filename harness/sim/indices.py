"""Device count and device-index parsing, shared by the device module, memory and streams."""

from __future__ import annotations

import os

import torch

from .native import ext

DEVICE_COUNT_ENV = "PORTHARNESS_SIM_DEVICES"
DEFAULT_DEVICE_COUNT = 2
MAX_DEVICES = 64  # the native side's per-device tables


def _read_device_count() -> int:
    raw = os.environ.get(DEVICE_COUNT_ENV, str(DEFAULT_DEVICE_COUNT))
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_DEVICES:
        raise ValueError(f"{DEVICE_COUNT_ENV}={raw!r}: expected an integer device count from 1 to {MAX_DEVICES}")
    return n


def device_count() -> int:
    # Read on every call, not once at import: a supervisor process that imported sim long ago must see
    # the count its workers (started with today's environment) will see.
    return _read_device_count()


def _check_index(index: int) -> int:
    count = _read_device_count()
    if not 0 <= index < count:
        raise RuntimeError(
            f"sim device index {index} out of range: {count} simulated devices "
            f"(set {DEVICE_COUNT_ENV} to simulate more)"
        )
    return index


def _index_of(device: torch.device | str | int | None) -> int:
    if device is None:
        return ext.current_device()
    if isinstance(device, int):
        return _check_index(device)
    device = torch.device(device)
    if device.type != "sim":
        raise ValueError(f"expected a sim device, got {device}")
    return ext.current_device() if device.index is None else _check_index(device.index)


current_device = ext.current_device  # () -> int, this thread's current sim device (native, per thread)

_read_device_count()  # a bad value fails the import, with the message above
