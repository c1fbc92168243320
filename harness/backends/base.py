"""The adapter contract: what the harness asks of a backend, answered for any PyTorch device type.

`Adapter` is the generic answer for an accelerator that plugs into PyTorch as its own device type
(cuda, xpu, mps, hpu, or an out-of-tree PrivateUse1 backend): the device count comes from the
backend's device module, the precision knob is `torch.set_float32_matmul_precision`, and nothing is
known about its errors beyond PyTorch's own messages. Backends with more to say (`sim`, the CPU, a
vendor's) subclass it and override only what differs.

Whose code raised an error decides two verdicts: a dispatcher error naming another backend ("Could not
run 'aten::X' with arguments from the 'CPU' backend") is the target's missing op only when the backend's
own code relayed it, and a connection error (refused, reset, broken pipe, timeout) is the device's in
*every* phase where the backend's code raised it (loading seeds the device, `.to(device)` moves to it),
anywhere in the target phase. The backend's code is found by what it is known by, not by its device
module's ``__file__`` alone (a Python backend may register a module object made at run time, which has
none): the modules given with ``--backend``, the package behind its ``torch.backends`` entry point, the
device module object (its file, else its functions' or its class's module) and the Python file that
registered the PrivateUse1 kernels, each standing for its top-level package; never torch's, the standard
library's or portharness's own (`harness.backends.owner` has the rule as a table). A refused connection
(nobody serves the device, after the client's own reconnect window) is *unreachable*: the fleet policy
quarantines that device at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from harness.backends import errors, owner
from harness.backends.contracts import contract

# --precision values every backend accepts: torch's float32 matmul precision knob
MATMUL_PRECISIONS = ("default", "highest", "high", "medium")
# Device types Ray knows as accelerators: it counts them on each node, assigns one to an actor and makes
# only that one visible to it (CUDA_VISIBLE_DEVICES, ...). Any other type is a custom resource of its name.
RAY_ACCELERATORS = {"cuda": "GPU", "xpu": "GPU", "hpu": "HPU", "npu": "NPU", "xla": "TPU", "neuron": "neuron_cores"}
# The variable that shows a process only some devices of a type (indices, comma-separated, in the process's
# own order), as each vendor's runtime reads it before its first use; ROCm reads CUDA's too.
VISIBILITY = {"cuda": "CUDA_VISIBLE_DEVICES", "xpu": "ZE_AFFINITY_MASK", "hpu": "HABANA_VISIBLE_MODULES",
              "npu": "ASCEND_RT_VISIBLE_DEVICES", "xla": "TPU_VISIBLE_CHIPS", "mlu": "MLU_VISIBLE_DEVICES",
              "musa": "MUSA_VISIBLE_DEVICES", "neuron": "NEURON_RT_VISIBLE_CORES"}


@dataclass
class OpCensus:
    """Which ops a target run executed natively and which fell back to the CPU (None: not reported)."""

    native: list[str] | None = None
    fallback: dict[str, int] | None = None


class UnsupportedSetting(ValueError):
    """A setting this backend has no such option for (`key`, as a run's settings name it: the CLI says which
    of its options set it)."""

    def __init__(self, key: str, kind: str) -> None:
        super().__init__(f"setting {key!r} is not an option of the {kind} backend")
        self.key, self.kind = key, kind


class Adapter:
    """Everything the runner, worker, CLI and benchmarks need to know about one device type."""

    options: tuple[str, ...] = ()  # backend-specific settings keys it accepts beyond precision/attn
    precisions: tuple[str, ...] = MATMUL_PRECISIONS

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kind!r})"

    # -- process setup -----------------------------------------------------------------------

    def load(self) -> None:
        """Make the device type usable in this process (import/register the backend). Idempotent."""

    more_devices_hint = ""  # how to get more devices, for the out-of-range message
    ranks_share_device = False  # --parallel: several ranks may run on one device (the CPU: one per core)

    def dist_backend(self) -> str:
        """The c10d backend for this device type's tensors (``dist.init_process_group(name)``): the one its
        backend registered for it (``Backend.register_backend(..., devices=[kind])``), or PyTorch's default.
        ValueError when there is none."""
        import torch.distributed as dist

        self.load()
        name = dist.Backend.default_device_backend_map.get(self.kind)
        if name is None:
            raise ValueError(f"no c10d backend is registered for {self.kind} tensors; load the backend's module "
                             "(--backend) or name the c10d backend (--dist-backend)")
        return name

    def collective_setting(self, name: str) -> contextlib.AbstractContextManager[None]:
        """The context that runs this process's collectives under setting `name` (`--collectives`: e.g. fused,
        skinny, bucket:25m, cap:1m), entered by every rank alike; ValueError for a setting the backend does not
        have. A vendor's adapter (`register_adapter`) implements it for its own knobs. CUDA's counterparts are
        per process, fixed when the communicator is made (NCCL_ALGO, NCCL_PROTO, NCCL_MIN/MAX_NCHANNELS,
        NCCL_BUFFSIZE; DDP's bucket_cap_mb and FSDP2's reshard_after_forward are arguments of the wrapping):
        they need a launch per setting, not an interleaved timing, and are not offered here yet."""
        raise ValueError(f"--collectives {name}: the {self.kind} backend declares no collective settings that can "
                         "change between steps (a backend's adapter implements Adapter.collective_setting)")

    @property
    def ray_resource(self) -> str:
        """The Ray resource one device of this type is: Ray's own accelerator resource where it has one
        (GPU, TPU, ...), else a custom resource named after the device type that each host declares
        (`ray start --resources '{"sim": 2}'`)."""
        return RAY_ACCELERATORS.get(self.kind, self.kind)

    @property
    def ray_assigns(self) -> bool:
        """Whether Ray picks the device an actor gets and shows it only that one (as `<type>:0`)."""
        return self.ray_resource != self.kind

    def device_count(self) -> int:
        """From the backend's device module (`torch.get_device_module`), as every PyTorch user asks it."""
        import torch

        try:
            module = torch.get_device_module(self.kind)
        except (RuntimeError, AttributeError, ValueError):
            return 0
        count = getattr(module, "device_count", None)
        return int(count()) if callable(count) else 0

    def devices(self, target: str) -> list[str]:
        """The devices a run on `target` uses: the one it names (`cuda:1`), or every device of its type."""
        import torch

        dev = torch.device(target)
        try:
            count = self.device_count()
        except Exception as e:  # a driver that cannot even count its devices
            raise ValueError(f"--target {target}: the {dev.type} backend cannot count its devices ({e})") from e
        if count < 1:
            raise ValueError(f"--target {target}: no {dev.type} device is visible in this process")
        if dev.index is not None:
            if dev.index >= count:
                raise ValueError(
                    f"--target {target}: device index {dev.index} out of range, {count} {dev.type} device(s) "
                    f"({', '.join(f'{dev.type}:{i}' for i in range(count))}){self.more_devices_hint}"
                )
            return [str(dev)]
        return [f"{dev.type}:{i}" for i in range(count)]

    # -- placement: which processes a device takes ------------------------------------------------

    @property
    def visibility_variable(self) -> str | None:
        """The environment variable that restricts which devices a process sees (`VISIBILITY`), or None
        where the backend has none (the CPU; a backend that did not say: a vendor adapter sets it)."""
        return VISIBILITY.get(self.kind)

    def visible_env(self, indices: list[int]) -> dict[str, str]:
        """The environment that shows a new process only these devices (as this process numbers them), in
        this order; composed with the variable's value here, so a restricted parent restricts further.
        {} where the backend has no such variable (the process then sees every device)."""
        import os

        var = self.visibility_variable
        if var is None:
            return {}
        mine = [x.strip() for x in os.environ.get(var, "").split(",") if x.strip()]
        return {var: ",".join(mine[i] if var in os.environ else str(i) for i in indices)}

    def sharing(self) -> str:
        """How the devices take processes: ``exclusive`` (the first process that uses one holds it; another
        is refused), ``shared`` (several may use one), or ``unknown``. Generic: unknown (a GPU in CUDA's
        default compute mode shares, one in an exclusive mode or a TPU does not): a vendor adapter says."""
        return "unknown"

    @property
    def exclusive(self) -> bool:
        """A device refuses a second process: the fleet never puts two workers on one."""
        return self.sharing() == "exclusive"

    def refusal(self, exc: BaseException) -> errors.InUse | None:
        """Whether `exc` (or its chain) says another process holds the device, with the holder's pid where
        the backend's words name it (`errors.IN_USE`); None for any other error."""
        for link in errors.chain(exc):
            found = errors.parse_in_use(str(link))
            if found is not None:
                return found
        return None

    def device_identity(self, device: str) -> str:
        """What tells a device apart whatever a process numbers it (processes restricted to different
        devices all call theirs index 0): its UUID where the device module reports one, else its name."""
        import torch

        index = torch.device(device).index or 0
        try:
            module = torch.get_device_module(self.kind)
        except (RuntimeError, AttributeError, ValueError):
            return device
        props = getattr(module, "get_device_properties", None)
        uuid = getattr(props(index), "uuid", None) if callable(props) else None
        if uuid:
            return str(uuid)
        name = getattr(module, "get_device_name", None)
        return str(name(index)) if callable(name) else device

    # -- settings ----------------------------------------------------------------------------

    def check_settings(self, settings: dict[str, Any]) -> dict[str, Any]:
        """Validated settings to record with each row; ValueError names the bad value and the choices."""
        out = dict(settings)
        if "declared_precision" in out:
            contract(out["declared_precision"])  # ValueError naming the known contracts
            implied = self.declared_precision({k: v for k, v in out.items() if k != "declared_precision"})
            if out["declared_precision"] == implied:
                del out["declared_precision"]  # what the backend declares anyway: one spelling per run identity
        precision = out.setdefault("precision", "default")
        if precision not in self.precisions:
            raise ValueError(
                f"--precision {precision!r}: {self.kind} supports {', '.join(self.precisions)}"
            )
        for key in out:
            if key not in ("precision", "attn", "declared_precision", "op_check", "dtype", "oracle_max_params",
                           "mode", "new_tokens", "cache", "compile", "dynamic", "amp", "confirm", "parallel",
                           "dist_backend", *self.options):
                raise UnsupportedSetting(key, self.kind)
        if "amp" in out:
            import torch

            self.load()
            if not torch.amp.is_autocast_available(self.kind):
                raise ValueError(f"--amp {out['amp']}: torch.autocast does not support the {self.kind} device type")
        return out

    def declared_precision(self, settings: dict[str, Any]) -> str:
        """The numerics contract the target declares under `settings` (`harness.backends.contracts`).

        What the user says (``--declared-precision``), fp32 when they say nothing: a generic backend
        cannot tell us what its matmuls do."""
        return settings.get("declared_precision", "fp32")

    def reference_settings(self, settings: dict[str, Any]) -> dict[str, Any]:
        """The settings that can change the CPU reference side (part of the reference cache's key): all but
        those only the target run sees (the matmul precision `apply` sets around it, the op check, --compile;
        the declared contract, --amp's included, enters the key on its own). A backend's own options stay in:
        an adapter that knows they touch only its device says so by overriding this."""
        target_only = ("precision", "op_check", "declared_precision", "compile", "dynamic", "confirm", "parallel",
                       "dist_backend")
        return {k: v for k, v in settings.items() if k not in target_only}

    def confirm_settings(self, settings: dict[str, Any]) -> dict[str, Any] | None:
        """The settings that run this device at its highest precision, where a pass within the declared
        precision is confirmed (`harness.run.variants.Confirmation`), or None where it has no such mode.
        Generic: torch's float32 matmul precision at ``highest``, the declared contract then the backend's
        own (a contract the user declared is the default precision's). A backend whose full-precision mode is
        another switch overrides this (and `declared_precision` for it)."""
        if "highest" not in self.precisions:
            return None
        return {**{k: v for k, v in settings.items() if k != "declared_precision"}, "precision": "highest"}

    def repro_setup(self, settings: dict[str, Any]) -> list[str]:
        """Python lines a standalone repro runs after importing torch and the backend, to apply `settings`."""
        precision = settings.get("precision", "default")
        return [f"torch.set_float32_matmul_precision({precision!r})"] if precision != "default" else []

    def compile_cache_tag(self) -> str:
        """What names this backend's own code generator in compile-cache directories ("" : torch's only).
        Inductor's cache key covers torch's code, not a generator registered from outside it."""
        return ""

    def worker_env(self, settings: dict[str, Any]) -> dict[str, str]:
        """Environment a worker needs for `settings` (switches a backend reads when it loads)."""
        return {}

    @contextlib.contextmanager
    def apply(self, settings: dict[str, Any]) -> Iterator[None]:
        """Run the target side of a model under `settings` (restored afterwards)."""
        import torch

        prev = torch.get_float32_matmul_precision()
        precision = settings.get("precision", "default")
        if precision != "default":
            torch.set_float32_matmul_precision(precision)
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(prev)

    def synchronize(self, device: str) -> None:
        """Wait for `device` to finish its queued work, so that an error it reports late (as CUDA does, at
        the next synchronizing call) surfaces now, with the model that caused it: its device module's
        `synchronize`, else `torch.accelerator`'s. Raises what the device reports."""
        import torch

        try:
            module = torch.get_device_module(self.kind)
        except (RuntimeError, AttributeError, ValueError):
            module = None
        sync = getattr(module, "synchronize", None)
        if callable(sync):
            sync(torch.device(device))
            return
        accelerator = getattr(torch, "accelerator", None)
        current = accelerator.current_accelerator() if accelerator is not None and accelerator.is_available() else None
        if current is not None and current.type == self.kind:
            accelerator.synchronize(torch.device(device))

    # -- speed (--perf) ------------------------------------------------------------------------

    def _memory_api(self, name: str):
        """``name`` (max_memory_allocated, reset_peak_memory_stats) from the device module, else from
        `torch.accelerator` when this is the current accelerator; None when neither has it."""
        import torch

        try:
            module = torch.get_device_module(self.kind)
        except (RuntimeError, AttributeError, ValueError):
            module = None
        fn = getattr(module, name, None)
        if callable(fn):
            return fn
        accelerator = getattr(torch, "accelerator", None)
        current = accelerator.current_accelerator() if accelerator is not None and accelerator.is_available() else None
        fn = getattr(accelerator, name, None) if current is not None and current.type == self.kind else None
        return fn if callable(fn) else None

    def reset_peak_memory(self, device: str) -> bool:
        """Start a new peak for `peak_memory_mb`; False where the backend keeps no statistics (no such
        function, or `torch.accelerator`'s, whose allocator for a Python backend is not a DeviceAllocator):
        peak memory is optional, the timing around it is not."""
        import torch

        fn = self._memory_api("reset_peak_memory_stats")
        if fn is None:
            return False
        try:
            fn(torch.device(device))
        except (RuntimeError, NotImplementedError, AttributeError):
            return False  # "Allocator for X is not a DeviceAllocator"
        return True

    def peak_memory_mb(self, device: str) -> float | None:
        """The device's peak allocated memory since `reset_peak_memory` (MiB), or None where the backend
        reports none (its device module's, or `torch.accelerator`'s, ``max_memory_allocated``)."""
        import torch

        fn = self._memory_api("max_memory_allocated")
        if fn is None:
            return None
        try:
            return int(fn(torch.device(device))) / 2**20
        except (RuntimeError, NotImplementedError, AttributeError):
            return None  # a device module that has the name but not the statistics

    def perf_clock(self) -> tuple[str, Callable[[], float]]:
        """The clock that measures this device's work on a step (`harness.run.perf`): the wall clock around a
        synchronized step, the only one that sees an accelerator's time."""
        import time

        return "wall", time.perf_counter

    def profiler_activity(self):
        """The `torch.profiler.ProfilerActivity` that records this device's own time (CUDA, XPU, MTIA, HPU,
        or PrivateUse1 for an out-of-tree backend that reports to the profiler), or None: the profile then
        reads host time, which is the device's own only where its kernels run on the host."""
        import torch
        from torch.profiler import ProfilerActivity, supported_activities

        if self.kind == "cpu":
            return None  # the host's own time is always recorded
        name = "PrivateUse1" if self.kind == torch._C._get_privateuse1_backend_name() else self.kind.upper()
        activity = getattr(ProfilerActivity, name, None)
        return activity if activity is not None and activity in supported_activities() else None

    def seed(self, seed: int) -> None:
        """Seed every device of this backend (a dead device fails here, before any model code)."""
        import torch

        module = torch.get_device_module(self.kind)
        manual_seed_all = getattr(module, "manual_seed_all", None)
        if callable(manual_seed_all):
            manual_seed_all(seed)

    @contextlib.contextmanager
    def census(self) -> Iterator[OpCensus]:
        """Count, around a target run, the ops that ran natively and those that fell back to the CPU.

        Generic backends have no portable counters: both stay None ("unknown")."""
        yield OpCensus()

    # -- errors ------------------------------------------------------------------------------

    def is_device_fault(self, exc: BaseException) -> bool:
        """True when `exc` (one exception, not its chain) says the device, not the model, is at fault.

        Generic: PyTorch's and common runtimes' messages for a lost device, ECC errors, driver and
        collective-library failures. A vendor adapter adds its runtime's exception types."""
        # another process holding the device is the device's unavailability too (its models run elsewhere)
        return isinstance(exc, RuntimeError | OSError) and (errors.is_device_fault_message(str(exc))
                                                            or errors.parse_in_use(str(exc)) is not None)

    def lost_connection(self, exc: BaseException, stage: str = "target") -> bool:
        """`exc` is a connection to the device failing: refused, reset, a broken pipe, a timeout. Raised
        through the backend's own code (its client talking to a device server) in any phase (loading
        seeds the device, the reference phase seeds it again), or anywhere in the target phase; a model's
        own download failing while it loads is not the device's."""
        if not isinstance(exc, ConnectionError | TimeoutError):  # socket.timeout is TimeoutError
            return False
        return stage == "target" or self.raised_by_backend(exc)

    def unreachable(self, exc: BaseException, stage: str = "target") -> bool:
        """`exc` says nobody serves the device: a refused connection that is a lost one (`lost_connection`),
        raised after the client's own reconnect attempts where it makes them ("could not reach the server
        again" from ConnectionRefusedError). Nothing will run there until it is back."""
        return any(isinstance(link, ConnectionRefusedError) and self.lost_connection(link, stage)
                   for link in errors.chain(exc))

    def blames_device(self, exc: BaseException, stage: str = "target") -> BaseException | None:
        """The exception in `exc`'s chain (what it was raised from or while handling: loaders wrap the
        backend's error) that says the device failed, or None."""
        for link in errors.chain(exc):
            if self.is_device_fault(link) or self.lost_connection(link, stage):
                return link
        return None

    def raised_by_backend(self, exc: BaseException) -> bool:
        """Whether the backend's own Python code is on `exc`'s traceback (it raised or relayed it): code
        of the packages the backend is known by (`harness.backends.owner`), not only its device
        module's file, which a Python backend's module made at run time does not have."""
        return owner.backend_code(self.kind).raised(exc)

    def parse_missing_op(self, exc: BaseException) -> errors.MissingOp | None:
        """The op (and dtype) `exc` says this backend lacks, or None for any other error. A dispatcher
        message naming another backend counts when the backend's own code relayed it (a remote
        executor that could not run the op it was asked to), as does a refusal only a backend makes
        ("prims::device_put ... is not an aten op"): read from the link of the chain its code raised (a
        compiler wraps it)."""
        if not isinstance(exc, NotImplementedError | RuntimeError | ValueError | TypeError):
            return None
        missing = errors.parse_missing_op(str(exc), self.kind)
        if missing is None:
            for link in errors.chain(exc):
                if self.raised_by_backend(link):
                    missing = errors.parse_missing_op(str(link), self.kind, relayed=True)
                    if missing is not None:
                        break
        return missing
