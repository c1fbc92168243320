"""Models across several chips (issue 43): `--parallel` rows, one process per device, judged as one device's.

Pure rules first (the spec, the device groups), the refusals through the CLI, then few real launches: real
ranks on real sim devices beside the gloo control on the CPU, a bug planted from outside the harness on one
rank's device (tests/planted_bugs.py, PLANTED_RANK), a rank that dies and one that hangs."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import LIST_HEADER, list_rows, rows_done

from harness.parallel.spec import groups, members, parse


def _env() -> dict[str, str]:
    """This test's environment without the run's switches, its own simulated host kept (conftest)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PORTHARNESS_") or k == "PORTHARNESS_SIM_NAMESPACE"}

EXACT = ["--precision", "highest", "--ops", "full"]

SPECS = [
    ("ddp:2", 2, ("ddp",), ("dp",)), ("fsdp:4", 4, ("fsdp",), ("dp",)), ("tp:2", 2, ("tp",), ("tp",)),
    ("fsdp:2,tp:2", 4, ("fsdp", "tp"), ("dp", "tp")), (" ddp:2 , tp:2 ", 4, ("ddp", "tp"), ("dp", "tp")),
]
BAD = [("dp:2", "not KIND:N"), ("fsdp:1", "at least 2"), ("fsdp:2,fsdp:2", "at most once"), ("tp:2,fsdp:2", "2-D spec"),
       ("fsdp:2,tp:2,ddp:2", "2-D spec"), ("", "at most once"), ("tp:x", "not KIND:N")]


# Ray's words for an actor whose process ended, as Ray 2.60 gives them for os._exit(3), SIGKILL and SIGSEGV alike
RAY_DIED = ("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
            "detail: Worker unexpectedly exits with a connection error code 2. End of file. Some common causes "
            "include: (1) the process was killed by the OOM killer due to high memory usage, (2) ray stop --force "
            "was called, or (3) the worker crashed unexpectedly due to SIGSEGV or another unexpected error.")
SEGV_REPORT = "Fatal Python error: Segmentation fault\n\nThread 0x00007f (most recent call first):\n  File ..."
RANK_DEATHS = [  # (the rank's log, Ray's words, killed by the worker) -> returncode as a child's would read
    (SEGV_REPORT, RAY_DIED, False, -11), ("Fatal Python error: Aborted\n", RAY_DIED, False, -6),
    ("", RAY_DIED, False, 1),  # nothing says how: a death, never a guess at the OOM killer (SIGKILL reads as oom)
    ("", RAY_DIED, True, -9),  # stopped by the worker, as a child is killed
    ("", "Task was killed due to the node running low on memory. Memory on the node ...", False, -9),
    (SEGV_REPORT, RAY_DIED, True, -11),  # its own death came first
]


@pytest.mark.parametrize("report,said,killed,code", RANK_DEATHS)
def test_a_ray_rank_actors_death_reads_as_a_childs_returncode(report: str, said: str, killed: bool, code: int) -> None:
    from harness.fleet.rayranks import death_code

    assert death_code(report, said, killed) == code


def _outs(loss: float, grad: float) -> dict:
    import torch

    return {"loss": torch.tensor(loss), "grad/w": torch.full((4,), grad)}


JUDGED = [  # (each rank's outputs, the rank judged, the note says)
    ([_outs(1.0, 2.0), _outs(1.0, 2.0)], 0, "every rank's outputs agree"),
    # FSDP: rank 1's own loss is off, the reduced gradient is off the same on both (the tie goes by the loss)
    ([_outs(1.0, 2.5), _outs(1.2, 2.5)], 1, "judged: rank 1 (sim:1), the furthest from the CPU reference on what differs (loss)"),
    ([_outs(1.3, 2.0), _outs(1.0, 2.0)], 0, "ranks' outputs differ (rank 0, rank 1): the drift is before the collectives"),
]


@pytest.mark.parametrize("outs,judged,said", JUDGED)
def test_where_ranks_differ_the_rank_judged_is_the_furthest_on_what_differs(outs: list, judged: int, said: str) -> None:
    from harness.parallel.launch import Parallel

    par = Parallel("fsdp:2", ["sim:0", "sim:1"], backends=[], dist_backend="gloo", deadline_s=10)
    try:
        par.ranks = [{"rank": 0, "device": "sim:0"}, {"rank": 1, "device": "sim:1"}]
        got = par._judged(outs, _outs(1.0, 2.0))
        assert got is outs[judged] and said in par.note, par.note
    finally:
        par.close()


