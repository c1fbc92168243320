"""pytest plugin for torchcts 0.4.1 runs (``-p cts_speedups``, as scripts/cts_table.py loads it): two
collection hot spots memoized, with the same answers.

Profiled on the ``complete`` template, two thirds of a 23-minute collection went to
``torchcts.op_metadata._validation_metadata`` (it rebuilds the versions collected for each of ~5,500 ops
from the whole metadata table, normalizing ~160 million version strings) and much of the rest to
``torch.testing._internal.common_utils.extract_test_fn`` walking every frame with ``inspect``. The first
is a pure function of the metadata table, cached here per table object; the second is replaced by the
same frame walk without ``inspect``'s source lookups.
"""

from __future__ import annotations

import sys
import unittest

import torch.testing._internal.common_utils as _common_utils
import torchcts.op_metadata as _op_metadata

_validation_metadata = _op_metadata._validation_metadata
_memo: dict[int, tuple[object, dict]] = {}


def _memoized_validation_metadata(metadata: dict | None = None) -> dict:
    data = metadata if metadata is not None else _op_metadata.load_op_metadata()
    hit = _memo.get(id(data))
    if hit is None or hit[0] is not data:  # a new table at a reused id
        hit = _memo[id(data)] = (data, _validation_metadata(data))
    return {"collected_versions": list(hit[1]["collected_versions"])}


def _extract_test_fn() -> object:
    try:
        frame = sys._getframe(1)
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, unittest.TestCase):
                *_, cls_name, test_name = owner.id().rsplit(".", 2)
                if cls_name == type(owner).__name__ and test_name.startswith("test"):
                    return getattr(owner, test_name).__func__
            frame = frame.f_back
    except Exception:  # as torch's: no test function rather than an error
        pass
    return None


_op_metadata._validation_metadata = _memoized_validation_metadata
_common_utils.extract_test_fn = _extract_test_fn
