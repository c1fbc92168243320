"""An op call as a *variation*: what a kernel is asked to do, without its tensors.

A variation is one overload with one input signature: each tensor argument's dtype, shape, strides and
whether it starts inside its storage, and every non-tensor argument as given (scalars, lists, dtypes; a
device argument stands for "the device under test"). Two calls with the same signature exercise the same
kernel path, so a list's models dedupe into far fewer variations than calls; a variation's id is its op
and a short hash of the signature: ``aten::addmm.default#3fa2c0d1e9``.

No tensor is stored. A variation's inputs are regenerated from a seed and what was seen of the values
(`Gen`, kept beside the signature but not part of it): floats drawn around the observed mean and spread,
clamped to the observed range (a variance stays positive, a probability in [0, 1]); two-valued floats
(additive attention masks: 0 and -inf, or 0 and the dtype's minimum) as such; non-finite values at their
observed rates. Values that matter are kept or regenerated valid: a small integer or boolean tensor (ids,
labels, masks of a tiny model) and any tensor of a few elements (a scale, a fill value) keep their storage's
values; a larger integer tensor is drawn from the values it held when they were few (class ids with an
ignore index), else from its range (indices stay within the indexed dimension: the shapes are part of the
signature), unique where it was unique (scatter and index_put targets, where duplicates would make the
result depend on the order of writes), sorted where it was sorted (positions).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from harness.results.variations import describe, display, inputs_key

__all__ = ["Signature", "describe", "display", "inputs_key", "regenerate", "resolve", "variation_id"]

KEEP_INT = 64  # integer/bool storages up to this many elements keep their values
KEEP_FLOAT = 4  # float storages up to this many elements keep theirs (a scale, a fill value)
SAMPLE = 4096  # float statistics from at most about this many of a tensor's values
FEW = 16  # an integer tensor with at most this many distinct values is drawn from them
MAX_OFFSET = 1 << 16  # a storage offset beyond this is regenerated smaller (same alignment mod 64)
_ENUMS = {str(v): v for v in (torch.strided, torch.sparse_coo, torch.contiguous_format, torch.channels_last,
                              torch.channels_last_3d, torch.preserve_format)}


class Unrepresentable(TypeError):
    """An argument a variation cannot describe (an opaque object): the call is not a variation."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _span(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Storage elements a strided tensor reaches from its offset (0 when empty)."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((n - 1) * abs(st) for n, st in zip(shape, stride, strict=True))


def _float(v: float) -> Any:
    return v if math.isfinite(v) else {"float": str(v)}


# -- what was seen of a tensor's values ------------------------------------------------------------------


