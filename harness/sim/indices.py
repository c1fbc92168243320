"""Device count and device-index parsing, shared by the device module, memory and streams."""

from __future__ import annotations

import os

import torch

from .native import ext

DEVICE_COUNT_ENV = "PORTHARNESS_SIM_DEVICES"
VISIBLE_ENV = "PORTHARNESS_SIM_VISIBLE_DEVICES"  # as CUDA_VISIBLE_DEVICES: which devices, in which order
DEFAULT_DEVICE_COUNT = 2
MAX_DEVICES = 64  # the native side's per-device tables


def _physical_count() -> int:
    raw = os.environ.get(DEVICE_COUNT_ENV, str(DEFAULT_DEVICE_COUNT))
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_DEVICES:
        raise ValueError(f"{DEVICE_COUNT_ENV}={raw!r}: expected an integer device count from 1 to {MAX_DEVICES}")
    return n


def visible_devices() -> list[int] | None:
    """The simulated devices this process sees, in its own order (logical sim:i is physical
    ``visible[i]``), or None when every device is visible. ValueError for a value naming no device
    (the native side reads the same variable, up to its first bad entry, as CUDA does)."""
    raw = os.environ.get(VISIBLE_ENV)
    if raw is None:
        return None
    count = _physical_count()
    out: list[int] = []
    for item in raw.split(","):
        if not item.isdigit() or int(item) >= count or int(item) in out:
            why = "repeats a device" if item.isdigit() and int(item) in out else "names no device"
            raise ValueError(f"{VISIBLE_ENV}={raw!r}: {item!r} {why}; expected distinct indices of the {count} "
                             f"simulated devices (0..{count - 1}), e.g. '1' or '1,0' (set {DEVICE_COUNT_ENV} to "
                             "simulate more)")
        out.append(int(item))
    return out


def _read_device_count() -> int:
    visible = visible_devices()
    return len(visible) if visible is not None else _physical_count()


def device_count() -> int:
    # Read on every call, not once at import: a supervisor process that imported sim long ago must see
    # the count its workers (started with today's environment) will see.
    return _read_device_count()


def _check_index(index: int) -> int:
    count = _read_device_count()
    if not 0 <= index < count:
        seen = f"{count} visible simulated devices ({VISIBLE_ENV})" if os.environ.get(VISIBLE_ENV) is not None \
            else f"{count} simulated devices"
        raise RuntimeError(f"sim device index {index} out of range: {seen} (set {DEVICE_COUNT_ENV} to simulate more)")
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
