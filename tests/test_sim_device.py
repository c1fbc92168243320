"""sim as a PyTorch device: registration, the torch.sim device module, RNG, the same-device rule.

Subprocess tests cover what is fixed at import time (device count, autoload entry point).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import harness.sim as sim


def _python(
    code: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("PORTHARNESS_SIM_", "TORCH_DEVICE")) or k == "PORTHARNESS_SIM_NAMESPACE"}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=timeout
    )


# --- registration --------------------------------------------------------------------------------


def test_factory_creates_sim_tensor():
    t = torch.ones(2, device="sim")
    assert t.device == torch.device("sim", 0)
    assert t.device.type == "sim"
    assert t.is_sim
    assert not t.is_cpu
    assert torch.equal(t.cpu(), torch.ones(2))
    assert t.cpu().device.type == "cpu"


def test_to_second_device_and_back():
    x = torch.arange(6.0).reshape(2, 3)
    t = x.to("sim:1")
    assert t.device == torch.device("sim", 1)
    assert torch.equal(t.to("cpu"), x)
    u = t.to("sim:0")
    assert u.device == torch.device("sim", 0)
    assert torch.equal(u.cpu(), x)


def test_module_to_sim_and_back():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    ref = m(torch.ones(1, 3)).detach()  # no live graph: Module.to swaps parameters in place
    m.to("sim")
    assert all(p.device.type == "sim" and p.is_sim for p in m.parameters())
    with sim.precision("highest"):
        out = m(torch.ones(1, 3, device="sim"))
    assert out.device.type == "sim"
    assert torch.equal(out.detach().cpu(), ref.detach())
    m.cpu()
    assert all(p.device.type == "cpu" for p in m.parameters())


def test_module_conversions_move_the_data_too():
    # Module.half()/.to("sim:1") rebind param.data; the host memory must follow the metadata.
    m = torch.nn.Linear(4, 4).to("sim")
    m.half()
    assert m.weight.dtype == torch.float16
    assert m.weight.cpu().dtype == torch.float16
    m.to("sim:1")
    assert m.weight.device == torch.device("sim", 1)
    assert (m.weight.float() + torch.zeros(4, device="sim:1")).device == torch.device("sim", 1)
    p = torch.nn.Parameter(torch.ones(2, device="sim"))
    p.data = torch.zeros(2, device="sim")
    assert p.sum().item() == 0


def test_device_count_default_and_index_check():
    if "PORTHARNESS_SIM_DEVICES" not in os.environ:
        assert torch.sim.device_count() == 2
    n = torch.sim.device_count()
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ones(1, device=f"sim:{n}")


def test_device_count_env_var():
    r = _python(
        "import torch, harness.sim\n"
        "print(torch.sim.device_count())\n"
        "print(torch.ones(1, device='sim:3').device)\n"
        "try:\n"
        "    torch.ones(1, device='sim:4')\n"
        "except RuntimeError as e:\n"
        "    print('refused', 'out of range' in str(e))\n",
        env={"PORTHARNESS_SIM_DEVICES": "4"},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:3] == ["4", "sim:3", "refused True"]
    bad = _python("import harness.sim", env={"PORTHARNESS_SIM_DEVICES": "zero"})
    assert bad.returncode != 0
    assert "PORTHARNESS_SIM_DEVICES='zero'" in bad.stderr


@pytest.mark.long
def test_autoload_entry_point_is_opt_in():
    # No harness import: with PORTHARNESS_SIM_AUTOLOAD=1 the torch.backends entry point registers sim
    # inside `import torch`; without it, importing torch leaves PrivateUse1 free for other backends.
    code = (
        "import torch\nprint(torch.ones(1, device='sim').device, torch._C._get_privateuse1_backend_name())\n"
    )
    r = _python(code, env={"PORTHARNESS_SIM_AUTOLOAD": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["sim:0", "sim"]
    off = _python(code, env={"PORTHARNESS_SIM_AUTOLOAD": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert off.returncode != 0
    assert "sim" in off.stderr and "device type" in off.stderr
    plain = _python("import torch\nprint(torch._C._get_privateuse1_backend_name())\n",
                    env={"PORTHARNESS_SIM_AUTOLOAD": ""})
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.split() == ["privateuseone"]


# --- the device module ----------------------------------------------------------------------------


def test_manual_seed_is_deterministic():
    torch.sim.manual_seed(123)
    a = torch.randn(5, device="sim")
    torch.sim.manual_seed(123)
    b = torch.randn(5, device="sim")
    torch.sim.manual_seed(124)
    c = torch.randn(5, device="sim")
    assert torch.equal(a.cpu(), b.cpu())
    assert not torch.equal(a.cpu(), c.cpu())


def test_manual_seed_touches_only_the_current_device_and_seed_all_touches_all():
    torch.sim.manual_seed_all(7)
    before = torch.sim.get_rng_state("sim:1")
    torch.sim.manual_seed(99)  # current device is sim:0
    assert torch.equal(torch.sim.get_rng_state("sim:1"), before)
    torch.sim.manual_seed_all(5)
    a = torch.rand(4, device="sim:0")
    b = torch.rand(4, device="sim:1")
    assert torch.equal(a.cpu(), b.cpu())  # same seed, independent generators


def test_rng_state_roundtrip():
    torch.sim.manual_seed(1)
    state = torch.sim.get_rng_state()
    a = torch.randn(8, device="sim")
    torch.sim.set_rng_state(state)
    b = torch.randn(8, device="sim")
    assert torch.equal(a.cpu(), b.cpu())
    states = torch.sim.get_rng_state_all()
    assert len(states) == torch.sim.device_count()
    x = torch.rand(3, device="sim:1")
    torch.sim.set_rng_state_all(states)
    assert torch.equal(torch.rand(3, device="sim:1").cpu(), x.cpu())


def test_torch_manual_seed_seeds_sim():
    torch.manual_seed(2024)
    a = torch.randn(6, device="sim")
    d = torch.nn.functional.dropout(torch.ones(64, device="sim"), 0.5)
    torch.manual_seed(2024)
    b = torch.randn(6, device="sim")
    e = torch.nn.functional.dropout(torch.ones(64, device="sim"), 0.5)
    assert torch.equal(a.cpu(), b.cpu())
    assert torch.equal(d.cpu(), e.cpu())
    # sim:N draws from its own CPU generator, seeded like torch.Generator().manual_seed(seed)
    assert torch.equal(a.cpu(), torch.randn(6, generator=torch.Generator().manual_seed(2024)))


def test_current_and_set_device():
    assert torch.sim.current_device() == 0
    try:
        torch.sim.set_device(1)
        assert torch.sim.current_device() == 1
        assert torch.ones(1, device="sim").device == torch.device("sim", 1)
    finally:
        torch.sim.set_device(0)
    with torch.sim.device(1):
        assert torch.empty(2, device="sim").device.index == 1
    assert torch.sim.current_device() == 0
    with pytest.raises(RuntimeError, match="out of range"):
        torch.sim.set_device(torch.sim.device_count())
    assert torch.sim.is_available()
    assert "sim" in torch.sim.get_device_name()


# --- same-device rule -----------------------------------------------------------------------------


def test_sim_and_cpu_tensor_in_one_op_fail_like_cuda():
    s = torch.ones(3, device="sim")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device.*sim:0 and cpu"):
        s + torch.ones(3)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.ones(2, 3) @ torch.ones(3, 2, device="sim")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.cat([s, torch.ones(3)])


def test_two_sim_devices_in_one_op_fail():
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device.*sim:0 and sim:1"):
        torch.ones(3, device="sim:0") * torch.ones(3, device="sim:1")
    with pytest.raises(RuntimeError, match="same device"):
        torch.stack([torch.ones(1, device="sim:1"), torch.ones(1, device="sim:0")])


def test_zero_dim_cpu_scalars_and_host_indices_are_allowed():
    s = torch.ones(3, device="sim")
    out = s * torch.tensor(2.0) + torch.tensor(1.0)
    assert out.device.type == "sim"
    assert torch.equal(out.cpu(), torch.full((3,), 3.0))
    # as on CUDA, index tensors may stay on the host
    assert torch.equal(torch.arange(5, device="sim")[torch.tensor([4, 0])].cpu(), torch.tensor([4, 0]))


def test_copies_between_devices_are_allowed():
    dst = torch.zeros(3, device="sim:1")
    dst.copy_(torch.ones(3, device="sim:0"))
    assert torch.equal(dst.cpu(), torch.ones(3))
    host = torch.zeros(3)
    host.copy_(torch.full((3,), 2.0, device="sim"))
    assert torch.equal(host, torch.full((3,), 2.0))
