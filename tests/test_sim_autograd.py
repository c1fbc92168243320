"""Autograd through sim matches CPU bit for bit at ``highest``; in-place ops through views, out=
resizes and in-place metadata changes behave as on a real device."""

from __future__ import annotations

import pytest
import torch

import harness.sim as sim


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.LayerNorm(16),
        torch.nn.GELU(),
        torch.nn.Dropout(0.0),
        torch.nn.Linear(16, 4),
        torch.nn.LogSoftmax(-1),
    )


def test_backward_matches_cpu_exactly_at_highest():
    cpu = _net()
    dev = _net().to("sim")
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    target = torch.tensor([0, 1, 2, 3, 0])
    with sim.precision("highest"):
        loss_dev = torch.nn.functional.nll_loss(dev(x.to("sim")), target.to("sim"))
        loss_dev.backward()
    loss_cpu = torch.nn.functional.nll_loss(cpu(x), target)
    loss_cpu.backward()
    torch.testing.assert_close(loss_dev.detach().cpu(), loss_cpu.detach(), rtol=0, atol=0)
    for (name, p_cpu), p_dev in zip(cpu.named_parameters(), dev.parameters(), strict=True):
        assert p_dev.grad is not None and p_dev.grad.device.type == "sim", name
        torch.testing.assert_close(p_dev.grad.cpu(), p_cpu.grad, rtol=0, atol=0, msg=name)


def test_input_gradient():
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    xs = x.to("sim").requires_grad_()
    (xs.sin() * xs).sum().backward()
    assert xs.grad.device == torch.device("sim", 0)
    torch.testing.assert_close(xs.grad.cpu(), x.cos() * x + x.sin(), rtol=0, atol=0)


@pytest.mark.parametrize("index", [1, 0])
def test_backward_on_every_device(index):
    # The autograd engine runs sim:N's backward on its worker for device N, which the native device
    # guard must report (torch's Python-registered guard knows one device: an engine assert).
    cpu = _net()
    dev = _net().to(f"sim:{index}")
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(6))
    with sim.precision("highest"):
        dev(x.to(f"sim:{index}")).sum().backward()
    cpu(x).sum().backward()
    for (name, p_cpu), p_dev in zip(cpu.named_parameters(), dev.parameters(), strict=True):
        assert p_dev.grad.device == torch.device("sim", index), name
        torch.testing.assert_close(p_dev.grad.cpu(), p_cpu.grad, rtol=0, atol=0, msg=name)
    assert torch.sim.current_device() == 0  # the engine's device threads did not move this thread


def test_attention_with_a_mask_that_needs_grad():
    # T5-style learned position bias: the mask requires grad, which rules out the fused CPU kernel.
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    bias = torch.randn(1, 2, 5, 5, generator=g, requires_grad=True)
    bias_s = bias.detach().to("sim").requires_grad_()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    with sim.precision("highest"):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.to("sim"), k.to("sim"), v.to("sim"), attn_mask=bias_s
        )
        out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), rtol=0, atol=0)
    torch.testing.assert_close(bias_s.grad.cpu(), bias.grad, rtol=0, atol=0)


def test_inplace_through_views_reaches_the_base():
    base_cpu = torch.zeros(4, 6)
    base = torch.zeros(4, 6, device="sim")
    for b in (base_cpu, base):
        b[1].add_(1.0)
        b.t()[2].mul_(3.0).add_(2.0)
        b.view(24)[5:9].fill_(-1.0)
        b[:, ::2].sub_(0.5)
        b.narrow(0, 3, 1).copy_(torch.arange(6.0).to(b.device))
    torch.testing.assert_close(base.cpu(), base_cpu, rtol=0, atol=0)
    same = base.add_(1)
    assert same is base  # in-place ops hand back the caller's own tensor


