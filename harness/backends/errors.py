"""What a backend's error message says: a missing op (and dtype), or a sick device.

PyTorch and out-of-tree backends report a coverage gap in a handful of standard ways; each is one
`Pattern` in `MISSING_OP` with an example message (tests/test_backend_errors.py checks every one).
A message no pattern knows stays a `crash` with the message kept. An error naming another backend
than the target's ("... from the 'CPU' backend") is not the target's gap, unless the target's own
code raised it (*relayed*: a remote executor passing on its server's error for an op it was asked
to run). Op names come out as `aten::name[.overload]` whatever the message calls them (`add`,
`aten.add.Tensor`, `baddbmm_cuda`); a dtype the message names is kept as it spells it.

Device faults are read from the whole exception chain (`chain`): loaders wrap a backend's error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class MissingOp:
    op: str
    dtype: str = ""


@dataclass(frozen=True)
class Pattern:
    name: str
    regex: re.Pattern[str]
    example: str
    relayed: bool = False  # applies only to an error the backend's own code raised


_DISPATCHER = re.compile(r"Could not run '(?P<op>[\w:.]+)' with arguments from the '(?P<backend>\w+)' backend")
_BARE_OP = r"'?(?P<op>(?:aten(?:::|\.))?[a-z_][a-z0-9_]*(?:\.\w+)?)'?"  # add, aten::add, aten.add.Tensor


MISSING_OP: tuple[Pattern, ...] = (
    Pattern(
        "dispatcher",
        _DISPATCHER,
        "NotImplementedError: Could not run 'aten::relu' with arguments from the 'toy' backend. This could be "
        "because the operator doesn't exist for this backend, or was omitted during the selective/custom build",
    ),
    Pattern(
        "relayed-dispatcher",
        _DISPATCHER,
        "RuntimeError: Could not run 'aten::histc' with arguments from the 'CPU' backend. This could be because "
        "the operator doesn't exist for this backend",
        relayed=True,
    ),
    Pattern(
        "cannot-run",
        re.compile(r"\bcannot run '?(?P<op>aten(?:::|\.)\w+(?:\.\w+)?)'?"),
        "NotImplementedError: toy cannot run aten.as_strided_.default yet: planned for a later release",
    ),
    Pattern(
        "overrideable",
        re.compile(r"(?P<op>\w*_overrideable\w*)(?: not implemented)?[.:]? .*TORCH_LIBRARY_IMPL"),
        "convolution_overrideable not implemented. You are likely triggering this with tensor backend other "
        "than CPU/CUDA/MKLDNN, if this is intended, please use TORCH_LIBRARY_IMPL to override this function ",
    ),
    Pattern(
        "python-backend",
        re.compile(
            r"(?P<op>aten(?:::|\.)\w+(?:\.\w+)?)\b[^\n]{0,80}?\b(?:is )?(?:not (?:supported|implemented)|"
            r"unsupported|no (?:kernel|implementation))"
        ),
        "NotImplementedError: aten.sort.default is not supported on the toy backend",
    ),
    Pattern(
        "python-backend-prefix",
        re.compile(
            r"(?:not (?:supported|implemented)|unsupported|no (?:kernel|implementation))(?: op(?:erator)?)?"
            r"(?: for| on)?[: ]+'?(?P<op>aten(?:::|\.)\w+(?:\.\w+)?)"
        ),
        "NotImplementedError: unsupported operator: aten::_fft_r2c",
    ),
    Pattern(
        "dtype-only",
        re.compile(
            r"(?:op|operator|kernel)\s+'?(?P<op>[\w:.]+)'?\s+(?:only )?supports?\s+(?P<allowed>[\w, ]+?)\s+only,?"
            r"\s+got\s+'?(?P<dtype>\w+)'?"
        ),
        "RuntimeError: op aten::index_add supports float32 only, got Long",
    ),
    Pattern(
        "dtype-not-implemented",
        re.compile(r"\"(?P<op>\w+)\" not implemented for '(?P<dtype>\w+)'"),
        "RuntimeError: \"baddbmm_cuda\" not implemented for 'Int'",
    ),
    Pattern(
        "bare-op-dtype",
        re.compile(r"\b(?:op|operator|kernel)\s+" + _BARE_OP + r"\s+(?:is\s+)?(?:not (?:supported|implemented)"
                   r"|unsupported|does not support)\s+(?:for\s+)?(?:dtype|scalar type|type)\s+'?(?P<dtype>\w+)'?"),
        "RuntimeError: toy: kernel mul does not support dtype 'Int'",
    ),
    Pattern(
        "bare-op",
        re.compile(r"\b(?:op|operator|kernel)\s+" + _BARE_OP + r"\s+(?:is\s+)?(?:not (?:currently\s+)?(?:supported|implemented)"
                   r"|unsupported)\b"),
        "NotImplementedError: toy runtime: op add is not implemented",
    ),
    Pattern(
        "not-aten-op",
        re.compile(r"(?P<op>[a-z_]\w*::\w+(?:\.\w+)?)'?\b[^\n]{0,60}?\bis not an aten op"),
        "NotImplementedError: prims::device_put.default is not an aten op: the toy backend runs aten ops only",
        relayed=True,  # a tensor-subclass backend's dispatch refusing an op the compiler traced
    ),
    Pattern(
        "c10d",  # c10d::Backend's refusal of a collective the process group does not implement
        re.compile(r"\bBackend (?P<backend>\w+) does not support (?P<op>[a-z_]+)\b"),
        "RuntimeError: Backend toy does not support reduce_scatter_tensor",
    ),
    Pattern(
        "flex-attention",
        re.compile(r"(?P<op>FlexAttention)[^\n]*(?:is only supported on|not supported)", re.IGNORECASE),
        "ValueError: FlexAttention is only supported on CUDA, CPU, HPU, or MPS devices.",
    ),
)

# Messages that mean the device (or its driver / runtime / server), not the model, failed.
DEVICE_FAULT = re.compile(
    r"\bdevice (?:lost|is lost|was lost|has been lost|unavailable|is unavailable|not responding|disconnected|"
    r"hung|has fallen off the bus)\b"
    r"|uncorrectable (?:ECC|memory) error|CUDA error: (?:an illegal memory access|unspecified launch failure|"
    r"uncorrectable ECC error|the launch timed out)|\bNCCL error\b|\bdriver (?:shutting down|error|crashed)\b"
    r"|\b(?:XLA|PJRT|NRT|HCCL|XCCL) (?:runtime )?(?:error|failure)\b|device server (?:gone|unreachable)",
    re.IGNORECASE,
)

# Messages that say another process holds the device (one `Pattern` each, with an example), and the holder's
# pid where the message names it: a chip that takes one process refuses the next at its first use.
IN_USE: tuple[Pattern, ...] = (
    Pattern("held-by-pid", re.compile(r"\bin use by (?:process(?:es)?|pid)(?: with pid)? (?P<pid>\d+)", re.IGNORECASE),
            "RuntimeError: sim:0 is in use by process 1234 (sim's devices are exclusive: ...)"),
    Pattern("tpu", re.compile(r"TPU is already in use by process with pid (?P<pid>\d+)"),
            "RuntimeError: Unable to initialize backend 'tpu': ABORTED: The TPU is already in use by process with "
            "pid 1234. Not attempting to load libtpu.so in this process."),
    Pattern("cuda-busy", re.compile(r"CUDA-capable device\(s\) is/are busy or unavailable|devices are busy or unavailable"),
            "RuntimeError: CUDA error: CUDA-capable device(s) is/are busy or unavailable"),
    Pattern("ebusy", re.compile(r"Device or resource busy"),
            "OSError: [Errno 16] Device or resource busy: '/dev/accel0'"),
)


@dataclass(frozen=True)
class InUse:
    """A device another process holds: the message's words, and the holder's pid where it names one."""

    message: str
    holder: int | None = None


def parse_in_use(message: str) -> InUse | None:
    """Whether `message` says another process holds the device (`IN_USE`); None otherwise."""
    for p in IN_USE:
        m = p.regex.search(message)
        if m is not None:
            pid = m.groupdict().get("pid")
            return InUse(" ".join(message.split())[:500], int(pid) if pid else None)
    return None


_DTYPE = re.compile(r"\bnot implemented for '(?P<dtype>\w+)'")
_KERNEL_SUFFIX = re.compile(r"_(?:impl_)?(?:cuda|cpu|mps|xpu)_?$")  # AT_DISPATCH names: baddbmm_cuda


def _aten(op: str) -> str:
    """'aten.sort.default' / 'aten::sort.default' / 'sort' / 'sort_cpu' -> 'aten::sort', the style used
    everywhere else (an op ranking must not say "implement add" for aten::add)."""
    if op.startswith("aten."):
        op = "aten::" + op[len("aten.") :]
    op = op.removesuffix(".default")
    if "::" not in op:
        op = "aten::" + _KERNEL_SUFFIX.sub("", op)
    return op


def chain(exc: BaseException, limit: int = 16) -> list[BaseException]:
    """`exc`, then what it was raised from or while handling (`__cause__`, `__context__`), or wraps (a
    compiler's `inner_exception`: Dynamo re-raises a backend's error inside its own), and so on."""
    out: list[BaseException] = []
    todo = [exc]
    while todo and len(out) < limit:
        e = todo.pop(0)
        if e is None or any(e is seen for seen in out):
            continue
        out.append(e)
        todo += [e.__cause__, e.__context__, getattr(e, "inner_exception", None)]
    return out


def _backend_matches(named: str, kind: str) -> bool:
    """Whether a dispatch-key name in a message (`toy`, `AutogradPrivateUse1`, `SparseCUDA`) is `kind`'s."""
    name = named.lower()
    for prefix in ("autograd", "sparsecsr", "sparse", "quantized", "nested"):
        name = name.removeprefix(prefix)
    return name == kind.lower()


