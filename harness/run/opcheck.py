"""Kernel conformance: every op the target runs, judged on its own inputs against the CPU.

Model outputs can hide a wrong kernel (random tiny models keep activations small, normalisation layers
rescale errors away) and they cannot say *which* op is wrong. So during one target forward a dispatch
mode snapshots each op's inputs, lets the target run the op, and replays it on the CPU twice: under the
declared contract (*expected*) and in fp64 (*oracle*). The op passes when

    rmse(oracle, target) <= m * rmse(oracle, expected) + ULPS * eps(dtype) * rms(oracle)

-- the outputs' rule, with a floor relative to the op's own magnitude instead of the absolute tol/10,
because ops see every magnitude. The first op that fails is where the drift enters: its name, module
path, input shapes and dtypes, and its inputs (for a standalone repro). Views, copies and factories are
exact by construction and skipped; integer results are not judged (ties may legitimately differ).

A real checkpoint repeats the same kernels once per layer: with `per_signature` set, only the first
calls of each signature (op, input dtypes/shapes/strides, non-tensor arguments) are judged and the rest
counted in `sampled_out`. Same kernel, same code path; what sampling can miss is a bug that shows only
at values a later layer reaches, which the model's outputs are still judged for.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from harness import files
from harness.backends.contracts import CONTRACTS, MULTIPLIER_ARGS, Contract, Emulate
from harness.results.draft import RowDraft

ULPS = 4
_SKIP_NAMES = frozenset(
    {"_to_copy", "copy_", "_copy_from", "_copy_from_and_resize", "clone", "detach", "alias", "lift_fresh",
     "empty", "empty_like", "empty_strided", "empty_permuted", "new_empty_strided", "zeros_like", "ones_like",
     "full_like", "new_empty", "new_zeros",
     "new_ones", "new_full", "_local_scalar_dense", "set_", "resize_", "contiguous"}
)


def _skip(func: torch._ops.OpOverload) -> bool:
    schema = func._schema
    if schema.name.removeprefix("aten::") in _SKIP_NAMES or not schema.name.startswith("aten::"):
        return True
    if any(a.name == "generator" for a in schema.arguments):
        return True  # random: nothing to replay
    # views return an alias of an input (no '!' write): exact by construction
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.sqrt(torch.mean(torch.square(a.double() - b.double()))).item()


def _multiplier(t: torch.Tensor) -> float:
    return 3.0 if t.dtype in (torch.float16, torch.bfloat16) or t.numel() < 1000 else 2.0


@dataclass
class OpFailure:
    """The first op whose own result is beyond the declared precision."""

    op: str
    module: str
    param: str  # the parameter the op takes, else the nearest one of its module ("" if none)
    inputs: list[str]  # "float32[2, 16, 64]" per tensor argument, in order
    output: str
    ratio: float | None
    max_abs: float | None
    note: str
    args: Any = field(default=None, repr=False)  # CPU snapshot of (args, kwargs), for the repro
    step: int | None = None  # where in the step it ran, as the step counts (generate: the decoding step)
    func: Any = field(default=None, repr=False)


def judge_output(target: torch.Tensor, expected: torch.Tensor, oracle: torch.Tensor | None) -> tuple[bool, float | None, str]:
    """(ok, ratio, note) for one float output of one op; all CPU tensors."""
    if target.shape != expected.shape:
        return False, None, f"shape {list(target.shape)} vs expected {list(expected.shape)}"
    if target.dtype != expected.dtype:  # a kernel that returns another dtype is wrong, however close its values
        return False, None, f"dtype {str(target.dtype).removeprefix('torch.')} vs expected {str(expected.dtype).removeprefix('torch.')}"
    if target.dtype == expected.dtype and torch.equal(target, expected):
        return True, 0.0, ""  # bit-identical to the contract's own result: nothing to measure
    t, e = target.double(), expected.double()
    fin_e = torch.isfinite(e)
    if bool(fin_e.all()):
        if not bool(torch.isfinite(t).all()):
            return False, math.inf, "non-finite values where the CPU has none"
    else:  # masks are the exception: compare only where both are finite, and only if they agree
        if not torch.equal(torch.isfinite(t), fin_e):
            return False, math.inf, "non-finite values where the CPU has none (or the reverse)"
        if not bool(fin_e.any()):
            return True, 0.0, ""
        t, e = t[fin_e], e[fin_e]
        oracle = oracle.double()[fin_e] if oracle is not None and oracle.shape == target.shape else None
    eps = torch.finfo(target.dtype).eps
    if oracle is not None and oracle.shape == t.shape:
        o = oracle.double()
        if bool(torch.isfinite(o).all()):
            bound = _multiplier(target) * _rmse(o, e) + ULPS * eps * o.square().mean().sqrt().item()
            err = _rmse(o, t)
            return err <= bound, (err / bound if bound > 0 else (0.0 if err == 0 else math.inf)), ""
    bound = ULPS * eps * e.square().mean().sqrt().item()  # no oracle: as close to the CPU as a few ulps
    err = _rmse(e, t)
    return err <= bound, (err / bound if bound > 0 else (0.0 if err == 0 else math.inf)), "no fp64 replay"


def _host(x: torch.Tensor) -> torch.Tensor:
    """A CPU copy through the one op every backend has (inside a dispatch mode, `Tensor.to` is not
    decomposed before it reaches the backend)."""
    return torch.ops.aten._to_copy.default(x, device=torch.device("cpu"))


def _describe(x: Any) -> str:
    return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"


class OpCheck(TorchDispatchMode):
    """While active, judge every op on a `device_type` tensor; `failure` is the first that fails."""

    def __init__(self, device_type: str, contract: Contract, model: torch.nn.Module | None = None,
                 per_signature: int | None = None) -> None:
        super().__init__()
        self.device_type = device_type
        self.contract = contract
        self.failure: OpFailure | None = None
        self.checked = 0
        self.per_signature = per_signature
        self.sampled_out = 0
        self._seen: dict[tuple, int] = {}
        self.worst = 0.0
        self._names: dict[int, str] = {}
        self._params: dict[int, str] = {}  # id(parameter) -> name
        self._param_objs: list[tuple[torch.nn.Parameter, str]] = []  # module order
        self._storages: dict[tuple[torch.device, int], str] | None = None
        self._owner = ""  # the parameter the op being judged takes
        self._owners: list[str] | None = None
        if model is not None:
            self.name_modules(model)
        self._stack: list[str] = []
        self._hooks: list[Any] = []
        self._grad_nodes: dict[Any, str] = {}  # autograd node -> module whose forward made it
        self.phase: Callable[[], int | None] | None = None  # the step's own count of where it is (see Plan)

    def name_modules(self, model: torch.nn.Module) -> None:
        """Report failures by this model's qualified module names (in backward, where no module is
        running, by the module whose parameter the op takes)."""
        self._names = {id(m): n for n, m in model.named_modules()}
        self._param_objs = [(p, n) for n, p in model.named_parameters()]
        self._params = {id(p): n for p, n in self._param_objs}
        self._storages = None  # parameter storages, looked up once the model is where it runs

    # -- where are we: a module stack kept by global forward hooks ------------------------------

    def __enter__(self) -> OpCheck:
        def pre(module: torch.nn.Module, args: Any) -> None:
            self._claim(args, self._module())  # made before this call: the caller's
            self._stack.append(self._names.get(id(module), type(module).__name__))

        def post(module: torch.nn.Module, _args: Any, out: Any) -> None:
            self._claim(out, self._module())
            if self._stack:
                self._stack.pop()

        self._hooks = [
            torch.nn.modules.module.register_module_forward_pre_hook(pre),
            torch.nn.modules.module.register_module_forward_hook(post),
        ]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._grad_nodes = {}
        return super().__exit__(*exc)

    def _claim(self, tensors: Any, module: str) -> None:
        """Backward runs outside any module: remember which module's forward made each autograd node, so a
        backward kernel is placed where its forward op ran. Inner modules claim their nodes first (their
        hooks run first); a module's inputs are claimed for its caller before it runs."""
        if not torch.is_grad_enabled():  # no autograd nodes to place (inference)
            return
        todo = [t.grad_fn for t in tree_flatten(tensors)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node in self._grad_nodes:
                continue
            self._grad_nodes[node] = module
            todo.extend(n for n, _ in node.next_functions if n is not None and n not in self._grad_nodes)

    def _backward_module(self) -> str:
        node = torch._C._current_autograd_node()
        return self._grad_nodes.get(node, "") if node is not None else ""

    def _module(self) -> str:
        return next((n for n in reversed(self._stack) if n), "")

    def _nearest_param(self, module: str) -> str:
        """The first parameter (module order) of `module`, else of its nearest ancestor that has one
        ('' where no module is known: the model's first parameter would be a guess)."""
        while module:
            found = next((n for _, n in self._param_objs if n.startswith(f"{module}.")), "")
            if found:
                return found
            module = module.rpartition(".")[0]
        return ""

    def _param_of(self, leaves: list[Any]) -> str:
        """The parameter an op takes, itself or as a view (backward's mm takes weight.t()): found by
        identity, else by the storage it shares. Where no module runs (backward) this names the site."""
        for x in leaves:
            if id(x) in self._params:
                return self._params[id(x)]
        if self._storages is None:
            self._storages = {}
            for p, name in self._param_objs:
                with contextlib.suppress(Exception):  # a backend without storages: identity only
                    self._storages.setdefault((p.device, _storage_id(p)), name)
        for x in leaves:
            if isinstance(x, torch.Tensor) and x.device.type == self.device_type:
                with contextlib.suppress(Exception):
                    name = self._storages.get((x.device, _storage_id(x)))
                    if name:
                        return name
        return ""

    # -- the judge ---------------------------------------------------------------------------

    def _on_target(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor) and x.device.type == self.device_type

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.failure is not None or _skip(func):
            return func(*args, **kwargs)
        leaves, _ = tree_flatten((args, kwargs))
        if not any(self._on_target(x) for x in leaves):
            return func(*args, **kwargs)
        if self.per_signature is not None:
            key = (func, *(_signature(x) for x in leaves))
            seen = self._seen.get(key, 0)
            if seen >= self.per_signature:
                out = func(*args, **kwargs)
                self.sampled_out += _has_float(out)  # what would have been judged
                return out
            self._seen[key] = seen + 1
        snap = tree_map(lambda x: _host(x) if self._on_target(x) else x, (args, kwargs))
        self._owner = self._param_of(leaves)
        # a foreach op (the optimizers on a device) takes a list of parameters: output i is list item i's
        self._owners = ([self._param_of([x]) for x in args[0]]
                        if func.__name__.startswith("_foreach") and args and isinstance(args[0], (list, tuple)) else None)
        out = func(*args, **kwargs)
        self._judge(func, snap, out)
        return out

    def _replay(self, func, snap: Any, dtype: torch.dtype | None) -> Any:
        args, kwargs = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, snap)
        if dtype is not None:
            args, kwargs = tree_map(
                lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, (args, kwargs)
            )
            return func(*args, **kwargs)
        with Emulate(self.contract):
            return func(*args, **kwargs)

    def _judge(self, func, snap: Any, out: Any) -> None:
        if not _has_float(out):
            return
        outs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        prev = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")  # the replay is the reference: no TF32 on the host
        try:
            expected = [x for x in tree_flatten(self._replay(func, snap, None))[0] if isinstance(x, torch.Tensor)]
            hosts = [_host(t) for t in outs]
            oracle = None
            if not all(h.dtype == e.dtype and torch.equal(h, e) for h, e in zip(hosts, expected, strict=False)):
                try:  # the fp64 replay only where the target differs from its contract at all
                    oracle = [x for x in tree_flatten(self._replay(func, snap, torch.float64))[0]
                              if isinstance(x, torch.Tensor)]
                except Exception:
                    oracle = None
        except Exception:
            return  # the CPU cannot replay it (a backend-only op): nothing to judge against
        finally:
            torch.set_float32_matmul_precision(prev)
        self.checked += 1
        for i, (t, host, e) in enumerate(zip(outs, hosts, expected, strict=False)):
            if not t.is_floating_point() or not e.is_floating_point():
                continue
            o = oracle[i] if oracle is not None and i < len(oracle) else None
            ok, ratio, note = judge_output(host, e, o)
            if ratio is not None and math.isfinite(ratio):
                self.worst = max(self.worst, ratio)
            if not ok:
                owner = self._owners[i] if self._owners is not None and i < len(self._owners) else self._owner
                module = self._module() or owner.rpartition(".")[0] or self._backward_module()
                self.failure = OpFailure(
                    op=_op_name(func), module=module, param=owner or self._nearest_param(module),
                    inputs=[_describe(x) for x in tree_flatten(snap)[0] if isinstance(x, torch.Tensor)],
                    output=f"{i}: {_describe(t)}", ratio=ratio, max_abs=_max_abs(host, e), note=note, args=snap, func=func,
                    step=self.phase() if self.phase is not None else None,
                )
                return


