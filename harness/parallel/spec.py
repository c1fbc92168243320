"""A parallel spec: how one model is spread over devices, one process per device.

``ddp:N`` (data parallel: the model replicated, gradients all-reduced), ``fsdp:N`` (FSDP2: parameters sharded,
gathered per layer, gradients reduce-scattered), ``tp:N`` (tensor parallel: the model's own tensor-parallel
plan, ``base_model_tp_plan``, over N devices), ``fsdp:N,tp:M`` (a 2-D mesh, FSDP2 over ``dp`` and tensor
parallel over ``tp``: N x M processes). Every rank is fed the whole batch (replicated data), so each rank's
outputs and the reduced gradients equal one device's: what is judged is the sharded computation and its
collectives, against the single-device CPU reference.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

KINDS = ("ddp", "fsdp", "tp")
_ITEM = re.compile(r"^(ddp|fsdp|tp):([0-9]+)$")


@dataclass(frozen=True)
class ParallelSpec:
    dims: tuple[tuple[str, int], ...]  # (kind, size), outermost first: (("fsdp", 2), ("tp", 2))

    @property
    def world(self) -> int:
        return math.prod(n for _, n in self.dims)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.dims)

    def size(self, kind: str) -> int:
        return dict(self.dims).get(kind, 1)

    @property
    def tp(self) -> bool:
        return "tp" in self.kinds

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(n for _, n in self.dims)

    @property
    def mesh_names(self) -> tuple[str, ...]:
        return tuple("dp" if k in ("ddp", "fsdp") else "tp" for k in self.kinds)

    def __str__(self) -> str:
        return ",".join(f"{k}:{n}" for k, n in self.dims)


def parse(text: str) -> ParallelSpec:
    """``fsdp:2,tp:2`` -> its spec; ValueError saying what a spec can be."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    dims = []
    for item in items:
        m = _ITEM.match(item)
        if m is None:
            raise ValueError(f"--parallel {text!r}: {item!r} is not KIND:N (KIND one of {', '.join(KINDS)}); "
                             "e.g. ddp:2, fsdp:2, tp:2 or fsdp:2,tp:2")
        if int(m.group(2)) < 2:
            raise ValueError(f"--parallel {text!r}: {item} spreads nothing (N must be at least 2)")
        dims.append((m.group(1), int(m.group(2))))
    kinds = [k for k, _ in dims]
    if not dims or len(set(kinds)) != len(kinds):
        raise ValueError(f"--parallel {text!r}: give each of {', '.join(KINDS)} at most once, e.g. fsdp:2,tp:2")
    if len(dims) > 2 or (len(dims) == 2 and (kinds[1] != "tp" or kinds[0] == "tp")):
        raise ValueError(f"--parallel {text!r}: a 2-D spec is data parallel then tensor parallel "
                         "(fsdp:N,tp:M or ddp:N,tp:M)")
    return ParallelSpec(tuple(dims))


def chosen(model_id: str, listed: str, run: str | None) -> str:
    """How one model of a run is spread: its list's `parallel` cell ("" the run's --parallel, "none" one device, or
    a spec), canonical ("" for one device); ValueError naming the model."""
    if not listed:
        return str(parse(run)) if run else ""
    if listed in ("none", "1"):
        return ""
    try:
        return str(parse(listed))
    except ValueError as e:
        raise ValueError(f"model {model_id!r}: its list's parallel cell {listed!r} is not a spec: "
                         f"{str(e).removeprefix(f'--parallel {listed!r}: ')}; or write none (one device)") from None


def groups(devices: list[str], world: int, *, shared: bool = False) -> list[str]:
    """The fleet's devices as groups of `world` (``sim:0+sim:1``), in order; ValueError when there are too few.
    A group is one slot of the fleet: a model's ranks run on its devices, one each. `shared`: a device several
    ranks can share (the CPU, the gloo control): each device is a group of its own, one rank per core."""
    if shared:
        return ["+".join([d] * world) for d in devices]
    if world > len(devices):
        raise ValueError(f"--parallel needs {world} devices per model, the target has {len(devices)} "
                         f"({', '.join(devices)})")
    by_node: dict[str, list[str]] = {}  # a cluster's devices are `<node>/<device>`: a group never spans nodes
    for d in devices:
        by_node.setdefault(node(d), []).append(d)
    out = [g for ds in by_node.values() for g in ("+".join(ds[i:i + world]) for i in range(0, len(ds) - world + 1, world))]
    if not out:
        raise ValueError(f"--parallel needs {world} devices per model on one node; no node has that many "
                         f"({', '.join(devices)})")
    return out


def node(device: str) -> str:
    """The node a fleet's device is on (`host/sim:0` -> host; "" for this host's own)."""
    return device.rpartition("/")[0]


def members(key: str) -> list[str]:
    """A group's devices (``sim:0+sim:1`` -> [sim:0, sim:1]); a lone device is its own group."""
    return key.split("+")
