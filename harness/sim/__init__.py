"""`sim`: a simulated young accelerator, plugged into PyTorch through the PrivateUse1 dispatch key.

Importing this package renames PrivateUse1 to ``sim``, registers the `torch.sim` device module and generates the
Tensor/Module helpers, after which ``torch.ones(2, device="sim")``, ``t.to("sim:1")``,
``model.to("sim")``, ``t.is_sim`` and ``t.cpu()`` behave as on any accelerator. Memory is host
memory, but tensors really live on ``sim``: mixing a sim and a CPU tensor in one op fails the way
CUDA does.

Behaviours that make it a realistic target, each one switch (env var / function / context manager):

========== ============================ ===================================== ======================
behaviour  env var                      API                                   values
========== ============================ ===================================== ======================
precision  PORTHARNESS_SIM_PRECISION    set_precision / precision()           default (bf16 matmul
                                                                              inputs), highest
op set     PORTHARNESS_SIM_OPS          set_op_profile / op_profile()         young (default), full,
                                                                              or a profile file
faults     PORTHARNESS_SIM_FAULTS       set_faults / clear_faults / faults()  nan, garbage, error,
                                                                              hang, crash per device
numerics   PORTHARNESS_SIM_NUMERICS     set_numerics_bugs / numerics_bugs()   planted quiet kernel bugs:
                                                                              bf16-accumulate, softmax-
                                                                              no-max, approx-exp, gelu-
                                                                              mixup, grad-scale
slowdown   PORTHARNESS_SIM_SLOW_OPS     set_slow_ops / slow_ops()             planted slow kernels,
                                                                              e.g. aten::_softmax:3
fallback   PORTHARNESS_SIM_FALLBACK     set_fallback / fallback()             off (default), cpu: ops
                                        fallback_counts()                     outside the profile run
                                                                              on the host, counted
memory     PORTHARNESS_SIM_MEMORY_MB    set_memory_size / memory_size()       MiB per device, def.
                                                                              host RAM; beyond: OOM
devices    PORTHARNESS_SIM_DEVICES      torch.sim.device_count() (live)       device count, def. 2
exclusive  PORTHARNESS_SIM_EXCLUSIVE    (read when a group is made)           1: one rank per device
check      PORTHARNESS_SIM_CHECK_       planner.for_group(pg).check           1 (default): a mismatch
           COLLECTIVES                                                        across ranks is an error
visible    PORTHARNESS_SIM_VISIBLE_     placement.visible_devices()           as CUDA_VISIBLE_DEVICES
           DEVICES                                                            (``1,0``)
sharing    PORTHARNESS_SIM_SHARING      placement.sharing()                   exclusive (default: one
                                                                              process per device), shared
fraction   PORTHARNESS_SIM_MEMORY_      torch.sim.set_per_process_memory_     share of a device's memory
           FRACTION                     fraction()                            this process may use
========== ============================ ===================================== ======================

Placement (``placement``): a device belongs to the first process that uses it ("sim:0 is in use by
process N" for the next), or, shared, is one memory budget whose processes' kernels take turns.

It behaves like a device because it is one: a native PrivateUse1 backend (``native``, C++ built on
first use). Its tensors are plain `torch.Tensor`s on ``sim:N`` and its parameters plain
`nn.Parameter`s; one C++ kernel serves every op (op profile, precision, same-device rule, the CPU
kernel on the same memory). Autograd and training on every ``sim:N`` (a native device guard),
the ``sim`` c10d backend (``distributed``: DDP, DeviceMesh, DTensor, FSDP2, tensor parallel, functional
collectives, under the collective settings), ``torch.accelerator`` memory statistics and ``torch.sim.memory_allocated``-style accounting with a
simulated memory size (``memory``), streams and events (``streams``), storages and data pointers
shared by views (``safetensors``/``save_pretrained``, ``torch.save``/``torch.load(map_location="sim")``),
``Module.to`` keeping parameters (and tied weights) as on any device, ``torch.compile`` with the
``eager``/``aot_eager`` backends and with Inductor, whose C++ code generation serves sim (``inductor``),
and ``torch.autocast("sim")`` with CUDA's op lists (``autocast``). Python runs per op only while a
switch needs it: injected faults, planted numerics bugs, autocast.

At ``highest`` under the ``full`` profile sim is the CPU it runs on: values bit for bit (the sign of a
zero included), and the CPU's errors, aliasing ``out=`` refused alike, except where the CPU kernel is
defective and a device gives the mathematical answer (``csrc/semantics.cpp``: ``logit_backward`` at -0.0,
``kaiser_window`` with a huge beta, ``ldexp`` with wide exponents, ``grid_sample`` at non-finite
coordinates, complex add/sub, small-int ``gcd``, im2col/col2im ``out=`` their input, ...). Where it is a
device rather than the CPU it behaves as CUDA does: index and length arguments may stay on the host
(``tensor_split`` indices, ``pack_padded_sequence`` lengths, whose batch sizes stay there too), pinned host
memory (``Tensor.pin_memory``, ``DataLoader(pin_memory=True)``), ``torch.Generator("sim")`` (drawing as a
CPU generator seeded alike), ``untyped_storage().resize_()`` and ``_resize_output_``; the kernels PyTorch
asks an accelerator for (fused RNN cells, SyncBatchNorm's, the PrivateUse1 fused-attention entry) are
computed as CUDA's (``csrc/accelerator_kernels.cpp``), while flash/efficient/cuDNN attention raise the
standard missing-kernel error. Sparse, nested and quantized tensors are not simulated (declared so in
``scripts/cts_table.py``'s manifest). It differs from the CPU only where PyTorch itself does not give one answer: code
that picks an algorithm by device type (``linear_cross_entropy``'s chunked fp16/bf16 accumulation takes a
non-CPU device's path) and CPU kernels that are nondeterministic (gelsy's uninitialized pivots, im2col
writing over its own input on several threads); ``conformance.EXPLAINED`` lists them, and
``scripts/opinfo_table.py --fidelity`` counts the differences over all of ``op_db`` by class.

FlexAttention is not supported on sim, as on any device outside its CUDA/CPU/XPU/HPU/MPS list:
PyTorch's own check raises "FlexAttention is only supported on ...", eagerly and while torch.compile
traces it (transformers' ``attn_implementation="flex_attention"``).

Known limits: the autograd engine reads the device count once, at the first backward.

``harness.sim.conformance`` (not imported here: it needs ``expecttest``) runs PyTorch's OpInfo
samples on sim against CPU.

Only one backend can own PrivateUse1 in a process, so sim is loaded only when asked for: by this
import (the harness does it only for a ``sim`` target), or at ``import torch`` through the
``torch.backends`` entry point when ``PORTHARNESS_SIM_AUTOLOAD=1`` is set.

This package depends only on torch and `harness.comms` (torch only; and, once, a C++ compiler to build
`native`); nothing here knows about the harness runner.
"""

