"""The rank side of the collectives benchmark: what each spawned process does.

Each rank joins the process group of its target (``sim``: the sim c10d backend on sim tensors;
``cpu``/``cuda``: the shaped process group over gloo/nccl, which loads no accelerator backend), times
every op, size and setting interleaved, then one DDP step per setting, and hands its times to rank 0.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Callable

from harness.bench.config import (
    COALESCED_TENSORS,
    DDP_BATCH,
    DDP_CONFIG,
    DDP_OP,
    ELEMENT_BYTES,
    TARGETS,
    BenchConfig,
)
from harness.comms.planner import for_group
from harness.comms.settings import collective_settings, parse_setting, set_collective_settings


def _device(target: str, rank: int):
    import torch

    if target == "sim":
        import harness.sim

        return torch.device("sim", rank % harness.sim.device_count())
    if target == "cuda":
        idx = rank % torch.cuda.device_count()
        torch.cuda.set_device(idx)
        return torch.device("cuda", idx)
    return torch.device("cpu")


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def ddp_device(target: str, rank: int):
    """The device a rank trains on: ``sim:{rank % count}`` (autograd runs on every sim device)."""
    return _device(target, rank)


def _op_runner(op: str, pg, size: int, world: int, device) -> Callable[[], None]:
    """Buffers for one op and size, and a closure that runs the collective once (blocking)."""
    import torch
    import torch.distributed as dist

    n = size // ELEMENT_BYTES
    if op == "all_reduce":
        t = torch.zeros(n).to(device)
        return lambda: dist.all_reduce(t, group=pg)
    if op == "all_gather":
        chunk = n // world
        inp, out = torch.zeros(chunk).to(device), torch.zeros(chunk * world).to(device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # 2.13 renamed it
        return lambda: gather(out, inp, group=pg)
    if op == "reduce_scatter":
        chunk = n // world
        inp, out = torch.zeros(chunk * world).to(device), torch.zeros(chunk).to(device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out, inp, group=pg)
    if op == "all_reduce_coalesced":
        ts = [torch.zeros(n // COALESCED_TENSORS).to(device) for _ in range(COALESCED_TENSORS)]
        return lambda: pg.allreduce_coalesced(ts).wait()
    raise ValueError(f"unknown op {op!r}")


def _ddp_setup(cfg: BenchConfig, specs: dict, rank: int, device, note: dict) -> dict[str, Callable[[], None]]:
    """One DDP-wrapped tiny GPT-2 per setting (bucket_cap_mb is fixed at construction)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import GPT2Config

    from harness.models.tiny import build_from_config

    device = ddp_device(cfg.target, rank)
    note["ddp_device"] = str(device)
    gen = torch.Generator().manual_seed(1234 + rank)
    ids = torch.randint(0, DDP_CONFIG["vocab_size"], DDP_BATCH, generator=gen).to(device)
    steps = {}
    for name, s in specs.items():
        model = build_from_config("causal-lm", GPT2Config(**DDP_CONFIG), seed=0).train().to(device)
        note["ddp_params"] = sum(p.numel() for p in model.parameters())
        with collective_settings(s):
            ddp = DDP(model, bucket_cap_mb=s.bucket_mb)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)

        def step(ddp=ddp, opt=opt) -> None:
            opt.zero_grad(set_to_none=False)
            ddp(input_ids=ids, labels=ids).loss.backward()
            opt.step()

        steps[name] = step
    note["ddp_grad_bytes"] = note["ddp_params"] * ELEMENT_BYTES
    return steps


def _time_interleaved(
    key: Callable[[str], tuple],
    runners: dict[str, Callable[[], None]],
    specs: dict,
    cfg: BenchConfig,
    transport,
    device,
    times: dict,
) -> None:
    names = list(runners)
    for it in range(cfg.warmup + cfg.repeats):
        k = it % len(names)
        for name in names[k:] + names[:k]:
            set_collective_settings(specs[name])
            _sync(device)
            transport.barrier().wait()
            t0 = time.perf_counter()
            runners[name]()
            _sync(device)
            dt = time.perf_counter() - t0
            if it >= cfg.warmup:
                times.setdefault(key(name), []).append(dt)
    set_collective_settings(specs[names[0]])


