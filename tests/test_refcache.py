"""The reference cache: its key, its entries under truncation, concurrent writers and kill -9, and cold
against warm runs of real models through the real pipeline (verdicts identical, reference phases skipped).

The default suite drives the store and the pipeline in this process (writers and killed writers are real
processes forked from it); the same guarantees through the CLI, a list in train mode over shard DBs and a
real run killed mid-write are `-m slow`."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from conftest import LIST_HEADER, list_rows

from harness.backends import adapter_for
from harness.cli import main as cli_main
from harness.models.inputs import make_inputs
from harness.models.load import load_model
from harness.models.model_list import find_entry
from harness.run import refkey
from harness.run.pipeline import Task, run_one
from harness.run.refcache import RefCache, prune, scan
from harness.run.refkey import NoKey, components, key_of

# Row fields that may differ between two runs of one model whatever the cache does.
_RUN_FIELDS = {"phases", "wall_time_s", "peak_rss_mb", "load_time_s", "ref_time_s", "target_time_s", "expected_time_s",
               "ref_cache", "run_id", "run_started_at", "finished_at", "attempts", "traceback", "repro_path"}


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def _check(*args: str) -> tuple[int, dict]:
    r = _cli("check", *args, "--json")
    start = r.stdout.find("{")
    assert start >= 0, r.stderr[-3000:]
    return r.returncode, json.loads(r.stdout[start:])


def _verdict(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in _RUN_FIELDS}


def _warm(row: dict) -> None:
    """A row whose reference side came from the cache: its reference phases ran for no time at all."""
    assert row["ref_cache"] == "cached", row["ref_cache"]
    cached = {name: p for name, p in row["phases"].items() if p.get("cached")}
    assert {"reference", "oracle"} <= set(cached) and all(p["s"] == 0 for p in cached.values()), row["phases"]


# ----------------------------------------------------------------------------------------------------
# the key: every component changes it, what only the target sees does not
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bert():
    entry = find_entry("tiny/bert/base")
    loaded = load_model(entry)
    return entry, loaded.config, make_inputs(loaded.model, loaded.config, entry)


def _parts(bert, **change):
    entry, config, inputs = bert
    args = {"mode": "inference", "contract": "bf16-matmul", "settings": {}, "seed": 0, **change}
    return components(change.pop("entry", entry), change.pop("config", config), change.pop("inputs", inputs),
                      mode=args["mode"], contract=args["contract"], settings=args["settings"], seed=args["seed"])


def test_each_component_changes_the_key(bert, monkeypatch, tmp_path: Path) -> None:
    entry, config, inputs = bert
    base = key_of(_parts(bert))
    assert key_of(_parts(bert)) == base  # the same model, inputs and settings: the same key
    changed = {
        "seed": _parts(bert, seed=1),
        "mode": _parts(bert, mode="train"),
        "contract": _parts(bert, contract="fp32"),
        "dtype": _parts(bert, settings={"dtype": "bf16"}),
        "attention": _parts(bert, settings={"attn": "eager"}),
        "oracle budget": _parts(bert, settings={"oracle_max_params": 10}),
        "inputs": _parts(bert, inputs={**inputs, "input_ids": inputs["input_ids"].flip(-1)}),
        "config": _parts(bert, config=replace_config(config, layer_norm_eps=1e-5)),
        "model": _parts(bert, entry=replace(entry, id="tiny/bert/masked-lm", task="masked-lm")),
    }
    for name, (lib, version) in {"torch": ("torch", "9.9.9"), "transformers": ("transformers", "9.9.9"),
                                 "portharness": ("harness", "9.9.9")}.items():
        with monkeypatch.context() as m:
            m.setattr(sys.modules[lib], "__version__", version)
            changed[f"{name} version"] = _parts(bert)
    with monkeypatch.context() as m:
        m.setattr(refkey, "code_digest", lambda: "another checkout")
        changed["harness code"] = _parts(bert)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        changed["cpu threads"] = _parts(bert)
    finally:
        torch.set_num_threads(threads)
    hub = replace(entry, id="org/model", source="hub", revision="r1")
    changed["hub revision"] = _parts(bert, entry=replace(hub, revision="r2"))
    keys = {name: key_of(parts) for name, parts in changed.items()}
    assert key_of(_parts(bert, entry=hub)) not in (base, keys["hub revision"])
    assert base not in keys.values() and len(set(keys.values())) == len(keys), keys
    # what only the target sees (its matmul precision, sim's op profile, planted bugs, the op check) keeps it
    sim = adapter_for("sim")
    target_only = {"precision": "highest", "ops": "full", "numerics": "approx-exp", "op_check": "off",
                   "fallback": "cpu"}
    assert sim.reference_settings({"attn": "eager", **target_only}) == {"attn": "eager"}
    # a hub model with no revision anywhere cannot be keyed (it may change under the same id)
    with pytest.raises(NoKey, match="no known revision"):
        _parts(bert, entry=replace(hub, revision=None))


def replace_config(config, **values):
    import copy

    c = copy.deepcopy(config)
    for k, v in values.items():
        setattr(c, k, v)
    return c


def test_a_local_checkpoint_is_keyed_by_its_files(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    load_model(find_entry("tiny/gpt2/causal-lm")).model.save_pretrained(d)
    entry = find_entry(str(d))
    loaded = load_model(entry)
    inputs = make_inputs(loaded.model, loaded.config, entry)
    memo = tmp_path / "memo"

    def key() -> str:
        return key_of(components(entry, loaded.config, inputs, mode="inference", contract="fp32", settings={},
                                 seed=0, memo=memo))

    first = key()
    assert len(list(memo.iterdir())) == len([p for p in d.iterdir() if p.is_file()])  # one digest per file
    moved = tmp_path / "elsewhere"
    d.rename(moved)
    entry = replace(entry, id=str(moved), path=str(moved))
    assert key() == first  # the same files elsewhere: the same model
    weights = next(moved.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    assert key() != first  # rewritten in place: the remembered digest no longer applies


# ----------------------------------------------------------------------------------------------------
# the store: corrupt entries, concurrent writers, a writer killed mid-write
# ----------------------------------------------------------------------------------------------------


def _tensors(n: int = 1 << 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"ref/logits": torch.randn(n, generator=g), "ref/mask": torch.ones(3, dtype=torch.bool),
            "oracle/logits": torch.randn(n, generator=g, dtype=torch.float64)}


def test_a_corrupt_entry_is_removed_and_never_trusted(tmp_path: Path) -> None:
    cache = RefCache(tmp_path / "c")
    assert cache.put("ab" * 32, _tensors(), {"oracle_rule": "fp64-copy"}, {}) == "stored"
    hit, note = cache.get("ab" * 32)
    assert note == "" and list(hit.tensors) == list(_tensors()) and hit.meta == {"oracle_rule": "fp64-copy"}
    assert all(torch.equal(hit.tensors[k], v) for k, v in _tensors().items())
    data = cache.path("ab" * 32) / "tensors.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0x40  # same size, one bit off
    data.write_bytes(bytes(raw))
    hit, note = cache.get("ab" * 32)
    assert hit is None and "does not match its checksum" in note and "removed" in note
    assert not cache.path("ab" * 32).exists()
    assert cache.put("ab" * 32, _tensors(), {"oracle_rule": "fp64-copy"}, {}) == "stored"
    index = cache.path("ab" * 32) / "index.json"
    index.write_text(index.read_text().replace('"fp64-copy', '"fp32-copy'))  # the tensors intact, the index lies
    assert cache.get("ab" * 32) == (None, "recomputed: the cached entry was corrupt (ValueError: the index does not "
                                          "match its checksum); removed")


def test_a_truncated_entry_is_removed_and_recomputed(tmp_path: Path) -> None:
    cache = RefCache(tmp_path / "c")
    assert cache.put("ef" * 32, _tensors(), {}, {}) == "stored"
    data = cache.path("ef" * 32) / "tensors.safetensors"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # a copy cut short
    hit, note = cache.get("ef" * 32)
    assert hit is None and note.startswith("recomputed: the cached entry was corrupt (ValueError: tensor file of")
    assert not cache.path("ef" * 32).exists() and scan(tmp_path / "c").partial == []
    (cache.path("ef" * 32)).mkdir(parents=True)  # an entry without its files (a copy that lost them)
    assert cache.get("ef" * 32) == (None, "recomputed: the cached entry was corrupt (a file of the entry is "
                                          "missing); removed")


# Writers are processes forked from this one: the tensors are made here, the children only write files.
_FORK = multiprocessing.get_context("fork")


def _put(root: Path, tensors: dict[str, torch.Tensor], barrier, results) -> None:
    barrier.wait(timeout=60)  # both hold their tensors: they start writing together
    results.put(RefCache(root).put("cd" * 32, tensors, {"writer": os.getpid()}, {}))


def test_two_writers_of_one_key_leave_one_valid_entry(tmp_path: Path) -> None:
    n = 1 << 22  # 48 MiB per entry: the two writes overlap
    tensors = {"ref/x": torch.arange(n, dtype=torch.float32), "oracle/x": torch.arange(n, dtype=torch.float64)}
    barrier, results = _FORK.Barrier(2), _FORK.Queue()
    procs = [_FORK.Process(target=_put, args=(tmp_path / "c", tensors, barrier, results)) for _ in range(2)]
    for proc in procs:
        proc.start()
    said = sorted(results.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    assert said == ["computed (another run stored the same entry meanwhile)", "stored"]
    found = scan(tmp_path / "c")
    assert len(found.entries) == 1 and found.partial == []
    hit, note = RefCache(tmp_path / "c").get("cd" * 32)
    assert note == "" and hit.meta["writer"] in [p.pid for p in procs]
    assert all(torch.equal(hit.tensors[k], v) for k, v in tensors.items())


def _stuck_put(root: Path, tensors: dict[str, torch.Tensor], mid_write: Path) -> None:
    import safetensors.torch

    real = safetensors.torch.save_file

    def stuck(*args, **kwargs):  # the tensors are on disk, the index not yet: then the writer is killed
        real(*args, **kwargs)
        mid_write.touch()
        time.sleep(600)

    safetensors.torch.save_file = stuck
    RefCache(root).put("9a" * 32, tensors, {}, {})


def test_a_writer_killed_mid_write_leaves_nothing_trusted(tmp_path: Path) -> None:
    root, mid_write = tmp_path / "c", tmp_path / "mid-write"
    proc = _FORK.Process(target=_stuck_put, args=(root, _tensors(), mid_write))
    proc.start()
    deadline = time.time() + 120
    while not mid_write.exists() and proc.is_alive() and time.time() < deadline:
        time.sleep(0.01)
    assert mid_write.exists(), proc.exitcode
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=60)
    left = scan(root)
    assert left.entries == [] and len(left.partial) == 1  # the tensors on disk, but not as an entry
    assert RefCache(root).get("9a" * 32) == (None, "")  # a later run finds nothing: it computes
    assert RefCache(root).put("9a" * 32, _tensors(), {}, {}) == "stored"
    assert prune(root)["partial_removed"] == 1  # its writer is gone: removed at once
    after = scan(root)
    assert after.partial == [] and [e.path.name for e in after.entries] == ["9a" * 32]


def _wait_for(paths: list[Path], procs: list[subprocess.Popen]) -> None:
    deadline = time.time() + 300
    while not all(p.exists() for p in paths) and all(p.poll() is None for p in procs) and time.time() < deadline:
        time.sleep(0.01)
    assert all(p.exists() for p in paths), [p.communicate(timeout=10) for p in procs]


_KILLED_RUN = """
import sys, time
from pathlib import Path
import safetensors.torch
real = safetensors.torch.save_file
def stuck(tensors, path, *a, **k):  # the tensors are on disk, the index not yet: then the writer dies
    real(tensors, path, *a, **k)
    Path(sys.argv[2]).touch()
    time.sleep(600)