@pytest.mark.parametrize("text,world,kinds,names", SPECS)
def test_a_spec_reads_as_its_mesh(text: str, world: int, kinds: tuple, names: tuple) -> None:
    spec = parse(text)
    assert spec.world == world and spec.kinds == kinds and spec.mesh_names == names
    assert parse(str(spec)) == spec  # one spelling per run identity


@pytest.mark.parametrize("text,said", BAD)
def test_a_spec_that_does_not_read_says_what_one_is(text: str, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        parse(text)


def test_devices_make_groups_of_the_world_size() -> None:
    assert groups(["sim:0", "sim:1", "sim:2", "sim:3"], 2) == ["sim:0+sim:1", "sim:2+sim:3"]
    assert groups(["sim:0", "sim:1", "sim:2"], 2) == ["sim:0+sim:1"]  # the odd device out runs nothing
    assert groups(["cpu"], 4, shared=True) == ["cpu+cpu+cpu+cpu"]
    assert members("sim:2+sim:3") == ["sim:2", "sim:3"] and members("sim:0") == ["sim:0"]
    with pytest.raises(ValueError, match="needs 4 devices per model, the target has 2"):
        groups(["sim:0", "sim:1"], 4)


def _refused(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    from harness.cli import main as cli_main

    capsys.readouterr()
    assert cli_main([str(a) for a in argv]) == 2, argv
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1, captured.err
    return lines[0]


def test_bad_parallel_input_is_one_line_before_anything_is_written(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for k in [k for k in os.environ if k.startswith("PORTHARNESS_") and k != "PORTHARNESS_SIM_NAMESPACE"]:
        monkeypatch.delenv(k)
    bert = tmp_path / "bert.csv"
    bert.write_text(LIST_HEADER + list_rows([("bert", "base"), ("distilbert", "base")]))
    db = tmp_path / "r.db"
    cases = [
        (["--parallel", "fdsp:2"], "'fdsp:2' is not KIND:N"),
        (["--parallel", "ddp:4"], "needs 4 devices per model, the target has 2"),
        (["--parallel", "tp:2"], "none of the 2 model(s)"),
        (["--parallel", "ddp:2", "--collectives", "skinny"], "only with --parallel and --perf"),
        (["--parallel", "ddp:2", "--perf", "--collectives", "warp:9"], "warp:9"),
        (["--parallel", "ddp:2", "--harvest"], "not with --harvest yet"),
        (["--dist-backend", "gloo"], "only with --parallel"),
        (["--parallel", "ddp:2", "--target", "cuda", "--executor", "ray"], "not with --executor ray on cuda yet"),
    ]
    for extra, said in cases:
        line = _refused(capsys, ["run", "--list", bert, "--db", db, "--quiet", *extra])
        assert said in line, (extra, line)
    line = _refused(capsys, ["ops", "--list", bert, "--db", db, "--parallel", "ddp:2", "--quiet"])
    assert "--parallel" in line, line
    assert not db.exists()


def test_fsdp_units_are_the_outermost_blocks() -> None:
    """A block holding a stack of its own (T5's layer list, a ConvNeXt stage's layers) is one FSDP unit: its
    inner blocks sharded again raised "Cannot concatenate overlapping meshes" on 8 of the 60 smoke models."""
    import torch

    from harness.parallel.wrap import blocks

    def block() -> torch.nn.Module:
        b = torch.nn.Module()
        b.layer = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
        return b

    model = torch.nn.Module()
    model.encoder = torch.nn.ModuleList([block(), block()])
    model.decoder = torch.nn.Module()
    model.decoder.block = torch.nn.ModuleList([block()])
    model.head = torch.nn.ModuleList([torch.nn.Linear(2, 1)])
    shared = block()
    model.shared = torch.nn.ModuleList([shared, shared])  # one block used twice (ALBERT) is one unit
    got = blocks(model)
    assert got == [*model.encoder, model.decoder.block[0], model.head[0], shared]
    flat = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    assert blocks(flat) == [flat[0]]


def test_the_ranks_checkpoint_has_the_config_as_loaded() -> None:
    """Train mode zeroes SpecAugment's mask_time_prob; a checkpoint saved so made the ranks' wav2vec2, hubert and
    wavlm without ``masked_spec_embed`` (3 of the 60 smoke models drifted, the parameter missing on target)."""
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    from harness.run.train import as_loaded, prepare

    config = Wav2Vec2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                            conv_dim=(8,), conv_stride=(5,), conv_kernel=(10,), num_feat_extract_layers=1,
                            mask_time_prob=0.05, num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2)
    model = prepare(Wav2Vec2Model(config))
    assert model.config.mask_time_prob == 0.0
    with as_loaded(model):
        assert model.config.mask_time_prob == 0.05
        rebuilt = Wav2Vec2Model(Wav2Vec2Config.from_dict(model.config.to_dict()))
    assert model.config.mask_time_prob == 0.0
    assert {n for n, _ in rebuilt.named_parameters()} == {n for n, _ in model.named_parameters()}
    with as_loaded(prepare(model)):  # prepared twice: still the value it was loaded with
        assert model.config.mask_time_prob == 0.05


def _run(tmp_path: Path, name: str, pairs: list, *extra: str, env: dict | None = None) -> tuple[int, list[dict], str]:
    lst = tmp_path / f"{name}.csv"
    lst.write_text(LIST_HEADER + list_rows(pairs))
    db = tmp_path / f"{name}.db"
    r = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--list", str(lst), "--db", str(db), "--quiet",
                        "--no-ref-cache", "--retries", "0", *extra], capture_output=True, text=True, timeout=900,
                       env={**_env(), "TMPDIR": str(tmp_path), **(env or {})})  # its ranks' job dirs are under tmp_path
    rows = []
    if db.exists():
        with sqlite3.connect(db) as c:
            c.row_factory = sqlite3.Row
            rows = [dict(x) for x in c.execute("SELECT * FROM results ORDER BY model_id")]
    return r.returncode, rows, r.stderr