def test_out_and_inplace_metadata_changes_update_the_tensor():
    assert torch.arange(5, device="sim").shape == (5,)  # arange fills a resized out= tensor
    with sim.op_profile("full"):  # out= variants are not in 'young'
        _check_out_and_inplace_metadata()


def _check_out_and_inplace_metadata() -> None:
    out = torch.empty(0, device="sim")
    torch.add(torch.ones(2, 3, device="sim"), 1, out=out)
    assert out.shape == (2, 3) and torch.equal(out.cpu(), torch.full((2, 3), 2.0))
    x = torch.zeros(3, device="sim")
    x.unsqueeze_(0)
    assert x.shape == (1, 3) and x.stride() == x.cpu().stride()
    x.resize_(2, 2)
    assert x.shape == (2, 2)
    y = torch.arange(6.0, device="sim")
    y.as_strided_((2, 2), (1, 2))
    assert torch.equal(y.cpu(), torch.arange(6.0).as_strided((2, 2), (1, 2)))


def test_batch_norm_updates_running_stats_and_returns_sim_tensors():
    torch.manual_seed(0)
    bn_cpu = torch.nn.BatchNorm1d(4)
    bn = torch.nn.BatchNorm1d(4).to("sim")
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(4))
    out = bn(x.to("sim"))
    assert out.device.type == "sim"
    torch.testing.assert_close(out.detach().cpu(), bn_cpu(x).detach(), rtol=0, atol=0)
    torch.testing.assert_close(bn.running_var.cpu(), bn_cpu.running_var, rtol=0, atol=0)


def test_optimizer_step_matches_cpu():
    cpu = _net()
    dev = _net().to("sim")
    opt_cpu = torch.optim.AdamW(cpu.parameters(), lr=1e-2)
    opt_dev = torch.optim.AdamW(dev.parameters(), lr=1e-2)  # foreach kernels, as on any accelerator
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(5))
    with sim.precision("highest"):
        for _ in range(2):
            dev(x.to("sim")).sum().backward()
            opt_dev.step()
            opt_dev.zero_grad()
    for _ in range(2):
        cpu(x).sum().backward()
        opt_cpu.step()
        opt_cpu.zero_grad()
    for p_cpu, p_dev in zip(cpu.parameters(), dev.parameters(), strict=True):
        torch.testing.assert_close(p_dev.detach().cpu(), p_cpu.detach(), rtol=1e-6, atol=1e-7)


def test_host_conversions():
    t = torch.tensor([1.5, 2.5], device="sim")
    assert t.tolist() == [1.5, 2.5]
    assert f"{torch.tensor(3, device='sim')}" == "3"  # 0-dim formats as its value, as on CUDA
    assert torch.tensor(2.0, device="sim").item() == 2.0
    try:
        t.numpy()
    except TypeError as e:
        assert "Use Tensor.cpu()" in str(e)
    else:
        raise AssertionError("numpy() of a device tensor must fail")
    assert "device='sim:0'" in repr(t)


@pytest.mark.parametrize("index", [0, 1])
def test_an_op_failing_inside_backward_raises_instead_of_aborting(tmp_path, index):
    # An error in an op the autograd engine runs on its device thread reaches backward()'s caller
    # (with torch's Python-registered device guard it aborted the process).
    x = torch.randn(4, 3, device=f"sim:{index}", requires_grad=True)
    with sim.op_profile("full"):
        y = x.sigmoid().sum()
    forward_only = tmp_path / "forward_only.txt"
    forward_only.write_text("aten::ones_like\naten::expand\naten::fill_\naten::empty_like\n")
    with (
        sim.op_profile(str(forward_only)),
        pytest.raises(NotImplementedError, match="aten::sigmoid_backward"),
    ):
        y.backward()
    with sim.op_profile("full"):
        z = (x * 3).sin().sum()
        with sim.faults(f"sim:{index}", error=1.0, seed=1):
            with pytest.raises(sim.SimDeviceError):
                z.backward()
        assert (x * 1).isfinite().all()  # the device works again