safetensors.torch.save_file = stuck
from dataclasses import asdict
from harness.models.model_list import find_entry
from harness.run.pipeline import Task, run_one
run_one(Task(entry=asdict(find_entry("tiny/gpt2/base")), target="sim:0", ref_cache=sys.argv[1],
             settings={"precision": "default", "ops": "young"}))
"""


@pytest.mark.slow
def test_a_run_killed_mid_write_leaves_nothing_trusted(tmp_path: Path) -> None:
    cache, mid_write = tmp_path / "c", tmp_path / "mid-write"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_RUN, str(cache), str(mid_write)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for([mid_write], [proc])
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    left = scan(cache)
    assert left.entries == [] and len(left.partial) == 1  # tensors on disk, but not as an entry
    rc, row = _check("tiny/gpt2/base", "--ref-cache", str(cache))
    assert left.partial[0].name.startswith(f".{row['ref_key']}.")  # the later run wanted exactly that entry
    assert row["ref_cache"] == "stored" and "reference" in row["phases"] and rc in (0, 1)
    assert prune(cache, older_than_s=None)["partial_removed"] == 1  # its writer is gone: removed at once
    after = scan(cache)
    assert after.partial == [] and [e.path.name for e in after.entries] == [row["ref_key"]]


# ----------------------------------------------------------------------------------------------------
# cold then warm: the pipeline in this process, then (slow) the CLI
# ----------------------------------------------------------------------------------------------------


def _run(cache: Path, model: str, **settings: object):
    import harness.sim  # noqa: F401  (the sim device in this process)

    return asdict(run_one(Task(entry=asdict(find_entry(model)), target="sim:0", ref_cache=str(cache),
                               settings={"precision": "default", "ops": "young", **settings})))


def test_warm_runs_skip_the_reference_side_and_keep_every_verdict(tmp_path: Path) -> None:
    """A drift (localized with CPU copies rebuilt for it) and a training step (its loss decision cached,
    its step rebuilt), each cold then warm; a truncated entry is recomputed in the run that finds it."""
    cache = tmp_path / "c"
    cold = _run(cache, "tiny/bert/base", declared_precision="fp32")
    assert cold["outcome"] == "drift" and cold["first_drift_module"] and cold["ref_cache"] == "stored"
    assert not any(p.get("cached") for p in cold["phases"].values())
    warm = _run(cache, "tiny/bert/base", declared_precision="fp32")
    _warm(warm)
    assert "localize" in warm["phases"] and _verdict(warm) == _verdict(cold)
    train_cold = _run(cache, "tiny/gpt2/causal-lm", mode="train")
    assert train_cold["loss_kind"] == "model" and train_cold["ref_cache"] == "stored", train_cold["error_message"]
    train_warm = _run(cache, "tiny/gpt2/causal-lm", mode="train")
    _warm(train_warm)
    assert _verdict(train_warm) == _verdict(train_cold)
    data = RefCache(cache).path(cold["ref_key"]) / "tensors.safetensors"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    again = _run(cache, "tiny/bert/base", declared_precision="fp32")
    assert again["ref_cache"].startswith("recomputed: the cached entry was corrupt (ValueError: tensor file of")
    assert again["ref_cache"].endswith("removed; stored") and _verdict(again) == _verdict(cold)
    assert _run(cache, "tiny/bert/base", declared_precision="fp32")["ref_cache"] == "cached"


def test_generate_mode_rebuilds_its_teacher_forced_step_from_the_cached_tokens(tmp_path: Path) -> None:
    """Decoding: the reference's tokens are the mode's decision; a warm run forces them without decoding on
    the CPU, judges every step as the cold run did, and a planted cache bug (a target-only setting) read
    against the same entry is still caught at its step."""
    cache = tmp_path / "c"
    cold = _run(cache, "tiny/gpt2/causal-lm", mode="generate")
    assert cold["outcome"] in ("pass", "pass_declared") and cold["ref_cache"] == "stored", cold["error_message"]
    warm = _run(cache, "tiny/gpt2/causal-lm", mode="generate")
    _warm(warm)
    assert _verdict(warm) == _verdict(cold) and warm["ref_key"] == cold["ref_key"]
    bugged = _run(cache, "tiny/gpt2/causal-lm", mode="generate", numerics="cache-off-by-one")
    _warm(bugged)
    assert bugged["outcome"] == "drift" and bugged["first_drift_step"] == 2, bugged["error_message"]


@pytest.mark.slow
def test_a_warm_drift_is_judged_and_localized_as_a_cold_one_and_a_truncated_entry_recomputed(tmp_path: Path) -> None:
    args = ["tiny/bert/base", "--declared-precision", "fp32", "--ref-cache", str(tmp_path / "c")]
    rc_cold, cold = _check(*args)
    assert cold["outcome"] == "drift" and cold["first_drift_module"] and cold["ref_cache"] == "stored"
    assert not any(p.get("cached") for p in cold["phases"].values())
    rc_warm, warm = _check(*args)
    _warm(warm)
    assert "localize" in warm["phases"]  # the CPU copies it needs were rebuilt for the drift
    assert (rc_warm, _verdict(warm)) == (rc_cold, _verdict(cold))
    data = RefCache(tmp_path / "c").path(cold["ref_key"]) / "tensors.safetensors"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # a copy cut short
    rc, again = _check(*args)
    assert again["ref_cache"].startswith("recomputed: the cached entry was corrupt (ValueError: tensor file of")
    assert again["ref_cache"].endswith("removed; stored") and (rc, _verdict(again)) == (rc_cold, _verdict(cold))


@pytest.mark.slow
def test_a_warm_run_of_a_list_in_train_mode_changes_no_verdict(tmp_path: Path, patho) -> None:
    """Shards of one nightly on one file system: the default cache sits next to their DBs; train mode's loss
    decision is cached and its step rebuilt; a nondeterministic reference is cached as such."""
    lst = tmp_path / "l.csv"
    lst.write_text(LIST_HEADER + list_rows([("gpt2", "causal-lm")]) + patho.rows(dict([patho("noisy-train")])))
    for shard in ("a", "b"):  # the second "night" runs as another shard DB in the same directory
        r = _cli("run", "--list", lst, "--db", tmp_path / f"{shard}.db", "--mode", "train", "--jobs", "1", "--quiet")
        assert r.returncode == 0, r.stderr[-3000:]
    from harness.console import clean_row
    from harness.results.store import ResultStore

    rows = {}
    for shard in ("a", "b"):
        with ResultStore(tmp_path / f"{shard}.db", read_only=True) as st:
            rows[shard] = {r["model_id"]: clean_row(r) for r in st.results().to_dict("records")}
    cold, warm = rows["a"], rows["b"]
    assert {m: r["ref_cache"] for m, r in cold.items()} == {"tiny/gpt2/causal-lm": "stored", "patho/noisy-train": "stored"}
    assert cold["patho/noisy-train"]["outcome"] == "ref_nondeterministic"
    assert cold["tiny/gpt2/causal-lm"]["loss_kind"] == "model"
    for m in cold:
        _warm_row = warm[m]
        assert _warm_row["ref_cache"] == "cached" and _warm_row["phases"]["reference"]["cached"]
        assert {k: v for k, v in _warm_row.items() if k not in _RUN_FIELDS} == \
            {k: v for k, v in cold[m].items() if k not in _RUN_FIELDS}, m
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir() and "cache" in p.name) == ["ref-cache"]
    d = _cli("diff", "--base-db", tmp_path / "a.db", "--head-db", tmp_path / "b.db", "--json")
    assert d.returncode == 0 and json.loads(d.stdout)["unchanged"] == 2, d.stdout[-2000:]
    s = _cli("cache", "stats", "--db", tmp_path / "a.db")
    assert s.returncode == 0 and ": 2 entries" in s.stdout and "train: 2 entries" in s.stdout, s.stdout


def _main(capsys, *argv: object) -> tuple[int, str, str]:
    """The CLI in this process: (exit status, stdout, stderr); argparse's refusals exit 2 as in a shell."""
    try:
        rc = cli_main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_bad_cache_input_is_one_line_and_writes_nothing(tmp_path: Path, capsys) -> None:
    afile = tmp_path / "file"
    afile.write_text("x")
    rc, _, err = _main(capsys, "check", "tiny/bert/base", "--ref-cache", afile / "c")
    assert rc == 2 and err.strip().splitlines()[-1].endswith("a file, not a directory (ENOTDIR); nothing was written"), err
    rc, _, err = _main(capsys, "run", "--list", "tiny-zoo", "--limit", "1", "--db", tmp_path / "r.db",
                       "--ref-cache", afile)
    assert rc == 2 and "exists and is not a directory" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    rc, _, err = _main(capsys, "check", "tiny/bert/base", "--ref-cache", tmp_path / "c", "--no-ref-cache")
    assert rc == 2 and "not allowed with argument" in err
    for args, says in [(("stats", "--ref-cache", tmp_path), "is not a portharness reference cache"),
                       (("stats", "--ref-cache", tmp_path / "none"), "no reference cache at"),
                       (("prune", "--ref-cache", tmp_path), "give --older-than AGE"),
                       (("prune", "--ref-cache", tmp_path, "--max-size", "lots"), "--max-size 'lots': expected"),
                       (("prune", "--ref-cache", tmp_path, "--older-than=-1d"), "--older-than '-1d': expected")]:
        rc, _, err = _main(capsys, "cache", *args)
        assert rc == 2 and says in err and len(err.strip().splitlines()) == 1, (args, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_prune_by_age_then_by_size_least_recently_used_first(tmp_path: Path, capsys) -> None:
    cache = RefCache(tmp_path / "c")
    keys = [f"{i:02d}" * 32 for i in range(3)]
    for i, key in enumerate(keys):
        assert cache.put(key, _tensors(1 << 10), {}, {"mode": "train"}) == "stored"
        os.utime(cache.path(key) / "index.json", (1000.0 * (i + 1),) * 2)  # last used: oldest first
    cache.get(keys[0])  # a hit makes it the most recently used
    rc, out, _ = _main(capsys, "cache", "stats", "--ref-cache", tmp_path / "c")
    assert rc == 0 and ": 3 entries" in out and "train: 3 entries" in out, out
    size = scan(tmp_path / "c").entries[0].bytes
    rc, out, _ = _main(capsys, "cache", "prune", "--ref-cache", tmp_path / "c", "--max-size", size + 1, "--dry-run")
    assert rc == 0 and "would remove 2 entries" in out and len(scan(tmp_path / "c").entries) == 3
    assert prune(tmp_path / "c", max_bytes=size + 1)["removed"] == 2
    assert [e.path.name for e in scan(tmp_path / "c").entries] == [keys[0]]
    assert prune(tmp_path / "c", older_than_s=3600)["removed"] == 0  # just used
    os.utime(cache.path(keys[0]) / "index.json", (1000.0, 1000.0))
    rc, out, _ = _main(capsys, "cache", "prune", "--ref-cache", tmp_path / "c", "--older-than", "30d")
    assert rc == 0 and "removed 1 entries" in out and scan(tmp_path / "c").entries == []
