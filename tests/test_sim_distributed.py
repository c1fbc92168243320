"""sim under PyTorch's distributed stack: DeviceMesh, DTensor, FSDP2, tensor parallel, transformers' TP, compiled
collectives; each probe beside its gloo control, in real processes on real sim (no mock of the group).

The probes (`harness.bench.distprobes`) run in four launches: 2 ranks on gloo and on sim under torchrun (env
rendezvous; sim with exclusive devices, at both precisions, and timing FSDP2/TP steps under collective
settings), then a 2x2 mesh on gloo (torchrun) and on sim (a FileStore passed by hand, 4 sim devices, the group
bound to a device so DeviceMesh splits it, as torchtitan's jobs do). Wrong use
runs in three more (`dist_wrong_use.py`, no torchrun: a rank that dies must not take its peers down with it).
Every launch has its own process group (killed whole on a timeout) and talks on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from harness.bench.watchdog import rank_in_text
from harness.comms.peers import Peers, describe, fingerprint, mismatch
from harness.comms.planner import OPS
from harness.comms.transport import Hosts

REPO = Path(__file__).resolve().parents[1]
LAUNCH_S = 900  # a hang guard: a 2x2 launch on two busy cores (imports, Inductor compiles, transformers) took 451 s
SETTINGS = "fused,skinny:16k,cap:64k,per-host:2"


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PORTHARNESS_SIM_EXCLUSIVE", "PORTHARNESS_SIM_DEVICES"):
        env.pop(key, None)
    return {**env, **extra}


def _wait(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Exit codes; on a timeout every process group is killed (torchrun's workers too) and the test fails."""
    try:
        return [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            p.wait()
        pytest.fail(f"a launch ran past {timeout} s")


def _torchrun(out: Path, nproc: int, args: list[str], **env: str) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--max-restarts", "0",
           "-m", "harness.bench.distprobes", "--out", str(out), "--timeout", "60", *args]
    with open(out / "log", "w") as log:
        proc = subprocess.Popen(cmd, env=_env(**env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _wait([proc], LAUNCH_S)
    return _tables(out, nproc)


def _by_hand(out: Path, nproc: int, args: list[str], **env: str) -> list[dict]:
    """Ranks started one by one, meeting in a FileStore (no torchrun, no MASTER_PORT, no LOCAL_RANK)."""
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for r in range(nproc):
        log = open(out / f"log{r}", "w")  # noqa: SIM115  closed with the process
        cmd = [sys.executable, "-m", "harness.bench.distprobes", "--out", str(out), "--timeout", "60",
               "--rendezvous", f"file:{out / 'store'}", *args]
        procs.append(subprocess.Popen(cmd, env=_env(RANK=str(r), WORLD_SIZE=str(nproc), **env), stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    _wait(procs, LAUNCH_S)
    return _tables(out, nproc)


def _tables(out: Path, nproc: int) -> list[dict]:
    missing = [r for r in range(nproc) if not (out / f"rank{r}.json").exists()]
    if missing:
        logs = "".join(p.read_text()[-3000:] for p in sorted(out.glob("log*")))
        pytest.fail(f"ranks {missing} wrote no table:\n{logs}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def _failures(tables: list[dict]) -> list[str]:
    return [f"rank {t['rank']} {prec} {name}: {res['error']}\n{res.get('trace', '')[-800:]}"
            for t in tables for prec, probes in t["probes"].items() for name, res in probes.items() if not res["ok"]]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("inductor"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, cache) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("probes2")
    gloo = _torchrun(tmp / "gloo", 2, ["--target", "cpu"], TORCHINDUCTOR_CACHE_DIR=cache)
    sim = _torchrun(tmp / "sim", 2, ["--target", "sim", "--set", "ops=full", "--precision", "highest,default",
                                     "--time", SETTINGS, "--repeats", "5"],
                    TORCHINDUCTOR_CACHE_DIR=cache, PORTHARNESS_SIM_EXCLUSIVE="1")
    return {"gloo": gloo, "sim": sim}


@pytest.fixture(scope="module")
def mesh_2x2(tmp_path_factory, cache) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("probes4")
    gloo = _torchrun(tmp / "gloo", 4, ["--target", "cpu", "--mesh", "2x2"], TORCHINDUCTOR_CACHE_DIR=cache)
    sim = _by_hand(tmp / "sim", 4, ["--target", "sim", "--set", "ops=full", "--mesh", "2x2", "--device-id",
                                    "--precision", "highest,default"],
                   TORCHINDUCTOR_CACHE_DIR=cache, PORTHARNESS_SIM_DEVICES="4")
    return {"gloo": gloo, "sim": sim}


def _same_probes(tables: dict[str, list[dict]], probes: set[str]) -> None:
    for side in ("gloo", "sim"):
        assert not _failures(tables[side]), f"{side}:\n" + "\n".join(_failures(tables[side]))
        for t in tables[side]:
            for prec, found in t["probes"].items():
                assert set(found) == probes, f"{side} {prec}: {sorted(found)}"


PROBES_1D = {"mesh", "funcol", "dtensor", "fsdp2", "tp", "hf_tp", "compile_aot_eager", "compile_inductor"}


@pytest.mark.long
def test_every_probe_passes_on_sim_as_on_gloo_two_ranks(two_ranks) -> None:
    _same_probes(two_ranks, PROBES_1D)
    sim = two_ranks["sim"][0]
    assert sim["backend"] == "sim" and two_ranks["gloo"][0]["backend"] == "gloo"
    assert set(sim["probes"]) == {"highest", "default"}
    assert sim["settings"]["default"]["contract"] == "bf16-matmul"  # judged against the bf16 emulation


# By hand, without LOCAL_RANK: transformers binds every rank to device 0 unless told (the probe tells it); once a
# 2x2 launch hung on it (exclusive devices refused ranks 2 and 3, ranks 0 and 1 waited for them in a mesh group
# made with c10d's default 30 min timeout).
@pytest.mark.long
def test_every_probe_passes_on_sim_as_on_gloo_2x2_mesh(mesh_2x2) -> None:
    _same_probes(mesh_2x2, PROBES_1D | {"fsdp2_tp"})
    assert [t["mesh"] for t in mesh_2x2["sim"]] == [[2, 2]] * 4


@pytest.mark.long
def test_settings_shape_fsdp2_and_tp_steps(two_ranks) -> None:
    """Each setting changes the messages an FSDP2 and a TP step send, and the step's time with them."""
    timing = [t["timing"] for t in two_ranks["sim"]]
    msgs = {s: {step: timing[0][s][step]["messages"] for step in ("fsdp2_step", "tp_step")} for s in timing[0]}
    fused = msgs["fused"]
    assert fused["fsdp2_step"] >= 4 and fused["tp_step"] >= 2  # all-gathers + reduce-scatters; TP all-reduces
    for step in ("fsdp2_step", "tp_step"):
        assert msgs["skinny:16k"][step] > 4 * fused[step], msgs
        assert fused[step] < msgs["cap:64k"][step] < msgs["skinny:16k"][step], msgs
        assert msgs["per-host:2"][step] == 2 * fused[step], msgs  # reduce on the host, then back: two stages
    # the slowest rank's median step: skinny's serialised 16 KiB pieces cost FSDP2 time (loose: shared cores)
    median = {s: statistics.median(max(t[s]["fsdp2_step"]["times_s"][i] for t in timing) for i in range(5))
              for s in timing[0]}
    assert median["skinny:16k"] > median["fused"], median


@pytest.mark.long
def test_wrong_use_fails_fast_and_names_the_rank(tmp_path) -> None:
    script = str(REPO / "tests" / "dist_wrong_use.py")

    def launch(name: str, world: int, scenario: str, **env: str) -> list[dict]:
        out = tmp_path / name
        out.mkdir()
        procs = [subprocess.Popen([sys.executable, script, str(out / "store"), str(out), scenario],
                                  env=_env(RANK=str(r), WORLD_SIZE=str(world), PORTHARNESS_SIM_EXCLUSIVE="1", **env),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
                 for r in range(world)]
        _wait(procs, 120)
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]

    # shared devices: each rank may touch the other's device (a tensor it makes there is then the group's to
    # refuse; exclusive ownership would refuse it first, at its first use: that is placement's test)
    r0, r1 = launch("misuse", 2, "misuse", PORTHARNESS_SIM_SHARING="shared")
    for found in (r0, r1):
        assert found["first"]["error"] == ""
        assert "No backend type associated with device type cpu" in found["cpu_tensor"]["error"]
        assert "Tensor found on device sim:" in found["other_sim_device"]["error"]
        assert "No backend type associated with device type sim" in found["sim_tensor_on_gloo"]["error"]
        err = found["mismatched_size"]["error"]
        assert err.startswith("Misuse: Detected mismatch between collectives on ranks"), err
        assert "all_reduce(4 x float32)" in err and "all_reduce(6 x float32)" in err, err
        assert "all_gather_into_tensor(4 x float32)" in found["mismatched_op"]["error"]
        assert found["still_usable"]["error"] == "" and found["still_usable"]["value"] == [3.0] * 4
        assert "DistBackendError" in found["late_peer"]["error"] and found["late_peer"]["s"] < 3 + 2
        for case in ("cpu_tensor", "other_sim_device", "sim_tensor_on_gloo", "mismatched_size", "mismatched_op"):
            assert found[case]["s"] < 2, (case, found[case])
    died = r0["peer_died"]
    assert died["error"].startswith("DistBackendError: rank 1 (pid ") and "is dead: all_reduce failed" in died["error"]
    killed_at = float((tmp_path / "misuse" / "killed_at").read_text())
    assert died["at"] - killed_at < 10, died  # far inside the 20 s timeout: gloo's connection reset, named

    for found in launch("too_many_ranks", 3, "misuse"):
        assert "world size 3 is larger than sim's 2 devices" in found["init"]["error"] and found["init"]["s"] < 2
    for found in launch("same_device", 2, "same_device", PORTHARNESS_SIM_SHARING="shared"):  # the group's rule
        assert "Duplicate sim device detected: rank 0 and rank 1 both on sim:0" in found["first_collective"]["error"]


# ----------------------------------------------------------------------------------------------
# No processes: host placement of subgroups, the mismatch check's words, a dead peer
# ----------------------------------------------------------------------------------------------


def test_hosts_place_a_mesh_dimension_where_its_ranks_are() -> None:
    # 2x2 mesh, 2 ranks per host: the tp group {0, 1} is one host; the dp group {0, 2} spans two
    tp = Hosts((0, 1), 1, 2)
    assert (tp.n_hosts, tp.here, tp.local, tp.order) == (1, 2, 1, [0, 1])
    dp = Hosts((0, 2), 1, 2)
    assert (dp.n_hosts, dp.here, dp.host, dp.local, dp.leader(1)) == (2, 1, 1, 0, 1)
    interleaved = Hosts((0, 2, 1, 3), 2, 2)  # group rank 2 is global rank 1: host 0
    assert interleaved.groups == [[0, 2], [1, 3]] and interleaved.order == [0, 2, 1, 3] and interleaved.host == 0
    with pytest.raises(ValueError, match=r"has \[2, 1\] per host"):
        Hosts((0, 1, 2), 0, 2).check()


def test_mismatch_names_both_ranks_and_all_to_all_splits(tmp_path) -> None:
    import torch
    import torch.distributed as dist

    peers = Peers(dist.FileStore(str(tmp_path / "s"), 2), 0, (0, 1), "test")
    a = fingerprint(OPS.index("all_reduce"), [torch.ones(4)], 2).tolist()
    b = fingerprint(OPS.index("all_reduce"), [torch.ones(6)], 2).tolist()
    assert mismatch(OPS, [a, a], peers) == ""
    assert "rank 0 called all_reduce(4 x float32) but rank 1 called all_reduce(6 x float32)" in mismatch(OPS, [a, b],
                                                                                                         peers)
    c = fingerprint(OPS.index("all_gather_into_tensor"), [torch.ones(4, dtype=torch.int64)], 2).tolist()
    assert describe(OPS, c) == "all_gather_into_tensor(4 x int64)"
    a2a = OPS.index("all_to_all_single")
    ok = [fingerprint(a2a, [torch.ones(3)], 2, ([1, 2], [1, 1])).tolist(),
          fingerprint(a2a, [torch.ones(2)], 2, ([1, 1], [2, 1])).tolist()]
    assert mismatch(OPS, ok, peers) == ""  # uneven splits, consistent
    bad = [ok[0], fingerprint(a2a, [torch.ones(2)], 2, ([1, 1], [3, 1])).tolist()]
    assert "rank 0 sends 2 rows to rank 1, which expects 3" in mismatch(OPS, bad, peers)


def test_a_dead_peer_is_named_by_its_pid(tmp_path) -> None:
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "s"), 2)
    me = Peers(store, 0, (4, 5), "sim group '1'")
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    store.set("portharness/peer/1", f"{socket.gethostname()} {proc.pid}")
    err = me.explain("all_reduce", RuntimeError("Connection reset by peer"))
    assert str(err).startswith(f"rank 5 (group rank 1) (pid {proc.pid}) is dead: all_reduce failed in sim group "
                               f"'1' of 2 ranks (here: pid {os.getpid()})"), str(err)
    assert "Connection reset by peer" in str(err) and isinstance(err, dist.DistBackendError)
    assert rank_in_text(str(err)) == 5  # what the fault bench's watchdog reads: the dead rank, not this one


def test_transformers_cannot_make_sims_group_itself(tmp_path, monkeypatch) -> None:
    """transformers maps device types to backends by a fixed table: asked to start the group for sim itself, it
    fails before any process group exists. The way that works (README): make the group first, then load."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import harness.sim  # noqa: F401  sim is this process's accelerator

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    assert torch.accelerator.current_accelerator().type == "sim"
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(OSError, match="We tried to initialize torch.distributed for you") as info:
        LlamaForCausalLM.from_pretrained(tmp_path, tp_plan="auto", use_kernels=False)
    assert "No distributed backend found for device type 'sim'" in str(info.value.__cause__)
    assert not dist.is_initialized()
