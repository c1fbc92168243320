"""`check`, `run` and `zoo`: the commands that run models (their options resolved into a RunConfig here)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any


def _run_config(args: argparse.Namespace, **overrides: Any):
    """Everything about the target checked before anything runs or is written (exit 2 otherwise)."""
    from harness.backends import backend_modules, load_backends, resolve_target
    from harness.run.runner import RunConfig

    modules = backend_modules(args.backend)
    load_backends(modules)
    adapter, _ = resolve_target(args.target)
    options = {"precision": args.precision}
    for key in ("ops", "attn", "fault", "fallback", "declared_precision", "numerics", "oracle_max_params"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    if args.dtype not in (None, "fp32"):
        options["dtype"] = args.dtype
    if args.mode != "inference":
        options["mode"] = args.mode  # inference is the default: its rows keep their identity
    if args.op_check != "auto":
        options["op_check"] = args.op_check  # a different rule judged the run: part of its identity
    settings = adapter.check_settings(options)
    if args.seed:
        settings["seed"] = args.seed  # results depend on it: part of the run's identity (0 is the default)
    return RunConfig(target=args.target, settings=settings, timeout_s=args.timeout, backends=modules,
                     load_timeout_s=args.load_timeout,
                     mem_cap_mb=args.mem_cap_mb or None, seed=args.seed, localize=not args.no_localize, **overrides)


def cmd_check(args: argparse.Namespace) -> int:
    from harness.console import clean_row, verdict_lines
    from harness.models.model_list import find_entry
    from harness.outcomes import PASSING
    from harness.results.store import ResultStore
    from harness.run.runner import run_models

    # One model: its worker forks from this process (one import of torch and transformers, not two) and
    # still isolates a segfault or a hang from the CLI.
    config = _run_config(args, jobs=1, retries=0, progress=False, fork_workers=True)
    entry = find_entry(args.model, task=args.task)
    if not args.db:  # the DB is temporary; a repro of a diverging op must outlive it
        config.repro_dir = tempfile.mkdtemp(prefix="portharness-repro-")
    with tempfile.TemporaryDirectory(prefix="portharness-check-") as tmp:
        db = args.db or os.path.join(tmp, "check.db")
        summary = run_models([entry], config, db, list_name=f"check:{entry.id}", argv=" ".join(sys.argv))
        with ResultStore(db, read_only=True) as store:
            row = clean_row(store.results(summary.run_id).iloc[0].to_dict())
    if args.json:
        print(json.dumps(row, indent=2, default=str))
    else:
        print(f"portharness check {entry.id} on {args.target}")
        print("\n".join(verdict_lines(row)))
    return 0 if row["outcome"] in PASSING else 1


def cmd_run(args: argparse.Namespace) -> int:
    from harness.console import headline_line, outcome_table
    from harness.models.model_list import load_model_list
    from harness.results.dbfile import usable
    from harness.run.runner import plan, run_models, shard

    entries = load_model_list(args.list)
    if args.only:
        wanted = set(args.only.split(","))
        entries = [e for e in entries if e.id in wanted or e.arch in wanted]
    entries = shard(entries, args.shard)
    if args.limit < 0:
        raise ValueError(f"--limit {args.limit}: must be >= 0 (0: no limit)")
    if args.limit:
        entries = entries[: args.limit]
    if not entries:
        raise ValueError(f"nothing to run ({args.list}, shard {args.shard}, limit {args.limit})")
    config = _run_config(args, jobs=args.jobs, retries=args.retries, spare=args.spare,
                         quarantine_after=args.quarantine_after, progress=not args.quiet,
                         rerun_flaky=args.rerun_flaky)
    plan(config)  # devices, spares, ranges: before a line is printed or a file touched
    if os.path.exists(args.db):
        usable(Path(args.db))  # ours and undamaged, checked without writing
    os.makedirs(os.path.dirname(os.path.abspath(args.db)), exist_ok=True)
    print(f"portharness: {len(entries)} models from {args.list} (shard {args.shard}) on {args.target} "
          f"{' '.join(f'{k}={v}' for k, v in config.settings.items())}, {args.jobs} worker(s) -> {args.db}",
          file=sys.stderr)
    summary = run_models(entries, config, args.db, list_name=args.list, shard_spec=args.shard, resume=args.resume,
                         argv=" ".join(sys.argv))
    if args.resume:
        print(f"portharness: resumed run {summary.resumed_run} ({summary.resumed_skipped} models already done)"
              if summary.resumed_run else "portharness: no unfinished run matches (list, target, settings, shard); "
              "started a new one", file=sys.stderr)
    counts = summary.run_counts or summary.counts  # the whole run's, a resume's earlier rows included
    done = sum(counts.values())
    print(f"\nrun {summary.run_id}: {done} models"
          + (f" ({summary.rows_written} now in {summary.wall_s:.1f}s, {summary.resumed_skipped} already done, resumed)"
             if summary.resumed_skipped else f" in {summary.wall_s:.1f}s"))
    print(headline_line(counts))
    print(outcome_table(counts, done))
    if summary.with_fallback:
        print("  with CPU fallback: " + ", ".join(f"{o} {n}" for o, n in sorted(summary.with_fallback.items())))
    if summary.reruns:
        print(f"  re-ran {summary.reruns.get('models', 0)} model(s) whose attempts disagreed, {args.rerun_flaky}x each: "
              f"flaky {summary.reruns.get('flaky', 0)}, stable {summary.reruns.get('stable', 0)}")
    if summary.quarantined:
        print(f"  quarantined devices: {', '.join(summary.quarantined)}"
              + (f"; hot spares brought in: {', '.join(summary.spares_used)}" if summary.spares_used else ""))
    if summary.unfinished:
        print(f"  {summary.unfinished} models unfinished: rerun with --resume", file=sys.stderr)
    if summary.never_worked:
        print(f"portharness: {summary.never_worked}", file=sys.stderr)
    if args.report:
        from harness.report import build_report

        print(f"report: {build_report(args.db, args.report, run_id=summary.run_id)}")
    if args.json:
        print(json.dumps(asdict(summary), indent=2))
    return 0 if not summary.unfinished and not summary.never_worked else 1


def cmd_zoo(args: argparse.Namespace) -> int:
    from harness.run.zoo import generate

    counts = generate(args.out, jobs=args.jobs, limit=args.limit, timeout_s=args.timeout,
                      only=args.only.split(",") if args.only else None, report_path=args.report)
    print(f"candidates: {counts['candidates']}  kept: {counts['kept']}  "
          f"architectures: {counts['architectures']}  wall: {counts['wall_s']}s")
    for reason, n in counts["failed"].items():
        print(f"  failed {reason}: {n}")
    print(f"wrote {args.out}")
    return 0

