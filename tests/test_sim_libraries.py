"""sim driven the way libraries drive an accelerator: accelerate's own parameter moves and cpu/disk
offload, offload and cache clearing by hand, save_pretrained/from_pretrained, generation with a static
cache, torch.compile, training on the second device, tied weights, autocast. Tiny models come from
`harness.models.tiny.build_tiny`."""

from __future__ import annotations

import warnings

import pytest
import torch

import harness.sim as sim

transformers = pytest.importorskip("transformers")

from harness.models.tiny import build_tiny  # noqa: E402  (after the transformers check)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        yield


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() dedups tied ones


def _tied(model: torch.nn.Module) -> bool:
    return model.lm_head.weight is model.transformer.wte.weight


def test_parameters_on_sim_are_plain_parameters():
    lin = torch.nn.Linear(2, 2).to("sim")
    assert type(lin.weight) is torch.nn.Parameter and lin.weight.device == torch.device("sim:0")
    assert type(lin.weight.data) is torch.Tensor
    # what accelerate does to re-place a parameter: rebuild it by its type, on any device
    rebuilt = type(lin.weight)(lin.weight.data.to("sim:1"), requires_grad=lin.weight.requires_grad)
    assert type(rebuilt) is torch.nn.Parameter and rebuilt.device == torch.device("sim:1")


def test_accelerate_moves_parameters_to_meta_and_back():
    accelerate_utils = pytest.importorskip("accelerate.utils")
    lin = torch.nn.Linear(2, 2).to("sim")
    weight = lin.weight.detach().cpu()
    accelerate_utils.set_module_tensor_to_device(lin, "weight", "meta")
    assert lin.weight.device.type == "meta" and type(lin.weight) is torch.nn.Parameter
    accelerate_utils.set_module_tensor_to_device(lin, "weight", "sim:1", value=weight)
    assert lin.weight.device == torch.device("sim:1") and torch.equal(lin.weight.detach().cpu(), weight)


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_accelerate_offload_round_trip(tmp_path, kind):
    accelerate = pytest.importorskip("accelerate")
    model = build_tiny("gpt2", "causal-lm").eval()
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    if kind == "cpu":
        accelerate.cpu_offload(model, execution_device=torch.device("sim:1"))
    else:
        accelerate.disk_offload(model, str(tmp_path / "offload"), execution_device=torch.device("sim:1"))
    with torch.no_grad(), sim.precision("highest"):
        out = model(input_ids=ids.to("sim:1")).logits
    assert out.device == torch.device("sim:1")
    torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=0)


def test_accelerate_style_offload_and_cache_clearing():
    model = build_tiny("gpt2", "causal-lm")
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    base = torch.accelerator.memory_allocated(1)
    torch.accelerator.reset_peak_memory_stats(1)
    model.to("sim:1")  # onload
    assert _tied(model)
    assert torch.accelerator.memory_allocated(1) == base + _param_bytes(model)  # the tied weight counts once
    with torch.no_grad(), sim.precision("highest"):
        out = model(input_ids=ids.to("sim:1")).logits
    torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=0)
    del out
    torch.accelerator.synchronize()
    model.cpu()  # offload: the device memory is free again, the ties survive
    torch.accelerator.empty_cache()
    assert torch.accelerator.memory_allocated(1) == base
    assert torch.accelerator.max_memory_allocated(1) > base + _param_bytes(model)  # the activations peaked
    assert _tied(model) and model.lm_head.weight.device.type == "cpu"
    for block in model.transformer.h:  # block by block, as offload hooks move them
        block.to("sim:1")
        assert torch.accelerator.memory_allocated(1) > base
        block.to("cpu")
    assert torch.accelerator.memory_allocated(1) == base


def test_save_pretrained_and_from_pretrained_round_trip(tmp_path):
    model = build_tiny("gpt2", "causal-lm").to("sim:1")
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight.mul_(2)  # on-device state the files must carry
    model.save_pretrained(tmp_path)  # safetensors: shared-storage check on device data pointers
    assert (tmp_path / "model.safetensors").exists()
    loaded = type(model).from_pretrained(tmp_path).to("sim")
    assert _tied(loaded)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert b.device.type == "sim"
        torch.testing.assert_close(b.cpu(), a.cpu(), rtol=0, atol=0, msg=name)


