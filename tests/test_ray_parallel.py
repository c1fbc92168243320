"""`--executor ray --parallel`: a model's group is a placement group of one bundle per device on one node; its
worker (one actor, holding no device) starts each run's ranks as actors of their own, one per bundle; on a real
one-node Ray cluster with two sim devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LIST_HEADER, list_rows

from harness.results.store import ResultStore

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'portharness[ray]' to test --executor ray")
from ray._private import ray_constants  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

ray_constants.ENABLE_RAY_CLUSTER = False


def _cluster() -> Cluster:
    """A real one-node Ray cluster with two sim devices (its processes take this test's environment)."""
    return Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"sim": 2},
                                                         "object_store_memory": 80 * 2**20, "include_dashboard": False})


def _two(tmp_path: Path) -> tuple[Path, Path]:
    """A list of bert (a layer norm) and llama (an RMS norm), and the DB a run of it writes."""
    lst = tmp_path / "two.csv"
    lst.write_text(LIST_HEADER + list_rows([("bert", "base"), ("llama", "causal-lm")]))
    return lst, tmp_path / "r.db"


@pytest.mark.long
def test_a_group_is_a_placement_group_whose_ranks_are_actors_one_per_bundle(tmp_path: Path) -> None:
    c = _cluster()
    try:
        lst, db = _two(tmp_path)
        r = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--list", str(lst), "--db", str(db),
                            "--executor", "ray", "--ray-address", c.address, "--parallel", "ddp:2", "--precision",
                            "highest", "--ops", "full", "--quiet", "--json"],
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        assert json.loads(r.stdout)["workers_started"] == 1  # one worker actor for the group sim:0+sim:1
        with ResultStore(db) as store:
            got = store.results().to_dict("records")
        assert sorted(x["outcome"] for x in got) == ["pass", "pass"], [(x["outcome"], x["error_message"]) for x in got]
        for x in got:
            host = x["host"]  # the fleet's key names each device with its node
            assert (x["device"], x["attempts"][-1]["device"]) == ("sim:0+sim:1", f"{host}/sim:0+{host}/sim:1")
            ranks = x["parallel"]["ranks"]
            assert [k["device"] for k in ranks] == ["sim:0", "sim:1"]
            # each rank ran in its own actor process, in its own bundle of one placement group (as it reported)
            assert [k["placement_group_bundle"] for k in ranks] == [0, 1]
            assert len({k["placement_group"] for k in ranks}) == 1 and ranks[0]["placement_group"], ranks
            assert len({k["pid"] for k in ranks}) == 2 and len({k["ray_actor"] for k in ranks}) == 2, ranks
    finally:
        c.shutdown()


@pytest.mark.long
@pytest.mark.parametrize("how,outcome,said", [("segv", "crash", "rank 1 (sim:1, in phase step) died: SIGSEGV"),
                                              ("hang", "timeout", "rank 1 (sim:1, in phase step) did not finish")])
def test_a_rank_actor_that_dies_or_hangs_is_named_and_its_group_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                        how: str, outcome: str, said: str) -> None:
    """A kernel planted from outside the harness kills rank 1's actor with SIGSEGV (or never returns) on bert (its
    layer norm) but not on llama (RMS norm): bert is a crash naming rank 1 and the signal its fatal report gave
    (a timeout naming it, its actor killed); the group's worker and its placement group outlive it, and llama
    passes on the same group."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # the cluster's processes are the node's
    monkeypatch.setenv("PLANTED_RANK", "1")
    monkeypatch.setenv("PLANTED_BUG", f"at_highest:{how}")
    c = _cluster()
    try:
        lst, db = _two(tmp_path)
        r = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--list", str(lst), "--db", str(db),
                            "--executor", "ray", "--ray-address", c.address, "--parallel", "ddp:2", "--backend",
                            "planted_bugs", "--precision", "highest", "--ops", "full", "--retries", "0",
                            "--timeout", "90", "--quiet", "--json"],  # the hang: caught at 72 s, the worker kept
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        assert json.loads(r.stdout)["workers_started"] == 1, r.stdout
        with ResultStore(db) as store:
            got = {x["model_id"]: x for x in store.results().to_dict("records")}
        bert, llama = got["tiny/bert/base"], got["tiny/llama/causal-lm"]
        assert bert["outcome"] == outcome and said in bert["error_message"], bert["error_message"]
        assert llama["outcome"] == "pass", llama["error_message"]
    finally:
        c.shutdown()
