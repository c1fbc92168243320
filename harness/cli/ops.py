"""`ops`: the kernel worklist. Harvest a list's op variations, run each alone on the target, rank the ops.

``portharness ops --list L --target T --db D`` harvests the list's models it has no harvest of yet (the load
and the reference step on the CPU, through the pool: a run of its own, ``harvest:L``), then runs every
variation they use as one job of an op run (``ops:L``, settings the target's plus ``variations``), through
the same workers, policy and store as models, and prints what to fix first (`harness.analysis.worklist`).
``portharness ops harvest --list L --db D`` only harvests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from typing import Any


def _entries(args: argparse.Namespace) -> list[Any]:
    from harness.models.model_list import load_model_list

    entries = load_model_list(args.list)
    if not entries:
        raise ValueError(f"{args.list}: the list has no models")
    return entries


def _harvest(entries: list[Any], config: Any, args: argparse.Namespace, *, resume: bool = False,
             shard_spec: str = "1/1") -> Any:
    """Harvest `entries` through the run's executor (a `harvest:<list>` run); its summary. A local pool
    harvests on this host's CPU; a Ray cluster on its nodes, in actors of the run's target (a harvest uses
    only their CPU)."""
    from harness.console import terminal_text
    from harness.fleet.runner import run_models
    from harness.results.variations import harvest_list

    cpu = _harvest_config(config)
    where = "the CPU" if cpu.executor == "local" else f"the {cpu.executor} cluster's nodes"
    print(terminal_text(f"portharness: harvesting the op calls of {len(entries)} model(s) of {args.list} on {where} "
                        f"({min(cpu.jobs, len(entries)) if cpu.jobs else 'one per device'} worker(s))"), file=sys.stderr)
    return run_models(entries, cpu, args.db, list_name=harvest_list(args.list), shard_spec=shard_spec, resume=resume,
                      argv=" ".join(sys.argv), kind="harvest")


def _harvest_config(config: Any) -> Any:
    """The harvest's RunConfig: the run's fleet options (executor, cluster, jobs, limits) on the CPU target
    locally, on the run's own target's actors on a cluster."""
    from harness.fleet.runconfig import RunConfig
    from harness.results.variations import harvest_identity

    local = config.executor == "local"
    return RunConfig(target="cpu" if local else config.target, settings=harvest_identity(config.settings),
                     jobs=(config.jobs or 1) if local else config.jobs, timeout_s=config.timeout_s,
                     load_timeout_s=config.load_timeout_s, retries=0, mem_cap_mb=config.mem_cap_mb, seed=config.seed,
                     progress=config.progress, backends=[] if local else config.backends, executor=config.executor,
                     ray_address=config.ray_address)


def _to_harvest(store: Any, entries: list[Any], settings: dict[str, Any]) -> list[Any]:
    """The models without a harvest under these settings. One whose last harvest failed is tried again: what
    failed (a path, a hub, a timeout) may have been fixed since."""
    from harness.results.variations import harvested

    have = set(harvested(store, [e.id for e in entries], settings))
    return [e for e in entries if e.id not in have]


def cmd_ops(args: argparse.Namespace) -> int:
    from harness.cli.runs import _jobs, _run_config, _workers, db_stopped
    from harness.console import terminal_text
    from harness.fleet.executor import executor_for
    from harness.fleet.resume import check_resume
    from harness.fleet.runner import fleet_for, run_models, shard
    from harness.ops import jobs
    from harness.results.dbfile import StoreWriteError
    from harness.results.store import ResultStore
    from harness.results.variations import (
        harvest_failures,
        harvest_list,
        harvested,
        op_settings,
        ops_list,
        record_variations,
        specs,
    )
    from harness.results.writable import check_writable

    entries = _entries(args)
    executor = executor_for(args.executor)
    executor.check()
    n_jobs = _jobs(args, executor)
    if args.limit < 0:
        raise ValueError(f"--limit {args.limit}: must be >= 0 (0: no limit)")
    if args.opinfo_samples < 1:
        raise ValueError(f"--opinfo-samples {args.opinfo_samples}: must be >= 1")
    config = _run_config(args, jobs=n_jobs, retries=args.retries, spare=args.spare,
                         quarantine_after=args.quarantine_after, progress=not args.quiet, executor=args.executor,
                         ray_address=args.ray_address)
    for key, flag in (("compile", "--compile"), ("amp", "--amp"), ("perf", "--perf"), ("parallel", "--parallel")):
        if key in config.settings or (key == "perf" and args.perf):
            raise ValueError(f"{flag}: ops runs each kernel alone, eagerly; {flag} applies to whole models (use run)")
    only = [t for t in (args.only or "").split(",") if t.strip()]
    bad = jobs.unknown(only)
    if bad:
        raise ValueError(f"--only {','.join(bad)}: no op of that name in torch (give an op, aten::sort.stable or "
                         "sort, or a variation id)")
    shard(entries, args.shard)  # validates the spec before anything is written
    fleet = fleet_for(config) if args.action == "run" else None  # a harvest needs no device here
    check_writable(args.db)
    os.makedirs(os.path.dirname(os.path.abspath(args.db)), exist_ok=True)
    if args.action == "harvest":
        chosen = shard(entries, args.shard)
        chosen = chosen[: args.limit] if args.limit else chosen
        if args.resume:
            hc = _harvest_config(config)
            check_resume(args.db, [e.id for e in chosen], harvest_list(args.list), hc.target, hc.settings, args.shard)
        try:
            summary = _harvest(chosen, config, args, resume=args.resume, shard_spec=args.shard)
        except StoreWriteError as e:
            return db_stopped("ops harvest", args.db, e)
        counts = summary.run_counts or summary.counts
        line = (f"harvest run {summary.run_id}: {summary.rows_written} model(s) in {summary.wall_s:.1f}s "
                f"({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))})")
        print(terminal_text(line), file=sys.stderr if args.json else sys.stdout)
        if summary.unfinished:
            print(f"  {summary.unfinished} model(s) unfinished: rerun with --resume", file=sys.stderr)
        if args.json:
            print(json.dumps(asdict(summary), indent=2))
        return 0 if not summary.unfinished else 1

    missing = entries
    if os.path.exists(args.db):
        with ResultStore(args.db, read_only=True) as store:
            missing = _to_harvest(store, entries, config.settings)
    try:
        if missing:
            _harvest(missing, config, args)
        with ResultStore(args.db, read_only=True) as store:
            uses = harvested(store, [e.id for e in entries], config.settings)
            found = specs(store, jobs.used(uses))
            failed = harvest_failures(store, harvest_list(args.list), [e.id for e in entries if e.id not in uses])
        harvested_specs = jobs.select({vid: meta["spec"] for vid, meta in found.items()}, only)
        if args.source == "opinfo":
            from harness.ops.opinfo import variations

            wanted = variations(jobs.dtypes_by_op(harvested_specs), samples=args.opinfo_samples, seed=config.seed)
        else:
            wanted = harvested_specs
        chosen = jobs.select(wanted, only)
        entries_v = shard([jobs.entry(vid, spec) for vid, spec in chosen.items()], args.shard)
        if args.limit:
            entries_v = entries_v[: args.limit]
        if not entries_v:
            raise ValueError(f"no op variations to run ({args.list}: {len(uses)} model(s) harvested"
                             + (f", --only {args.only}" if args.only else "") + f", shard {args.shard})")
        config.settings = op_settings(config.settings, args.source)
        if args.resume:
            check_resume(args.db, [e.id for e in entries_v], ops_list(args.list), config.target, config.settings,
                         args.shard)
        print(terminal_text(
            f"portharness: {len(entries_v)} op variation(s) of {len(uses)} of {len(entries)} model(s) of {args.list} "
            + (f"({len(failed)} without a harvest: {', '.join(f'{m} {o}' for m, o in list(failed.items())[:3])}"
               f"{' ...' if len(failed) > 3 else ''}) " if failed else "")
            + f"({args.source}) on {args.target} {' '.join(f'{k}={v}' for k, v in config.settings.items())}, "
            f"{_workers(executor, n_jobs, fleet, len(entries_v), args.jobs, args.target)} -> {args.db}"), file=sys.stderr)
        summary = run_models(entries_v, config, args.db, list_name=ops_list(args.list), shard_spec=args.shard,
                             resume=args.resume, argv=" ".join(sys.argv), kind="variation",
                             variations={e.id: chosen[e.id] for e in entries_v})
        if args.source == "opinfo":
            with ResultStore(args.db) as store:
                record_variations(store, summary.run_id, {e.id: chosen[e.id] for e in entries_v}, "opinfo")
    except StoreWriteError as e:
        return db_stopped("ops", args.db, e)
    return _report(args, summary)


def _report(args: argparse.Namespace, summary: Any) -> int:
    from harness.analysis.worklist import format_worklist, load
    from harness.console import headline_line, outcome_table, terminal_text

    human = sys.stderr if args.json else sys.stdout
    counts = summary.run_counts or summary.counts
    done = sum(counts.values())
    print(f"\nop run {summary.run_id}: {done} variation(s) in {summary.wall_s:.1f}s"
          + (f" ({summary.resumed_skipped} already done, resumed)" if summary.resumed_skipped else ""), file=human)
    print(headline_line(counts), file=human)
    print(outcome_table(counts, done), file=human)
    if summary.quarantined:
        print(f"  quarantined devices: {', '.join(summary.quarantined)}", file=human)
    if summary.unfinished:
        print(f"  {summary.unfinished} variations unfinished: rerun with --resume", file=sys.stderr)
    if summary.never_worked:
        print(terminal_text(f"portharness: {summary.never_worked}", one_line=True), file=sys.stderr)
    work = load(args.db, summary.run_id, args.source)
    print("\n" + terminal_text(format_worklist(work)), file=human)
    if args.json:
        top = work.top(20)
        print(json.dumps({"summary": asdict(summary), "worklist": json.loads(top.to_json(orient="records"))},
                         indent=2))
    return 0 if not summary.unfinished and not summary.never_worked else 1
