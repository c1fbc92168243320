"""Collective-setting performance: what each communication setting costs, as a time ratio.

Why ratios: absolute collective times on a simulated backend (or on whatever machine runs the
nightly) mean little, but "skinny collectives make an all_reduce of 16 MiB 6x slower and a DDP step
1.3x slower than fused, on the same machine in the same run" carries over. Every setting is therefore
timed against the baseline setting (fused, default bucket, no message cap, per-device) *in the same
run*, interleaved repeat by repeat (the order rotates each repeat) so drift and noise hit both; the
ratio's spread comes from the per-repeat ratios.

What is timed, per setting (see `harness.sim.distributed` for what each setting does):

- ``all_reduce``, ``all_gather`` (``all_gather_into_tensor``), ``reduce_scatter``
  (``reduce_scatter_tensor``) and ``all_reduce_coalesced`` (16 equal tensors, packed by the bucket
  setting) over a sweep of sizes. The size is the full buffer: the all_reduce tensor, the gathered
  output, the scattered input, the sum of the coalesced tensors (nccl-tests' convention), float32.
- one DDP training step (forward, backward with gradient all_reduce, SGD step) of a tiny GPT-2 built
  from a small config, with ``bucket_cap_mb`` from the bucket setting.

Each timing is the slowest rank's wall time for the op after a barrier on the raw transport (outside
the settings), so it is the collective's completion time. Ranks are started with
``torch.multiprocessing.spawn`` and meet through a ``FileStore`` in a temporary directory (no ports).

``--target sim`` runs the ``sim`` c10d backend (gloo under sim tensors); ``--target cpu`` runs the same
settings layer over gloo on CPU tensors and ``--target cuda`` over nccl on CUDA tensors, so rows from
different targets are comparable. With the fused baseline the layer passes each collective straight to
the transport (one call), so the baseline is gloo/nccl itself.

On sim the benchmark runs with the ``full`` op profile unless ``PORTHARNESS_SIM_OPS`` is set: DDP
needs ops (``aten::empty_like``, ...) the young profile lacks, and op coverage is the matrix's job,
not this benchmark's.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

KIB = 1024
MIB = 1024 * 1024
DEFAULT_SIZES = [4 * KIB, 64 * KIB, 1 * MIB, 16 * MIB]
BASELINE = "fused"
DEFAULT_SETTINGS = [BASELINE, "skinny", "bucket:256k", "cap:256k", "per-host"]
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_reduce_coalesced")
DDP_OP = "ddp_step"
COALESCED_TENSORS = 16
DEFAULT_REPEATS = 10
DEFAULT_WARMUP = 2
ELEMENT_BYTES = 4  # float32
MAX_SIZE = 1 << 30

# target -> (c10d backend name registered by harness.sim.distributed, transport label for rows)
TARGETS = {"sim": ("sim", "sim(gloo)"), "cpu": ("shaped_gloo", "gloo"), "cuda": ("shaped_nccl", "nccl")}

# The DDP model: GPT-2 shrunk so a step is short on a 2-core host but the gradients (~5.7 MiB in
# fp32) are big enough for the communication settings to show. No dropout: nothing random in a step.
DDP_CONFIG = {
    "vocab_size": 8192,
    "n_embd": 128,
    "n_layer": 2,
    "n_head": 2,
    "n_positions": 64,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
DDP_BATCH = (2, 32)  # sequences x tokens per rank


def _simdist():
    """`harness.sim.distributed`, imported lazily (torch first) so that importing this module for the
    CLI stays cheap; until 193b139 importing `harness.sim` before torch also broke torch's autoload."""
    import torch  # noqa: F401

    import harness.sim.distributed

    return harness.sim.distributed


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------