def test_generate_with_a_static_cache_matches_cpu():
    cpu = build_tiny("llama", "causal-lm")
    dev = build_tiny("llama", "causal-lm").to("sim")
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=5, do_sample=False, cache_implementation="static")
    with sim.precision("highest"):
        out = dev.generate(ids.to("sim"), attention_mask=torch.ones_like(ids).to("sim"), **kwargs)
    ref = cpu.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    assert out.device.type == "sim"
    assert out.cpu().tolist() == ref.tolist()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_forward_matches_cpu(backend):
    cpu = build_tiny("gpt2", "causal-lm")
    dev = build_tiny("gpt2", "causal-lm").to("sim")
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    compiled = torch.compile(dev, backend=backend)
    with torch.no_grad(), sim.precision("highest"):
        out = compiled(input_ids=ids.to("sim")).logits
        again = compiled(input_ids=ids.to("sim")).logits
        ref = cpu(input_ids=ids).logits
    assert out.device.type == "sim" and type(out) is torch.Tensor
    torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=0)
    torch.testing.assert_close(again.cpu(), ref, rtol=0, atol=0)


def test_inductor_generates_kernels_for_sim_and_matmuls_keep_its_precision():
    from torch._inductor.utils import run_and_get_code

    cpu = build_tiny("gpt2", "causal-lm").eval()
    dev = build_tiny("gpt2", "causal-lm").eval().to("sim:1")
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    compiled = torch.compile(dev)  # default backend: Inductor
    with torch.no_grad():
        with sim.precision("highest"):
            out, code = run_and_get_code(compiled, input_ids=ids.to("sim:1"))
        with sim.precision("default"):
            rounded, eager = compiled(input_ids=ids.to("sim:1")).logits, dev(input_ids=ids.to("sim:1")).logits
        ref = cpu(input_ids=ids).logits
    assert out.logits.device == torch.device("sim:1")
    assert "cpp_fused" in code[0] and "device='sim:1'" in code[0]  # generated C++ kernels, buffers on sim:1
    torch.testing.assert_close(out.logits.cpu(), ref)  # fused fp32 code: within fp32 rounding of eager
    # matmuls are ATen calls from compiled code too: at default they see bf16 operands, as in eager mode
    assert (rounded.cpu() - ref).abs().max() > 100 * (out.logits.cpu() - ref).abs().max()
    torch.testing.assert_close(rounded.cpu(), eager.cpu())


@pytest.mark.long
def test_a_planted_compiler_bug_changes_compiled_sim_code_only(tmp_path, monkeypatch):
    """erf-tanh rewrites erf in Inductor's code for sim graphs: exact GELU comes out as tanh GELU when
    compiled for sim, never eagerly, never on the CPU, and not after the switch is off (the FX graph
    cache keys the planted pass apart)."""
    from harness.sim.inductor import compiler_bugs, get_compiler_bugs

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x = torch.linspace(-4, 4, 257)
    exact, tanh = torch.nn.functional.gelu(x), torch.nn.functional.gelu(x, approximate="tanh")

    def f(t):
        return torch.nn.functional.gelu(t) * 2

    def compiled(t):
        torch._dynamo.reset()
        return torch.compile(f)(t).cpu()

    with compiler_bugs("erf-tanh"):
        bugged, on_cpu, eager = compiled(x.to("sim")), compiled(x), f(x.to("sim")).cpu()
    assert get_compiler_bugs() == ()
    clean = compiled(x.to("sim"))
    torch.testing.assert_close(bugged, 2 * tanh, rtol=1e-5, atol=1e-5)
    assert (bugged - 2 * exact).abs().max() > 1e-4
    for t in (on_cpu, eager, clean):
        torch.testing.assert_close(t, 2 * exact, rtol=1e-5, atol=1e-5)  # compiled erf: a few e-6 off eager


