"""The collective fault matrix: sim and gloo, five scenarios, world size 2 and 4, one hot spare.

Not a timed test: run it by hand (``python scripts/bench_collective_faults.py [--db x.db] [--json]``).
Each (target, world size) is one `portharness collectives --faults all --spare 1` matrix (a healthy
baseline, the five scenarios, and the fault-free restart reference the recoveries are compared
with); the script prints one table over all of them, then the headline numbers: detection time per
scenario and backend, time to resume after a recovery, and the throughput a straggler costs.

Options: ``--targets sim,cpu``, ``--world-sizes 2,4``, ``--spare 1``, ``--timeout 10``, ``--steps 20``,
``--settings fused``, ``--db`` (record every matrix, list ``collective-faults``), ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from harness.bench import faultmatrix
from harness.bench.faults import ALL, FaultConfig


def _args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench_collective_faults", description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="sim,cpu", help="comma-separated: sim, cpu (gloo), cuda (nccl)")
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--scenarios", default="all")
    ap.add_argument("--settings", default="fused")
    ap.add_argument("--spare", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--db", default=None)
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def headline(matrices: list[faultmatrix.FaultMatrix]) -> str:
    """Detection time per scenario x backend/world, resume time, straggler throughput loss."""
    results = [r for m in matrices for r in m.results if r.scenario != "none"]
    lines = ["headline (seconds from the injection):"]
    for r in results:
        what = f"detected in {r.detect_s:.2f} s by {r.detected_by}" if r.detect_s is not None else "NOT detected"
        extra = []
        if r.recovered:
            extra.append(f"resumed on the spare in {r.resume_s:.2f} s, params {'match' if r.params_match else 'DIFFER'}")
        if r.throughput_loss is not None:
            extra.append(f"throughput {-r.throughput_loss:+.0%}")
        lines.append(f"  {r.backend:<9} w{r.world_size} {r.scenario:<7} {what}" + (f"; {'; '.join(extra)}" if extra else ""))
    detect = [r.detect_s for r in results if r.detect_s is not None]
    if detect:
        lines.append(f"  detection: median {statistics.median(detect):.2f} s, max {max(detect):.2f} s over {len(detect)} runs")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _args(sys.argv[1:] if argv is None else argv)
    t0 = time.time()
    matrices = []
    try:
        configs = [
            FaultConfig(target=target.strip(), world_size=int(world), spare=args.spare, timeout_s=args.timeout,
                        steps=args.steps, scenarios=list(ALL) if args.scenarios == "all" else args.scenarios.split(","),
                        settings=args.settings.split(","))
            for target in args.targets.split(",") for world in args.world_sizes.split(",")
        ]
        for cfg in configs:
            cfg.validate()
    except ValueError as exc:
        print(f"bench_collective_faults: error: {exc}", file=sys.stderr)
        return 2
    for cfg in configs:
        print(f"running {cfg.target} world {cfg.world_size} ...", file=sys.stderr, flush=True)
        matrices.append(faultmatrix.run_matrix(cfg))
    run_ids = [faultmatrix.record(m, args.db, argv=" ".join(sys.argv)) if args.db else None for m in matrices]
    if args.json:
        print(json.dumps([faultmatrix.as_json(m, rid) for m, rid in zip(matrices, run_ids, strict=True)], indent=2))
        return 0
    rows = [row for m in matrices for row in faultmatrix.table_rows(m.results)]
    print(faultmatrix.render_table(rows, f"collective fault matrix: {len(matrices)} matrices in {time.time() - t0:.0f} s"))
    print()
    print(headline(matrices))
    if args.db:
        print(f"recorded runs {', '.join(str(r) for r in run_ids)} in {args.db}")
    problems = [p for m in matrices for p in faultmatrix.problems(m)]
    for p in problems:
        print(f"  problem: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
