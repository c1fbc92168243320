"""sim as an Inductor device: ``torch.compile(backend="inductor")`` on sim tensors.

sim memory is host memory, so Inductor's CPU code generation serves it, as PyTorch's own tests register
an out-of-tree device whose memory is the host's (test/inductor/test_extension_backend.py): the C++
scheduling writes loops over raw pointers, the Python wrapper allocates buffers on ``sim:N``
(through sim's allocator, so device memory is counted) and calls the generated kernels, and whatever
Inductor does not generate (matmuls, convolutions, fallback ops) it calls as ATen ops, which reach
sim's native dispatch path like any eager op.

What that means for sim's switches in compiled code:

- precision: matmul-family ops are extern ATen calls (without max-autotune's C++ GEMM templates), so at
  ``default`` their operands are bf16-rounded exactly as in eager mode; pointwise and reduction code is
  fused fp32 C++, which the precision switch never touched anyway.
- op profile: ops fused into generated kernels never reach the dispatcher, so the profile does not
  apply to them (a compiler path covers ops the eager backend lacks, as on real backends); extern
  calls and fallbacks are checked as in eager mode.
- faults and planted numerics bugs act on the ATen calls only.
- FlexAttention stays unsupported: `flex_attention` itself refuses devices outside PyTorch's list, in
  compiled code too (it is checked while Dynamo traces it), before any Inductor template is chosen.

A planted compiler-only bug (env ``PORTHARNESS_SIM_COMPILER_BUG``, `set_compiler_bugs` /
`compiler_bugs()`), for checking that a harness tells a compiler's bug from the device's: ``erf-tanh``
is a post-grad graph pass that rewrites every ``aten.erf`` of a sim graph into the tanh approximation
``tanh(2/sqrt(pi) * (u + 0.044715 * 2 * u**3))`` -- exact GELU becomes tanh GELU (about 3e-4 off at
its worst) in generated code only; eager sim and every CPU graph are untouched. The pass is Inductor's
``post_grad_custom_post_pass`` while the switch is on, with a ``uuid`` naming the bug, so the FX graph
cache keeps its code apart from clean code.

Inductor finds this module through the device module's ``Scheduling`` / ``PythonWrapperCodegen`` /
``CppWrapperCodegen`` / ``WrapperFxCodegen`` (``harness.sim.device`` loads it on first use, so a process
that never compiles never imports Inductor).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._dynamo.device_interface import CpuInterface, register_interface_for_device
from torch._inductor.codegen.common import register_device_op_overrides
from torch._inductor.codegen.cpp import CppScheduling
from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
from torch._inductor.codegen.cpu_device_op_overrides import CpuDeviceOpOverrides
from torch._inductor.codegen.wrapper import PythonWrapperCodegen, SubgraphPythonWrapperCodegen
from torch._inductor.codegen.wrapper_fxir import WrapperFxCodegen
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.virtualized import V

from .indices import MAX_DEVICES, current_device, device_count

BACKEND = "sim"


class SimInterface(CpuInterface):
    """What Dynamo and Inductor ask of a device at run time: the CPU's answers, sim's device indices."""

    @staticmethod
    def current_device() -> int:
        return current_device()

    @staticmethod
    def device_count() -> int:
        return device_count()

    @staticmethod
    def set_device(device: torch.types.Device) -> None:
        torch.sim.set_device(device)

    @staticmethod
    def synchronize(device: torch.types.Device = None) -> None:
        torch.sim.synchronize(device)


class SimDeviceOpOverrides(CpuDeviceOpOverrides):
    """The wrapper's device calls: sim's current device is real (multi-device), the rest as on the CPU."""

    def set_device(self, device_idx: int) -> str:
        return f"torch.sim.set_device({device_idx})"

    def device_guard(self, device_idx: int) -> str:
        return f"torch.sim.device({device_idx})"

    def synchronize(self) -> str:
        return "torch.sim.synchronize()"


def _call_cpu_kernel(wrapper: PythonWrapperCodegen, kernel_name: str, call_args: Any, kwargs: dict) -> bool:
    """Generated C++ kernels for sim are called like the CPU's (Inductor knows no non-Triton device
    beyond cpu and mps). True when it wrote the call."""
    device = kwargs.get("device") or V.graph.get_current_device_or_throw()
    if kwargs.get("triton", True) or device.type != BACKEND:
        return False
    wrapper.writeline(wrapper.wrap_kernel_call(kernel_name, call_args))
    return True


class SimWrapperCodegen(PythonWrapperCodegen):
    @staticmethod
    def create(is_subgraph: bool, subgraph_name: str | None, parent_wrapper: PythonWrapperCodegen | None,
               partition_signatures: Any = None) -> PythonWrapperCodegen:
        if is_subgraph:
            assert subgraph_name is not None and parent_wrapper is not None
            return SimSubgraphWrapperCodegen(subgraph_name, parent_wrapper, partition_signatures)
        return SimWrapperCodegen()

    def _generate_kernel_call_helper(self, kernel_name: str, call_args: Any, **kwargs: Any) -> None:
        if not _call_cpu_kernel(self, kernel_name, call_args, kwargs):
            super()._generate_kernel_call_helper(kernel_name, call_args, **kwargs)

    def make_allocation(self, name: str, device: torch.device, *args: Any, **kwargs: Any) -> str:
        # Buffers go on the graph's own sim device (Inductor names only the type for devices it does
        # not guard, which would put them on the current device).
        line = super().make_allocation(name, device, *args, **kwargs)
        if device.type == BACKEND and device.index is not None:
            line = line.replace(f"device='{BACKEND}'", f"device='{device}'", 1)
        return line


class SimSubgraphWrapperCodegen(SubgraphPythonWrapperCodegen):
    def _generate_kernel_call_helper(self, kernel_name: str, call_args: Any, **kwargs: Any) -> None:
        if not _call_cpu_kernel(self, kernel_name, call_args, kwargs):
            super()._generate_kernel_call_helper(kernel_name, call_args, **kwargs)


def _on_sim(device: Any) -> bool:
    return device is not None and getattr(device, "type", device) == BACKEND


def _compile_like_the_cpu() -> None:
    """Inductor knows one device whose kernels are its C++ backend's: the CPU. It asks in three ways,
    each answered here for sim as for the CPU (and unchanged for every other device):

    - scheduler nodes' ``is_cpu()`` picks the C++ backend's fusion rules over the GPU ones;
    - ``get_current_backend()`` names the code generator (``cpp``, not ``triton``) for dtype
      propagation, asserts and matmul choices;
    - layout optimisation (channels-last convolutions) is a GPU heuristic unless mkldnn's fused CPU
      convolutions serve the graph, which sim's ATen convolutions are not.
    """
    from torch._inductor import config, graph, scheduler, utils
    from torch._inductor.codegen import common
    from torch._inductor.kernel import mm_common

    def is_cpu(self: Any) -> bool:
        device = self.get_device()
        return device is not None and device.type in ("cpu", BACKEND)

    scheduler.BaseSchedulerNode.is_cpu = is_cpu

    original = utils.get_current_backend

    def get_current_backend(device_type: str | None = None) -> str:
        if not device_type:
            device_type = V.graph.get_current_device_or_throw().type
        return config.cpu_backend if device_type == BACKEND else original(device_type)

    for module in (utils, common, scheduler, mm_common):
        module.get_current_backend = get_current_backend

    decide = graph.GraphLowering.decide_layout_opt

    def decide_layout_opt(gm: Any, *, is_inference: bool) -> bool:
        convs = [n for n in gm.graph.nodes if n.target is torch.ops.aten.convolution.default]
        if any(_on_sim(getattr(n.args[0].meta.get("val"), "device", None)) for n in convs):
            return False
        return decide(gm, is_inference=is_inference)

    graph.GraphLowering.decide_layout_opt = staticmethod(decide_layout_opt)


COMPILER_BUG_ENV = "PORTHARNESS_SIM_COMPILER_BUG"
aten = torch.ops.aten


class ErfAsTanh(CustomGraphPass):
    """``erf-tanh``: sim graphs' ``aten.erf`` computed with the tanh approximation (see the docstring)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            val = node.meta.get("val")
            if node.target is not aten.erf.default or not _on_sim(getattr(val, "device", None)):
                continue
            u = node.args[0]
            with graph.inserting_before(node):
                steps = [(aten.mul.Tensor, (u, u)), (aten.mul.Tensor, (None, u)),
                         (aten.mul.Tensor, (None, 0.044715 * 2)), (aten.add.Tensor, (u, None)),
                         (aten.mul.Tensor, (None, 2 / math.sqrt(math.pi))), (aten.tanh.default, (None,))]
                prev = None
                for op, args in steps:
                    prev = graph.call_function(op, tuple(prev if a is None else a for a in args))
                    prev.meta["val"] = val
            node.replace_all_uses_with(prev)
            graph.erase_node(node)

    def uuid(self) -> str:
        return "portharness-sim-erf-tanh-1"