def _no_rank_left(tmp_path: Path) -> None:
    """No process of this test's runs is running: no rank, no worker, no forkserver (each run's environment
    has TMPDIR=tmp_path; a forked rank's command line is its forkserver's, so it is found by environment)."""
    mark = f"TMPDIR={tmp_path}".encode()
    left = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if mark in (proc / "environ").read_bytes().split(b"\0"):
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ")[:120]
                left.append(f"{proc.name}: {cmdline!r}")
        except OSError:  # gone, or not ours to read
            continue
    assert not left, f"processes of this test's runs left running: {left}"


@pytest.mark.long
@pytest.mark.parametrize("target", ["sim", "cpu"])
def test_fsdp_training_and_tp_inference_rows_beside_their_gloo_control(tmp_path: Path, target: str) -> None:
    """One list, two ways: FSDP2 training (llama) and tensor-parallel inference (bert has no plan: skipped, not
    failed); on sim and on the CPU over gloo, the same outcomes, judged against one device's CPU reference."""
    exact = EXACT if target == "sim" else []
    rc, rows, err = _run(tmp_path, "fsdp", [("llama", "causal-lm")], "--target", target, "--parallel", "fsdp:2",
                         "--mode", "train", *exact)
    assert rc == 0, err[-3000:]
    (row,) = rows
    assert row["outcome"] == "pass", row["error_message"]
    par = json.loads(row["parallel"])
    assert par["spec"] == "fsdp:2" and [r["phase"] for r in par["ranks"]] == ["done", "done"]
    assert all(r["sharded_params"].startswith(r["sharded_params"].split(" of ")[1]) for r in par["ranks"])  # all
    assert json.loads(row["settings"])["parallel"] == "fsdp:2"  # part of the run's identity
    rc, rows, err = _run(tmp_path, "tp", [("bert", "base"), ("llama", "causal-lm")], "--target", target,
                         "--parallel", "tp:2", *exact)
    assert rc == 0, err[-3000:]
    got = {r["model_id"]: r for r in rows}
    assert got["tiny/bert/base"]["outcome"] == "skipped" and "no tensor-parallel plan" in got["tiny/bert/base"]["error_message"]
    assert got["tiny/llama/causal-lm"]["outcome"] == "pass", got["tiny/llama/causal-lm"]["error_message"]
    assert json.loads(got["tiny/llama/causal-lm"]["parallel"])["ranks"][0]["sharded_params"] != "0 of 0"
    _no_rank_left(tmp_path)


