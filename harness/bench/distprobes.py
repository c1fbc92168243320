"""Probes of PyTorch's distributed stack on a target, run by every rank of one job.

What a backend team bringing up a chip checks first, each probe against the same computation on one CPU
(fp32, or emulating the target's declared matmul contract at its default precision):

============== =====================================================================================
probe          what it does
============== =====================================================================================
mesh           ``init_device_mesh`` (1-D, or 2-D ``("dp", "tp")``); each rank bound to its device
funcol         functional collectives on every mesh dimension (all_reduce, all_gather, reduce_scatter,
               all_to_all_single even and uneven, the coalesced forms), and the in-place ``dist.*`` forms,
               async + wait
dtensor        DTensor matmul: Shard(0) x Replicate (2-D: Shard(0) x Shard(1)) = the local product
fsdp2          ``fully_shard`` a 2-layer MLP on the dp dimension, one backward: gradients = one device's
tp             ``parallelize_module`` colwise + rowwise on the tp dimension: output and gradients
fsdp2_tp       (2-D only) tensor parallel on tp, then FSDP2 on dp: gradients
hf_tp          transformers ``from_pretrained(dir, tp_plan="auto", device_mesh=mesh)``: logits
compile_*      ``torch.compile`` (aot_eager, inductor) of a step calling functional collectives = eager
============== =====================================================================================

Run it under torchrun (env rendezvous), or with a store given by hand (``--rendezvous file:PATH`` and
``RANK``/``WORLD_SIZE``)::

    torchrun --nproc-per-node 2 -m harness.bench.distprobes --target sim --out DIR
    torchrun --nproc-per-node 4 -m harness.bench.distprobes --target sim --mesh 2x2 --out DIR

Each rank writes ``DIR/rank{R}.json`` (and prints it on one line): per probe ``ok``, the error, the largest
difference from the reference and the tolerance. ``--time fused,skinny:4k`` also times an FSDP2 step and a
tensor-parallel step under each collective setting (interleaved) and counts the messages the group's planner
issued, where the group has one (`harness.comms.planner.for_group`). The c10d backend is the target's
(`Adapter.dist_backend`) unless ``--dist-backend`` names one; transformers is given the mesh, since its own
table maps no out-of-tree device to a backend.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

IN, HID, OUT = 16, 32, 8  # the probes' MLP
BATCH = 4


@dataclass
class Ctx:
    """One rank's job: its device, mesh, the reference rule, and what it found."""

    target: str
    rank: int
    world: int
    device: Any = None
    mesh: Any = None
    contract: str = "fp32"
    workdir: str = ""
    mesh_error: str = "no mesh"
    results: dict[str, dict] = field(default_factory=dict)

    @property
    def dp(self):
        return self.mesh["dp"] if self.mesh.ndim > 1 else self.mesh

    @property
    def tp(self):
        return self.mesh["tp"] if self.mesh.ndim > 1 else self.mesh

    def reference(self) -> contextlib.AbstractContextManager:
        """The CPU reference's arithmetic: fp32, or the target's declared matmul rounding emulated."""
        from harness.backends.contracts import Emulate, contract

        c = contract(self.contract)
        return contextlib.nullcontext() if c.exact else Emulate(c)


def _mlp(seed: int = 0, hidden: int = HID, width: int = IN):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, OUT))


def _batch(seed: int, width: int = IN):
    import torch

    return torch.randn(BATCH, width, generator=torch.Generator().manual_seed(1000 + seed))


