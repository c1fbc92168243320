"""Adapter for `sim`, the simulated young accelerator in `harness.sim`.

The only module outside `harness/sim/` that knows sim's switches: its two precision modes, its op
profiles, its injected device errors, its planted numerics bugs and planted slowdowns, and its placement
(which processes a device takes, which devices a process sees).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from harness.backends.base import Adapter, OpCensus


class SimAdapter(Adapter):
    options = ("ops", "fault", "fallback", "numerics", "slow_ops", "compiler_bug")
    more_devices_hint = "; set PORTHARNESS_SIM_DEVICES to simulate more"
    precisions = ("default", "highest")

    def load(self) -> None:
        import harness.sim  # noqa: F401  registers the backend in this process

    def dist_backend(self) -> str:
        import harness.sim.distributed  # noqa: F401  registers the "sim" c10d backend

        return super().dist_backend()

    def collective_setting(self, name: str) -> contextlib.AbstractContextManager[None]:
        """sim's switches (harness.comms.settings' grammar: fused, skinny[:PIECE], bucket:SIZE, cap:SIZE,
        per-host[:N], joined by '+'), which shape every collective its c10d backend plans."""
        import harness.sim.distributed as simdist

        try:
            setting = simdist.parse_setting(name)
        except ValueError as e:
            raise ValueError(f"--collectives {name}: {e}") from None
        return simdist.collective_settings(setting)

    def device_count(self) -> int:
        self.load()
        import torch

        return torch.get_device_module("sim").device_count()

    def check_settings(self, settings: dict[str, Any]) -> dict[str, Any]:
        out = super().check_settings(settings)
        from harness.sim.opset import profile_names

        ops = out.setdefault("ops", "young")
        if ops not in profile_names() and not os.path.isfile(ops):
            raise ValueError(f"--ops {ops!r}: expected one of {', '.join(profile_names())} or a profile file")
        if ops not in profile_names():
            from pathlib import Path

            from harness.sim.opset import read_profile

            read_profile(Path(ops))  # a malformed file fails here, not in every worker
        if out.get("fallback", "off") not in ("off", "cpu"):
            raise ValueError(f"--fallback {out['fallback']!r}: sim supports off or cpu")
        if "numerics" in out:
            from harness.sim.numerics import KINDS

            bad = [k for k in out["numerics"].split(",") if k not in KINDS]
            if bad:
                raise ValueError(f"--numerics-bug {','.join(bad)}: sim's planted bugs are {', '.join(KINDS)}")
            out["numerics"] = ",".join(sorted(set(out["numerics"].split(","))))  # one spelling per run identity
            if "cache-off-by-one" in out["numerics"].split(",") and out.get("mode") != "generate":
                # only decoding writes a KV cache: elsewhere the bug would be planted, never met, and the row pass
                raise ValueError("--numerics-bug cache-off-by-one: only with --mode generate (it plants a bug in the KV "
                                 f"cache's writes, which --mode {out.get('mode', 'inference')} never makes)")
        if "slow_ops" in out:
            from harness.sim.slowdown import canonical_slow_ops

            try:
                out["slow_ops"] = canonical_slow_ops(out["slow_ops"])
            except ValueError as e:
                raise ValueError(f"--slow-ops {out['slow_ops']!r}: {str(e).split(': ', 1)[-1]}") from None
        if "compiler_bug" in out:
            if "compile" not in out or not str(out["compile"]).startswith("inductor"):
                raise ValueError(f"--compiler-bug {out['compiler_bug']}: sim plants it in Inductor's generated code; "
                                 "add --compile inductor")
            from harness.sim.inductor import COMPILER_BUGS

            if out["compiler_bug"] not in COMPILER_BUGS:
                raise ValueError(f"--compiler-bug {out['compiler_bug']!r}: sim's planted compiler bugs are "
                                 f"{', '.join(COMPILER_BUGS)}")
        if "fault" in out:
            from harness.sim.fault_injection import canonical_fault_spec, parse_fault_spec

            count = self.device_count()  # a bad spec, or a device that does not exist, fails here
            missing = sorted(i for i in parse_fault_spec(out["fault"]) if i >= count)
            if missing:
                raise ValueError(f"--fault {out['fault']!r}: sim:{missing[0]} does not exist, sim has {count} device(s) "
                                 f"(sim:0..sim:{count - 1}); nothing would be injected{self.more_devices_hint}")
            out["fault"] = canonical_fault_spec(out["fault"])  # one spelling per run identity
        return out

    def declared_precision(self, settings: dict[str, Any]) -> str:
        # sim declares what its precision switch does: default = bf16 matmul operands, fp32 accumulate
        if "declared_precision" in settings:
            return settings["declared_precision"]
        return "fp32" if settings.get("precision", "default") == "highest" else "bf16-matmul"

    def reference_settings(self, settings: dict[str, Any]) -> dict[str, Any]:
        # op profile, CPU fallback, planted bugs and injected faults act in sim's kernels only
        return {k: v for k, v in super().reference_settings(settings).items() if k not in self.options}

    def worker_env(self, settings: dict[str, Any]) -> dict[str, str]:
        # faults are read when sim loads in the worker, so they travel as its environment
        return {"PORTHARNESS_SIM_FAULTS": settings["fault"]} if settings.get("fault") else {}

    def compile_cache_tag(self) -> str:
        # Inductor's key does not cover sim's code generator (harness/sim/inductor.py): its source names it
        import hashlib
        from pathlib import Path

        import harness.sim as sim

        return "sim-" + hashlib.sha256(Path(sim.__file__).with_name("inductor.py").read_bytes()).hexdigest()[:12]

    @contextlib.contextmanager
    def apply(self, settings: dict[str, Any]) -> Iterator[None]:
        import harness.sim as sim

        with (
            sim.precision(settings.get("precision", "default")),
            sim.op_profile(settings.get("ops", "young")),
            sim.fallback(settings.get("fallback", "off")),
            sim.numerics_bugs(*[k for k in settings.get("numerics", "").split(",") if k]),
            sim.slow_ops(settings["slow_ops"]) if "slow_ops" in settings else contextlib.nullcontext(),
            _compiler_bug(settings.get("compiler_bug", "")),
        ):
            yield

    def repro_setup(self, settings: dict[str, Any]) -> list[str]:
        bugs = [k for k in settings.get("numerics", "").split(",") if k]
        return [
            "import harness.sim as sim  # the backend",
            f"sim.set_precision({settings.get('precision', 'default')!r})",
            f"sim.set_op_profile({settings.get('ops', 'young')!r})",
            f"sim.set_fallback({settings.get('fallback', 'off')!r})",
            f"sim.set_numerics_bugs(*{bugs!r})",
        ]

    def seed(self, seed: int) -> None:
        self.load()
        super().seed(seed)

    @contextlib.contextmanager
    def census(self) -> Iterator[OpCensus]:
        from harness.sim import fallback_counts, reset_fallback_counts
        from harness.sim.opset import start_trace, stop_trace

        found = OpCensus()
        reset_fallback_counts()
        start_trace()
        try:
            yield found
        finally:
            seen = stop_trace()
            found.fallback = fallback_counts()
            found.native = sorted(seen - set(found.fallback))

    def perf_clock(self) -> tuple[str, Callable[[], float]]:
        """Thread CPU time: sim's kernels run to completion on the calling thread (one intra-op thread while
        timing), so its CPU time is the device's work, planted slowdowns included (they spin), while other
        processes on a shared host only stretch the wall clock."""
        import time

        return "thread-cpu", time.thread_time

    def is_device_fault(self, exc: BaseException) -> bool:
        from harness.sim import SimDeviceError

        return isinstance(exc, SimDeviceError) or super().is_device_fault(exc)  # "sim:0 is in use by process N"

    # harness.sim.indices.VISIBLE_ENV: its devices shown to a process, as CUDA_VISIBLE_DEVICES does
    visibility_variable = "PORTHARNESS_SIM_VISIBLE_DEVICES"

    def sharing(self) -> str:
        """PORTHARNESS_SIM_SHARING: exclusive by default, as a young chip is (harness.sim.placement)."""
        self.load()
        from harness.sim.placement import sharing

        return sharing()


@contextlib.contextmanager
def _compiler_bug(kind: str) -> Iterator[None]:
    """sim's planted compiler bug in what Inductor generates (none: Inductor is not even imported)."""
    if not kind:
        yield
        return
    from harness.sim.inductor import compiler_bugs

    with compiler_bugs(kind):
        yield