def _storage_id(t: torch.Tensor) -> int:
    """Which storage `t` is a view of: the StorageImpl itself, not its data pointer (a backend whose
    storages keep their bytes elsewhere reports 0 for every one of them)."""
    return t.untyped_storage()._cdata


def _has_float(out: Any) -> bool:
    return any(isinstance(x, torch.Tensor) and x.is_floating_point() for x in tree_flatten(out)[0])


def _signature(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (x.dtype, tuple(x.shape), x.stride(), x.device.type)
    return x if isinstance(x, (int, float, bool, str, type(None), torch.dtype)) else type(x).__name__


def _max_abs(t: torch.Tensor, e: torch.Tensor) -> float | None:
    try:
        d = (t.double() - e.double()).abs()
        d = d[torch.isfinite(d)]
        return d.max().item() if d.numel() else None
    except RuntimeError:
        return None


def _op_name(func: torch._ops.OpOverload) -> str:
    ov = func._overloadname
    return func._schema.name if ov == "default" else f"{func._schema.name}.{ov}"


# -- a standalone repro of the first diverging op ---------------------------------------------------
# A standalone repro of the first diverging op: plain torch, the backend's own import, one op.
#
# What a bring-up engineer hands to the kernel team: the op's real inputs (saved with torch.save), a
# script that runs it on the CPU under the declared contract (the expected result), in fp64 (the oracle)
# and on the target, and prints the errors and the verdict. It needs nothing of portharness but the
# backend module itself.

_ROUNDING = {  # how each contract's operand rounding reads in plain torch
    "tf32": "(t.view(torch.int32) + 0xFFF + ((t.view(torch.int32) >> 13) & 1) & ~0x1FFF).view(torch.float32)",
    "bf16-matmul": "t.to(torch.bfloat16).to(torch.float32)",
    "fp16-matmul": "t.to(torch.float16).to(torch.float32)",
}
assert set(_ROUNDING) == {c.rounding for c in CONTRACTS.values() if c.rounding}, "a contract without repro rounding"

_TEMPLATE = '''"""Repro (portharness): one op on a device, beyond its declared precision. FOUND below says which op, on
which device, under which contract, where it was found and with which inputs.

Found by the kernel-conformance check: rmse(fp64, target) must be <= m * rmse(fp64, expected) + ULPS ulp,
where expected is the op on the CPU with the contract's rounding. Run: python <this file>
"""

# Every value below that came from a run (ids, op names, devices) is a Python literal: nothing here is code
# made from data.
FOUND = {found!r}
ULPS = {ulps!r}

import importlib  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
{preamble}

OP = getattr(getattr(getattr(torch.ops, {namespace!r}), {packet!r}), {overload!r})
DEVICE = {device!r}
saved = torch.load(Path(__file__).with_suffix(".pt"), weights_only=True)  # tensors and plain values: no code
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
for i in {positions!r}:  # the operands a reduced-precision multiplier sees
    if i < len(expected_args) and expected_args[i].dtype is torch.float32:
        expected_args[i] = contract_round(expected_args[i])
expected = OP(*expected_args, **tree(lambda t: t.clone(), kwargs))
oracle = OP(*tree(lambda t: t.double() if t.is_floating_point() else t.clone(), args),
            **tree(lambda t: t.double() if t.is_floating_point() else t.clone(), kwargs))
target = OP(*tree(lambda t: t.to(DEVICE), args), **tree(lambda t: t.to(DEVICE), kwargs))


def first(x):
    return x[{output_index!r}] if isinstance(x, (list, tuple)) else x


t, e, o = first(target).cpu().double(), first(expected).double(), first(oracle).double()
rmse = lambda a, b: (a - b).square().mean().sqrt().item()  # noqa: E731
m = 3.0 if first(expected).dtype in (torch.float16, torch.bfloat16) or e.numel() < 1000 else 2.0
bound = m * rmse(o, e) + ULPS * torch.finfo(first(expected).dtype).eps * o.square().mean().sqrt().item()
print(f"max |target - expected| = {{(t - e).abs().max().item():.3g}}")
print(f"rmse(fp64, target) = {{rmse(o, t):.3g}}   rmse(fp64, expected) = {{rmse(o, e):.3g}}   bound = {{bound:.3g}}")
print("verdict:", "within the declared precision" if rmse(o, t) <= bound else "BEYOND the declared precision")
'''


def write_repro(
    failure: OpFailure, *, contract: Contract, target: str, preamble: list[str], model_id: str, directory: Path,
    where: str | None = None,
) -> Path:
    """Save the op's inputs and a script that replays it; returns the script's path (one per model and op,
    `files.safe_name`). `where` says what it was found in (default: model `model_id` and the failure's module).
    Every value from the run enters the script as a `repr()` literal."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / f"{files.safe_name(f'{model_id}--{failure.op}', limit=100)}.py"
    args, kwargs = failure.args
    with files.atomic_path(script.with_suffix(".pt")) as tmp:
        torch.save({"args": args, "kwargs": kwargs}, tmp)
    namespace, packet = failure.func._schema.name.split("::")
    found = {"op": failure.op, "target": target, "contract": contract.name,
             "where": where or f"Model {model_id}, module {failure.module or '(top)'}", "inputs": list(failure.inputs)}
    files.write_text(
        script,
        _TEMPLATE.format(
            found=found, ulps=float(ULPS), preamble="\n".join(preamble), namespace=namespace, packet=packet,
            overload=failure.func._overloadname, device=target,
            rounding=f"return {_ROUNDING[contract.rounding]}" if contract.rounding else "return t",
            positions=[int(i) for i in MULTIPLIER_ARGS.get(failure.func, ())], output_index=int(failure.output.split(":")[0]),
        )
    )
    return script


def repro_preamble(modules: list[str], extra: list[str] | None = None) -> list[str]:
    """Import lines for the backend modules plus the adapter's own setup lines."""
    return [f"importlib.import_module({m!r})  # the backend" for m in modules] + list(extra or [])


def describe(failure: OpFailure) -> RowDraft:
    """Row fields for the first diverging op."""
    return RowDraft(
        first_drift_op=failure.op,
        first_drift_op_module=failure.module,
        first_drift_op_inputs=failure.inputs,
        first_drift_op_ratio=failure.ratio if failure.ratio is not None and failure.ratio < 1e300 else None,
    )