def _merge_notes(notes: list[dict]) -> dict:
    """One note for the run: values all ranks agree on stay scalar, the rest become per-rank lists."""
    out: dict = {}
    for key in dict.fromkeys(k for n in notes for k in n):
        values = [n.get(key) for n in notes]
        same = all(json.dumps(v, sort_keys=True) == json.dumps(values[0], sort_keys=True) for v in values)
        out[key] = values[0] if same else values
    return out


def rank_main(rank: int, cfg_dict: dict, workdir: str) -> None:
    """One rank: init the backend, time every op/size/setting and the DDP step, hand times to rank 0."""
    from harness.fleet.pool import die_with_parent

    die_with_parent()  # a killed benchmark leaves no rank behind
    cfg = BenchConfig(**cfg_dict)
    import torch.distributed as dist

    from harness.backends import load_backends

    load_backends(cfg.backends, entry_points=True)
    import harness.comms.shaped  # noqa: F401  registers shaped_gloo / shaped_nccl

    note: dict = {}
    if cfg.target == "sim":
        import harness.sim
        import harness.sim.distributed  # noqa: F401  registers the "sim" c10d backend

        if not os.environ.get("PORTHARNESS_SIM_OPS"):
            harness.sim.set_op_profile("full")
        note["sim"] = harness.sim.settings()
        if cfg.world_size > harness.sim.device_count():  # ranks share devices, which take one process each:
            from harness.sim.placement import NAMESPACE_ENV  # so each rank is its own simulated host

            os.environ[NAMESPACE_ENV] = f"{os.environ.get(NAMESPACE_ENV, '')}:{os.path.basename(workdir)}:r{rank}"
    device = _device(cfg.target, rank)
    note["device"] = str(device)
    store = dist.FileStore(os.path.join(workdir, "store"), cfg.world_size)
    dist.init_process_group(
        TARGETS[cfg.target][0],
        store=store,
        rank=rank,
        world_size=cfg.world_size,
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
    )
    try:
        pg = dist.group.WORLD
        planner = for_group(pg)
        transport = planner.transport  # barriers outside the settings: the planner's own wire
        planner.check = False  # time the settings, not a mismatch check no production backend makes
        specs = {name: parse_setting(name) for name in cfg.settings}
        times: dict[tuple, list[float]] = {}
        for op in cfg.ops:
            for size in cfg.sizes:
                runners = {name: _op_runner(op, pg, size, cfg.world_size, device) for name in specs}
                _time_interleaved(
                    lambda n, op=op, size=size: (op, size, n), runners, specs, cfg, transport, device, times
                )
        if cfg.ddp:
            steps = _ddp_setup(cfg, specs, rank, device, note)
            size = note["ddp_grad_bytes"]
            _time_interleaved(lambda n: (DDP_OP, size, n), steps, specs, cfg, transport, device, times)
        payload = {"times": [[list(k), v] for k, v in times.items()], "note": note}
        store.set(f"portharness/times/{rank}", json.dumps(payload))
        if rank == 0:
            per_rank = [json.loads(store.get(f"portharness/times/{r}")) for r in range(cfg.world_size)]
            merged: dict[tuple, list[float]] = {}
            for p in per_rank:
                for k, v in p["times"]:
                    k = tuple(k)
                    merged[k] = [max(a, b) for a, b in zip(merged[k], v, strict=True)] if k in merged else v
            out = {
                "times": [[list(k), v] for k, v in merged.items()],
                "note": _merge_notes([p["note"] for p in per_rank]),
            }
            with open(os.path.join(workdir, "result.json"), "w") as fh:
                json.dump(out, fh)
        transport.barrier().wait()
    finally:
        dist.destroy_process_group()