@dataclass
class BenchConfig:
    """One benchmark run; `validate` explains every bad value before any process starts."""

    target: str = "sim"
    world_size: int = 2
    sizes: list[int] = field(default_factory=lambda: list(DEFAULT_SIZES))
    settings: list[str] = field(default_factory=lambda: list(DEFAULT_SETTINGS))
    ops: list[str] = field(default_factory=lambda: list(OPS))
    repeats: int = DEFAULT_REPEATS
    warmup: int = DEFAULT_WARMUP
    ddp: bool = True
    timeout_s: float = 300.0

    def validate(self) -> None:
        parse_setting = _simdist().parse_setting

        if self.target not in TARGETS:
            raise ValueError(f"unknown target {self.target!r}; expected one of {', '.join(TARGETS)}")
        if not isinstance(self.world_size, int) or self.world_size < 2:
            raise ValueError(
                f"world size must be an integer >= 2 (a collective needs peers), got {self.world_size}"
            )
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        bad_ops = [o for o in self.ops if o not in OPS]
        if bad_ops:
            raise ValueError(f"unknown op(s) {', '.join(bad_ops)}; expected some of {', '.join(OPS)}")
        smallest = ELEMENT_BYTES * self.world_size * COALESCED_TENSORS
        for s in self.sizes:
            if not isinstance(s, int) or isinstance(s, bool) or s < smallest or s > MAX_SIZE:
                raise ValueError(
                    f"bad size {s!r}: sizes are byte counts from {smallest} (float32 x world size "
                    f"{self.world_size} x {COALESCED_TENSORS} coalesced tensors) to {MAX_SIZE}"
                )
        if not self.settings:
            raise ValueError("no settings to measure")
        for name in self.settings:
            s = parse_setting(name)  # raises ValueError naming the grammar
            if s.placement == "per-host" and self.world_size % s.ranks_per_host:
                raise ValueError(
                    f"setting {name!r}: {s.ranks_per_host} ranks per host does not divide world size "
                    f"{self.world_size}"
                )
        if len(set(self.settings)) != len(self.settings):
            raise ValueError(f"duplicate settings in {self.settings}")
        if self.target == "cuda":
            import torch

            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if n < self.world_size:
                raise ValueError(
                    f"--target cuda needs one GPU per rank (nccl refuses two ranks on one GPU): "
                    f"world size {self.world_size}, {n} GPU(s) visible"
                )

    def with_baseline(self) -> BenchConfig:
        """The baseline is always measured (first), since every ratio is against it."""
        if BASELINE in self.settings:
            names = [BASELINE] + [s for s in self.settings if s != BASELINE]
        else:
            names = [BASELINE, *self.settings]
        return BenchConfig(**{**asdict(self), "settings": names})


@dataclass
class Measurement:
    """One op x size x setting: its time spread and its ratio vs the baseline (paired per repeat)."""

    op: str
    size_bytes: int
    setting: str
    settings: dict
    times_s: list[float]
    median_s: float
    p10_s: float
    p90_s: float
    ratio: float
    ratio_p10: float
    ratio_p90: float

    def as_dict(self) -> dict:
        return asdict(self)


def spread(xs: Sequence[float]) -> tuple[float, float, float]:
    """(p10, median, p90), linearly interpolated (numpy's default method)."""
    if not xs:
        raise ValueError("quantile of no values")
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    deciles = statistics.quantiles(xs, n=10, method="inclusive")
    return deciles[0], statistics.median(xs), deciles[-1]


def summarize(
    times: dict[tuple[str, int, str], list[float]], settings: dict[str, dict], baseline: str = BASELINE
) -> list[Measurement]:
    """Per-repeat times (slowest rank) -> measurements with ratios vs ``baseline`` of the same op/size."""
    out = []
    for (op, size, name), ts in times.items():
        base = times[(op, size, baseline)]
        ratios = [t / b for t, b in zip(ts, base, strict=True) if b > 0]
        p10, med, p90 = spread(ts)
        r10, rmed, r90 = spread(ratios)
        out.append(
            Measurement(
                op=op, size_bytes=size, setting=name, settings=settings[name], times_s=list(ts),
                median_s=med, p10_s=p10, p90_s=p90, ratio=rmed, ratio_p10=r10, ratio_p90=r90,
            )
        )
    order = {n: i for i, n in enumerate(settings)}
    op_order = {o: i for i, o in enumerate((*OPS, DDP_OP))}
    out.sort(key=lambda m: (op_order.get(m.op, 99), m.size_bytes, order[m.setting]))
    return out


# ----------------------------------------------------------------------------------------------
# Rank side
# ----------------------------------------------------------------------------------------------


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


def _sim_backward_ok(index: int) -> bool:
    """Whether autograd runs on ``sim:index``: torch 2.13's Python PrivateUse1 device guard reports a
    device count of 1, so the autograd engine has a ready queue for index 0 only."""
    import torch

    try:
        x = torch.zeros(1).to(f"sim:{index}").requires_grad_()
        (x * 2).sum().backward()
        return True
    except RuntimeError as exc:
        if "device_ready_queues_" in str(exc):
            return False
        raise


