"""A row on its way through one model's run: the `Measurement` fields its producers set so far.

Every part of the pipeline that decides row fields (the reference side, the target side, the comparison, the
mode, attribution, the follow-ups, the timing) hands them over as a `RowDraft`. Its names are `Measurement`'s own
(the field list has one home, `harness.results.rows`): setting a name that is no field, or a value of the wrong
kind, raises `RowFieldError` where it is set, not when the row is built at the end; reading one raises too (a
misspelt ``row.get("graphs")`` would otherwise be None forever). It is a mapping of the fields *set*, because the
merge rules go by what a run measured (a follow-up's fields replace the row's only where it set them), and
`row` reads them typed (unset ones at their defaults, as the finished `Measurement` has them).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

from harness.results.rows import Measurement, column_types


class RowFieldError(TypeError):
    """A row field that `Measurement` does not have, or a value its type does not take."""


def _kinds() -> dict[str, tuple[type, bool, Any]]:
    """Field -> (base type, whether None is allowed, a maker of its default)."""
    hints = typing.get_type_hints(Measurement)
    out = {}
    for f in dataclasses.fields(Measurement):
        optional = type(None) in typing.get_args(hints[f.name])
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory
        else:
            value = "" if f.default is dataclasses.MISSING else f.default  # model_id, outcome: "" until decided
            default = (lambda v: lambda: v)(value)
        out[f.name] = (column_types(Measurement)[f.name], optional, default)
    return out


_KINDS = _kinds()
_ACCEPTS: dict[type, tuple[type, ...]] = {float: (int, float)}  # an int ratio is a float's value; bool is an int


def check(name: str, value: Any) -> None:
    """Raise `RowFieldError` unless `name` is a `Measurement` field that takes `value`."""
    kind = _KINDS.get(name)
    if kind is None:
        raise RowFieldError(f"{name!r} is not a row field (harness.results.rows.Measurement has no such field)")
    base, optional, _ = kind
    if value is None:
        if not optional:
            raise RowFieldError(f"row field {name!r} takes {base.__name__}, not None")
    elif not isinstance(value, _ACCEPTS.get(base, base)):
        raise RowFieldError(f"row field {name!r} takes {base.__name__}, not {type(value).__name__}: {value!r:.80}")


class RowDraft(MutableMapping[str, Any]):
    """The `Measurement` fields set so far, each checked as it is set (see the module docstring)."""

    __slots__ = ("_given", "row")

    def __init__(self, fields: Mapping[str, Any] | None = None, /, **more: Any) -> None:
        self.row = Measurement(model_id="", outcome="")  # typed reads: `draft.row.outcome`
        self._given: dict[str, None] = {}  # the names set, in order
        self.update(fields or {}, **more)

    def __setitem__(self, name: str, value: Any) -> None:
        check(name, value)
        setattr(self.row, name, value)
        self._given[name] = None

    def __getitem__(self, name: str) -> Any:
        if name not in self._given:
            if name not in _KINDS:
                raise RowFieldError(f"{name!r} is not a row field (harness.results.rows.Measurement has no such field)")
            raise KeyError(name)
        return getattr(self.row, name)

    def __delitem__(self, name: str) -> None:
        self[name]  # an unset or unknown name raises as a read does
        setattr(self.row, name, _KINDS[name][2]())
        del self._given[name]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._given))

    def __len__(self) -> int:
        return len(self._given)

    def __repr__(self) -> str:
        return f"RowDraft({dict(self)!r})"

    def measurement(self, **own: Any) -> Measurement:
        """The finished row: the fields set, and `own` (the pipeline's: ids, timings), which none may have set."""
        return Measurement(**self, **own)