def test_training_on_the_second_device_matches_cpu():
    cpu = build_tiny("gpt2", "causal-lm").train()
    dev = build_tiny("gpt2", "causal-lm").train().to("sim:1")
    for m in (cpu, dev):
        m.config.resid_pdrop = m.config.embd_pdrop = m.config.attn_pdrop = 0.0
        for mod in m.modules():
            if isinstance(mod, torch.nn.Dropout):
                mod.p = 0.0
    opt_cpu = torch.optim.AdamW(cpu.parameters(), lr=1e-2)
    opt_dev = torch.optim.AdamW(dev.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        ids = torch.randint(0, 100, (2, 8), generator=gen)
        with sim.precision("highest"):
            loss_dev = dev(input_ids=ids.to("sim:1"), labels=ids.to("sim:1")).loss
            loss_dev.backward()
            opt_dev.step()
            opt_dev.zero_grad()
        loss_cpu = cpu(input_ids=ids, labels=ids).loss
        loss_cpu.backward()
        opt_cpu.step()
        opt_cpu.zero_grad()
        torch.testing.assert_close(loss_dev.detach().cpu(), loss_cpu.detach(), rtol=1e-6, atol=1e-6)
    assert _tied(dev) and dev.lm_head.weight.device == torch.device("sim", 1)
    for (name, p_cpu), p_dev in zip(cpu.named_parameters(), dev.parameters(), strict=True):
        torch.testing.assert_close(p_dev.detach().cpu(), p_cpu.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_tied_weights_stay_tied_and_get_their_gradient():
    gpt2 = build_tiny("gpt2", "causal-lm")
    for move in (lambda m: m.to("sim"), lambda m: m.to("sim:1"), lambda m: m.half(), lambda m: m.float(),
                 lambda m: m.cpu(), lambda m: m.to("sim")):
        move(gpt2)
        assert _tied(gpt2)
    t5 = build_tiny("t5", "seq2seq-lm").to("sim")
    assert t5.shared.weight is t5.encoder.embed_tokens.weight is t5.decoder.embed_tokens.weight
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(4)).to("sim")
    t5(input_ids=ids, labels=ids).loss.backward()
    assert t5.shared.weight.grad is not None and t5.shared.weight.grad.device.type == "sim"
    assert t5.shared.weight.grad.abs().sum().item() > 0


def test_autocast_uses_cudas_op_lists():
    g = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(4, 8, generator=g), torch.randn(3, 8, generator=g), torch.randn(3, generator=g)
    xs, ws, bs = x.to("sim"), w.to("sim"), b.to("sim")
    with torch.autocast("sim", dtype=torch.bfloat16), sim.precision("highest"):
        y = torch.nn.functional.linear(xs, ws, bs)  # matmul family: bf16
        p = torch.softmax(y, -1)  # reductions / softmax: fp32
        s = y.sum()
        mixed = torch.addcmul(y, xs[:, :3], xs[:, :3])  # promote: the widest type
        ln = torch.nn.functional.layer_norm(y, (3,))
    assert (y.dtype, p.dtype, s.dtype, mixed.dtype, ln.dtype) == (
        torch.bfloat16, torch.float32, torch.float32, torch.float32, torch.float32
    )
    ref = torch.nn.functional.linear(x.bfloat16(), w.bfloat16(), b.bfloat16())
    torch.testing.assert_close(y.cpu(), ref, rtol=0, atol=0)
    torch.testing.assert_close(p.cpu(), torch.softmax(ref.float(), -1), rtol=0, atol=0)
    assert (ws.float() @ xs.t()).dtype == torch.float32  # outside the region nothing is cast
    lin = torch.nn.Linear(8, 3).to("sim")
    with torch.autocast("sim", dtype=torch.bfloat16):
        loss = lin(xs).float().pow(2).mean()
    loss.backward()
    assert lin.weight.grad.dtype == torch.float32 and lin.weight.grad.device.type == "sim"


@pytest.mark.long
def test_inductor_serves_sim_when_it_compiled_for_the_cpu_before_sim_was_imported():
    """Inductor registers its devices once, at its first compile: sim imported after a CPU compile must
    still get its code generators (it failed with InductorError KeyError 'sim')."""
    import subprocess
    import sys

    code = ("import torch\n"
            "torch.compile(lambda x: torch.tanh(x) * 2)(torch.randn(8))\n"
            "import harness.sim\n"
            "x = torch.randn(8)\n"
            "y = torch.compile(lambda x: torch.sin(x) + 1)(x.to('sim'))\n"
            "assert y.device.type == 'sim', y\n"
            "torch.testing.assert_close(y.cpu(), torch.sin(x) + 1)  # generated code: within fp32 rounding\n"
            "print('ok')\n")
    env = {k: v for k, v in __import__("os").environ.items() if (not k.startswith("PORTHARNESS_") or k == "PORTHARNESS_SIM_NAMESPACE")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