SIM_AUTOGRAD_NOTE = "autograd on sim:N>0 is unsupported (torch's Python device guard reports 1 device)"


def ddp_device(target: str, rank: int):
    """The device a rank trains on: ``sim:{rank % count}``, or ``sim:0`` where autograd can't run there.

    Each rank is its own process (its own simulated host), so falling back to its own ``sim:0`` keeps
    one device per rank; the fallback is recorded with the rows.
    """
    import torch

    device = _device(target, rank)
    if device.type == "sim" and device.index and not _sim_backward_ok(device.index):
        return torch.device("sim", 0)
    return device


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

    collective_settings = _simdist().collective_settings

    train_on = ddp_device(cfg.target, rank)
    if train_on != device:
        note["ddp_device_reason"] = SIM_AUTOGRAD_NOTE
    device = train_on
    note["ddp_device"] = str(device)
    gen = torch.Generator().manual_seed(1234 + rank)
    ids = torch.randint(0, DDP_CONFIG["vocab_size"], DDP_BATCH, generator=gen).to(device)
    steps = {}
    for name, s in specs.items():
        model = build_from_config("causal-lm", GPT2Config(**DDP_CONFIG), seed=0).train().to(device)
        model.tie_weights()  # .to("sim") unties lm_head from wte (a new Parameter per module); re-tie
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
    set_collective_settings = _simdist().set_collective_settings

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


def _worker(rank: int, cfg_dict: dict, workdir: str) -> None:
    """One rank: init the backend, time every op/size/setting and the DDP step, hand times to rank 0."""
    cfg = BenchConfig(**cfg_dict)
    import torch.distributed as dist

    import harness.sim

    parse_setting = _simdist().parse_setting

    note: dict = {}
    if cfg.target == "sim":
        if not os.environ.get("PORTHARNESS_SIM_OPS"):
            harness.sim.set_op_profile("full")
        note["sim"] = harness.sim.settings()
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
        transport = pg.transport
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


# ----------------------------------------------------------------------------------------------
# Driver side
# ----------------------------------------------------------------------------------------------


@dataclass
class BenchResult:
    """Everything a run measured, plus what the rows need to say where it was measured."""

    config: BenchConfig
    measurements: list[Measurement]
    note: dict
    wall_s: float

    @property
    def backend(self) -> str:
        return TARGETS[self.config.target][1]


def run_benchmark(cfg: BenchConfig) -> BenchResult:
    """Validate ``cfg``, spawn ``world_size`` ranks, and return the measurements (ratios vs fused)."""
    cfg.validate()
    cfg = cfg.with_baseline()
    import torch.multiprocessing as mp

    parse_setting = _simdist().parse_setting

    workdir = tempfile.mkdtemp(prefix="portharness-collectives-")
    t0 = time.perf_counter()
    try:
        mp.spawn(_worker, args=(asdict(cfg), workdir), nprocs=cfg.world_size, join=True)
        with open(os.path.join(workdir, "result.json")) as fh:
            raw = json.load(fh)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    times = {tuple(k): v for k, v in raw["times"]}
    note = raw["note"]
    settings = {}
    for name in cfg.settings:
        d = parse_setting(name).as_dict()
        d.update({k: v for k, v in note.items() if not k.startswith("ddp_")})
        settings[name] = d
    ms = summarize(times, settings)
    for m in ms:
        if m.op == DDP_OP:
            m.settings = {
                **m.settings,
                "model": "gpt2",
                "model_config": DDP_CONFIG,
                "batch": list(DDP_BATCH),
                **{k: v for k, v in note.items() if k.startswith("ddp_")},
            }
    return BenchResult(cfg, ms, note, time.perf_counter() - t0)


