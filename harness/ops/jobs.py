"""An op run's jobs: the variations a list's models use (or OpInfo's samples of their ops), as fleet entries.

Each variation is one job of an ordinary run (`harness.fleet.runner.run_models` with ``kind="variation"``):
an entry whose id is the variation's (``aten::addmm.default#3fa2c0d1e9``), whose ``arch`` is the op's
packet (so ``matrix --by arch`` reads per op) and whose ``task`` is its source; the signature travels
in the task beside it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from harness.models.model_list import ModelEntry
from harness.results.variations import display


def packet(op: str) -> str:
    """``aten::addmm.default`` -> ``addmm``."""
    return op.split("::", 1)[-1].split(".", 1)[0].split("#", 1)[0]


def entry(vid: str, spec: Mapping[str, Any]) -> ModelEntry:
    return ModelEntry(id=vid, source="variation", arch=packet(str(spec.get("op", vid))),
                      task=str(spec.get("source", "models")), modality="op")


def used(uses: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    """Variation id -> the models that call it."""
    out: dict[str, int] = {}
    for calls in uses.values():
        for vid in calls:
            out[vid] = out.get(vid, 0) + 1
    return out


def matches(vid: str, spec: Mapping[str, Any], terms: Iterable[str]) -> bool:
    """Whether `--only` names this variation: its id, its op (``aten::sort.stable``, ``aten::gelu.default``,
    ``aten::gelu``) or the op's bare name (``gelu``)."""
    op = str(spec.get("op", vid.split("#", 1)[0]))
    names = {vid, op, display(op), packet(op), f"aten::{packet(op)}"}
    return any(t.strip() in names for t in terms if t.strip())


def unknown(terms: Iterable[str]) -> list[str]:
    """The `--only` terms that name no op this torch has (a variation id, ``aten::sort.stable``, ``aten::gelu``
    or ``gelu``): refused before anything is harvested or run."""
    import torch

    def known(term: str) -> bool:
        op = term.split("#", 1)[0]
        ns, sep, rest = op.partition("::")
        if not sep:
            ns, rest = "aten", op
        name, _, overload = rest.partition(".")
        try:
            schemas = torch._C._jit_get_schemas_for_operator(f"{ns}::{name}")
        except RuntimeError:
            return False
        return bool(schemas) and (not overload or overload == "default" or any(s.overload_name == overload
                                                                                for s in schemas))

    return [t for t in (t.strip() for t in terms) if t and not known(t)]


def select(specs: Mapping[str, Mapping[str, Any]], only: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
    """The variations to run, in id order (`only`: those `matches` names)."""
    terms = [t for t in only if t.strip()]
    return {vid: dict(specs[vid]) for vid in sorted(specs) if not terms or matches(vid, specs[vid], terms)}


def dtypes_by_op(specs: Mapping[str, Mapping[str, Any]]) -> dict[str, set[str]]:
    """Op -> the dtypes the list called it with (its first tensor argument's), for OpInfo's samples."""
    out: dict[str, set[str]] = {}
    for spec in specs.values():
        first = _first_tensor(spec.get("args", []))
        out.setdefault(str(spec.get("op", "")), set()).update([first] if first else [])
    return out


def _first_tensor(x: Any) -> str:
    if isinstance(x, dict) and "t" in x:
        return str(x["t"]["dtype"])
    if isinstance(x, dict) and "list" in x:
        x = x["list"]
    if isinstance(x, list):
        for v in x:
            found = _first_tensor(v)
            if found:
                return found
    return ""