def observe(t: torch.Tensor) -> dict[str, Any]:
    """What regeneration needs of `t`'s values (cheap: a few reductions; a small storage's values)."""
    shape, stride = tuple(t.shape), tuple(t.stride())
    span = _span(shape, stride)
    small = KEEP_FLOAT if t.is_floating_point() or t.is_complex() else KEEP_INT
    if span == 0:
        return {}
    if span <= small and not t.is_complex():
        flat = t.as_strided((span,), (1,), t.storage_offset()).detach()
        return {"values": [_float(v) if isinstance(v, float) else v for v in flat.tolist()]}
    if t.dtype == torch.bool:
        return {"p": round(float(t.float().mean()), 4)}
    if t.is_complex():
        t = torch.view_as_real(t)
    x = t.detach()
    if x.is_floating_point():
        x = x if x.dtype == torch.float32 else x.float()
        if x.numel() > SAMPLE:  # a feature map or a weight: its statistics from an even sample of it
            x = x.reshape(-1)[:: x.numel() // SAMPLE]
        if x.numel() > 1:  # one read-back for the four numbers
            lo, hi, std, mean = torch.stack([*torch.aminmax(x), *torch.std_mean(x)]).tolist()
        else:
            lo = hi = mean = float(x.reshape(-1)[0])
            std = 0.0
        gen: dict[str, Any] = {}
        if not (math.isfinite(lo) and math.isfinite(hi)):  # NaN or inf somewhere: their rates, then the rest
            n = x.numel()
            gen["nan"] = round(float(torch.isnan(x).sum()) / n, 4)
            gen["posinf"] = round(float((x == math.inf).sum()) / n, 4)
            gen["neginf"] = round(float((x == -math.inf).sum()) / n, 4)
            x = x[torch.isfinite(x)]
            if x.numel() == 0:
                return gen
            lo, hi = (float(v) for v in torch.aminmax(x))
            std, mean = (float(v) for v in torch.std_mean(x)) if x.numel() > 1 else (0.0, lo)
        gen.update(lo=lo, hi=hi, mean=mean, std=std)
        # two-valued (an additive mask: 0 and -inf or the dtype's minimum; 0 and 1): only a spread that wide
        # can be (a bell-shaped tensor's std is about a sixth of its range), so only those are checked
        if lo != hi and std > 0.25 * (hi - lo) and bool(((x == lo) | (x == hi)).all()):
            gen["p_hi"] = round(float((x == hi).float().mean()), 4)
        return gen
    x = x.long().flatten()
    lo, hi = int(x.min()), int(x.max())
    gen = {"lo": lo, "hi": hi}
    distinct = torch.unique(x)
    if distinct.numel() <= FEW:
        gen["distinct"] = distinct.tolist()
    if distinct.numel() == x.numel() and x.numel() > 1:
        gen["unique"] = True
    if x.numel() > 1 and bool((x[1:] >= x[:-1]).all()):
        gen["sorted"] = True
    return gen


def merge_gen(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two observations of one signature (two calls, two models) as one: the more demanding of the two.
    Ranges are united (each is valid for the signature's shapes, so their union is), the wider spread is
    drawn from (a model whose activations are near zero at this kernel would make a bug there invisible),
    non-finite values at the higher rate; kept values and the rest as first seen."""
    if not a or not b or "values" in a or "values" in b:
        return a or b
    out = dict(a)
    if "lo" in a and "lo" in b:
        out["lo"], out["hi"] = min(a["lo"], b["lo"]), max(a["hi"], b["hi"])
    if b.get("std", 0.0) > a.get("std", 0.0):
        out["mean"], out["std"] = b["mean"], b["std"]
    for key in ("nan", "posinf", "neginf"):
        if key in b:
            out[key] = max(a.get(key, 0.0), b[key])
    if "distinct" in a:
        both = sorted(set(a["distinct"]) | set(b.get("distinct", [])))
        if "distinct" in b and len(both) <= FEW:
            out["distinct"] = both
        else:
            out.pop("distinct")
    if "p_hi" in a and (b.get("lo"), b.get("hi")) != (a.get("lo"), a.get("hi")):
        out.pop("p_hi")
    for flag in ("unique", "sorted"):
        if not b.get(flag):
            out.pop(flag, None)
    return out


def merge_gens(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`merge_gen` per tensor argument (a list that does not line up is kept as it was)."""
    return [merge_gen(x, y) for x, y in zip(a, b, strict=True)] if len(a) == len(b) else a


def observations(args: Any, kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    """Each tensor argument's observation, in `encode`'s order (a signature known already, seen again)."""
    out: list[dict[str, Any]] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out.append(observe(x))
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    for a in args:
        walk(a)
    for v in kwargs.values():
        walk(v)
    return out


# -- the signature ---------------------------------------------------------------------------------------


def encode(x: Any, gens: list[dict[str, Any]] | None) -> Any:
    """`x` as JSON-able signature data; each tensor's observation is appended to `gens` (None: not
    observed) and the tensor refers to it by position."""
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided or x.is_quantized or x.is_nested:
            raise Unrepresentable(f"a {x.layout} tensor")
        spec: dict[str, Any] = {"dtype": dtype_name(x.dtype), "shape": list(x.shape), "stride": list(x.stride()),
                                "offset": x.storage_offset()}
        if gens is not None:
            spec["gen"] = len(gens)
            gens.append(observe(x))
        return {"t": spec}
    if isinstance(x, (list, tuple)):
        return {"list": [encode(v, gens) for v in x]} if any(isinstance(v, torch.Tensor) for v in x) else [
            encode(v, gens) for v in x]
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return _float(x)
    if isinstance(x, torch.dtype):
        return {"dtype": dtype_name(x)}
    if isinstance(x, torch.device):
        return {"device": True}
    if isinstance(x, (torch.layout, torch.memory_format)):
        return {"enum": str(x)}
    if isinstance(x, torch.Generator):
        return {"generator": True}
    raise Unrepresentable(type(x).__name__)


def _keyed(x: Any) -> Any:
    """The part of encoded data that tells kernel paths apart: a tensor's offset only as 0 or not, no
    observation."""
    if isinstance(x, dict) and "t" in x:
        t = x["t"]
        return {"t": [t["dtype"], t["shape"], t["stride"], t["offset"] > 0]}
    if isinstance(x, dict) and "list" in x:
        return {"list": [_keyed(v) for v in x["list"]]}
    if isinstance(x, list):
        return [_keyed(v) for v in x]
    return x


def op_name(func: torch._ops.OpOverload) -> str:
    """``aten::addmm.default``: the overload, always with its overload name."""
    return f"{func._schema.name}.{func._overloadname}"


def resolve(op: str) -> torch._ops.OpOverload:
    """The overload named ``ns::packet.overload`` (ValueError when this torch has none)."""
    ns, _, rest = op.partition("::")
    packet, _, overload = rest.rpartition(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), packet), overload)
    except (AttributeError, RuntimeError):
        raise ValueError(f"{op}: no such operator overload in torch {torch.__version__}") from None


@dataclass
class Signature:
    """One call, described: the overload and its encoded arguments (tensors' observations apart)."""

    op: str
    args: list[Any]
    kwargs: dict[str, Any]
    gens: list[dict[str, Any]]

    @classmethod
    def of(cls, func: torch._ops.OpOverload, args: tuple, kwargs: dict[str, Any], observe_values: bool = True
           ) -> Signature:
        gens: list[dict[str, Any]] | None = [] if observe_values else None
        enc_args = [encode(a, gens) for a in args]
        enc_kwargs = {k: encode(v, gens) for k, v in kwargs.items()}
        return cls(op_name(func), enc_args, enc_kwargs, gens or [])

    @property
    def key(self) -> str:
        return json.dumps([self.op, _keyed(self.args), {k: _keyed(v) for k, v in self.kwargs.items()}],
                          sort_keys=True, separators=(",", ":"))

    @property
    def id(self) -> str:
        return variation_id(self.op, self.key)

    def spec(self) -> dict[str, Any]:
        """What is stored and what a worker regenerates the inputs from."""
        return {"op": self.op, "args": self.args, "kwargs": self.kwargs, "gens": self.gens}


def variation_id(op: str, key: str) -> str:
    return f"{op}#{hashlib.sha1(key.encode()).hexdigest()[:10]}"


def call_key(func: torch._ops.OpOverload, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """A cheap hashable key equal for calls with equal signatures (the harvest's per-call dedupe, before
    anything is encoded)."""
    return (func, *(_quick(a) for a in args), *((k, _quick(v)) for k, v in kwargs.items()))


def _quick(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (x.dtype, x.shape, x.stride(), x.storage_offset() > 0)  # a sparse tensor has no strides: no key
    if isinstance(x, (list, tuple)):
        return tuple(_quick(v) for v in x)
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    return x if isinstance(x, (int, float, bool, str, type(None), torch.dtype)) else (type(x).__name__, str(x))


# -- regeneration ----------------------------------------------------------------------------------------


def regenerate(spec: dict[str, Any], seed: int, device: torch.device | str = "cpu") -> tuple[list[Any], dict[str, Any]]:
    """The call's (args, kwargs), on the CPU, drawn from `seed` (a device argument is `device`)."""
    g = torch.Generator().manual_seed(seed)
    gens = spec.get("gens", [])
    args = [_decode(a, gens, g, device) for a in spec["args"]]
    kwargs = {k: _decode(v, gens, g, device) for k, v in spec["kwargs"].items()}
    return args, kwargs


def _decode(x: Any, gens: list[dict[str, Any]], g: torch.Generator, device: Any) -> Any:
    if isinstance(x, dict):
        if "t" in x:
            t = x["t"]
            return _tensor(t, gens[t["gen"]] if "gen" in t and t["gen"] < len(gens) else {}, g)
        if "list" in x:
            return [_decode(v, gens, g, device) for v in x["list"]]
        if "float" in x:
            return float(x["float"])
        if "dtype" in x:
            return _dtype(x["dtype"])
        if "device" in x:
            return torch.device(device)
        if "enum" in x:
            return _ENUMS[x["enum"]]
        if "generator" in x:
            return None
    if isinstance(x, list):
        return [_decode(v, gens, g, device) for v in x]
    return x


def _tensor(t: dict[str, Any], gen: dict[str, Any], g: torch.Generator) -> torch.Tensor:
    dtype = _dtype(t["dtype"])
    shape, stride = tuple(t["shape"]), tuple(t["stride"])
    offset = t["offset"] if t["offset"] < MAX_OFFSET else MAX_OFFSET + t["offset"] % 64
    span = _span(shape, stride)
    if "values" in gen:
        vals = [float(v["float"]) if isinstance(v, dict) else v for v in gen["values"]]
        flat = torch.tensor(vals, dtype=dtype) if vals else torch.empty(0, dtype=dtype)
        if flat.numel() < span:  # an observation of another call with this signature: fill the rest
            flat = torch.cat([flat, torch.zeros(span - flat.numel(), dtype=dtype)])
        flat = flat[:span]
    else:
        flat = _draw(span, dtype, gen, g)
    base = torch.zeros(offset + span, dtype=dtype)
    base[offset:] = flat
    out = base.as_strided(shape, stride, offset)
    if "values" not in gen and not dtype.is_floating_point and dtype != torch.bool and not dtype.is_complex \
            and (gen.get("unique") or gen.get("sorted")) and span == out.numel():
        out.copy_(_ordered(out.flatten(), gen, g).reshape(shape))  # no overlap: logical order is writable
    return out


def _draw(n: int, dtype: torch.dtype, gen: dict[str, Any], g: torch.Generator) -> torch.Tensor:
    if n == 0:
        return torch.empty(0, dtype=dtype)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) < gen.get("p", 0.5)
    if dtype.is_floating_point or dtype.is_complex:
        width = 2 if dtype.is_complex else 1
        lo, hi = gen.get("lo", -3.0), gen.get("hi", 3.0)
        if "p_hi" in gen:
            x = torch.where(torch.rand(n * width, generator=g) < gen["p_hi"], hi, lo)
        else:
            std = gen.get("std", 1.0)
            x = (torch.randn(n * width, generator=g) * (std if math.isfinite(std) else 1.0) + gen.get("mean", 0.0))
            x = x.clamp(lo, hi) if math.isfinite(lo) and math.isfinite(hi) else x
        for key, value in (("nan", math.nan), ("posinf", math.inf), ("neginf", -math.inf)):
            if gen.get(key):
                x = torch.where(torch.rand(n * width, generator=g) < gen[key], value, x)
        x = x.double()
        return torch.view_as_complex(x.reshape(n, 2)).to(dtype) if dtype.is_complex else x.to(dtype)
    if "distinct" in gen and gen["distinct"]:
        pool = torch.tensor(gen["distinct"], dtype=torch.long)
        x = pool[torch.randint(len(pool), (n,), generator=g)]
    else:
        lo, hi = int(gen.get("lo", 0)), int(gen.get("hi", 0 if dtype == torch.uint8 else 9))
        x = torch.randint(lo, hi + 1, (n,), generator=g, dtype=torch.long)
    return x.to(dtype)


def _ordered(x: torch.Tensor, gen: dict[str, Any], g: torch.Generator) -> torch.Tensor:
    """`x` redrawn unique (a permutation of the range, where it has room) and/or sorted, as observed."""
    n = x.numel()
    lo, hi = int(gen.get("lo", 0)), int(gen.get("hi", n - 1))
    if gen.get("unique") and hi - lo + 1 >= n:
        pool = torch.tensor(gen["distinct"], dtype=torch.long) if "distinct" in gen else None
        if pool is not None and len(pool) >= n:
            x = pool[torch.randperm(len(pool), generator=g)[:n]].to(x.dtype)
        elif pool is None and hi - lo + 1 <= max(4 * n, 1 << 16):
            x = (torch.randperm(hi - lo + 1, generator=g)[:n] + lo).to(x.dtype)
        # a wider range (an uninitialised buffer's garbage): independent draws rarely collide there
    return torch.sort(x).values if gen.get("sorted") else x