def to_rows(result: BenchResult, run_id: str) -> list:
    """`CollectiveRow`s for `ResultStore.record_collective` (kind: collective)."""
    from harness.results.rows import CollectiveRow

    cfg = result.config
    return [
        CollectiveRow(
            run_id=run_id,
            target=cfg.target,
            backend=result.backend,
            world_size=cfg.world_size,
            op=m.op,
            size_bytes=m.size_bytes,
            setting=m.setting,
            settings={**m.settings, "kind": "collective", "warmup": cfg.warmup},
            baseline_setting=BASELINE,
            median_s=m.median_s,
            p10_s=m.p10_s,
            p90_s=m.p90_s,
            repeats=len(m.times_s),
            ratio=m.ratio,
            ratio_p10=m.ratio_p10,
            ratio_p90=m.ratio_p90,
        )
        for m in result.measurements
    ]


def record(result: BenchResult, db: str | os.PathLike, argv: str = "") -> str:
    """Write the rows into the DB at ``db`` as one run (list ``collectives``); returns the run id."""
    from harness.results.rows import RunInfo
    from harness.results.store import ResultStore

    cfg = result.config
    with ResultStore(db) as store:
        run_id = store.begin_run(
            RunInfo(
                list_name="collectives",
                target=cfg.target,
                settings={
                    "kind": "collective",
                    "backend": result.backend,
                    "world_size": cfg.world_size,
                    "settings": cfg.settings,
                },
                argv=argv,
            )
        )
        for row in to_rows(result, run_id):
            store.record_collective(row)
        store.finish_run(run_id)
    return run_id


def fmt_size(n: int) -> str:
    """Bytes as "4 KiB" / "16 MiB" (exact units where they divide)."""
    for unit, div in (("MiB", MIB), ("KiB", KIB)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    if n >= MIB:
        return f"{n / MIB:.1f} MiB"
    return f"{n} B"


def format_table(result: BenchResult) -> str:
    """A readable table: op, size, setting, median ms, p10-p90 ms, ratio vs baseline [p10-p90]."""
    cfg = result.config
    head = (
        f"collectives: target {cfg.target} ({result.backend}), world size {cfg.world_size}, "
        f"{cfg.repeats} repeats after {cfg.warmup} warm-up, baseline {BASELINE}; "
        f"{result.wall_s:.0f} s"
    )
    cols = ("op", "size", "setting", "median ms", "p10-p90 ms", f"x {BASELINE}", "ratio p10-p90")
    lines = []
    for m in result.measurements:
        lines.append(
            (
                m.op,
                fmt_size(m.size_bytes),
                m.setting,
                f"{m.median_s * 1e3:.3f}",
                f"{m.p10_s * 1e3:.3f}-{m.p90_s * 1e3:.3f}",
                f"{m.ratio:.2f}",
                f"{m.ratio_p10:.2f}-{m.ratio_p90:.2f}",
            )
        )
    widths = [max(len(c), *(len(r[i]) for r in lines)) for i, c in enumerate(cols)]
    right = {3, 4, 5, 6}

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths, strict=True))
        )

    out = [head, fmt(cols), "  ".join("-" * w for w in widths)]
    prev = None
    for row in lines:
        if prev is not None and row[:2] != prev[:2]:
            out.append("")
        out.append(fmt(row))
        prev = row
    ddp = result.note.get("ddp_device")
    if ddp:
        devices = ", ".join(ddp) if isinstance(ddp, list) else ddp
        reason = result.note.get("ddp_device_reason")
        reasons = [r for r in (reason if isinstance(reason, list) else [reason]) if r]
        out.append("")
        out.append(
            f"ddp_step: tiny GPT-2 ({result.note.get('ddp_params', 0):,} params, "
            f"{fmt_size(result.note.get('ddp_grad_bytes', 0))} of fp32 grads), batch "
            f"{DDP_BATCH[0]}x{DDP_BATCH[1]} per rank, on {devices}" + (f" ({reasons[0]})" if reasons else "")
        )
    return "\n".join(out)


def parse_sizes(text: str) -> list[int]:
    """'4k,1m,4096' -> byte counts (k/m suffixes, as the sim collective settings take them)."""
    return [_simdist().parse_size(x.strip()) for x in text.split(",") if x.strip()]


def as_json(result: BenchResult, run_id: str | None) -> dict:
    """The `--json` payload: config, where it ran, and every measurement."""
    cfg = result.config
    return {
        "target": cfg.target,
        "backend": result.backend,
        "world_size": cfg.world_size,
        "baseline": BASELINE,
        "run_id": run_id,
        "note": result.note,
        "rows": [m.as_dict() for m in result.measurements],
    }
