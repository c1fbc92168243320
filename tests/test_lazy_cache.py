"""State a forward leaves on a model's modules (a tensor cached lazily in a plain attribute, as Mimi's codebook
keeps `_embed`) is the CPU reference's: the target gets the model as loaded, not the CPU's cache, which
`.to(device)` does not move. Before, tiny/mimi/base crashed on sim ("X1 and X2 must have the same device type")
whenever the reference ran in the worker and passed when it came from the reference cache: a flaky row."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from harness.models.load import forget_lazy, lazy_slots


class Codebook(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_sum = torch.nn.Buffer(torch.randn(4, 3))
        self._embed = None  # built at the first forward, on whatever device the buffer is then

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._embed is None:
            self._embed = self.embed_sum * 2
        return torch.cdist(x[None], self._embed[None])[0]


def test_a_lazily_built_cache_is_emptied_and_nothing_else_is_touched() -> None:
    model = torch.nn.Sequential(Codebook())
    model[0].name = None  # a None that stays None: nothing to reset
    slots = lazy_slots(model)
    assert ("0", "_embed") in slots and ("0", "name") in slots
    model(torch.randn(2, 3))
    assert isinstance(model[0]._embed, torch.Tensor)
    buffer = model[0].embed_sum
    assert forget_lazy(model, slots) == ["0._embed"]
    assert model[0]._embed is None and model[0].embed_sum is buffer and model[0].name is None
    assert forget_lazy(model, slots) == []


@pytest.mark.long
def test_mimi_runs_on_sim_after_its_reference_ran_in_the_same_process(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PORTHARNESS_") or k == "PORTHARNESS_SIM_NAMESPACE"}
    r = subprocess.run([sys.executable, "-m", "harness.cli", "check", "tiny/mimi/base", "--target", "sim",
                        "--precision", "highest", "--ops", "full", "--no-ref-cache", "--json"],
                       capture_output=True, text=True, timeout=600, env=env)
    row = json.loads(r.stdout)
    assert row["outcome"] == "pass", (row["outcome"], row.get("error_message"))
