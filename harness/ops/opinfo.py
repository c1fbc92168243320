"""PyTorch's own OpInfo samples of the ops a list uses, as variations (``ops --source opinfo``).

Models rarely hit an op's edge cases: empty and zero-sized tensors, non-contiguous and broadcast inputs,
scalars, extreme values, integer dtypes. PyTorch's OpInfo database (the corpus its own device tests
use, `harness.sim.conformance`) has them per op. For each ATen op a list's harvest holds, the OpInfos
testing it contribute their first samples in float32 and in every other dtype the list called the op
with; a sample is named by its OpInfo, dtype and position, and a worker makes it again from the same seed.
Each runs as a variation like a harvested one (`harness.ops.variation`): the OpInfo's Python callable on
the CPU (fp32, declared contract, fp64) and on the target, judged by the op check's rule.

Needs ``torch.testing._internal``, which needs the ``expecttest`` package; importing it takes seconds, so
it is imported only here and only for this source.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_map

from harness.ops.signature import dtype_name

DEFAULT_SAMPLES = 8  # per OpInfo and dtype
EXCLUDED = {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided",
            "nn.functional.dropout"}  # uninitialised memory; a fresh random mask per call


@functools.cache
def _db() -> dict[tuple[str, str], Any]:
    from torch.testing._internal.common_methods_invocations import op_db

    return {(o.name, o.variant_test_name): o for o in op_db}


def _packet(op: str) -> str:
    return op.split("::", 1)[-1].split(".", 1)[0]


def _names(packet: str) -> set[str]:
    """The OpInfo names an ATen packet may be tested under (``_softmax`` by ``softmax``, ``native_layer_norm``
    by ``layer_norm``, ``add_`` by ``add``)."""
    base = {packet, packet.lstrip("_"), packet.removeprefix("native_"), packet.rstrip("_"),
            packet.lstrip("_").removesuffix("_")}
    return {n for n in base if n}


def opinfos_for(ops: Iterable[str]) -> dict[str, list[Any]]:
    """ATen op (as named in a harvest) -> the OpInfos that test it."""
    by_name: dict[str, list[Any]] = {}
    for (name, _variant), info in _db().items():
        if name in EXCLUDED:
            continue
        for key in {info.aten_name, name.rsplit(".", 1)[-1]}:
            by_name.setdefault(key, []).append(info)
    out = {}
    for op in ops:
        found = [i for n in sorted(_names(_packet(op))) for i in by_name.get(n, [])]
        if found:
            out[op] = list({id(i): i for i in found}.values())
    return out


@functools.lru_cache(maxsize=64)
def _cached(name: str, variant: str, dtype: torch.dtype, seed: int, limit: int) -> list[Any]:
    """A worker's samples of one OpInfo and dtype, made once (each job takes one of them, copied)."""
    return _samples(_db()[(name, variant)], dtype, seed, limit)


def _samples(info: Any, dtype: torch.dtype, seed: int, limit: int | None) -> list[Any]:
    torch.manual_seed(seed)
    out = []
    for s in info.sample_inputs("cpu", dtype, requires_grad=False):
        out.append(s)
        if limit is not None and len(out) >= limit:
            break
    return out


def _tensors(sample: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    return [x for x in tree_flatten((sample.input, sample.args, sample.kwargs))[0] if isinstance(x, torch.Tensor)]


def _describe(sample: Any) -> list[str]:
    return [f"{dtype_name(x.dtype)}{list(x.shape)}" + ("" if x.is_contiguous() else "/strided")
            for x in _tensors(sample)]


def variations(dtypes_by_op: Mapping[str, Iterable[str]], *, samples: int = DEFAULT_SAMPLES, seed: int = 0
               ) -> dict[str, dict[str, Any]]:
    """Variation id -> spec, for the OpInfo samples of these ops: float32 and the dtypes the list called
    each op with, where the OpInfo supports them on the CPU."""
    out: dict[str, dict[str, Any]] = {}
    for op, infos in opinfos_for(dtypes_by_op).items():
        display = op.removesuffix(".default")
        for info in infos:
            supported = info.supported_dtypes("cpu")
            wanted = ["float32", *sorted(set(dtypes_by_op[op]) - {"float32"})]
            for name in wanted:
                dtype = getattr(torch, name, None)
                if dtype not in supported:
                    continue
                try:
                    batch = _samples(info, dtype, seed, samples)
                except Exception:  # an OpInfo whose samples cannot be made here: nothing to run
                    continue
                oid = f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name
                for i, s in enumerate(batch):
                    if any(x.layout != torch.strided for x in _tensors(s)):
                        continue  # sparse layouts: a strided device's kernels are what is asked about
                    vid = f"{display}#opinfo:{oid}:{name}:{i}"
                    out[vid] = {"source": "opinfo", "op": display, "display": display, "opinfo": info.name,
                                "variant": info.variant_test_name, "dtype": name, "index": i, "seed": seed,
                                "inputs": _describe(s)}
    return out


def sample_call(spec: Mapping[str, Any], seed: int) -> tuple[Any, list[Any], dict[str, Any]]:
    """(callable, args, kwargs) of an OpInfo variation, made again as `variations` made it."""
    info = _db().get((spec["opinfo"], spec.get("variant", "")))
    if info is None:
        raise ValueError(f"no OpInfo {spec['opinfo']!r} in torch {torch.__version__}")
    index = int(spec["index"])
    batch = _cached(info.name, info.variant_test_name, getattr(torch, spec["dtype"]), int(spec.get("seed", seed)),
                    max(index + 1, DEFAULT_SAMPLES))
    if len(batch) <= index:
        raise ValueError(f"OpInfo {spec['opinfo']} has only {len(batch)} {spec['dtype']} samples in this torch")
    s = batch[index]

    def detach(x: Any) -> Any:
        return x.detach() if isinstance(x, torch.Tensor) else x

    return info.op, tree_map(detach, [s.input, *s.args]), tree_map(detach, dict(s.kwargs))
