"""Op allow-list: a young backend implements only part of ATen.

A profile is a text file in ``profiles/`` (one op per line, ``aten::name`` for every overload or
``aten::name.overload`` for one; ``#`` comments). Shipped profiles:

- ``young``: modelled on a backend a few months into bring-up: Core ATen IR plus the eager
  view/copy/factory ops real models hit, minus the long tail such backends typically still lack
  (FFT, cumulative ops, fancy upsampling/grid sampling, weight norm, some sorts).
- ``full``: every op (the CPU kernels), for checking numerics without coverage noise.

Any other value is read as a path to a profile file. An op outside the profile raises the same
``NotImplementedError: Could not run 'aten::X' with arguments from the 'sim' backend`` a real
PrivateUse1 backend raises for a missing kernel, so tooling parses both the same way.

Switch: env ``PORTHARNESS_SIM_OPS``, `set_op_profile()`, or the `op_profile()` context manager.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

OPS_ENV = "PORTHARNESS_SIM_OPS"
PROFILE_DIR = Path(__file__).with_name("profiles")

# Needed to create, move and inspect tensors at all; every profile has them.
ALWAYS_ALLOWED = frozenset(
    {
        "aten::empty.memory_format",
        "aten::empty_strided",
        "aten::_to_copy",
        "aten::copy_",
        "aten::_copy_from",
        "aten::_copy_from_and_resize",
        "aten::detach",
        "aten::alias",
        "aten::view",
        "aten::_local_scalar_dense",
        "aten::set_.source_Storage_storage_offset",
        "aten::resize_",
    }
)


def profile_names() -> list[str]:
    return sorted(["full"] + [p.stem for p in PROFILE_DIR.glob("*.txt")])


def read_profile(path: Path) -> frozenset[str]:
    ops = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            if not line.startswith(("aten::", "prims::", "_")) and "::" not in line:
                raise ValueError(f"{path}: bad op name {line!r}; expected 'namespace::op[.overload]'")
            ops.add(line)
    return frozenset(ops)


class OpProfile:
    """A resolved profile; `allows` is memoised per OpOverload because it sits on the dispatch hot path."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "full":
            self.ops: frozenset[str] | None = None
        else:
            path = PROFILE_DIR / f"{name}.txt"
            if not path.exists():
                path = Path(name)
            if not path.is_file():
                raise ValueError(
                    f"unknown sim op profile {name!r}: expected one of {', '.join(profile_names())} "
                    "or a path to a profile file"
                )
            self.ops = read_profile(path) | ALWAYS_ALLOWED
        self._cache: dict[torch._ops.OpOverload, bool] = {}

    def allows(self, func: torch._ops.OpOverload) -> bool:
        hit = self._cache.get(func)
        if hit is None:
            if self.ops is None:
                hit = True
            else:
                name = func._schema.name
                hit = name in self.ops or op_name(func) in self.ops
            self._cache[func] = hit
        return hit

    def __len__(self) -> int:
        return 0 if self.ops is None else len(self.ops)


def op_name(func: torch._ops.OpOverload) -> str:
    """'aten::add.Tensor' style name; the default overload is just 'aten::add'."""
    ov = func._overloadname
    return func._schema.name if ov == "default" else f"{func._schema.name}.{ov}"


_profile = OpProfile(os.environ.get(OPS_ENV, "young"))


def get_op_profile() -> OpProfile:
    return _profile


def set_op_profile(name: str) -> None:
    global _profile
    _profile = OpProfile(name)


@contextmanager
def op_profile(name: str) -> Iterator[None]:
    """Run the block with another op profile (``full``, ``young``, or a file path)."""
    global _profile
    prev, _profile = _profile, OpProfile(name)
    try:
        yield
    finally:
        _profile = prev


def unsupported_error(func: torch._ops.OpOverload) -> NotImplementedError:
    name = op_name(func)
    return NotImplementedError(
        f"Could not run '{name}' with arguments from the 'sim' backend. This could be because the "
        f"operator doesn't exist for this backend, or was omitted during the selective/custom build "
        f"process. '{name}' is not in the sim op profile '{_profile.name}' "
        f"(set {OPS_ENV}=full to allow every op)."
    )
