"""Injectable device faults, per simulated device, for resilience testing.

Real fleets lose runs to a single sick chip: NaN storms from bad memory, driver errors, hangs,
hard crashes. Each `sim` device can be made sick in one of these ways, checked on every kernel
launch on that device:

- ``nan``: a freshly computed floating-point output is filled with NaN.
- ``garbage``: a freshly computed floating-point output is overwritten with large random values.
- ``error``: the kernel raises `SimDeviceError` (a RuntimeError, like a CUDA/XLA runtime error).
- ``hang``: the kernel sleeps for ``hang_s`` seconds (default: an hour, i.e. a hang).
- ``slow``: the kernel keeps the device busy ``slow_s`` seconds longer (default 1 ms), as a throttled
  chip would: a straggler. The time is spent working (host CPU time), not sleeping, so it shows in
  the device's busy time as well as in wall time.
- ``crash``: the process dies from SIGSEGV, as a driver segfault would.

Each kind has a per-launch probability; draws come from a per-device RNG seeded from ``seed``, so a
given spec fails the same launches every run. A launch is a kernel that made fresh outputs (not a view,
not only in-place writes); sim's native dispatch path calls `on_launch` for launches on faulty devices
only, so a healthy machine never enters Python per op.

Switch: env ``PORTHARNESS_SIM_FAULTS`` (e.g. ``sim:1=nan:1.0;sim:0=error:0.05,hang:0.01@seed=3``,
``sim:1=slow:1.0@slow_s=0.002``),
`set_faults()` / `clear_faults()`, or the `faults()` context manager (re-exported by ``harness.sim``).
"""

from __future__ import annotations

import os
import random
import signal
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from .native import ext
from .switch import Switch

FAULTS_ENV = "PORTHARNESS_SIM_FAULTS"
KINDS = ("crash", "hang", "error", "nan", "garbage", "slow")  # new kinds go last: draws stay the same


class SimDeviceError(RuntimeError):
    """An (injected) device runtime error: the device, not the model, is at fault."""


@dataclass
class DeviceFaults:
    """Fault probabilities for one device plus the RNG that decides each launch."""

    probabilities: dict[str, float]
    seed: int = 0
    hang_s: float = 3600.0
    slow_s: float = 0.001
    rng: random.Random = field(init=False, repr=False)
    injected: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        for kind, p in self.probabilities.items():
            if kind not in KINDS:
                raise ValueError(f"unknown sim fault kind {kind!r}; expected one of {', '.join(KINDS)}")
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"sim fault {kind}: probability {p} not in [0, 1]")
        self.rng = random.Random(self.seed)
        self.injected = dict.fromkeys(KINDS, 0)


def _sync(active: dict[int, DeviceFaults]) -> None:
    """Tell the native dispatch path which devices call `on_launch`."""
    ext.set_fault_hook(on_launch if active else None, sorted(active))


# device index -> faults; empty on a healthy machine so the dispatch hot path skips it entirely.
_switch: Switch[dict[int, DeviceFaults]] = Switch(_sync, {})


def _device_index(device: str | int) -> int:
    if isinstance(device, int):
        return device
    # Parsed by hand: the env spec is read while the backend registers, before "sim" is a device type.
    kind, _, index = str(device).partition(":")
    if kind != "sim" or not (index.isdigit() or index == ""):
        raise ValueError(f"faults can only be injected on sim devices (sim or sim:N), got {device!r}")
    return int(index or 0)


def _with(device: str | int, seed: int, hang_s: float, slow_s: float, probabilities: dict[str, float]
          ) -> dict[int, DeviceFaults]:
    idx = _device_index(device)
    faults = DeviceFaults(dict(probabilities), seed=seed * 1_000_003 + idx, hang_s=hang_s, slow_s=slow_s)
    return {**_switch.get(), idx: faults}


def set_faults(
    device: str | int, *, seed: int = 0, hang_s: float = 3600.0, slow_s: float = 0.001, **probabilities: float
) -> None:
    """Make `device` faulty, e.g. ``set_faults("sim:1", nan=1.0)``. Replaces earlier faults there."""
    _switch.set(_with(device, seed, hang_s, slow_s, probabilities))


def clear_faults(device: str | int | None = None) -> None:
    if device is None:
        _switch.set({})
    else:
        idx = _device_index(device)
        _switch.set({i: f for i, f in _switch.get().items() if i != idx})


def active_faults() -> dict[int, DeviceFaults]:
    return _switch.get()


