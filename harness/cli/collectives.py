"""`collectives`: the collective-settings benchmark and its fault scenarios."""

from __future__ import annotations

import argparse
import json
import sys


def collectives_config(args: argparse.Namespace):
    """The benchmark configuration `portharness collectives` arguments describe (validated)."""
    from harness.bench import collectives as bench
    from harness.cli.guard import load_backends_guarded

    modules = load_backends_guarded(args.backend, args.backend_timeout)
    cfg = bench.BenchConfig(
        target=args.target, world_size=args.world_size, repeats=args.repeats, warmup=args.warmup, ddp=args.ddp,
        backends=modules,
        sizes=bench.parse_sizes(args.sizes) if args.sizes else list(bench.DEFAULT_SIZES),
        settings=[s.strip() for s in args.settings.split(",") if s.strip()] if args.settings
        else list(bench.DEFAULT_SETTINGS),
        **({"timeout_s": args.timeout} if args.timeout is not None else {}),
    )
    cfg.validate()
    return cfg


def collective_faults_config(args: argparse.Namespace):
    """The fault matrix `portharness collectives --faults` arguments describe (validated)."""
    from harness.bench.faults import FaultConfig, parse_scenarios

    cfg = FaultConfig(
        target=args.target, world_size=args.world_size, scenarios=[s.name for s in parse_scenarios(args.faults)],
        settings=[s.strip() for s in args.settings.split(",") if s.strip()] if args.settings else ["fused"],
        fault_rank=args.fault_rank, fault_step=args.fault_step, steps=args.steps, spare=args.spare,
        straggler_excess=args.straggler_excess, **({"timeout_s": args.timeout} if args.timeout is not None else {}),
    )
    cfg.validate()
    return cfg


def _check_db(args: argparse.Namespace) -> None:
    """--db can take the rows, checked before the benchmark runs (not after minutes of it)."""
    if args.db:
        from harness.results.writable import check_writable

        check_writable(args.db)


def cmd_collective_faults(args: argparse.Namespace) -> int:
    from harness.bench import faultmatrix

    cfg = collective_faults_config(args)
    _check_db(args)
    matrix = faultmatrix.run_matrix(cfg)
    run_id = faultmatrix.record(matrix, args.db, argv=" ".join(sys.argv)) if args.db else None
    if args.json:
        print(json.dumps(faultmatrix.as_json(matrix, run_id), indent=2))
    else:
        print(faultmatrix.format_table(matrix))
        if run_id:
            print(f"recorded run {run_id} in {args.db}")
    return 1 if faultmatrix.problems(matrix) else 0


def cmd_collectives(args: argparse.Namespace) -> int:
    from harness.bench import collectives as bench

    if args.faults is not None:
        return cmd_collective_faults(args)
    cfg = collectives_config(args)
    _check_db(args)
    try:
        result = bench.run_benchmark(cfg)
    except Exception as exc:  # a rank died: spawn re-raises its traceback
        print(f"portharness collectives: benchmark failed: {exc}", file=sys.stderr)
        return 1
    run_id = bench.record(result, args.db, argv=" ".join(sys.argv)) if args.db else None
    if args.json:
        print(json.dumps(bench.as_json(result, run_id), indent=2))
    else:
        print(bench.format_table(result))
        if run_id:
            print(f"recorded run {run_id} in {args.db}")
    return 0

