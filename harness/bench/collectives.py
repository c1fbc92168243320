"""Collective-setting performance: what each communication setting costs, as a time ratio.

Why ratios: absolute collective times on a simulated backend (or on whatever machine runs the
nightly) mean little, but "skinny collectives make an all_reduce of 16 MiB 6x slower and a DDP step
1.3x slower than fused, on the same machine in the same run" carries over. Every setting is therefore
timed against the baseline setting (fused, default bucket, no message cap, per-device) *in the same
run*, interleaved repeat by repeat (the order rotates each repeat) so drift and noise hit both; the
ratio's spread comes from the per-repeat ratios.

What is timed, per setting (see `harness.comms.settings` for what each setting does):

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

import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from harness.bench.config import (  # noqa: F401  the benchmark's vocabulary, re-exported
    BASELINE,
    DDP_BATCH,
    DDP_CONFIG,
    DDP_OP,
    DEFAULT_SETTINGS,
    DEFAULT_SIZES,
    KIB,
    MIB,
    OPS,
    TARGETS,
    BenchConfig,
    Measurement,
    spread,
    summarize,
)
from harness.bench.ranks import rank_main
from harness.comms.settings import parse_setting, parse_size


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

    workdir = tempfile.mkdtemp(prefix="portharness-collectives-")
    t0 = time.perf_counter()
    try:
        mp.spawn(rank_main, args=(asdict(cfg), workdir), nprocs=cfg.world_size, join=True)
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
    return [parse_size(x.strip()) for x in text.split(",") if x.strip()]


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
