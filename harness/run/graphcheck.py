"""The graph check: every node of the compiled graphs, judged on its own inputs against the CPU.

The op check's job (`harness.run.opcheck`) for compiled code, where fused kernels never reach the
dispatcher. For each graph Dynamo compiled (and its inputs, recorded during the judged run), a copy
whose outputs are the original ones plus every node with a float tensor value is compiled with the same
backend and mode, and run on the target: the compiled value of every node. Then each node is replayed
on the CPU in graph order, fed the *compiled* values of the nodes before it, under the declared
contract (expected) and in fp64 (oracle), and judged by the op check's rule (`judge_output`). The first
node beyond its contract is where the compiler's code goes wrong, named by its graph, its torch call
and the module it came from (Dynamo's ``nn_module_stack``).

What it does not see: a bug that appears only in the original graph's fusion (the copy materialises
every node, so it may fuse differently), and the backward graph (the copy runs without gradients; a
backward-only bug shows in the gradients' verdict). Under ``--amp`` each node is replayed with its
float inputs cast to the dtype its compiled value has (what the target's autocast chose for it);
global-state nodes (autocast and grad-mode switches) are not replayed.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from harness.backends.contracts import Contract, Emulate
from harness.run.compiled import Configuration, Graph
from harness.run.opcheck import OpFailure, judge_output

_STATE = {torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast,
          torch._C._set_grad_enabled, torch.autograd.grad_mode._enter_inference_mode,
          torch.autograd.grad_mode._exit_inference_mode}


@dataclass
class GraphJudge:
    """What the pipeline reads of a check (the op check's names): the first failure, nodes judged."""

    failure: OpFailure | None = None
    checked: int = 0
    sampled_out: int | None = None
    per_signature: int | None = None
    graphs: int = 0  # graphs judged (those the judged run called)
    error: str = ""  # why a graph could not be judged
    raised: list[BaseException] = field(default_factory=list, repr=False)  # what stopped a graph (a device fault stops the row)


def module_path(node: torch.fx.Node) -> str:
    """The innermost module a node came from, as ``named_modules`` spells it (``encoder.layer.0.attn``)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = str(list(stack.values())[-1][0])
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\._modules\.|\.modules\.", ".", path)
    return path.strip(".")


def target_name(node: torch.fx.Node) -> str:
    t = node.target
    if node.op == "call_method":
        return f"Tensor.{t}"
    if isinstance(t, torch._ops.OpOverload):
        return str(t)
    module = getattr(t, "__module__", None) or ""
    name = getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or str(t)
    if module in ("_operator", "operator"):
        return f"operator.{name}"
    return f"{module}.{name}".lstrip(".") if module and not name.startswith(module) else name


def _float_value(node: torch.fx.Node) -> bool:
    v = node.meta.get("example_value", node.meta.get("val"))
    return isinstance(v, torch.Tensor) and v.is_floating_point()


_INPLACE = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
            operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
            operator.setitem}
_VIEWS = {"view", "reshape", "view_as", "reshape_as", "transpose", "permute", "t", "flatten", "unflatten",
          "squeeze", "unsqueeze", "expand", "expand_as", "narrow", "select", "unbind", "split", "chunk", "detach",
          "contiguous", "as_strided", "unfold", "diagonal", "movedim", "swapaxes", "real", "imag", "__getitem__",
          "getitem"}


def _name(n: torch.fx.Node) -> str:
    return n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")


def _written(n: torch.fx.Node) -> torch.fx.Node | None:
    """The node whose tensor `n` writes into, if `n` is an in-place op (``x += y``, ``x.add_(y)``,
    ``x[i] = v``, ``relu(x, inplace=True)``, ``out=``)."""
    first = n.args[0] if n.args and isinstance(n.args[0], torch.fx.Node) else None
    if n.op == "call_function" and (n.target in _INPLACE or n.kwargs.get("inplace") is True):
        return first
    if n.op in ("call_function", "call_method") and isinstance(n.kwargs.get("out"), torch.fx.Node):
        return n.kwargs["out"]
    name = _name(n)
    if n.op in ("call_function", "call_method") and name.endswith("_") and not name.startswith("_"):
        return first
    return None


def _mutated_later(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Nodes whose tensor a later node writes into, directly or through a view. The compiled copy returns
    such a node's tensor as it is at the end of the graph (as eager code would), while the replay judges the
    value the node computed: they must not be compared. In-place nodes are not judged either: the replay
    runs them on the CPU for their effect on the tensors after them."""
    root: dict[torch.fx.Node, torch.fx.Node] = {}
    members: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    out: set[torch.fx.Node] = set()
    for n in gm.graph.nodes:
        base = n.args[0] if n.args and isinstance(n.args[0], torch.fx.Node) else None
        r = root.get(base, base) if base is not None and (_name(n) in _VIEWS or _written(n) is base) else n
        root[n] = r
        members.setdefault(r, []).append(n)
        w = _written(n)
        if w is not None:
            out.update(m for m in members.get(root.get(w, w), [w]) if m is not n)
    return out


def _with_every_node(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[torch.fx.Node], int]:
    """(copy of `gm` also returning every float-valued call node, those nodes in order, original outputs)."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    out = graph.graph_copy(gm.graph, env)
    mutated = _mutated_later(gm)
    judged = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")
              and n.target not in _STATE and _float_value(n) and n not in mutated and _written(n) is None]
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    graph.output((*outs, *[env[n] for n in judged]))
    return torch.fx.GraphModule(gm, graph), judged, len(outs)


def _host(x: Any) -> Any:
    return x.detach().to("cpu") if isinstance(x, torch.Tensor) else x


def _cpu_devices(x: Any, device_type: str) -> Any:
    if isinstance(x, torch.device) and x.type == device_type:
        return torch.device("cpu")
    if isinstance(x, str) and x.split(":")[0] == device_type:
        return "cpu"
    return x


class _Replay(torch.fx.Interpreter):
    """Runs the graph on the CPU; a judged node's value is its compiled one, after judging it."""

    def __init__(self, gm: torch.fx.GraphModule, compiled: dict[torch.fx.Node, torch.Tensor], contract: Contract,
                 device_type: str, amp: bool) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.compiled = compiled
        self.contract = contract
        self.device_type = device_type
        self.amp = amp
        self.failure: tuple[torch.fx.Node, float | None, str, float | None, list[str], str] | None = None
        self.checked = 0
        self.recomputed: set[torch.fx.Node] = set()

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op == "placeholder" or n.op == "output" or n.op == "get_attr":
            return super().run_node(n)
        if n.target in _STATE:
            return None
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        args, kwargs = tree_map(lambda x: _cpu_devices(x, self.device_type), (args, kwargs))
        if n not in self.compiled:  # not judged (no float tensor, or a later op writes into it): computed here
            self.recomputed.add(n)
            return getattr(self, n.op)(n.target, args, kwargs)
        target = self.compiled[n]
        # a node fed a value computed here rather than the target's (which did not follow the contract's
        # rounding) is not judged; it passes its compiled value on, so the nodes after it are judged again
        if self.failure is None and not self.recomputed.intersection(n.all_input_nodes):
            self._judge(n, target, args, kwargs)
        return target

    def _call(self, n: torch.fx.Node, args: Any, kwargs: Any, dtype: torch.dtype | None) -> Any:
        def prep(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            x = x.clone()
            return x.to(dtype) if dtype is not None and x.is_floating_point() else x

        a, k = tree_map(prep, (args, kwargs))
        return getattr(self, n.op)(n.target, a, k)

    def _judge(self, n: torch.fx.Node, target: torch.Tensor, args: Any, kwargs: Any) -> None:
        prev = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")  # the replay is the reference: no TF32 on the host
        try:
            with Emulate(self.contract):
                expected = self._call(n, args, kwargs, target.dtype if self.amp else None)
            if not isinstance(expected, torch.Tensor):
                return
            oracle = None
            if not (expected.dtype == target.dtype and torch.equal(expected, target)):
                try:
                    oracle = self._call(n, args, kwargs, torch.float64)
                except Exception:
                    oracle = None
        except Exception:
            return  # the CPU cannot replay it: nothing to judge against
        finally:
            torch.set_float32_matmul_precision(prev)
        if expected.dtype != target.dtype and self.amp:
            expected = expected.to(target.dtype)
        self.checked += 1
        ok, ratio, note = judge_output(target, expected, oracle if isinstance(oracle, torch.Tensor) else None)
        if not ok:
            inputs = [f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
                      for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
            max_abs = None
            if target.shape == expected.shape:
                d = (target.double() - expected.double()).abs()
                d = d[torch.isfinite(d)]
                max_abs = d.max().item() if d.numel() else None
            self.failure = (n, ratio, note, max_abs, inputs, f"{str(target.dtype).removeprefix('torch.')}"
                            f"{list(target.shape)}")


def check_graphs(graphs: list[Graph], cfg: Configuration, contract: Contract, device_type: str,
                 params: list[str]) -> GraphJudge:
    """Judge every node of the recorded `graphs` that the judged run called; `params` (module order)
    name the parameter nearest a failing node's module."""
    found = GraphJudge()
    for index, graph in enumerate(graphs, 1):
        if graph.args is None:
            continue
        try:
            gm, judged, n_out = _with_every_node(graph.gm)
            if not judged:
                continue
            compiled = torch.compile(gm, backend=cfg.backend, mode=cfg.compile_mode, dynamic=cfg.dynamic)
            with torch.no_grad():
                values = compiled(*graph.args)
            values = {n: _host(v) for n, v in zip(judged, values[n_out:], strict=True)}
            replay = _Replay(graph.gm, values, contract, device_type, amp=cfg.amp != "")
            with torch.no_grad():
                replay.run(*[_host(a) for a in graph.args])
        except Exception as e:  # the check is diagnostics: the verdict stands without it
            found.raised.append(e)
            found.error = found.error or f"graph {index}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            continue
        found.graphs += 1
        found.checked += replay.checked
        if replay.failure is not None:
            n, ratio, note, max_abs, inputs, output = replay.failure
            module = module_path(n)
            found.failure = OpFailure(
                op=f"{target_name(n)} (node {n.name} of compiled graph {index})", module=module,
                param=_nearest(params, module), inputs=inputs, output=f"0: {output}",
                ratio=ratio if ratio is None or math.isfinite(ratio) else None, max_abs=max_abs,
                note=note or "compiled code against the CPU on the same inputs",
            )
            break
    return found


def _nearest(params: list[str], module: str) -> str:
    while module:
        found = next((p for p in params if p.startswith(f"{module}.")), "")
        if found:
            return found
        module = module.rpartition(".")[0]
    return ""

