"""`--executor ray` measured: its overhead against the local executor, and a chaos run on a local cluster.

    python scripts/bench_ray.py overhead [--list tiny-zoo] [--jobs 2]
        The list through the local executor (--jobs N), then through Ray on this host alone (N sim
        devices, one actor each), one after the other: both walls, their ratio (Ray / local), and
        `portharness diff` of the two runs (unchanged should be every model).

    python scripts/bench_ray.py chaos [--list tiny-zoo] [--nodes 3] [--remove-at 0.3] [--flap SPEC]
        A local Ray cluster of N nodes, one sim device each: the list fault-free, then again with one
        node's sim device flapping (sim's fault switches in that node's environment, e.g.
        'sim:0=crash:0.0005,error:0.0005') and another node removed once that share of the rows is in.
        Reports rows lost (models without exactly one row), rows blamed on the wrong party (outcomes
        that differ from the fault-free run: a model charged with a device's fault or a node's loss, or
        the reverse), what the policy did (quarantines, interrupted and faulted attempts), and both walls.

Every run goes through the real CLI in a subprocess, as a user's would; the numbers print as JSON too
(--json-out FILE). Long: the tiny zoo takes tens of minutes per run on a small machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

CLI = [sys.executable, "-m", "harness.cli"]


def run(args: list[str], log: Path) -> tuple[float, dict]:
    """One `portharness run ... --json`: (wall seconds, its summary)."""
    t0 = time.monotonic()
    with open(log, "w") as err:
        out = subprocess.run([*CLI, "run", *args, "--quiet", "--json"], stdout=subprocess.PIPE, stderr=err,
                             text=True, check=False)
    wall = time.monotonic() - t0
    if out.returncode not in (0, 1):
        sys.exit(f"run failed (exit {out.returncode}); see {log}")
    return wall, json.loads(out.stdout)


def diff(base: Path, head: Path) -> dict:
    out = subprocess.run([*CLI, "diff", "--base-db", str(base), "--head-db", str(head), "--json"],
                         capture_output=True, text=True, check=False)
    return json.loads(out.stdout)


def rows(db: Path) -> list[dict]:
    with sqlite3.connect(db) as c:
        c.row_factory = sqlite3.Row
        return [dict(r) for r in c.execute("SELECT model_id, outcome, device, host, attempts FROM results")]


def count(db: Path) -> int:
    try:
        with sqlite3.connect(db, timeout=5) as c:
            return c.execute("SELECT count(*) FROM results").fetchone()[0]
    except sqlite3.OperationalError:
        return 0


def overhead(a: argparse.Namespace, out: Path) -> dict:
    base = ["--list", a.list, "--jobs", str(a.jobs), "--no-ref-cache"]  # a shared cache would favour the second run
    local_db, ray_db = out / "local.db", out / "ray.db"
    local_s, local = run([*base, "--db", str(local_db)], out / "local.log")
    print(f"local executor, --jobs {a.jobs}: {local_s:.1f}s wall", file=sys.stderr)
    # Ray on this host alone, with as many sim devices as local workers: one actor each
    env_devices = os.environ.get("PORTHARNESS_SIM_DEVICES")
    os.environ["PORTHARNESS_SIM_DEVICES"] = str(a.jobs)
    try:
        ray_s, far = run([*base, "--db", str(ray_db), "--executor", "ray"], out / "ray.log")
    finally:
        if env_devices is None:
            os.environ.pop("PORTHARNESS_SIM_DEVICES")
        else:
            os.environ["PORTHARNESS_SIM_DEVICES"] = env_devices
    print(f"ray executor, one node, {a.jobs} actors: {ray_s:.1f}s wall", file=sys.stderr)
    d = diff(local_db, ray_db)
    return {"list": a.list, "models": len(rows(local_db)), "jobs": a.jobs,
            "local_wall_s": round(local_s, 1), "ray_wall_s": round(ray_s, 1), "ratio": round(ray_s / local_s, 3),
            "local_run_s": round(local["wall_s"], 1), "ray_run_s": round(far["wall_s"], 1),
            "diff_unchanged": d["unchanged"], "diff_regressions": len(d["regressions"]),
            "diff_changes": len(d["outcome_changes"]) + len(d["new_failures"]) + len(d["fixes"]),
            "local_counts": local["run_counts"], "ray_counts": far["run_counts"]}


def chaos(a: argparse.Namespace, out: Path) -> dict:
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "resources": {"sim": 1}, "object_store_memory": 80 * 2**20}
    result: dict = {"list": a.list, "nodes": a.nodes, "flap": a.flap, "remove_at": a.remove_at}
    for phase in ("fault_free", "chaos"):
        cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
        try:
            extra = [cluster.add_node(**node) for _ in range(a.nodes - 2)]
            flapping = cluster.add_node(**node, env_vars={"PORTHARNESS_SIM_FAULTS": a.flap} if phase == "chaos" else {})
            if phase == "chaos":
                result["flapping_node"], result["removed_node"] = flapping.node_id[:6], extra[0].node_id[:6]
            cluster.wait_for_nodes()
            db = out / f"{phase}.db"
            args = ["run", "--list", a.list, "--db", str(db), "--executor", "ray", "--ray-address", cluster.address,
                    "--no-ref-cache", "--quiet", "--json"]
            t0 = time.monotonic()
            with open(out / f"{phase}.log", "w") as err:
                driver = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=err, text=True)
                removed_at = None
                if phase == "chaos" and extra:
                    while driver.poll() is None and count(db) < a.remove_at * a.models:
                        time.sleep(1)
                    if driver.poll() is None:
                        removed_at = count(db)
                        cluster.remove_node(extra[0])
                stdout, _ = driver.communicate()
            wall = time.monotonic() - t0
            try:
                summary = json.loads(stdout)
            except json.JSONDecodeError:
                sys.exit(f"{phase}: the driver exited {driver.returncode} without its summary "
                         f"(stdout: {stdout[:1500]!r}); see {out / f'{phase}.log'}")
            got = rows(db)
            result[phase] = {"wall_s": round(wall, 1), "rows": len(got), "distinct_models": len({r["model_id"] for r in got}),
                             "unfinished": summary["unfinished"], "quarantined": summary["quarantined"],
                             "workers_started": summary["workers_started"], "counts": summary["run_counts"]}
            if phase == "chaos":
                attempts = [x for r in got for x in json.loads(r["attempts"])]
                result[phase].update({
                    "removed_after_rows": removed_at,
                    "interrupted_attempts": sum(x["outcome"] == "interrupted" for x in attempts),
                    "device_fault_attempts": sum(bool(x.get("device_fault")) for x in attempts),
                    "worker_deaths": sum(x.get("error_type") == "WorkerDied" for x in attempts)})
        finally:
            cluster.shutdown()
    free = {r["model_id"]: r["outcome"] for r in rows(out / "fault_free.db")}
    hit = {r["model_id"]: r["outcome"] for r in rows(out / "chaos.db")}
    result["rows_lost"] = len(set(free) - set(hit)) + (result["chaos"]["rows"] - len(hit))
    result["blamed_on_the_wrong_party"] = sorted((m, free[m], hit[m]) for m in free if m in hit and hit[m] != free[m])
    result["wall_ratio"] = round(result["chaos"]["wall_s"] / result["fault_free"]["wall_s"], 3)
    return result


def main() -> None:
    # This host alone: every Ray node and driver on 127.0.0.1 (Ray's single-host mode)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("overhead")
    p.add_argument("--list", default="tiny-zoo")
    p.add_argument("--jobs", type=int, default=2)
    p = sub.add_parser("chaos")
    p.add_argument("--list", default="tiny-zoo")
    p.add_argument("--nodes", type=int, default=3, help="nodes, one sim device each (>= 2)")
    p.add_argument("--remove-at", type=float, default=0.3, help="share of the rows in when a node is removed")
    p.add_argument("--flap", default="sim:0=crash:0.0005,error:0.0005@seed=7",
                   help="PORTHARNESS_SIM_FAULTS on the flapping node")
    for p in sub.choices.values():
        p.add_argument("--out", default="artifacts/bench-ray", help="DBs and logs go here")
        p.add_argument("--json-out", default=None)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("*.db*"):
        f.unlink()
    if a.what == "chaos":
        from harness.models.model_list import load_model_list

        a.models = len(load_model_list(a.list))
    result = overhead(a, out) if a.what == "overhead" else chaos(a, out)
    text = json.dumps(result, indent=2)
    print(text)
    if a.json_out:
        Path(a.json_out).write_text(text + "\n")


if __name__ == "__main__":
    main()