COMPILER_BUGS: dict[str, type[CustomGraphPass]] = {"erf-tanh": ErfAsTanh}
_bugs: tuple[str, ...] = ()


def set_compiler_bugs(*kinds: str) -> None:
    """Plant these compiler bugs (none: clean code) in what Inductor generates for sim from now on."""
    global _bugs
    bad = [k for k in kinds if k not in COMPILER_BUGS]
    if bad:
        raise ValueError(f"sim compiler bug {', '.join(bad)}: expected one of {', '.join(COMPILER_BUGS)}")
    from torch._inductor import config

    if len(kinds) > 1:
        raise ValueError("one sim compiler bug at a time (each is Inductor's post-grad custom pass)")
    current = config.post_grad_custom_post_pass
    if current is not None and not isinstance(current, tuple(COMPILER_BUGS.values())):
        raise RuntimeError("Inductor's post_grad_custom_post_pass is someone else's: no sim compiler bug planted")
    config.post_grad_custom_post_pass = COMPILER_BUGS[kinds[0]]() if kinds else None
    _bugs = tuple(kinds)


def get_compiler_bugs() -> tuple[str, ...]:
    return _bugs


@contextmanager
def compiler_bugs(*kinds: str) -> Iterator[None]:
    prev = _bugs
    set_compiler_bugs(*kinds)
    try:
        yield
    finally:
        set_compiler_bugs(*prev)


def _register() -> None:
    _compile_like_the_cpu()
    register_interface_for_device(BACKEND, SimInterface)
    for i in range(MAX_DEVICES):
        register_interface_for_device(f"{BACKEND}:{i}", SimInterface)
    register_device_op_overrides(BACKEND, SimDeviceOpOverrides())


_register()
set_compiler_bugs(*[k for k in os.environ.get(COMPILER_BUG_ENV, "").split(",") if k])

# What the device module hands Inductor (harness.sim.device.__getattr__).
CODEGEN = {
    "Scheduling": CppScheduling,
    "PythonWrapperCodegen": SimWrapperCodegen,
    "CppWrapperCodegen": CppWrapperCpu,
    "WrapperFxCodegen": WrapperFxCodegen,
}