def _compare(ctx: Ctx, got: Any, want: Any) -> tuple[float, float]:
    """(largest difference, tolerance): fp32 reduction-order error, scaled by the reference's size."""

    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    if got.shape != want.shape:
        raise AssertionError(f"shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    return float((got - want).abs().max()), 2e-6 * max(1.0, float(want.abs().max())) * (4 if got.ndim > 2 else 1)


def _record(ctx: Ctx, name: str, fn: Callable[[Ctx], list[tuple[float, float]] | None]) -> None:
    t0 = time.perf_counter()
    try:
        pairs = fn(ctx) or []
        err = max((e for e, _ in pairs), default=0.0)
        worst = max(pairs, key=lambda p: p[0] / p[1]) if pairs else (0.0, 1.0)
        ok = all(e <= tol for e, tol in pairs)
        ctx.results[name] = {"ok": ok, "max_abs": err, "tol": worst[1], "error": "" if ok else "differs"}
    except Exception as exc:  # a probe that fails is a result, like a model that fails
        line = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        ctx.results[name] = {"ok": False, "error": line[:400], "trace": traceback.format_exc()[-2000:]}
    ctx.results[name]["time_s"] = round(time.perf_counter() - t0, 3)


# ----------------------------------------------------------------------------------------------
# Probes
# ----------------------------------------------------------------------------------------------


def probe_mesh(ctx: Ctx) -> None:
    import torch

    if ctx.mesh is None:
        raise RuntimeError(ctx.mesh_error)
    local = int(os.environ.get("LOCAL_RANK", ctx.rank))
    if ctx.device.type != "cpu" and torch.accelerator.current_device_index() != local:
        raise AssertionError(f"rank {ctx.rank} is on {ctx.device.type}:{torch.accelerator.current_device_index()}, "
                             f"expected {local}")
    for dim in range(ctx.mesh.ndim):
        ctx.mesh.get_group(dim).group_name  # a name: what DeviceMesh and funcol resolve groups by  # noqa: B018


def _dims(ctx: Ctx) -> list[tuple[Any, list[int]]]:
    """Each mesh dimension's group and the global ranks in it (this rank's row)."""
    out = []
    coord = ctx.mesh.get_coordinate()
    for dim in range(ctx.mesh.ndim):
        idx = list(coord)
        idx[dim] = slice(None)
        out.append((ctx.mesh.get_group(dim), ctx.mesh.mesh[tuple(idx)].tolist()))
    return out


def probe_funcol(ctx: Ctx) -> list[tuple[float, float]]:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    pairs = []
    val = lambda r, n=6: torch.arange(n, dtype=torch.float32) + 100 * r  # noqa: E731  exact in fp32
    for pg, ranks in _dims(ctx):
        n, me = len(ranks), ranks.index(ctx.rank)
        x = val(ctx.rank).to(ctx.device)
        cases = [
            (funcol.all_reduce(x, "sum", pg), sum(val(r) for r in ranks)),
            (funcol.all_gather_tensor(x, 0, pg), torch.cat([val(r) for r in ranks])),
            (funcol.reduce_scatter_tensor(val(ctx.rank, 6 * n).to(ctx.device), "sum", 0, pg),
             sum(val(r, 6 * n) for r in ranks).chunk(n)[me]),
            (funcol.all_to_all_single(val(ctx.rank, 2 * n).to(ctx.device), None, None, pg),
             torch.cat([val(r, 2 * n).chunk(n)[me] for r in ranks])),
        ]
        # uneven splits: rank i sends i+j+1 rows to rank j
        ins = [me + j + 1 for j in range(n)]
        outs = [i + me + 1 for i in range(n)]
        src = lambda r, i, n=n: val(r, sum(i + j + 1 for j in range(n)))  # noqa: E731
        x_u = src(ctx.rank, me).to(ctx.device)
        want_u = torch.cat([src(r, i).split([i + j + 1 for j in range(n)])[me] for i, r in enumerate(ranks)])
        cases.append((funcol.all_to_all_single(x_u, outs, ins, pg), want_u))
        # the coalesced forms (one call, several tensors: packed by the bucket setting on a planned group)
        a, b = val(ctx.rank, 2 * n).to(ctx.device), val(ctx.rank + 7, 4 * n).to(ctx.device)
        gathered = funcol.all_gather_into_tensor_coalesced([a, b], pg)
        cases += [(gathered[0], torch.cat([val(r, 2 * n) for r in ranks])),
                  (gathered[1], torch.cat([val(r + 7, 4 * n) for r in ranks]))]
        scattered = funcol.reduce_scatter_tensor_coalesced([a, b], "sum", [0, 0], pg)
        cases += [(scattered[0], sum(val(r, 2 * n) for r in ranks).chunk(n)[me]),
                  (scattered[1], sum(val(r + 7, 4 * n) for r in ranks).chunk(n)[me])]
        for got, want in cases:
            pairs.append(_compare(ctx, funcol.wait_tensor(got) if hasattr(got, "wait") else got, want))
        # the in-place forms, async: the Work's wait, as FSDP2 uses them
        out = torch.empty(6 * n).to(ctx.device)
        dist.all_gather_into_tensor(out, x, group=pg, async_op=True).wait()
        pairs.append(_compare(ctx, out, torch.cat([val(r) for r in ranks])))
        rs = torch.empty(6).to(ctx.device)
        dist.reduce_scatter_tensor(rs, val(ctx.rank, 6 * n).to(ctx.device), op=dist.ReduceOp.AVG, group=pg,
                                   async_op=True).wait()
        pairs.append(_compare(ctx, rs, (sum(val(r, 6 * n) for r in ranks) / n).chunk(n)[me]))
        a2a = torch.empty(sum(outs)).to(ctx.device)
        dist.all_to_all_single(a2a, x_u, outs, ins, group=pg, async_op=True).wait()
        pairs.append(_compare(ctx, a2a, want_u))
        y = x.clone()
        work = dist.all_reduce(y, group=pg, async_op=True)
        pairs.append(_compare(ctx, work.get_future().wait()[0], sum(val(r) for r in ranks)))
    return pairs


def probe_dtensor(ctx: Ctx) -> list[tuple[float, float]]:
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(8, 16, generator=gen), torch.randn(16, 12, generator=gen)
    with ctx.reference():
        want = a @ b
    if ctx.mesh.ndim == 1:
        pa, pb = [Shard(0)], [Replicate()]
    else:
        pa, pb = [Shard(0), Replicate()], [Replicate(), Shard(1)]
    da = distribute_tensor(a.to(ctx.device), ctx.mesh, pa)
    db = distribute_tensor(b.to(ctx.device), ctx.mesh, pb)
    return [_compare(ctx, da @ db, want)]


def _reference_grads(ctx: Ctx, ranks: list[int]) -> dict:
    """One CPU model's gradients of the dp ranks' mean loss (what FSDP2's AVG reduce-scatter makes)."""
    model = _mlp()
    with ctx.reference():
        loss = sum(model(_batch(r)).pow(2).mean() for r in ranks) / len(ranks)
        loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _dp_ranks(ctx: Ctx) -> tuple[int, list[int]]:
    """The data-parallel index of this rank and of each of its dp peers (batches depend on it alone)."""
    if ctx.mesh.ndim == 1:
        return ctx.rank, list(range(ctx.world))
    return ctx.mesh.get_local_rank("dp"), list(range(ctx.mesh.size(0)))


def probe_fsdp2(ctx: Ctx) -> list[tuple[float, float]]:
    from torch.distributed.fsdp import fully_shard

    me, dp = _dp_ranks(ctx)
    want = _reference_grads(ctx, dp)
    model = _mlp().to(ctx.device)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=ctx.dp)
    fully_shard(model, mesh=ctx.dp)
    model(_batch(me).to(ctx.device)).pow(2).mean().backward()
    return [_compare(ctx, p.grad, want[n]) for n, p in model.named_parameters()]


