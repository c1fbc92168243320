"""Tiny transformers models on sim (``young`` profile): bit-identical to CPU at ``highest``, a small
but measurable drift at ``default`` (bf16-rounded matmul inputs)."""

from __future__ import annotations

import copy

import pytest
import torch

import harness.sim as sim

transformers = pytest.importorskip("transformers")

SMALL = {
    "bert": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=256,
        max_position_embeddings=64,
    ),
    "llama": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
    ),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64),
}
HEADS = {"bert": "AutoModelForMaskedLM", "llama": "AutoModelForCausalLM", "gpt2": "AutoModelForCausalLM"}


@pytest.fixture(scope="module", params=sorted(SMALL))
def pair(request):
    name = request.param
    cfg = transformers.AutoConfig.for_model(
        name, bos_token_id=1, eos_token_id=2, pad_token_id=0, **SMALL[name]
    )
    torch.manual_seed(0)
    cpu = getattr(transformers, HEADS[name]).from_config(cfg, attn_implementation="sdpa").eval()
    dev = copy.deepcopy(cpu).to("sim")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # padding exercises the mask path
    with torch.no_grad():
        ref = cpu(input_ids=ids, attention_mask=mask).logits
    return name, dev, ids, mask, ref


def _logits(dev, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        out = dev(input_ids=ids.to("sim"), attention_mask=mask.to("sim")).logits
    assert out.device.type == "sim"
    return out.cpu()


def test_matches_cpu_exactly_at_highest(pair):
    name, dev, ids, mask, ref = pair
    with sim.precision("highest"), sim.op_profile("young"):
        got = _logits(dev, ids, mask)
    torch.testing.assert_close(got, ref, rtol=0, atol=0, msg=name)


def test_default_precision_drifts_measurably_but_little(pair):
    name, dev, ids, mask, ref = pair
    with sim.precision("default"), sim.op_profile("young"):
        got = _logits(dev, ids, mask)
        again = _logits(dev, ids, mask)  # second call hits the cached rounded weights
    torch.testing.assert_close(again, got, rtol=0, atol=0)
    err = (got - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err > 1e-5 * scale, f"{name}: default precision should not be bit-exact (err {err})"
    assert err < 5e-2 * scale, f"{name}: default precision drift too large (err {err}, scale {scale})"


def test_generate_on_sim_matches_cpu_at_highest(pair):
    name, dev, ids, mask, ref = pair
    if name == "bert":
        pytest.skip("masked LM: no generation")
    cpu = copy.deepcopy(dev).cpu()
    with torch.no_grad():
        want = cpu.generate(input_ids=ids[:1], max_new_tokens=4, do_sample=False)
        with sim.precision("highest"), sim.op_profile("young"):
            got = dev.generate(input_ids=ids[:1].to("sim"), max_new_tokens=4, do_sample=False)
    assert torch.equal(got.cpu(), want)
