"""`--executor ray --parallel`: a model's group is one actor on one node holding the group's devices (a Ray
resource count of N), whose worker starts the ranks there; on a real one-node Ray cluster with two sim devices."""

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


@pytest.mark.long
def test_a_group_runs_as_one_actor_holding_its_devices_and_its_ranks(tmp_path: Path) -> None:
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"sim": 2},
                                                      "object_store_memory": 80 * 2**20, "include_dashboard": False})
    try:
        lst = tmp_path / "two.csv"
        lst.write_text(LIST_HEADER + list_rows([("bert", "base"), ("llama", "causal-lm")]))
        db = tmp_path / "r.db"
        r = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--list", str(lst), "--db", str(db),
                            "--executor", "ray", "--ray-address", c.address, "--parallel", "ddp:2", "--precision",
                            "highest", "--ops", "full", "--quiet", "--json"],
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        assert json.loads(r.stdout)["workers_started"] == 1  # one actor for the group sim:0+sim:1
        with ResultStore(db) as store:
            got = store.results().to_dict("records")
        assert sorted(x["outcome"] for x in got) == ["pass", "pass"], [(x["outcome"], x["error_message"]) for x in got]
        for x in got:
            host = x["host"]  # the fleet's key names each device with its node
            assert (x["device"], x["attempts"][-1]["device"]) == ("sim:0+sim:1", f"{host}/sim:0+{host}/sim:1")
            assert [k["device"] for k in x["parallel"]["ranks"]] == ["sim:0", "sim:1"]
    finally:
        c.shutdown()