@pytest.mark.long
def test_a_bug_on_one_ranks_device_is_caught_with_the_rank_named_and_a_dead_or_hung_rank_too(tmp_path: Path) -> None:
    """Planted from outside the harness on rank 1 only: a layer norm 1% off drifts and names rank 1 (its
    outputs differ from rank 0's: before the collectives); a SIGSEGV and a hang on rank 1 stop every rank and
    name it; nothing is left running."""
    plant = {"PYTHONPATH": str(Path(__file__).parent), "PLANTED_RANK": "1"}
    base = ["--backend", "planted_bugs", "--parallel", "ddp:2", *EXACT, "--timeout", "120"]  # the hang's: 40 s below (a loaded host loads ranks for 16 s)
    rc, rows, err = _run(tmp_path, "drift", [("bert", "base")], *base, env={**plant, "PLANTED_BUG": "layer_norm:0.01"})
    assert rc == 0, err[-3000:]
    assert rows[0]["outcome"] == "drift" and "judged: rank 1 (sim:1)" in rows[0]["error_message"], rows[0]["error_message"]
    assert rows[0]["first_drift_module"] == "embeddings.LayerNorm", rows[0]["error_message"]  # localized on the ranks
    # tensor parallel: the ranks agree at the output (the reduced result drifts); their modules name rank 1's norm
    rc, rows, err = _run(tmp_path, "tp", [("phi", "causal-lm")], *base[:3], "tp:2", *base[4:],
                         env={**plant, "PLANTED_BUG": "layer_norm:0.01"})
    assert rc == 0, err[-3000:]
    assert rows[0]["outcome"] == "drift" and rows[0]["first_drift_module"] == "model.layers.0.input_layernorm", rows[0]
    assert "first drifting module is model.layers.0.input_layernorm on rank 1 (sim:1)" in rows[0]["error_message"]
    # FSDP2 training: rank 1's own loss drifts, the reduced gradients carry it to every rank: rank 1 is named, and
    # the first parameter whose (unsharded) gradient drifts
    rc, rows, err = _run(tmp_path, "train", [("bert", "base")], *base[:3], "fsdp:2", *base[4:], "--mode", "train",
                         env={**plant, "PLANTED_BUG": "layer_norm:0.01"})
    assert rc == 0, err[-3000:]
    assert rows[0]["outcome"] == "drift" and "judged: rank 1 (sim:1)" in rows[0]["error_message"], rows[0]["error_message"]
    assert rows[0]["first_drift_param"] == "embeddings.word_embeddings.weight", rows[0]["error_message"]
    for how, outcome, said in (("segv", "crash", "rank 1 (sim:1, in phase step) died: SIGSEGV"),
                               ("hang", "timeout", "rank 1 (sim:1, in phase step) did not finish")):
        rc, rows, err = _run(tmp_path, how, [("bert", "base")], *base[:-1], "40",
                             env={**plant, "PLANTED_BUG": f"at_highest:{how}"})
        assert rc == 0, err[-3000:]
        assert rows[0]["outcome"] == outcome and said in rows[0]["error_message"], rows[0]["error_message"]
        _no_rank_left(tmp_path)


@pytest.mark.long
def test_a_bad_chip_in_a_group_is_quarantined_alone_and_a_spare_device_takes_its_place(tmp_path: Path) -> None:
    """Three sim devices, ddp:2: the group sim:0+sim:1 and sim:2 standing by. A kernel planted on the chip sim:1
    (whichever rank runs there) kills its rank: a death on the group with sim:1 at fault; at the first strike
    the group is quarantined naming sim:1 and sim:2 replaces it beside sim:0, where the model passes."""
    env = {"PYTHONPATH": str(Path(__file__).parent), "PLANTED_CHIP": "1", "PLANTED_BUG": "at_highest:segv",
           "PORTHARNESS_SIM_DEVICES": "3"}
    rc, rows, err = _run(tmp_path, "chip", [("bert", "base")], "--backend", "planted_bugs", "--parallel", "ddp:2",
                         *EXACT, "--timeout", "240", "--quarantine-after", "1", env=env)
    assert rc == 0, err[-3000:]
    assert "quarantining sim:0+sim:1" in err and "at fault: sim:1" in err, err[-3000:]
    assert "bringing in hot spare sim:0+sim:2 (the group without sim:1)" in err, err[-3000:]
    (r,) = rows
    assert (r["outcome"], r["device"]) == ("pass", "sim:0+sim:2"), (r["outcome"], r["device"], r["error_message"])
    _no_rank_left(tmp_path)