from __future__ import annotations

import os
import sys

import torch

from . import device as _device_mod
from .cpu_fallback import fallback, fallback_counts, get_fallback, reset_fallback_counts, set_fallback
from .fault_injection import SimDeviceError, active_faults, clear_faults, faults, injected_counts, set_faults
from .memory import get_memory_size, memory_size, set_memory_size
from .numerics import get_numerics_bugs, numerics_bugs, numerics_hits, reset_numerics_hits, set_numerics_bugs
from .opset import get_op_profile, op_profile, profile_names, set_op_profile
from .placement import sharing
from .precision_mode import get_precision, precision, set_precision
from .slowdown import get_slow_ops, set_slow_ops, slow_ops

__all__ = [
    "SimDeviceError",
    "active_faults",
    "clear_faults",
    "device_count",
    "fallback",
    "fallback_counts",
    "faults",
    "get_fallback",
    "get_memory_size",
    "get_numerics_bugs",
    "get_op_profile",
    "get_precision",
    "get_slow_ops",
    "injected_counts",
    "is_registered",
    "memory_size",
    "numerics_bugs",
    "numerics_hits",
    "op_profile",
    "precision",
    "profile_names",
    "reset_fallback_counts",
    "reset_numerics_hits",
    "set_fallback",
    "set_faults",
    "set_memory_size",
    "set_numerics_bugs",
    "set_op_profile",
    "set_precision",
    "set_slow_ops",
    "settings",
    "sharing",
    "slow_ops",
]

BACKEND_NAME = "sim"
_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    current = torch._C._get_privateuse1_backend_name()
    if current not in ("privateuseone", BACKEND_NAME):
        raise RuntimeError(
            f"PrivateUse1 is already claimed by backend {current!r} in this process; "
            "only one PrivateUse1 backend can be loaded at a time"
        )
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    if current == BACKEND_NAME and hasattr(torch, BACKEND_NAME):
        raise RuntimeError("a different 'sim' backend is already registered in this process")
    # The native device guard, hooks (pinned memory, generators), allocator and dispatch path go in first:
    # torch's Python guard and hooks (which the call below would otherwise install) report a single device
    # and lack those APIs. See native.py.
    _device_mod._ext.register()
    _setup_privateuseone_for_python_backend(BACKEND_NAME, backend_module=_device_mod)
    from . import autocast, numerics

    autocast.register()
    numerics.plant_from_env()
    if os.environ.get("PORTHARNESS_SIM_COMPILER_BUG"):  # a compiler bug: Inductor must know before compiling
        from . import inductor  # noqa: F401
    common = sys.modules.get("torch._inductor.codegen.common")
    if common is not None:  # Inductor registered its devices before sim existed: it asks again next compile
        common.init_backend_registration.cache_clear()
    _printable()
    _registered = True
    from . import distributed  # noqa: F401  the "sim" c10d backend: init_device_mesh("sim") picks it



def _printable() -> None:
    """Printing a tensor runs ops on its device (masked_select, abs, ...: xla and lazy copy to the CPU
    first, see torch._tensor_str). A young profile lacks some of them, and a repr must not fail over the
    op set: sim tensors are formatted under the full profile."""
    str_tensor = torch._tensor_str._str

    def _str(self: torch.Tensor, *, tensor_contents: object = None) -> str:
        if self.device.type != BACKEND_NAME:
            return str_tensor(self, tensor_contents=tensor_contents)
        with op_profile("full"):
            return str_tensor(self, tensor_contents=tensor_contents)

    torch._tensor_str._str = _str


def is_registered() -> bool:
    return _registered


def device_count() -> int:
    return _device_mod.device_count()


def settings() -> dict[str, str]:
    """The switches in force, for recording next to results."""
    return {"precision": get_precision(), "ops": get_op_profile().name, "fallback": get_fallback(),
            "numerics": ",".join(get_numerics_bugs())}


_register()
