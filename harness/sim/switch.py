"""The one shape every sim switch has: a value, applied to the backend on each change, read with
``get``, replaced with ``set``, and replaced for a block with ``scoped`` (restored after, even when the
block raises). Each switch module validates and parses its own arguments into a value and keeps its
public ``get_X`` / ``set_X`` / ``X()`` API as thin wrappers over one `Switch`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")


class Switch(Generic[T]):
    """A switch's value and the function that makes the backend follow it (native state, kernels)."""

    def __init__(self, apply: Callable[[T], object], value: T) -> None:
        self._apply = apply
        apply(value)
        self._value = value

    def get(self) -> T:
        return self._value

    def set(self, value: T) -> None:
        """Apply `value` (first, so a failing apply leaves the old value in force) and keep it."""
        if value is self._value or value == self._value:
            return
        self._apply(value)
        self._value = value

    @contextmanager
    def scoped(self, value: T, restore: Callable[[T, T], T] | None = None) -> Iterator[None]:
        """`value` for the block; after it the previous value, or ``restore(previous, current)`` for a
        switch that puts back only part of its state (one device's faults, one device's memory size)."""
        prev = self._value
        self.set(value)
        try:
            yield
        finally:
            self.set(prev if restore is None else restore(prev, self._value))