@pytest.mark.long
def test_ranks_run_compiled_and_under_autocast_as_one_device_does(tmp_path: Path) -> None:
    """--compile: every rank compiles its wrapped model (the row counts rank 0's graphs); --amp: every rank's step
    runs under autocast (before, the ranks ran fp32 and a bf16-autocast row passed at fp32: nothing was cast)."""
    rc, rows, err = _run(tmp_path, "compiled", [("bert", "base")], "--parallel", "fsdp:2", "--mode", "train",
                         "--compile", "aot_eager", *EXACT)
    assert rc == 0, err[-3000:]
    (r,) = rows
    assert r["outcome"] == "pass", r["error_message"]
    assert r["graph_count"] >= 1 and r["compile_s"] > 0, (r["graph_count"], r["compile_s"])
    rc, rows, err = _run(tmp_path, "amp", [("bert", "base")], "--parallel", "ddp:2", "--amp", "bf16", *EXACT)
    assert rc == 0, err[-3000:]
    assert rows[0]["outcome"] == "pass_declared", rows[0]["error_message"]


# -- a list that spreads its models differently (its `parallel` column): the run goes in stages ---------------------

def test_a_models_listed_spread_overrides_the_runs_and_reads_canonically() -> None:
    from harness.parallel.spec import chosen

    table = [("", None, ""), ("", "fsdp:2", "fsdp:2"), ("none", "fsdp:2", ""), ("1", None, ""),
             (" ddp:2", None, "ddp:2"), ("fsdp:2,tp:2", None, "fsdp:2,tp:2"), ("tp:2", "ddp:2", "tp:2")]
    for listed, run, way in table:
        assert chosen("m", listed.strip(), run) == way, (listed, run)
    with pytest.raises(ValueError, match=r"model 'm': its list's parallel cell 'fdsp:2' is not a spec.*or write none"):
        chosen("m", "fdsp:2", None)


def test_stages_run_single_devices_first_then_by_group_size_and_a_quarantined_device_stays_out() -> None:
    from harness.fleet import policy, slots, stages

    ways = {"a": "fsdp:2,tp:2", "b": "", "c": "ddp:2", "d": "", "e": "fsdp:2"}
    assert stages.of(ways) == [("", ["b", "d"]), ("ddp:2", ["c"]), ("fsdp:2", ["e"]), ("fsdp:2,tp:2", ["a"])]
    assert slots.out_of_service("sim:0+sim:1", "sim:1") == ["sim:1"]
    assert slots.out_of_service("sim:0+sim:1", "") == ["sim:0", "sim:1"]
    assert slots.out_of_service("cpu+cpu", "") == ["cpu"]
    devices = [f"sim:{i}" for i in range(5)]
    fleet = policy.Fleet(devices[:4], devices[4:], quarantine_after=1, devices=devices)
    q = policy.quarantine(fleet, "sim:1")  # a single-device stage's bad chip: sim:4 stands in
    assert (q.spare, fleet.gone) == ("sim:4", ["sim:1"])
    nxt = stages.fleet_after(fleet, "ddp:2", 0, shared=False)
    assert (nxt.active, nxt.spares, nxt.quarantined) == (["sim:0+sim:2", "sim:3+sim:4"], [], ["sim:1"])
    q = policy.quarantine(nxt, "sim:0+sim:2")  # no device at fault named: both leave; no spare left for it
    assert q.spare is None and nxt.gone == ["sim:1", "sim:0", "sim:2"]
    assert stages.fleet_after(nxt, "", 0, shared=False).active == ["sim:3", "sim:4"]
    with pytest.raises(ValueError, match="needs 4 devices per model"):
        stages.fleet_after(nxt, "fsdp:2,tp:2", 0, shared=False)


