"""Rank side of the wrong-use tests (tests/test_sim_distributed.py): each scenario's error and how long it took.

Run as ``RANK=r WORLD_SIZE=w python tests/dist_wrong_use.py STORE OUT SCENARIO`` (a FileStore given by
hand, no torchrun: a rank that dies must not take the others down with it). Writes ``OUT/rank{r}.json``:
``{case: {"error": "Type: message", "s": seconds}}``.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

import harness.sim  # noqa: F401  registers the device and the "sim" c10d backend

TIMEOUT = datetime.timedelta(seconds=20)


def _try(found: dict, case: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        fn()
        found[case] = {"error": "", "s": time.perf_counter() - t0}
    except Exception as exc:  # the error is what the test reads
        found[case] = {"error": f"{type(exc).__name__}: {exc}", "s": time.perf_counter() - t0}


def misuse(rank: int, world: int, found: dict, out: str) -> None:
    """Wrong devices, mismatched collectives, a late rank, then a rank that dies mid-collective (exclusive devices)."""
    torch.sim.set_device(rank)
    dev = torch.device("sim", rank)
    _try(found, "first", lambda: dist.all_reduce(torch.ones(4, device=dev)))  # this rank's device, from now on
    _try(found, "cpu_tensor", lambda: dist.all_reduce(torch.ones(4)))
    _try(found, "other_sim_device", lambda: dist.all_reduce(torch.ones(4, device=f"sim:{1 - rank}")))
    gloo = dist.new_group(backend="gloo")
    _try(found, "sim_tensor_on_gloo", lambda: dist.all_reduce(torch.ones(4, device=dev), group=gloo))
    _try(found, "mismatched_size", lambda: dist.all_reduce(torch.ones(4 if rank == 0 else 6, device=dev)))
    if rank == 0:
        _try(found, "mismatched_op", lambda: dist.all_reduce(torch.ones(4, device=dev)))
    else:
        _try(found, "mismatched_op", lambda: dist.all_gather_into_tensor(torch.empty(8, device=dev),
                                                                           torch.ones(4, device=dev)))
    t = torch.full((4,), float(rank + 1), device=dev)
    _try(found, "still_usable", lambda: dist.all_reduce(t))
    found["still_usable"]["value"] = t.cpu().tolist()
    short = dist.new_group(timeout=datetime.timedelta(seconds=3))
    if rank == 1:
        time.sleep(5)  # late: rank 0 waits for it up to the group's timeout
    _try(found, "late_peer", lambda: dist.all_reduce(torch.ones(4, device=dev), group=short))
    dist.barrier(group=gloo)
    big = torch.ones(4 << 20, device=dev)  # 16 MiB in 1 KiB skinny pieces: seconds of messages
    harness.sim.distributed.set_collective_settings(harness.sim.distributed.parse_setting("skinny:1k"))
    if rank == 1:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:  # what it found, before it dies
            json.dump(found, fh)

        def die() -> None:
            with open(os.path.join(out, "killed_at"), "w") as fh:
                fh.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Timer(0.5, die).start()
    _try(found, "peer_died", lambda: dist.all_reduce(big))
    found["peer_died"]["at"] = time.time()


def main() -> None:
    store_path, out, scenario = sys.argv[1:4]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    found: dict = {}
    store = dist.FileStore(store_path, world)
    t0 = time.perf_counter()
    try:
        dist.init_process_group("sim", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    except Exception as exc:  # a world the devices cannot hold fails here
        found["init"] = {"error": f"{type(exc).__name__}: {exc}", "s": time.perf_counter() - t0}
    else:
        if scenario == "misuse":
            misuse(rank, world, found, out)
        elif scenario == "same_device":  # nobody bound a device: every rank on sim:0
            _try(found, "first_collective", lambda: dist.all_reduce(torch.ones(4, device="sim")))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(found, fh)
    os._exit(0)  # a broken group's teardown is not what is tested


if __name__ == "__main__":
    main()
