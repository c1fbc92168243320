"""The `torch.sim` device module: the contract PyTorch expects of a PrivateUse1 backend.

`torch.utils.backend_registration` looks these functions up by name (device count, current device,
RNG hooks used by `torch.manual_seed`, AMP dtypes). Simulated devices are independent: each has its
own current-device slot and its own RNG, so seeding `sim:1` never perturbs `sim:0`.

Inductor looks for a device's code generators in this module (`Scheduling`, `PythonWrapperCodegen`,
`CppWrapperCodegen`, `WrapperFxCodegen`): sim's are Inductor's CPU ones (``inductor``), loaded on
first use.

The current device (and stream) is per thread, as on CUDA, and lives in the native device guard
(``native``), so `torch.sim.set_device`, `torch.accelerator.set_device_index` and the autograd
engine's per-device worker threads agree. Memory (``memory``) and stream (``streams``) functions
are re-exported here because this module is `torch.sim`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .indices import (  # noqa: F401  the index helpers other modules reach through here
    DEFAULT_DEVICE_COUNT,
    DEVICE_COUNT_ENV,
    _check_index,
    _index_of,
    current_device,
    device_count,
)
from .memory import (  # noqa: F401  torch.sim's memory API
    empty_cache,
    get_memory_size,
    max_memory_allocated,
    max_memory_reserved,
    mem_get_info,
    memory_allocated,
    memory_reserved,
    memory_size,
    memory_stats,
    reset_accumulated_memory_stats,
    reset_max_memory_allocated,
    reset_peak_memory_stats,
    set_memory_size,
)
from .native import ext as _ext
from .placement import (  # noqa: F401  torch.sim's per-process memory cap, as torch.cuda's
    get_per_process_memory_fraction,
    set_per_process_memory_fraction,
)
from .streams import (  # noqa: F401  torch.sim's stream API
    Event,
    Stream,
    StreamContext,
    current_stream,
    default_stream,
    set_stream,
    stream,
)


class _PerDevice(dict):
    """Per-device state, created on first use: the device count may grow after import (below)."""

    def __init__(self, make) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, index: int):
        value = self[index] = self._make(index)
        return value


# The RNG each device's random kernels draw from (held by the native dispatch path, which passes it to
# every op with a generator argument left unset).
_generators: dict[int, torch.Generator] = _PerDevice(_ext.generator)


def is_available() -> bool:
    return True


_selected = False  # set_device or device() ran in this process


def is_initialized() -> bool:
    """Whether this process has used sim yet (selected a device or allocated on one), as
    `torch.cuda.is_initialized` says whether CUDA has a context: DeviceMesh binds each rank to its
    device (``LOCAL_RANK``) only while this is False, respecting a device the user chose first."""
    return _selected or _ext.current_device() != 0 or any(_ext.stats(i)[2] > 0 for i in range(device_count()))


def _is_in_bad_fork() -> bool:
    return False


def set_device(device: torch.device | str | int) -> None:
    global _selected
    _ext.set_device(_index_of(device))
    _selected = True


@contextmanager
def device(dev: torch.device | str | int) -> Iterator[None]:
    """Make `dev` the current sim device inside the block (like `torch.cuda.device`)."""
    global _selected
    prev = _ext.current_device()
    _ext.set_device(_index_of(dev))
    _selected = True
    try:
        yield
    finally:
        _ext.set_device(prev)


def synchronize(device: torch.device | str | int | None = None) -> None:
    # Kernels run eagerly on the host, so there is never outstanding work; validate the index anyway.
    _index_of(device)


def generator(index: int) -> torch.Generator:
    """The RNG that random kernels on `sim:index` draw from."""
    return _generators[_check_index(index)]


def manual_seed(seed: int) -> None:
    _generators[current_device()].manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for i in range(device_count()):
        _generators[i].manual_seed(int(seed))


def seed() -> None:
    _generators[current_device()].seed()


def seed_all() -> None:
    for i in range(device_count()):
        _generators[i].seed()


def initial_seed() -> int:
    return _generators[current_device()].initial_seed()


def get_rng_state(device: torch.device | str | int = "sim") -> torch.Tensor:
    return _generators[_index_of(device)].get_state()


def set_rng_state(new_state: torch.Tensor, device: torch.device | str | int = "sim") -> None:
    _generators[_index_of(device)].set_state(new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [_generators[i].get_state() for i in range(device_count())]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for i, s in zip(range(device_count()), new_states, strict=True):
        _generators[i].set_state(s)


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16]


def _is_autocast_enabled() -> bool:
    return torch.is_autocast_enabled("sim")


def get_device_name(device: torch.device | str | int | None = None) -> str:
    # the device itself, not this process's index for it: processes restricted to different devices by
    # the visibility variable tell them apart by name, as by a GPU's UUID
    return f"portharness sim accelerator {_ext.physical_index(_index_of(device))}"


class DeviceProperties:
    """What `torch.cuda.get_device_properties` reports, for a sim device (memory is simulated)."""

    def __init__(self, index: int) -> None:
        self.name = get_device_name(index)
        self.index = index
        self.type = "sim"
        self.total_memory = get_memory_size(index)
        self.major, self.minor = 1, 0
        self.multi_processor_count = 1
        self.is_integrated = False

    def __repr__(self) -> str:
        return (f"_SimDeviceProperties(name='{self.name}', total_memory={self.total_memory >> 20}MB, "
                f"major={self.major}, minor={self.minor}, multi_processor_count={self.multi_processor_count})")


def get_device_properties(device: torch.device | str | int | None = None) -> DeviceProperties:
    return DeviceProperties(_index_of(device))


def get_device_capability(device: torch.device | str | int | None = None) -> tuple[int, int]:
    props = get_device_properties(device)
    return props.major, props.minor


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True  # bf16 kernels are the CPU's


_INDUCTOR = ("Scheduling", "PythonWrapperCodegen", "CppWrapperCodegen", "WrapperFxCodegen")


def __getattr__(name: str) -> object:
    """Inductor's code generators for sim (``harness.sim.inductor``), imported when Inductor first asks."""
    if name in _INDUCTOR:
        from .inductor import CODEGEN

        return CODEGEN[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