def _tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"0": ColwiseParallel(), "2": RowwiseParallel()}


def probe_tp(ctx: Ctx) -> list[tuple[float, float]]:
    from torch.distributed.tensor.parallel import parallelize_module

    ref = _mlp()
    x = _batch(0)
    with ctx.reference():
        want = ref(x)
        want.pow(2).mean().backward()
    model = parallelize_module(_mlp().to(ctx.device), ctx.tp, _tp_plan())
    out = model(x.to(ctx.device))
    out.pow(2).mean().backward()
    grads = dict(ref.named_parameters())
    return [_compare(ctx, out, want)] + [_compare(ctx, p.grad, grads[n].grad) for n, p in model.named_parameters()]


def probe_fsdp2_tp(ctx: Ctx) -> list[tuple[float, float]]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    me, dp = _dp_ranks(ctx)
    want = _reference_grads(ctx, dp)
    model = parallelize_module(_mlp().to(ctx.device), ctx.tp, _tp_plan())
    fully_shard(model, mesh=ctx.dp)
    model(_batch(me).to(ctx.device)).pow(2).mean().backward()
    return [_compare(ctx, p.grad, want[n]) for n, p in model.named_parameters()]


def _tiny_llama(ctx: Ctx) -> str:
    """A tiny Llama saved once (rank 0), for every rank to load: no download."""
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    path = os.path.join(ctx.workdir, "tiny-llama")
    if ctx.rank == 0 and not os.path.isdir(path):
        cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        import torch

        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(path)
    dist.barrier()
    return path