def injected_counts() -> dict[str, dict[str, int]]:
    """How many faults of each kind fired per device in this process (for test assertions)."""
    return {f"sim:{i}": dict(f.injected) for i, f in _switch.get().items()}


def faults(
    device: str | int, *, seed: int = 0, hang_s: float = 3600.0, slow_s: float = 0.001, **probabilities: float
) -> AbstractContextManager[None]:
    """Inject faults on `device` inside the block only (the other devices' faults stay as the block left them)."""
    idx = _device_index(device)

    def restore(prev: dict[int, DeviceFaults], now: dict[int, DeviceFaults]) -> dict[int, DeviceFaults]:
        out = {i: f for i, f in now.items() if i != idx}
        return {**out, idx: prev[idx]} if idx in prev else out

    return _switch.scoped(_with(idx, seed, hang_s, slow_s, probabilities), restore)


def parse_fault_spec(spec: str) -> dict[int, DeviceFaults]:
    """Parse ``sim:1=nan:1.0,error:0.1;sim:0=hang:0.5@seed=3`` (``@seed=``, ``@hang_s=``, ``@slow_s=`` optional)."""
    out: dict[int, DeviceFaults] = {}
    for clause in filter(None, (c.strip() for c in spec.split(";"))):
        try:
            dev, rest = clause.split("=", 1)
            kinds, *opts = rest.split("@")
            probs = {}
            for item in filter(None, kinds.split(",")):
                kind, p = item.split(":")
                probs[kind.strip()] = float(p)
            kw = {}
            for opt in opts:
                k, v = opt.split("=")
                kw[k.strip()] = float(v)
            idx = _device_index(dev.strip())
            out[idx] = DeviceFaults(
                probs, seed=int(kw.get("seed", 0)) * 1_000_003 + idx, hang_s=kw.get("hang_s", 3600.0),
                slow_s=kw.get("slow_s", 0.001),
            )
        except ValueError as e:
            raise ValueError(
                f"{FAULTS_ENV}: bad clause {clause!r} ({e}); expected e.g. 'sim:1=nan:1.0,error:0.1@seed=3'"
            ) from None
    return out


def canonical_fault_spec(spec: str) -> str:
    """One spelling per meaning of a fault spec (`parse_fault_spec`'s): clauses by device, kinds sorted,
    numbers as Python writes floats, options only where not the default. ``sim:0=nan:1.00,crash:.5`` and
    ``sim:0=crash:0.5,nan:1`` are the same faults, so the same run identity."""
    clauses = []
    for idx, f in sorted(parse_fault_spec(spec).items()):
        kinds = ",".join(f"{k}:{float(p)!r}" for k, p in sorted(f.probabilities.items()))
        seed = (f.seed - idx) // 1_000_003
        opts = "".join(f"@{k}={v!r}" for k, v, default in (("seed", seed, 0), ("hang_s", float(f.hang_s), 3600.0),
                                                             ("slow_s", float(f.slow_s), 0.001)) if v != default)
        clauses.append(f"sim:{idx}={kinds}{opts}")
    return ";".join(clauses)


def on_launch(idx: int, outputs: list[torch.Tensor]) -> None:
    """Called by the dispatch path after a kernel on `sim:idx` computed `outputs` (fresh, non-aliasing)."""
    f = _switch.get().get(idx)
    if f is None:
        return
    p = f.probabilities
    rng = f.rng
    for kind in KINDS:
        prob = p.get(kind)
        if not prob or rng.random() >= prob:
            continue
        if kind in ("nan", "garbage"):
            floats = [t for t in outputs if t.is_floating_point() and t.numel()]
            if not floats:
                continue
            f.injected[kind] += 1
            for t in floats:
                if kind == "nan":
                    t.fill_(float("nan"))
                else:
                    g = torch.Generator().manual_seed(rng.getrandbits(31))
                    t.copy_(torch.randn(t.shape, generator=g).mul_(1e4).to(t.dtype))
            continue
        f.injected[kind] += 1
        if kind == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        elif kind == "hang":
            time.sleep(f.hang_s)
        elif kind == "slow":
            end = time.thread_time() + f.slow_s  # busy, not asleep: a slow chip still computes
            while time.thread_time() < end:
                pass
        elif kind == "error":
            raise SimDeviceError(f"sim:{idx}: device error (injected fault): uncorrectable memory error")


if os.environ.get(FAULTS_ENV):
    _switch.set(parse_fault_spec(os.environ[FAULTS_ENV]))
