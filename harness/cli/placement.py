"""`placement`: which placements of processes on chips the target allows, and what each costs."""

from __future__ import annotations

import argparse
import json
import sys


def placement_config(args: argparse.Namespace):
    """The scenarios `portharness placement` arguments describe (validated: bad input is one line, exit 2)."""
    from harness.bench.placement import PlacementConfig, parse_scenarios
    from harness.cli.guard import load_backends_guarded

    cfg = PlacementConfig(target=args.target, scenarios=parse_scenarios(args.scenarios), steps=args.steps,
                          warmup=args.warmup, timeout_s=args.timeout,
                          backends=load_backends_guarded(args.backend, args.backend_timeout))
    cfg.validate()
    return cfg


def cmd_placement(args: argparse.Namespace) -> int:
    from harness.backends import resolve_target
    from harness.bench import placement
    from harness.console import terminal_text

    cfg = placement_config(args)
    adapter, devices = resolve_target(args.target)  # the device exists, its visibility variable names devices
    adapter.sharing()  # a bad sharing switch is bad input too, said before anything runs
    if args.db:
        from harness.results.writable import check_writable

        check_writable(args.db)
    results = placement.run_placement(cfg, adapter, devices)
    run_id = placement.record(results, cfg, args.db, argv=" ".join(sys.argv)) if args.db else None
    if args.json:
        print(json.dumps(placement.as_json(results, cfg, run_id), indent=2))
    else:
        print(terminal_text(placement.format_table(results, cfg)))
        if run_id:
            print(f"recorded run {run_id} in {args.db}")
    for line in placement.problems(results):
        print(terminal_text(f"portharness placement: {line}", one_line=True), file=sys.stderr)
    return 1 if placement.problems(results) else 0