def parse_missing_op(message: str, kind: str, relayed: bool = False) -> MissingOp | None:
    """The op (and dtype) a target-side error says the `kind` backend lacks; None if it says nothing so.
    `relayed`: the backend's own code raised it (a dispatcher error naming another backend is then the
    target's gap too: its executor could not run the op it was asked to)."""
    for p in MISSING_OP:
        if p.relayed and not relayed:
            continue
        m = p.regex.search(message)
        if m is None:
            continue
        if p.name == "dispatcher" and not _backend_matches(m["backend"], kind):
            if relayed:
                continue  # "relayed-dispatcher" claims it
            return None  # e.g. an op the CPU lacks: not the target's gap
        dtype = m.groupdict().get("dtype") or ""
        if not dtype:  # an op named before a kernel's dtype message: aten::histc: "histogram_cpu" not implemented for 'Int'
            d = _DTYPE.search(message, m.start())
            dtype = d["dtype"] if d else ""
        if p.name == "flex-attention":
            return MissingOp("flex_attention", dtype)  # a feature, not an ATen op
        if p.name == "c10d":
            if not _backend_matches(m["backend"], kind):
                return None  # another group's (gloo beside the device's): not the target's gap
            return MissingOp(f"c10d::{m['op']}", "")  # a collective, named as c10d names its ops
        return MissingOp(_aten(m["op"]), dtype)
    return None


def is_device_fault_message(message: str) -> bool:
    return DEVICE_FAULT.search(message) is not None
