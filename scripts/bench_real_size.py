"""Real-size checkpoints through `portharness check`: peak memory and wall time per model size.

Builds GPT-2-style models of about 125M, 355M and 1.3B parameters with ``from_config`` (seeded) and
``save_pretrained`` (sharded safetensors) into a temp dir -- no download -- then runs
``portharness check DIR --target sim --json`` on each in a fresh process and prints: parameters, fp32
weight bytes, the process's peak RSS (the kernel's own ``ru_maxrss`` of the child) and its ratio to the
weight bytes, wall time, and wall / reference-forward time, plus the per-phase peaks the row records.
Not a timed test; run by hand (the 1.3B model needs ~6 GB of disk and several minutes):

    python scripts/bench_real_size.py [--sizes 125m,355m,1.3b] [--keep DIR] [-- extra check options]

Cold then warm reference cache: the same command twice with ``-- --ref-cache DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {  # GPT-2 small, medium, and a 1.3B between large and XL
    "125m": {"n_embd": 768, "n_layer": 12, "n_head": 12},
    "355m": {"n_embd": 1024, "n_layer": 24, "n_head": 16},
    "1.3b": {"n_embd": 2048, "n_layer": 24, "n_head": 16},
}


def build(size: str, out: Path) -> int:
    """Save the model in a child process (so its memory is gone before the check); returns parameters."""
    code = f"""
import torch, json, sys
from transformers import GPT2Config
from harness.models.tiny import build_from_config
cfg = GPT2Config(**{SIZES[size]!r}, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = build_from_config("causal-lm", cfg, seed=0)
model.save_pretrained({str(out)!r}, max_shard_size="500MB")
print(sum(p.numel() for p in model.parameters()))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(r.stdout.strip().splitlines()[-1])


def check(path: Path, extra: list[str]) -> tuple[dict, float, float]:
    """(row, wall seconds, peak RSS MiB of the check process)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "harness.cli", "check", str(path), "--target", "sim", "--json", *extra],
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if peak <= before:
        print("note: ru_maxrss of children did not grow; the peak below may belong to an earlier child", file=sys.stderr)
    start = r.stdout.find("{")
    if start < 0:
        raise RuntimeError(f"check failed (exit {r.returncode}): {r.stderr[-2000:]}")
    return json.loads(r.stdout[start:]), wall, peak / 1024


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="125m,355m,1.3b")
    p.add_argument("--keep", default=None, help="save the checkpoints here (and reuse them) instead of a temp dir")
    p.add_argument("extra", nargs="*", help="more `portharness check` options, after --")
    args = p.parse_args(argv)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-real-size-"))
    rows = []
    try:
        for size in [s.strip() for s in args.sizes.split(",") if s.strip()]:
            d = root / f"gpt2-{size}"
            if not (d / "config.json").exists():
                t0 = time.perf_counter()
                build(size, d)
                print(f"built {d} in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
            weight_bytes = sum(f.stat().st_size for f in d.glob("*.safetensors"))
            row, wall, peak = check(d, args.extra)
            params = weight_bytes // 4
            ref = row.get("ref_time_s") or float("nan")
            rows.append((size, params, weight_bytes, peak, wall, ref, row))
            print(f"{size}: {row['outcome']} oracle={row.get('oracle')} peak {peak:.0f} MiB, wall {wall:.1f}s",
                  file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"{'model':<8} {'params':>14} {'weights':>10} {'peak RSS':>10} {'RSS/weights':>12} {'wall s':>8} "
          f"{'wall/ref fwd':>13}  outcome")
    for size, params, wb, peak, wall, ref, row in rows:
        print(f"{size:<8} {params:>14,} {wb / 2**20:>8.0f}Mi {peak:>8.0f}Mi {peak * 2**20 / wb:>12.2f} {wall:>8.1f} "
              f"{wall / ref:>13.0f}  {row['outcome']}")
    print("\nper-phase seconds / peak RSS MiB (as recorded in each row):")
    for size, *_, row in rows:
        phases = row.get("phases") or {}
        print(f"  {size}: " + ", ".join(f"{k} cached" if v.get("cached") else f"{k} {v['s']:.1f}s/{v['peak_rss_mb']:.0f}"
                                        for k, v in phases.items())
              + (f"  (reference side: {row['ref_cache']})" if row.get("ref_cache") else ""))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
