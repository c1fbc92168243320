"""Loading tiny, local and hub entries; error mapping.  Real tiny models, no network."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub.file_download import repo_folder_name

from harness.models.load import (
    AttentionUnsupportedError,
    HubUnreachableError,
    LoadedModel,
    LoadError,
    ModelNotFoundError,
    RemoteCodeRequiredError,
    load_model,
)
from harness.models.model_list import ModelEntry
from harness.models.tiny import build_tiny

BERT = ModelEntry(id="tiny/bert/masked-lm", source="tiny", arch="bert", task="masked-lm")


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def tiny_bert() -> torch.nn.Module:
    return build_tiny("bert", "masked-lm", seed=0)


def test_tiny_weights_depend_only_on_seed(tiny_bert: torch.nn.Module) -> None:
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    again = build_tiny("bert", "masked-lm", seed=0)
    assert torch.equal(torch.get_rng_state(), state), "building must not consume the caller's RNG"
    assert same_weights(tiny_bert, again)
    assert not same_weights(tiny_bert, build_tiny("bert", "masked-lm", seed=1))


def test_load_tiny(tiny_bert: torch.nn.Module) -> None:
    loaded = load_model(BERT)
    assert isinstance(loaded, LoadedModel)
    assert loaded.entry is BERT and loaded.config is loaded.model.config
    assert not loaded.model.training
    assert next(loaded.model.parameters()).device.type == "cpu"
    assert loaded.load_time_s > 0
    assert same_weights(loaded.model, tiny_bert)


def test_dtype_and_attn_implementation_pass_through() -> None:
    loaded = load_model(BERT, dtype=torch.float64, attn_implementation="eager")
    assert next(loaded.model.parameters()).dtype == torch.float64
    assert loaded.model.config._attn_implementation == "eager"
    flex = load_model(BERT, attn_implementation="flex_attention")
    assert flex.model.config._attn_implementation == "flex_attention"


def test_flex_unsupported_is_its_own_error() -> None:
    gpt2 = ModelEntry(id="tiny/gpt2/base", source="tiny", arch="gpt2", task="base")
    with pytest.raises(AttentionUnsupportedError, match="flex_attention") as info:
        load_model(gpt2, attn_implementation="flex_attention")
    assert isinstance(info.value, LoadError) and info.value.__cause__ is not None


def test_local_round_trip_is_exact(tmp_path: Path, tiny_bert: torch.nn.Module) -> None:
    tiny_bert.save_pretrained(tmp_path / "ckpt")
    entry = ModelEntry(id="mine", source="local", arch="bert", task="masked-lm", path=str(tmp_path / "ckpt"))
    loaded = load_model(entry)
    assert same_weights(loaded.model, tiny_bert)
    assert not loaded.model.training


def test_local_missing_path_and_config(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="not a directory"):
        load_model(ModelEntry(id="x", source="local", task="base", path=str(tmp_path / "nope")))
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_model(ModelEntry(id="x", source="local", task="base", path=str(tmp_path)))


def test_local_broken_config_chains_cause(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(LoadError, match="could not load") as info:
        load_model(ModelEntry(id="x", source="local", task="base", path=str(tmp_path)))
    assert info.value.__cause__ is not None


def test_remote_code_required(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "my-custom",
        "auto_map": {"AutoConfig": "configuration_x.XConfig", "AutoModel": "modeling_x.XModel"},
    }))
    with pytest.raises(RemoteCodeRequiredError, match="trust_remote_code=true"):
        load_model(ModelEntry(id="x", source="local", task="base", path=str(tmp_path)))


def put_in_hf_cache(src: Path, repo_id: str, cache: Path) -> None:
    """Lay out ``src`` as huggingface_hub's cache does after a download of ``repo_id``."""
    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in src.iterdir():
        shutil.copy(f, snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("PORTHARNESS_HF_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_offline_from_cache(tmp_path: Path, offline_cache: Path, tiny_bert: torch.nn.Module) -> None:
    tiny_bert.save_pretrained(tmp_path / "src")
    put_in_hf_cache(tmp_path / "src", "portharness-test/tiny-bert", offline_cache)
    loaded = load_model(ModelEntry(id="portharness-test/tiny-bert", source="hub", task="masked-lm"))
    assert same_weights(loaded.model, tiny_bert)
    assert not loaded.model.training


def test_hub_offline_uncached_says_what_to_do(offline_cache: Path) -> None:
    entry = ModelEntry(id="portharness-test/not-cached", source="hub", task="base")
    with pytest.raises(HubUnreachableError) as info:
        load_model(entry)
    msg = str(info.value)
    assert "HF_HUB_OFFLINE=0" in msg and "huggingface-cli download portharness-test/not-cached" in msg
    assert info.value.__cause__ is not None


@pytest.mark.long
def test_tiny_weights_identical_in_another_process(tiny_bert: torch.nn.Module) -> None:
    import subprocess
    import sys

    code = (
        "import hashlib, torch\n"
        "from harness.models.tiny import build_tiny\n"
        "m = build_tiny('bert', 'masked-lm', seed=0)\n"
        "h = hashlib.sha256()\n"
        "for k, v in sorted(m.state_dict().items()):\n"
        "    h.update(k.encode()); h.update(v.numpy().tobytes())\n"
        "print(h.hexdigest())\n"
    )
    import hashlib

    h = hashlib.sha256()
    for k, v in sorted(tiny_bert.state_dict().items()):
        h.update(k.encode())
        h.update(v.numpy().tobytes())
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True)
    assert out.stdout.strip().splitlines()[-1] == h.hexdigest()