def probe_hf_tp(ctx: Ctx) -> list[tuple[float, float]]:
    import torch
    from transformers import LlamaForCausalLM

    path = _tiny_llama(ctx)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    with ctx.reference():
        want = LlamaForCausalLM.from_pretrained(path).eval()(ids).logits
    # transformers maps device types to c10d backends by a fixed table, and the kernels hub validates device
    # types against another: an out-of-tree device needs the group made first and no hub kernels. Given a
    # tp_plan, transformers 5.25 builds its own mesh (torch.accelerator's device type, tp_size = WORLD_SIZE unless
    # told): a 2-D job says its sizes through DistributedConfig (device_mesh is not used then, gloo alike).
    if ctx.mesh.ndim == 1:
        kw: dict = {"tp_plan": "auto", "device_mesh": ctx.mesh}
    else:
        from transformers import DistributedConfig

        kw = {"distributed_config": DistributedConfig(tp_size=ctx.tp.size(), dp_replicate_size=ctx.dp.size())}
    # It binds each process to LOCAL_RANK's device (0 unset): ranks started by hand say theirs, or all land on
    # device 0 (exclusive devices refuse the others, whose peers then wait out c10d's default 30 min timeout).
    local = {"LOCAL_RANK": str(ctx.device.index)} if ctx.device.type != "cpu" and "LOCAL_RANK" not in os.environ else {}
    try:
        with mock.patch.dict(os.environ, local):
            model = LlamaForCausalLM.from_pretrained(path, use_kernels=False, **kw).eval()
            with torch.no_grad():
                got = model(ids.to(model.device)).logits
    finally:
        if ctx.device.type != "cpu":
            torch.accelerator.set_device_index(ctx.device.index)
    return [_compare(ctx, got, want)]


def _compiled(ctx: Ctx, backend: str) -> list[tuple[float, float]]:
    import torch
    import torch.distributed._functional_collectives as funcol

    pg = ctx.tp.get_group()
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(5)).to(ctx.device)

    def step(x):
        y = funcol.all_reduce(torch.sin(x) @ w, "sum", pg)
        z = funcol.all_gather_tensor(y * 2, 0, pg)
        return funcol.reduce_scatter_tensor(z + 1, "sum", 0, pg)

    x = _batch(ctx.rank, 8).to(ctx.device)
    torch._dynamo.reset()
    got = torch.compile(step, backend=backend, fullgraph=True)(x)
    return [_compare(ctx, got, step(x))]


PROBES: dict[str, Callable[[Ctx], Any]] = {
    "mesh": probe_mesh,
    "funcol": probe_funcol,
    "dtensor": probe_dtensor,
    "fsdp2": probe_fsdp2,
    "tp": probe_tp,
    "fsdp2_tp": probe_fsdp2_tp,
    "hf_tp": probe_hf_tp,
    "compile_aot_eager": lambda ctx: _compiled(ctx, "aot_eager"),
    "compile_inductor": lambda ctx: _compiled(ctx, "inductor"),
}


# ----------------------------------------------------------------------------------------------
# Settings' cost in an FSDP2 and a tensor-parallel step
# ----------------------------------------------------------------------------------------------

TIME_WIDTH, TIME_HIDDEN, TIME_TOKENS = 256, 1024, 256  # 2 MiB of parameters (FSDP2's all-gather, reduce-scatter)


