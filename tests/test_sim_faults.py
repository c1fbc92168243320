"""Injected device faults: every kind, per-device isolation, determinism under a seed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import harness.sim as sim
from harness.sim import fault_injection as sim_faults


@pytest.fixture(autouse=True)
def _healthy_devices():
    sim.clear_faults()
    yield
    sim.clear_faults()


def _x(device: str = "sim:0") -> torch.Tensor:
    return torch.arange(1.0, 9.0).reshape(2, 4).to(device)


def test_nan_fills_fresh_outputs_but_never_inputs_or_views():
    x = _x()
    with sim.faults("sim:0", nan=1.0):
        y = x * 2
        v = x.view(8)  # a view aliases x: filling it would corrupt x
        i = x.argmax()  # integer output: nothing to fill
    assert torch.isnan(y.cpu()).all()
    assert torch.equal(v.cpu(), torch.arange(1.0, 9.0))
    assert torch.equal(x.cpu(), torch.arange(1.0, 9.0).reshape(2, 4))
    assert i.item() == 7
    assert (x * 2).isfinite().all()  # the block restored a healthy device


def test_garbage_overwrites_outputs_with_large_finite_values():
    x = _x()
    with sim.faults("sim:0", garbage=1.0):
        y = (x + 1).cpu()
    assert torch.isfinite(y).all()
    assert y.abs().max() > 100
    assert not torch.equal(y, torch.arange(2.0, 10.0).reshape(2, 4))


def test_error_raises_sim_device_error():
    x = _x()
    sim.set_faults("sim:0", error=1.0)
    with pytest.raises(sim.SimDeviceError, match="sim:0: device error") as info:
        x.exp()
    assert isinstance(info.value, RuntimeError)
    assert sim.injected_counts()["sim:0"]["error"] == 1
    sim.clear_faults("sim:0")
    assert x.exp().isfinite().all()


def test_hang_sleeps_for_hang_s():
    x = _x()
    with sim.faults("sim:0", hang=1.0, hang_s=0.3):
        t0 = time.perf_counter()
        y = x + 1
        elapsed = time.perf_counter() - t0
    assert 0.3 <= elapsed < 5
    assert torch.equal(y.cpu(), _x().cpu() + 1)  # a hang that ends still computes the right thing


def test_crash_kills_the_process_with_sigsegv():
    env = {k: v for k, v in os.environ.items() if (not k.startswith("PORTHARNESS_SIM_") or k == "PORTHARNESS_SIM_NAMESPACE")}
    env["PORTHARNESS_SIM_FAULTS"] = "sim:0=crash:1.0"
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch, harness.sim\nx = torch.ones(2, device='sim') + 1\nprint('alive')",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == -signal.SIGSEGV
    assert "alive" not in r.stdout


def _nan_pattern(seed: int, n: int = 60) -> list[bool]:
    x = _x()
    with sim.faults("sim:0", nan=0.3, seed=seed):
        return [bool(torch.isnan((x + i).cpu()).any()) for i in range(n)]


def test_faults_are_deterministic_under_a_seed():
    a, b, c = _nan_pattern(11), _nan_pattern(11), _nan_pattern(12)
    assert a == b
    assert a != c
    assert 5 < sum(a) < 35  # about 30% of launches


def test_faults_on_one_device_leave_the_other_alone():
    sim.set_faults("sim:1", nan=1.0, error=0.0)
    healthy = _x("sim:0") * 3
    sick = _x("sim:1") * 3
    assert torch.isfinite(healthy.cpu()).all()
    assert torch.isnan(sick.cpu()).all()
    assert "sim:0" not in sim.injected_counts()
    assert sim.injected_counts()["sim:1"]["nan"] >= 1


def test_fault_spec_parsing_and_validation():
    parsed = sim_faults.parse_fault_spec("sim:1=nan:1.0,error:0.1;sim:0=hang:0.5@seed=3@hang_s=2")
    assert parsed[1].probabilities == {"nan": 1.0, "error": 0.1}
    assert parsed[0].hang_s == 2.0
    with pytest.raises(ValueError, match="unknown sim fault kind"):
        sim.set_faults("sim:0", melt=1.0)
    with pytest.raises(ValueError, match="not in \\[0, 1\\]"):
        sim.set_faults("sim:0", nan=2.0)
    with pytest.raises(ValueError, match="only be injected on sim devices"):
        sim.set_faults("cpu", nan=1.0)
