"""Each sim behaviour switch works three ways: env var (read at import, so in a subprocess),
function, and context manager; plus the unsupported-op error format and FlexAttention's failure."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import harness.sim as sim
from harness.sim import opset
from harness.sim import precision_mode as precision

UNSUPPORTED = r"^Could not run 'aten::roll' with arguments from the 'sim' backend\. This could be because"


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if (not k.startswith("PORTHARNESS_SIM_") or k == "PORTHARNESS_SIM_NAMESPACE")}
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=120
    )


def _mm_operands() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 32, generator=g), torch.randn(32, 8, generator=g)


def _bf16_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return precision.round_to_bf16(a) @ precision.round_to_bf16(b)


# --- precision ------------------------------------------------------------------------------------


def test_precision_function_and_context_manager():
    a, b = _mm_operands()
    sa, sb = a.to("sim"), b.to("sim")
    prev = sim.get_precision()
    try:
        sim.set_precision("highest")
        assert sim.get_precision() == "highest"
        assert torch.equal((sa @ sb).cpu(), a @ b)
        sim.set_precision("default")
        got = (sa @ sb).cpu()
        assert torch.equal(got, _bf16_reference(a, b))
        assert not torch.equal(got, a @ b)
    finally:
        sim.set_precision(prev)
    with sim.precision("highest"):
        assert torch.equal((sa @ sb).cpu(), a @ b)
        with sim.precision("default"):
            assert sim.get_precision() == "default"
        assert sim.get_precision() == "highest"
    assert sim.get_precision() == prev
    with pytest.raises(ValueError, match="unknown sim precision 'tf32'"):
        sim.set_precision("tf32")
    assert sim.settings()["precision"] == prev


def test_precision_env_var():
    code = (
        "import torch, harness.sim as sim\n"
        "a = torch.randn(8, 16); b = torch.randn(16, 4)\n"
        "print(sim.get_precision(), torch.equal((a.to('sim') @ b.to('sim')).cpu(), a @ b))\n"
    )
    r = _python(code, {"PORTHARNESS_SIM_PRECISION": "highest"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["highest", "True"]
    bad = _python("import harness.sim", {"PORTHARNESS_SIM_PRECISION": "fast"})
    assert bad.returncode != 0 and "unknown sim precision 'fast'" in bad.stderr


def test_default_precision_rounds_only_multiplier_operands():
    a, b = _mm_operands()
    bias = torch.randn(8) * 1e-3
    with sim.precision("default"):
        got = torch.addmm(bias.to("sim"), a.to("sim"), b.to("sim")).cpu()
        elementwise = (a.to("sim") * 1.001).cpu()
    assert torch.equal(got, torch.addmm(bias, precision.round_to_bf16(a), precision.round_to_bf16(b)))
    assert torch.equal(elementwise, a * 1.001)  # non-matmul ops stay fp32


def test_default_precision_sees_every_kind_of_write():
    # The multiplier must see a weight as it is now, whichever way it was last written.
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 8, bias=False).to("sim")
    x = torch.randn(4, 32).to("sim")

    def expected() -> torch.Tensor:
        return _bf16_reference(x.cpu(), lin.weight.detach().cpu().t())

    with sim.precision("default"), torch.no_grad():
        assert torch.equal(lin(x).cpu(), expected())
        lin.weight.mul_(-2.0)  # in-place through the parameter
        assert torch.equal(lin(x).cpu(), expected())
        lin.weight.data.add_(1.0)  # through .data (a separate version counter)
        assert torch.equal(lin(x).cpu(), expected())
        lin.weight.copy_(torch.randn(8, 32))  # host -> device copy
        assert torch.equal(lin(x).cpu(), expected())
        lin.weight.t()[3].fill_(0.5)  # through a view
        assert torch.equal(lin(x).cpu(), expected())
        lin.weight.data = torch.randn(8, 32, device="sim")  # rebinding
        assert torch.equal(lin(x).cpu(), expected())
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    with sim.precision("default"):
        lin(x).sum().backward()
        opt.step()  # foreach in-place update
        with torch.no_grad():
            assert torch.equal(lin(x).cpu(), expected())


# --- op profile -----------------------------------------------------------------------------------


def test_unsupported_op_error_format():
    x = torch.ones(4, device="sim")
    with sim.op_profile("young"), pytest.raises(NotImplementedError, match=UNSUPPORTED) as info:
        torch.roll(x, 1)
    assert "not in the sim op profile 'young'" in str(info.value)
    assert "PORTHARNESS_SIM_OPS=full" in str(info.value)


def test_op_profile_function_and_context_manager(tmp_path):
    x = torch.arange(4.0, device="sim")
    prev = sim.get_op_profile().name
    try:
        sim.set_op_profile("full")
        assert torch.equal(torch.roll(x, 1).cpu(), torch.tensor([3.0, 0.0, 1.0, 2.0]))
        assert sim.settings()["ops"] == "full"
        sim.set_op_profile("young")
        with pytest.raises(NotImplementedError, match=UNSUPPORTED):
            torch.roll(x, 1)
    finally:
        sim.set_op_profile(prev)
    with sim.op_profile("full"):
        torch.roll(x, 1)
    assert sim.get_op_profile().name == prev
    # a profile file: only what it lists (plus the always-allowed plumbing)
    path = tmp_path / "tiny.txt"
    path.write_text("# just addition\naten::add.Tensor\n")
    with sim.op_profile(str(path)):
        assert torch.equal((x + x).cpu(), torch.arange(4.0) * 2)
        with pytest.raises(NotImplementedError, match="Could not run 'aten::mul.Tensor'"):
            x * x
    with pytest.raises(ValueError, match="unknown sim op profile"):
        sim.set_op_profile("adult")
    assert "young" in sim.profile_names() and "full" in sim.profile_names()


def test_default_overload_entries_do_not_allow_other_overloads(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("aten::sum.default\n")
    x = torch.ones(2, 3, device="sim")
    with sim.op_profile(str(path)):
        assert x.sum().item() == 6
        with pytest.raises(NotImplementedError, match="aten::sum.dim_IntList"):
            x.sum(dim=0)


def test_op_profile_env_var():
    code = (
        "import torch, harness.sim as sim\n"
        "print(sim.get_op_profile().name, torch.roll(torch.arange(3.0, device='sim'), 1).cpu().tolist())\n"
    )
    r = _python(code, {"PORTHARNESS_SIM_OPS": "full"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split(" ", 1) == ["full", "[2.0, 0.0, 1.0]\n"]
    young = _python(code, {"PORTHARNESS_SIM_OPS": "young"})
    assert young.returncode != 0 and "Could not run 'aten::roll'" in young.stderr


def test_young_profile_is_generated_and_sized_like_a_young_backend():
    prof = opset.OpProfile("young")
    assert 380 <= len(prof) <= 600
    text = (opset.PROFILE_DIR / "young.txt").read_text()
    assert "GENERATED by scripts/build_op_profile.py" in text
    assert "aten::addmm.default" in prof.ops and "aten::add_.Tensor" in prof.ops
    assert not any(op.startswith(("aten::roll", "aten::sort.", "aten::_fft_")) for op in prof.ops)


def test_missing_host_kernel_reads_like_a_missing_sim_kernel():
    q = torch.randn(1, 2, 8, 16, device="sim")  # a CUDA-only kernel: the CPU has none to run
    with (
        sim.op_profile("full"),
        pytest.raises(
            NotImplementedError,
            match=(
                r"Could not run 'aten::_scaled_dot_product_efficient_attention' with arguments from the 'sim' "
                r"backend.*host \(CPU\)"
            ),
        ),
    ):
        torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, None, False)


# --- faults (env var; function/context manager are in test_sim_faults.py) -----------------------


def test_faults_env_var():
    code = (
        "import torch, harness.sim as sim\n"
        "print(sim.active_faults()[1].probabilities)\n"
        "print(torch.ones(2, device='sim:0').add(1).cpu().tolist())\n"
        "try:\n"
        "    torch.ones(2, device='sim:1').add(1)\n"
        "except sim.SimDeviceError as e:\n"
        "    print('SimDeviceError', 'sim:1' in str(e))\n"
    )
    r = _python(code, {"PORTHARNESS_SIM_FAULTS": "sim:1=error:1.0@seed=3"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["{'error': 1.0}", "[2.0, 2.0]", "SimDeviceError True"]
    bad = _python("import harness.sim", {"PORTHARNESS_SIM_FAULTS": "sim:0=melt:1.0"})
    assert bad.returncode != 0 and "PORTHARNESS_SIM_FAULTS" in bad.stderr and "melt" in bad.stderr


# --- FlexAttention --------------------------------------------------------------------------------


def test_flex_attention_on_sim_tensors_fails_naming_it():
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 2, 8, 16, device="sim")
    with pytest.raises(ValueError, match="FlexAttention is only supported on"):
        flex_attention(q, q, q)


def test_transformers_flex_attention_model_fails_naming_it():
    from transformers import AutoConfig, AutoModel

    cfg = AutoConfig.for_model(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
    )
    model = AutoModel.from_config(cfg, attn_implementation="flex_attention").to("sim")
    # transformers compiles the block mask with Inductor (which serves sim), then FlexAttention itself
    # refuses the device; on 'young' the block mask's sort comes first, a missing op of its own
    with sim.op_profile("full"), pytest.raises(Exception, match="FlexAttention is only supported on") as info:
        model(torch.randint(0, 64, (1, 8)).to("sim"))
    assert "AssertionError" not in str(info.value)


# --- planted slowdowns ----------------------------------------------------------------------------


def test_slow_ops_spec_and_switch():
    from harness.sim.slowdown import parse_slow_ops

    assert parse_slow_ops("aten::_softmax:3, aten::add.Tensor:1.5") == {"aten::_softmax": 3.0, "aten::add.Tensor": 1.5}
    for bad in ("softmax:3", "aten::_softmax", "aten::_softmax:0.5", "aten::_softmax:x"):
        with pytest.raises(ValueError, match="expected 'aten::op:FACTOR'"):
            parse_slow_ops(bad)
    x = torch.randn(4, 64)
    with sim.slow_ops("aten::softmax:4"):  # names the kernel under the composite too
        assert sim.get_slow_ops() == {"aten::softmax": 4.0}
        got = torch.softmax(x.to("sim"), -1).cpu()
    assert sim.get_slow_ops() == {} and torch.equal(got, torch.softmax(x, -1))  # slower, never different


def _python_calls_per_forward(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Python functions of sim's own (harness/sim) entered during one forward: its ops' callbacks."""
    calls, home = 0, os.path.dirname(sim.__file__)

    def prof(frame, event, arg) -> None:
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.startswith(home):
            calls += 1

    sys.setprofile(prof)
    try:
        model(x)
    finally:
        sys.setprofile(None)
    return calls


def test_with_every_switch_off_no_op_enters_python() -> None:
    """Issue 27: one C++ path per op; Python only while a switch needs it (here: a fault on the device
    and a planted numerics bug, each of which must show up, so the count can fail)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 8), torch.nn.Softmax(-1)).to("sim")
    x = torch.randn(4, 32, device="sim")
    model(x)  # warm: lazy initialisations on first use are not per-op costs
    assert _python_calls_per_forward(model, x) == 0
    with sim.faults("sim:0", nan=0.0):
        assert _python_calls_per_forward(model, x) > 0  # the fault check calls back into Python
    with sim.numerics_bugs("softmax-no-max", "gelu-mixup"):  # kernels of their own, in Python
        model(x)
        assert _python_calls_per_forward(model, x) > 0
    assert _python_calls_per_forward(model, x) == 0
