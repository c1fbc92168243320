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


def test_sim_slow_fault_keeps_the_device_busy() -> None:
    """The sim's `slow` kind: each launch works (CPU time, not sleep) ``slow_s`` longer."""
    import importlib
    import time

    import harness.sim as sim

    sim_faults = importlib.import_module("harness.sim.faults")  # the package re-exports a `faults()` function

    x = torch.ones(64).to("sim:0")
    with sim.faults("sim:0", slow=1.0, slow_s=0.02):
        c0 = time.process_time()
        for _ in range(5):
            x = x + 1
        busy = time.process_time() - c0
        assert sim.injected_counts()["sim:0"]["slow"] == 5
    assert busy >= 0.1
    assert torch.equal(x.cpu(), torch.full((64,), 6.0))  # slow, not wrong
    parsed = sim_faults.parse_fault_spec("sim:1=slow:1.0@slow_s=0.002")
    assert parsed[1].slow_s == 0.002 and parsed[1].probabilities == {"slow": 1.0}
