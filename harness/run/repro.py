"""A standalone repro of the first diverging op: plain torch, the backend's own import, one op.

What a bring-up engineer hands to the kernel team: the op's real inputs (saved with torch.save), a
script that runs it on the CPU under the declared contract (the expected result), in fp64 (the oracle)
and on the target, and prints the errors and the verdict. It needs nothing of portharness but the
backend module itself.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from harness import files
from harness.backends.contracts import CONTRACTS, MULTIPLIER_ARGS, Contract
from harness.run.opcheck import ULPS, OpFailure

_ROUNDING = {  # how each contract's operand rounding reads in plain torch
    "tf32": "(t.view(torch.int32) + 0xFFF + ((t.view(torch.int32) >> 13) & 1) & ~0x1FFF).view(torch.float32)",
    "bf16-matmul": "t.to(torch.bfloat16).to(torch.float32)",
    "fp16-matmul": "t.to(torch.float16).to(torch.float32)",
}
assert set(_ROUNDING) == {c.rounding for c in CONTRACTS.values() if c.rounding}, "a contract without repro rounding"

_TEMPLATE = '''"""Repro (portharness): {op} on {target} is beyond its declared precision ({contract}).

Model {model_id}, module {module}; inputs {inputs}.
Found by the kernel-conformance check: rmse(fp64, target) must be <= m * rmse(fp64, expected) + {ulps} ulp,
where expected is the op on the CPU with the {contract} contract's rounding.
Run: python {script_name}
"""

from pathlib import Path

import torch
{preamble}

OP = torch.ops.{namespace}.{packet}.{overload}
DEVICE = {device!r}
saved = torch.load(Path(__file__).with_suffix(".pt"), weights_only=False)
args, kwargs = saved["args"], saved["kwargs"]


def tree(fn, x):
    if isinstance(x, (list, tuple)):
        return type(x)(tree(fn, y) for y in x)
    if isinstance(x, dict):
        return {{k: tree(fn, v) for k, v in x.items()}}
    return fn(x) if isinstance(x, torch.Tensor) else x


def contract_round(t):
    {rounding}


expected_args = list(tree(lambda t: t.clone(), args))
for i in {positions}:  # the operands a reduced-precision multiplier sees
    if i < len(expected_args) and expected_args[i].dtype is torch.float32:
        expected_args[i] = contract_round(expected_args[i])
expected = OP(*expected_args, **tree(lambda t: t.clone(), kwargs))
oracle = OP(*tree(lambda t: t.double() if t.is_floating_point() else t.clone(), args),
            **tree(lambda t: t.double() if t.is_floating_point() else t.clone(), kwargs))
target = OP(*tree(lambda t: t.to(DEVICE), args), **tree(lambda t: t.to(DEVICE), kwargs))


def first(x):
    return x[{output_index}] if isinstance(x, (list, tuple)) else x


t, e, o = first(target).cpu().double(), first(expected).double(), first(oracle).double()
rmse = lambda a, b: (a - b).square().mean().sqrt().item()  # noqa: E731
m = 3.0 if first(expected).dtype in (torch.float16, torch.bfloat16) or e.numel() < 1000 else 2.0
bound = m * rmse(o, e) + {ulps} * torch.finfo(first(expected).dtype).eps * o.square().mean().sqrt().item()
print(f"max |target - expected| = {{(t - e).abs().max().item():.3g}}")
print(f"rmse(fp64, target) = {{rmse(o, t):.3g}}   rmse(fp64, expected) = {{rmse(o, e):.3g}}   bound = {{bound:.3g}}")
print("verdict:", "within the declared precision" if rmse(o, t) <= bound else "BEYOND the declared precision")
'''


def _name(model_id: str, op: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"{model_id}--{op}").strip("._-")[:120]


def write_repro(
    failure: OpFailure, *, contract: Contract, target: str, preamble: list[str], model_id: str, directory: Path
) -> Path:
    """Save the op's inputs and a script that replays it; returns the script's path."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / f"{_name(model_id, failure.op)}.py"
    args, kwargs = failure.args
    with files.atomic_path(script.with_suffix(".pt")) as tmp:
        torch.save({"args": args, "kwargs": kwargs}, tmp)
    schema_name = failure.func._schema.name
    namespace, packet = schema_name.split("::")
    files.write_text(
        script,
        _TEMPLATE.format(
            op=failure.op, target=target, contract=contract.name, model_id=model_id, module=failure.module or "(top)",
            inputs=", ".join(failure.inputs), ulps=ULPS, script_name=script.name,
            preamble="\n".join(preamble), namespace=namespace, packet=packet, overload=failure.func._overloadname,
            device=target, rounding=f"return {_ROUNDING[contract.rounding]}" if contract.rounding else "return t",
            positions=list(MULTIPLIER_ARGS.get(failure.func, ())), output_index=int(failure.output.split(":")[0]),
        )
    )
    return script


def repro_preamble(modules: list[str], extra: list[str] | None = None) -> list[str]:
    """Import lines for the backend modules plus the adapter's own setup lines."""
    return [f"import {m}  # noqa: F401  the backend" for m in modules] + list(extra or [])


def describe(failure: OpFailure) -> dict[str, Any]:
    """Row fields for the first diverging op."""
    return {
        "first_drift_op": failure.op,
        "first_drift_op_module": failure.module,
        "first_drift_op_inputs": failure.inputs,
        "first_drift_op_ratio": failure.ratio if failure.ratio is not None and failure.ratio < 1e300 else None,
    }
