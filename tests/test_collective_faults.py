"""Collectives under one bad rank: scenario parsing, the straggler rule, and the measured scenarios."""

from __future__ import annotations

import pytest
import torch

from harness.comms.shaped import _FutureWork


def test_shaped_work_wait_raises_failed_future() -> None:
    """A blocking shaped collective whose message failed raises (it used to return, with stale data)."""
    fut: torch.futures.Future = torch.futures.Future()
    work = _FutureWork(fut)
    assert not work.is_completed()
    fut.set_exception(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        work.wait()
    ok: torch.futures.Future = torch.futures.Future()
    ok.set_result([torch.ones(1)])
    assert _FutureWork(ok).wait() and _FutureWork(ok).get_future() is ok
