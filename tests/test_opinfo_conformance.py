"""OpInfo conformance at ``highest``: every OpInfo's samples give bit-identical results on sim and CPU.

One test per OpInfo in ``op_db``. A sample that needs an op outside the ``young`` profile is
skipped (coverage is tested elsewhere), so an OpInfo whose samples all need such ops is skipped.
The default run takes the first `LIMIT` samples per op; ``-m slow`` runs every sample. Known
mismatches are in `XFAIL`, strict, so a fix shows up as an unexpected pass. Random ops are compared
too: CPU and sim are seeded alike and sim:N draws from a CPU generator. Ops never compared (they
return uninitialized memory, ...) are in ``harness.sim.conformance.EXCLUDED``.

Needs ``expecttest`` (``torch.testing._internal`` imports it).
"""

from __future__ import annotations

import pytest

pytest.importorskip("expecttest", reason="torch.testing._internal (OpInfo op_db) needs expecttest")

from harness.sim import conformance  # noqa: E402

LIMIT = 3

# OpInfo id -> why sim differs from CPU there. Empty: every mismatch found so far was fixed in sim
# or is an op outside 'young' (the LAPACK-backed linalg ops that differ -- PyTorch asks LAPACK for
# singular vectors whenever the input is a tensor subclass -- need ops 'young' excludes).
XFAIL: dict[str, str] = {}

_DB = conformance.op_db()


def _params(slow: bool) -> list:
    out = []
    for op in _DB:
        oid = conformance.opinfo_id(op)
        marks = [pytest.mark.xfail(strict=True, reason=XFAIL[oid])] if oid in XFAIL else []
        if slow:
            marks.append(pytest.mark.slow)
        out.append(pytest.param(op, id=oid, marks=marks))
    return out


def _check(op, limit: int | None) -> None:
    results = conformance.run_op(op, limit=limit, mode="highest", exact=True, profile="young")
    failed = [r for r in results if r.status == "failed"]
    if failed:
        pytest.fail(
            "; ".join(f"sample {i}: {r.reason}" for i, r in enumerate(results) if r.status == "failed")
        )
    if not any(r.status == "passed" for r in results):
        pytest.skip(sorted({r.reason for r in results})[0] if results else "no samples")


@pytest.mark.parametrize("op", _params(slow=False))
@pytest.mark.long
def test_opinfo_matches_cpu_exactly(op):
    _check(op, LIMIT)


@pytest.mark.parametrize("op", _params(slow=True))
def test_opinfo_matches_cpu_exactly_all_samples(op):
    _check(op, None)


def test_the_exact_comparison_can_fail():
    # Guard against a comparison that passes everything: a deliberately wrong "sim" result.
    import torch

    got = torch.ones(3, device="sim")
    ok, why, err = conformance.compare(got, torch.tensor([1.0, 1.0, 1.0 + 2**-20]), rtol=0, atol=0)
    assert not ok and err > 0
    ok, _, _ = conformance.compare(got.cpu(), torch.ones(3), rtol=0, atol=0)
    assert not ok  # an output that is not on sim is a failure too