def time_settings(ctx: Ctx, specs: list[str], repeats: int) -> dict:
    """Per setting: each rank's step times (FSDP2 on dp, TP on tp; interleaved) and the messages sent."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from harness.comms.planner import for_group
    from harness.comms.settings import collective_settings, parse_setting

    fsdp = _mlp(hidden=TIME_HIDDEN, width=TIME_WIDTH).to(ctx.device)
    for layer in (fsdp[0], fsdp[2]):
        fully_shard(layer, mesh=ctx.dp)
    fully_shard(fsdp, mesh=ctx.dp)
    tp = parallelize_module(_mlp(hidden=TIME_HIDDEN, width=TIME_WIDTH).to(ctx.device), ctx.tp, _tp_plan())
    # 256 tokens, needing their gradient (as inside a model): the TP step all-reduces 256 KiB each way
    x = torch.randn(TIME_TOKENS, TIME_WIDTH, generator=torch.Generator().manual_seed(ctx.rank))
    x = x.to(ctx.device).requires_grad_()
    planners = {p for p in (for_group(ctx.dp.get_group()), for_group(ctx.tp.get_group())) if p is not None}
    for p in planners:
        p.check = False  # time the settings, not a mismatch check no production backend makes
    steps = {"fsdp2_step": lambda: fsdp(x).pow(2).mean().backward(),
             "tp_step": lambda: tp(x).pow(2).mean().backward()}
    out: dict = {}
    for it in range(repeats + 1):  # the first round warms up
        for k in range(len(specs)):
            spec = specs[(k + it) % len(specs)]
            with collective_settings(parse_setting(spec)):
                for name, step in steps.items():
                    dist.barrier()
                    sent = sum(p.sent for p in planners)
                    t0 = time.perf_counter()
                    step()
                    torch.accelerator.synchronize() if ctx.device.type != "cpu" else None
                    dt = time.perf_counter() - t0
                    if it:
                        row = out.setdefault(spec, {}).setdefault(name, {"times_s": [], "messages": 0})
                        row["times_s"].append(dt)
                        row["messages"] = sum(p.sent for p in planners) - sent
    return out


# ----------------------------------------------------------------------------------------------
# The rank
# ----------------------------------------------------------------------------------------------


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m harness.bench.distprobes", description=__doc__.split("\n")[0])
    p.add_argument("--target", default="sim", help="device type (sim, cpu, cuda, an out-of-tree one)")
    p.add_argument("--backend", action="append", default=[], help="module to import that registers the device")
    p.add_argument("--dist-backend", default="", help="c10d backend (default: the target's)")
    p.add_argument("--mesh", default="", help="N (1-D) or DPxTP, e.g. 2x2 (default: the world, 1-D)")
    p.add_argument("--precision", default="highest", help="the target's precision modes to probe at, e.g. highest,default")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a target setting (sim: ops=full, ...), as `check` takes them")
    p.add_argument("--probes", default=",".join(PROBES), help="comma-separated subset of " + ",".join(PROBES))
    p.add_argument("--rendezvous", default="env", help="env (torchrun) or file:PATH (a FileStore given by hand)")
    p.add_argument("--device-id", action="store_true",
                   help="init_process_group(device_id=...): bind the group to the rank's device, as torchtitan does "
                        "(DeviceMesh then makes its groups with split_group)")
    p.add_argument("--timeout", type=float, default=120.0, help="collective timeout, seconds")
    p.add_argument("--time", default="", help="collective settings to time FSDP2/TP steps under, e.g. fused,skinny")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="", help="directory for rank{R}.json (and the tiny model)")
    return p.parse_args(argv)


@contextlib.contextmanager
def _group(args: argparse.Namespace, backend: str) -> Iterator[tuple[int, int]]:
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=args.timeout)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    kw: dict = {"timeout": timeout}
    if args.device_id:
        kw["device_id"] = torch.device(args.target, int(os.environ.get("LOCAL_RANK", rank)))
    if args.rendezvous == "env":
        dist.init_process_group(backend, **kw)
    elif args.rendezvous.startswith("file:"):
        store = dist.FileStore(args.rendezvous[5:], world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kw)
    else:
        raise ValueError(f"--rendezvous {args.rendezvous!r}: expected env or file:PATH")
    try:
        yield dist.get_rank(), dist.get_world_size()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import torch

    from harness.backends import adapter_for, load_backends

    load_backends(args.backend, entry_points=True)
    adapter = adapter_for(args.target)
    adapter.load()
    extra = dict(kv.split("=", 1) for kv in args.set)
    per = {p: adapter.check_settings({"precision": p, **extra}) for p in args.precision.split(",")}
    backend = args.dist_backend or adapter.dist_backend()
    torch.set_num_threads(1)  # several ranks on few cores
    first = next(iter(per.values()))
    report: dict = {"target": args.target, "backend": backend, "probes": {}, "settings": {}}
    with adapter.apply(first), _group(args, backend) as (rank, world):
        from torch.distributed.device_mesh import init_device_mesh

        ctx = Ctx(args.target, rank, world, workdir=args.out or ".")
        if args.target != "cpu" and "LOCAL_RANK" not in os.environ:  # by hand: bind as a user would
            torch.accelerator.set_device_index(rank % adapter.device_count())
        shape = tuple(int(n) for n in args.mesh.split("x")) if args.mesh else (world,)
        try:
            ctx.mesh = init_device_mesh(args.target, shape, mesh_dim_names=("dp", "tp") if len(shape) == 2
                                        else ("world",))
        except Exception as exc:  # the mesh probe says why; the others fail on it
            ctx.mesh_error = f"{type(exc).__name__}: {exc}"
        ctx.device = torch.device(args.target, torch.accelerator.current_device_index()) \
            if args.target != "cpu" else torch.device("cpu")
        wanted = [p for p in args.probes.split(",") if p and (p != "fsdp2_tp" or len(shape) == 2)]
        for precision, settings in per.items():
            ctx.contract, ctx.results = adapter.declared_precision(settings), {}
            with adapter.apply(settings):
                for name in wanted:
                    _record(ctx, name, PROBES[name])
            report["probes"][precision] = ctx.results
            report["settings"][precision] = {**settings, "contract": ctx.contract}
        with adapter.apply(first):
            timing = time_settings(ctx, args.time.split(","), args.repeats) if args.time else {}
        report.update(rank=rank, world=world, mesh=list(shape), timing=timing)
    line = json.dumps(report)
    if args.out:
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fh:
            fh.write(line)
    print(line, flush=True)
    return 0  # a probe that fails is a result in the report; torchrun would kill the other ranks on a 1


if __name__ == "__main__":
    sys.exit(main())
