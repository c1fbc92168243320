"""What a backend's error message says: a missing op (and dtype), or a sick device.

PyTorch and out-of-tree backends report a coverage gap in a handful of standard ways; each is one
`Pattern` in `MISSING_OP` with an example message (tests/test_backend_errors.py checks every one).
A message no pattern knows stays a `crash` with the message kept. An error naming another backend
than the target's ("... from the 'CPU' backend") is not the target's gap.
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


MISSING_OP: tuple[Pattern, ...] = (
    Pattern(
        "dispatcher",
        re.compile(r"Could not run '(?P<op>[\w:.]+)' with arguments from the '(?P<backend>\w+)' backend"),
        "NotImplementedError: Could not run 'aten::relu' with arguments from the 'toy' backend. This could be "
        "because the operator doesn't exist for this backend, or was omitted during the selective/custom build",
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


def _aten(op: str) -> str:
    """'aten.sort.default' / 'aten::sort.default' -> 'aten::sort' style names used everywhere else."""
    if op.startswith("aten."):
        op = "aten::" + op[len("aten.") :]
    return op.removesuffix(".default")


def _backend_matches(named: str, kind: str) -> bool:
    """Whether a dispatch-key name in a message (`toy`, `AutogradPrivateUse1`, `SparseCUDA`) is `kind`'s."""
    name = named.lower()
    for prefix in ("autograd", "sparsecsr", "sparse", "quantized", "nested"):
        name = name.removeprefix(prefix)
    return name == kind.lower()


def parse_missing_op(message: str, kind: str) -> MissingOp | None:
    """The op (and dtype) a target-side error says the `kind` backend lacks; None if it says nothing so."""
    for p in MISSING_OP:
        m = p.regex.search(message)
        if m is None:
            continue
        if p.name == "dispatcher" and not _backend_matches(m["backend"], kind):
            return None  # e.g. an op the CPU lacks: not the target's gap
        op = m["op"]
        if p.name == "overrideable":
            op = f"aten::{op}"
        elif p.name == "flex-attention":
            op = "flex_attention"
        return MissingOp(_aten(op), (m.groupdict().get("dtype") or ""))
    return None


def is_device_fault_message(message: str) -> bool:
    return DEVICE_FAULT.search(message) is not None