def test_bad_listed_spreads_are_one_line_before_anything_is_written(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for k in [k for k in os.environ if k.startswith("PORTHARNESS_") and k != "PORTHARNESS_SIM_NAMESPACE"]:
        monkeypatch.delenv(k)
    db = tmp_path / "r.db"
    for cell, said in (("fdsp:2", "model 'tiny/gpt2/causal-lm': its list's parallel cell 'fdsp:2' is not a spec"),
                       ("ddp:4", "needs 4 devices per model, the target has 2")):
        lst = tmp_path / "mixed.csv"
        lst.write_text(LIST_HEADER.strip() + ",parallel\n" + "tiny/bert/base,tiny,bert,base,text,,,,,,,,\n"
                       + f"tiny/gpt2/causal-lm,tiny,gpt2,causal-lm,text,,,,,,,,{cell}\n")
        line = _refused(capsys, ["run", "--list", lst, "--db", db, "--quiet"])
        assert said in line, line
    lst.write_text(LIST_HEADER.strip() + ",parallel\ntiny/bert/base,tiny,bert,base,text,,,,,,,,ddp:2\n")
    line = _refused(capsys, ["run", "--list", lst, "--db", db, "--quiet", "--harvest"])
    assert "the list's parallel ddp:2: not with --harvest yet" in line, line
    assert not db.exists()


@pytest.mark.long
def test_a_list_mixing_single_device_and_parallel_models_shares_the_exclusive_devices(tmp_path: Path) -> None:
    """Two sim devices, each owned by one process at a time: two models on one device each (two workers, one per
    device), then one spread over both by ddp:2 and one by fsdp:2. Each stage's workers are gone before the next
    stage's ranks take the devices: every model passes, none refused, and each row says how it ran."""
    lst = tmp_path / "mixed.csv"
    lst.write_text(LIST_HEADER.strip() + ",parallel\n" + "".join(
        f"tiny/{a}/{h},tiny,{a},{h},text,,,,,,,,{p}\n"
        for a, h, p in (("bert", "base", ""), ("llama", "causal-lm", "ddp:2"), ("gpt2", "causal-lm", "none"),
                        ("distilbert", "base", "fsdp:2"))))
    db = tmp_path / "mixed.db"
    r = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--list", str(lst), "--db", str(db), "--quiet",
                        "--no-ref-cache", "--retries", "0", "--jobs", "2", *EXACT, "--timeout", "240"],
                       capture_output=True, text=True, timeout=900, env={**_env(), "TMPDIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    with sqlite3.connect(db) as c:
        c.row_factory = sqlite3.Row
        rows = {x["model_id"]: dict(x) for x in c.execute("SELECT * FROM results")}
        (finished,) = c.execute("SELECT finished_at FROM runs").fetchone()
    assert {m: r["outcome"] for m, r in rows.items()} == dict.fromkeys(rows, "pass"), \
        {m: r["error_message"] for m, r in rows.items()}
    spread = {m.split("/")[1]: (json.loads(r["parallel"] or "{}").get("spec", ""), r["device"]) for m, r in rows.items()}
    assert spread["llama"] == ("ddp:2", "sim:0+sim:1") and spread["distilbert"] == ("fsdp:2", "sim:0+sim:1"), spread
    assert {spread["bert"][0], spread["gpt2"][0]} == {""} and {spread["bert"][1], spread["gpt2"][1]} <= {"sim:0", "sim:1"}
    assert finished, "the run is closed: every model has its row"
    _no_rank_left(tmp_path)
    site = tmp_path / "site"  # the model page of a spread model shows its spread, mesh and each rank's times
    r = subprocess.run([sys.executable, "-m", "harness.cli", "report", "--db", str(db), "--out", str(site)],
                       capture_output=True, text=True, timeout=300, env=_env())
    assert r.returncode == 0, r.stderr[-2000:]
    pages = {p.read_text() for p in site.rglob("*.html") if "tiny/llama/causal-lm" in p.read_text()
             and "Across devices" in p.read_text()}
    assert len(pages) == 1, sorted(str(p) for p in site.rglob("*.html"))[:20]
    (page,) = pages
    assert "<code>ddp:2</code>" in page and "dp=2" in page and page.count("<td>sim:") >= 2, page[-3000:]
    assert "step (s)" in page and "load (s)" in page


def test_a_collective_sim_is_told_to_lack_is_named_as_c10d_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.sim import distributed

    monkeypatch.setenv(distributed.LACKS_ENV, "reduce_scatter_tensor, all_to_all_single")
    assert distributed._lacking() == {"reduce_scatter_tensor", "all_to_all_single"}
    monkeypatch.setenv(distributed.LACKS_ENV, "reduce_scater")
    with pytest.raises(ValueError, match="no collective named reduce_scater"):
        distributed._lacking()


@pytest.mark.long
def test_an_op_or_a_collective_the_device_lacks_is_unsupported_op_naming_it_and_the_rank(tmp_path: Path) -> None:
    """A young op profile lacks `aten::sort.stable` (mixtral's expert routing): unsupported_op on a rank, as on one
    device; sim's process group told to lack reduce_scatter_tensor (FSDP2's gradient reduction): unsupported_op
    `c10d::reduce_scatter_tensor`, the rank named, not a crash and no strike against the device."""
    rc, rows, err = _run(tmp_path, "op", [("mixtral", "causal-lm")], "--parallel", "ddp:2", "--timeout", "240")
    assert rc == 0, err[-3000:]
    assert (rows[0]["outcome"], rows[0]["unsupported_op"]) == ("unsupported_op", "aten::sort.stable"), rows[0]
    assert rows[0]["error_message"].startswith("rank "), rows[0]["error_message"]
    rc, rows, err = _run(tmp_path, "coll", [("bert", "base")], "--parallel", "fsdp:2", "--mode", "train", *EXACT,
                         "--timeout", "240", env={"PORTHARNESS_SIM_LACKS_COLLECTIVES": "reduce_scatter_tensor"})
    assert rc == 0, err[-3000:]
    r = rows[0]
    assert (r["outcome"], r["unsupported_op"]) == ("unsupported_op", "c10d::reduce_scatter_tensor"), r
    assert "does not support reduce_scatter_tensor" in r["error_message"] and r["error_message"].startswith("rank ")
    assert "quarantin" not in err
    _no_rank_left(tmp_path)


@pytest.mark.long
def test_kill_9_of_the_supervisor_mid_group_leaves_nothing_and_resume_finishes_the_list(tmp_path: Path) -> None:
    """The supervisor alone is SIGKILLed while a group runs: its workers, their ranks' forkserver and the ranks
    all go (each dies with its parent), the finished rows stay, and --resume runs only the rest, once each."""
    lst = tmp_path / "four.csv"
    lst.write_text(LIST_HEADER + list_rows([("bert", "base"), ("distilbert", "base"), ("llama", "causal-lm"),
                                            ("gpt2", "causal-lm")]))
    db = tmp_path / "r.db"
    args = [sys.executable, "-m", "harness.cli", "run", "--list", str(lst), "--db", str(db), "--quiet",
            "--no-ref-cache", "--parallel", "ddp:2", *EXACT, "--retries", "0"]
    env = {**_env(), "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    assert rows_done(db, 1, 300), "the run made no progress"
    time.sleep(1.0)  # the next model's ranks are starting or running
    proc.kill()  # the supervisor only: what it started must follow it
    proc.wait()
    for _ in range(50):  # the chain of parent-death signals takes a moment
        try:
            _no_rank_left(tmp_path)
            break
        except AssertionError:
            time.sleep(0.2)
    _no_rank_left(tmp_path)
    with sqlite3.connect(db) as c:
        before = dict(c.execute("SELECT model_id, finished_at FROM results").fetchall())
    assert 1 <= len(before) < 4, before
    r = subprocess.run([*args, "--resume"], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    with sqlite3.connect(db) as c:
        after = c.execute("SELECT model_id, outcome, finished_at FROM results").fetchall()
    assert sorted(m for m, _, _ in after) == sorted(["tiny/bert/base", "tiny/distilbert/base", "tiny/llama/causal-lm",
                                                     "tiny/gpt2/causal-lm"])  # each once
    assert all(o == "pass" for _, o, _ in after), after
    assert all(before[m] == f for m, _, f in after if m in before)  # the finished rows untouched
    _no_rank_left(tmp_path)
