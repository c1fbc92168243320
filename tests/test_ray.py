"""`--executor ray` on a real multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`): real
actors, real tiny models on the real `sim` device, a node really removed, a driver really killed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import LIST_HEADER, list_rows

from harness.results.store import ResultStore

# Every node, and every driver the tests start, on 127.0.0.1 alone: Ray's single-host mode (set before
# Ray is imported here and inherited by the drivers; a node forced onto 127.0.0.1 otherwise leaves a
# driver looking for a raylet on the host's own address).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'portharness[ray]' to test --executor ray")
from ray._private import ray_constants  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

ray_constants.ENABLE_RAY_CLUSTER = False  # in case this process imported Ray before

# Lean nodes: one CPU and one sim device each, a small object store, no dashboard.
NODE = {"num_cpus": 1, "resources": {"sim": 1}, "object_store_memory": 80 * 2**20}
MIXED = [  # fast smoke models whose outcomes at default settings differ (pass, pass_declared, unsupported_op)
    ("patchtst", "base"), ("deberta-v2", "seq-cls"), ("deit", "image-cls"), ("bert", "masked-lm"),
    ("whisper", "speech-seq2seq"), ("yolos", "object-detection"), ("qwen3_moe", "causal-lm"), ("wav2vec2", "ctc"),
]

SMOKE = [("patchtst", "base"), ("deberta-v2", "seq-cls"), ("deit", "image-cls"), ("qwen3_moe", "causal-lm")]


def cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def rows(db: Path) -> list[dict]:
    with ResultStore(db) as store:
        return store.results().to_dict("records")


def count_rows(db: Path) -> int:
    try:
        with sqlite3.connect(db, timeout=5) as c:
            return c.execute("SELECT count(*) FROM results").fetchone()[0]
    except sqlite3.OperationalError:
        return 0


def actor_processes(cluster: Cluster) -> list[int]:
    """Our actors' processes on the cluster's nodes (Ray names them `ray::DeviceActor...`)."""
    import psutil

    found = []
    for node in [cluster.head_node, *cluster.worker_nodes]:
        for info in node.all_processes.get("raylet", []):
            try:
                kids = psutil.Process(info.process.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            for p in kids:
                try:
                    if "DeviceActor" in " ".join(p.cmdline()):
                        found.append(p.pid)
                except psutil.NoSuchProcess:
                    pass
    return found


@pytest.fixture(name="cluster", scope="module")
def _cluster():
    """A head and one more node on 127.0.0.1, each offering one `sim` device, shared by the module's
    tests (Ray's start-up is the slow part); every process of it gone afterwards. Each node is a simulated host
    of its own (its actors' PORTHARNESS_SIM_NAMESPACE): sharing one, both nodes' sim:0 were one device, which
    the second actor found in use by the first (exclusive devices) and quarantined."""
    host = os.environ.get("PORTHARNESS_SIM_NAMESPACE", "ray")
    c = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False,
                                                      "env_vars": {"PORTHARNESS_SIM_NAMESPACE": f"{host}-head"}})
    try:
        c.add_node(**NODE, env_vars={"PORTHARNESS_SIM_NAMESPACE": f"{host}-node1"})
        c.wait_for_nodes()
        yield c
    finally:
        c.shutdown()


def label(cluster: Cluster, node) -> str:
    """The name a node's devices get in the fleet (both nodes share this host: its name plus the node id)."""
    import socket

    return f"{socket.gethostname()}-{node.node_id[:6]}"


def run_args(lst: Path, db: Path, cluster: Cluster, *extra: str) -> list[str]:
    return ["run", "--list", str(lst), "--db", str(db), "--executor", "ray", "--ray-address", cluster.address,
            "--quiet", *extra]


@pytest.mark.long
def test_a_list_through_ray_gives_the_local_executors_outcomes(tmp_path: Path, cluster: Cluster) -> None:
    lst = tmp_path / "mixed.csv"
    lst.write_text(LIST_HEADER + list_rows(SMOKE))
    local, far = tmp_path / "local.db", tmp_path / "ray.db"
    r = cli("run", "--list", str(lst), "--db", str(local), "--jobs", "2", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli(*run_args(lst, far, cluster, "--json"))
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)
    assert summary["unfinished"] == 0 and summary["workers_started"] == 2  # one actor per device, none replaced
    assert summary["quarantined"] == [] and summary["faults_seen"] == 0, summary  # two hosts' devices, both sound
    got = rows(far)
    assert sorted(x["model_id"] for x in got) == sorted(f"tiny/{a}/{h}" for a, h in SMOKE)
    assert len({x["outcome"] for x in got}) >= 3, {x["outcome"] for x in got}  # a mix, not all one outcome
    nodes = {label(cluster, n) for n in [cluster.head_node, *cluster.worker_nodes]}
    for x in got:  # the host as well as the device; the policy's name for a device is per node
        assert x["host"] in nodes and x["device"] == "sim:0", (x["host"], x["device"])
        assert x["attempts"][-1]["device"] == f"{x['host']}/sim:0"
    # which node ran which models is the scheduler's: on a loaded host the second node's actor can start after
    # the first one has taken the whole list (seen with a build running beside the suite)
    assert {x["host"] for x in got} <= nodes
    d = cli("diff", "--base-db", str(local), "--head-db", str(far))
    assert d.returncode == 0, d.stdout + d.stderr
    assert f"unchanged={len(SMOKE)}" in d.stdout and "regressions=0" in d.stdout, d.stdout


@pytest.mark.long
def test_the_op_worklist_through_ray_gives_the_local_executors_outcomes(tmp_path: Path, cluster: Cluster) -> None:
    """`portharness ops` runs its variations through the same executors: on the cluster's actors, the same
    variations with the same outcomes as on local workers."""
    lst = tmp_path / "one.csv"
    lst.write_text(LIST_HEADER + list_rows([("bert", "masked-lm")]))
    local, far = tmp_path / "local.db", tmp_path / "ray.db"
    r = cli("ops", "--list", str(lst), "--db", str(local), "--jobs", "2", "--only", "addmm,gelu", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli("ops", "--list", str(lst), "--db", str(far), "--executor", "ray", "--ray-address", cluster.address,
            "--only", "addmm,gelu", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ray actor(s) on 2 node(s)" in r.stderr, r.stderr[-2000:]

    def outcomes(db: Path) -> dict[str, str]:
        return {x["model_id"]: x["outcome"] for x in rows(db) if x["model_id"].startswith("aten::")}

    here, there = outcomes(local), outcomes(far)
    assert here and here == there, (here, there)
    nodes = {label(cluster, n) for n in [cluster.head_node, *cluster.worker_nodes]}
    assert {x["host"] for x in rows(far) if x["model_id"] in there} <= nodes
    # the harvest ran on the cluster too (issue 48, cause 6), not on the driver's CPU
    assert "harvesting the op calls of 1 model(s) of" in r.stderr and "on the ray cluster's nodes" in r.stderr
    harvest = [x for x in rows(far) if x["model_id"] == "tiny/bert/masked-lm"]
    assert len(harvest) == 1 and harvest[0]["host"] in nodes, harvest
    # a device index no node has is said as such (cause 15), not as a resource the nodes lack
    r = cli("ops", "--list", str(lst), "--db", str(far), "--executor", "ray", "--ray-address", cluster.address,
            "--target", "sim:5", "--quiet")
    assert r.returncode == 2 and "no node of the Ray cluster" in r.stderr and "has a device sim:5" in r.stderr, r.stderr
    assert "sim:0..sim:0" in r.stderr and "'sim' resource" not in r.stderr, r.stderr


@pytest.mark.slow
def test_a_target_no_node_offers_is_one_line_and_touches_nothing(tmp_path: Path, cluster: Cluster) -> None:
    lst = tmp_path / "one.csv"
    lst.write_text(LIST_HEADER + list_rows(SMOKE[:1]))
    db = tmp_path / "r.db"
    r = cli(*run_args(lst, db, cluster))
    assert r.returncode == 0, r.stderr[-3000:]
    before = [(x["model_id"], x["outcome"], x["finished_at"]) for x in rows(db)]
    r = cli(*run_args(lst, db, cluster, "--target", "cpu"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "no node of the Ray cluster" in r.stderr and "'cpu' resource" in r.stderr and "--resources" in r.stderr
    assert [(x["model_id"], x["outcome"], x["finished_at"]) for x in rows(db)] == before


def _slow_models(tmp_path: Path, patho, n: int, seconds: int) -> str:
    """`n` models that each take `seconds` to load (copies of one checkpoint: each its own directory)."""
    _, src = patho(f"slow-load:{seconds}")
    dirs = {}
    for i in range(n):
        d = tmp_path / f"slow-{i}"
        shutil.copytree(src, d)
        dirs[f"patho/slow-{i}"] = d
    return patho.rows(dirs)


@pytest.mark.slow
def test_a_node_removed_mid_run_loses_no_row_and_its_model_runs_on_the_other(tmp_path: Path, cluster: Cluster,
                                                                            patho) -> None:
    gone = cluster.add_node(**NODE, env_vars={"PORTHARNESS_SIM_NAMESPACE": f"{os.environ.get('PORTHARNESS_SIM_NAMESPACE', 'ray')}-gone"})  # the module's cluster keeps its two nodes
    cluster.wait_for_nodes()
    lst = tmp_path / "slow.csv"
    lst.write_text(LIST_HEADER + _slow_models(tmp_path, patho, 6, 6))
    db = tmp_path / "r.db"
    driver = subprocess.Popen([sys.executable, "-m", "harness.cli", *run_args(lst, db, cluster, "--json")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and count_rows(db) < 2 and driver.poll() is None:
            time.sleep(0.2)
        time.sleep(1.5)  # both actors are 1.5 s into their next 6 s load
        before = {r["model_id"]: r for r in rows(db)}
        assert len(before) >= 2, "the run made no progress"
        cluster.remove_node(gone)
        out, err = driver.communicate(timeout=600)
    finally:
        driver.kill()
    assert driver.returncode == 0, err[-3000:]
    summary = json.loads(out)
    got = {r["model_id"]: r for r in rows(db)}
    assert len(got) == 6 and summary["unfinished"] == 0  # every model once: none lost, none twice
    assert all(r["outcome"] == "pass" for r in got.values()), {m: r["outcome"] for m, r in got.items()}
    for mid, r in before.items():  # rows committed before the node went are untouched
        assert got[mid]["finished_at"] == r["finished_at"]
    lost = f"{label(cluster, gone)}/sim:0"
    assert summary["quarantined"] == [lost], summary["quarantined"]
    moved = [r for r in got.values() if any(a["outcome"] == "interrupted" for a in r["attempts"])]
    assert moved, "no model was in flight on the removed node"
    for r in moved:  # its in-flight model: interrupted there (not the model's doing), its row from the other node
        interrupted = [a for a in r["attempts"] if a["outcome"] == "interrupted"]
        assert [(a["device"], a["error_type"]) for a in interrupted] == [(lost, "node_lost")]
        assert r["attempts"][-1]["device"] != lost and r["host"] != label(cluster, gone)
    assert "left the cluster" in err


@pytest.mark.slow
def test_hung_segfaulting_and_runaway_models_cost_only_their_rows_and_actors(tmp_path: Path, cluster: Cluster,
                                                                           patho) -> None:
    """A hung model: `timeout`, its actor killed and replaced. A segfault kills the actor: a worker death
    in the target phase for the policy (signal and phase read back from its node), as a local worker's.
    A runaway allocation stops at the actor's memory cap: `oom`, and the actor lives on."""
    lst = tmp_path / "patho.csv"
    # well-behaved ones first: a device that ran models cleanly shows the deaths are the models'
    lst.write_text(LIST_HEADER + patho.rows(dict(patho(b) for b in ("none", "oom", "hang", "crash", "norm"))))
    db = tmp_path / "r.db"
    # --quarantine-after 3: the two dying models alone never quarantine a device, even one that got
    # both before any well-behaved model (actors start at their own pace)
    r = cli(*run_args(lst, db, cluster, "--timeout", "10", "--retries", "0", "--mem-cap-mb", "2048",
                      "--quarantine-after", "3", "--json"))
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)  # stdout is the JSON alone: Ray's notices of dead workers went to stderr
    got = {x["model_id"]: x for x in rows(db)}
    hung = got["patho/hang"]
    assert hung["outcome"] == "timeout" and hung["signal"] == signal.SIGKILL, hung["error_message"]
    assert "no result 10s after loading (--timeout, compiling excluded, in phase target)" in hung["error_message"]
    assert "actor killed" in hung["error_message"]
    # (a device that has not run a model yet gets a death's verdict once more, after the rest: the policy's)
    assert {(a["outcome"], a["phase"], a["signal"]) for a in hung["attempts"]} == {("timeout", "target", signal.SIGKILL)}
    crash = got["patho/crash"]
    assert crash["outcome"] == "crash" and crash["signal"] == signal.SIGSEGV, crash["error_message"]
    assert "actor process on" in crash["error_message"] and crash["error_message"].endswith("died: SIGSEGV")
    assert "Segmentation fault" in crash["traceback"]  # the node's fatal-signal report
    assert {(a["error_type"], a["phase"], a["signal"]) for a in crash["attempts"]} == {
        ("WorkerDied", "target", signal.SIGSEGV)}
    assert got["patho/oom"]["outcome"] == "oom" and "allocate" in got["patho/oom"]["error_message"]
    assert got["patho/none"]["outcome"] == "pass" and got["patho/norm"]["outcome"] in ("pass", "pass_declared")
    # the segfault and the timeout each ended an actor; a new one took the device while work was left
    assert summary["workers_started"] >= 3, summary["workers_started"]
    assert summary["quarantined"] == [], summary["quarantined"]  # the models' doing, not the devices'


@pytest.mark.slow
def test_a_killed_driver_leaves_no_actor_and_resume_finishes_the_run(tmp_path: Path, cluster: Cluster,
                                                                     patho) -> None:
    lst = tmp_path / "l.csv"
    # a hanging model keeps the run going until it is killed; on resume it times out
    lst.write_text(LIST_HEADER + list_rows(MIXED[:4]) + patho.rows(dict([patho("hang")])))
    db = tmp_path / "r.db"
    args = run_args(lst, db, cluster, "--timeout", "15", "--retries", "0")
    driver = subprocess.Popen([sys.executable, "-m", "harness.cli", *args], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and count_rows(db) < 2:
            time.sleep(0.2)
        assert count_rows(db) >= 2, "the run made no progress"
        assert actor_processes(cluster), "no actor to leave behind"
    finally:
        os.killpg(driver.pid, signal.SIGKILL)  # the driver, mid-run, with no chance to clean up
        driver.wait()
    before = {r["model_id"]: r for r in rows(db)}
    assert 2 <= len(before) < 5
    deadline = time.time() + 120
    while time.time() < deadline and actor_processes(cluster):
        time.sleep(0.5)
    assert not actor_processes(cluster), "actors outlived their driver"
    r = cli(*args, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "already done, resumed" in r.stdout
    after = rows(db)
    assert sorted(x["model_id"] for x in after) == sorted([*(f"tiny/{a}/{h}" for a, h in MIXED[:4]), "patho/hang"])
    assert len({x["run_id"] for x in after}) == 1
    by_id = {x["model_id"]: x for x in after}
    for mid, x in before.items():  # finished rows untouched
        assert by_id[mid]["finished_at"] == x["finished_at"] and by_id[mid]["outcome"] == x["outcome"]
    assert by_id["patho/hang"]["outcome"] == "timeout"
