"""`check`, `run` and `zoo`: the commands that run models (their options resolved into a RunConfig here)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from dataclasses import asdict
from typing import Any


def _run_config(args: argparse.Namespace, **overrides: Any):
    """Everything about the target checked before anything runs or is written (exit 2 otherwise)."""
    from harness.backends import resolve_target
    from harness.cli.guard import load_backends_guarded
    from harness.fleet.executor import executor_for
    from harness.fleet.runner import RunConfig

    if args.oracle_max_params is not None and args.oracle_max_params < 0:
        raise ValueError(f"--oracle-max-params {args.oracle_max_params}: must be >= 0 (0: no fp64 oracle for any model)")
    modules = load_backends_guarded(args.backend, args.backend_timeout)
    if not executor_for(getattr(args, "executor", "local")).one_host:  # the driver needs no device: the nodes have them
        from harness.backends import adapter_for

        adapter = adapter_for(args.target)
        adapter.load()
    else:
        adapter, _ = resolve_target(args.target)
    options = {"precision": args.precision}
    for key in ("ops", "attn", "fault", "fallback", "declared_precision", "numerics", "oracle_max_params", "slow_ops",
                "compile", "amp", "compiler_bug"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    if args.dynamic:
        options["dynamic"] = True
    if args.dtype not in (None, "fp32"):
        options["dtype"] = args.dtype
    if args.mode != "inference":
        options["mode"] = args.mode  # inference is the default: its rows keep their identity
    options.update(_generate_options(args))
    if args.op_check != "auto":
        options["op_check"] = args.op_check  # a different rule judged the run: part of its identity
    if args.confirm == "off":
        options["confirm"] = "off"  # pass_declared rows not confirmed: part of its identity
    from harness.run.compiled import check

    check(options)  # --compile, --dynamic, --amp: before the backend's own checks read them
    settings = adapter.check_settings(options)
    if args.seed:
        settings["seed"] = args.seed  # results depend on it: part of the run's identity (0 is the default)
    if args.compile_timeout <= 0:
        raise ValueError(f"--compile-timeout {args.compile_timeout}: must be > 0 seconds")
    config = RunConfig(target=args.target, settings=settings, timeout_s=args.timeout, backends=modules,
                       load_timeout_s=args.load_timeout, compile_timeout_s=args.compile_timeout,
                       compile_cache=args.compile_cache,
                       mem_cap_mb=args.mem_cap_mb or None, seed=args.seed, localize=not args.no_localize,
                       perf=args.perf, perf_budget_s=args.perf_budget, **overrides)
    config.validate()
    return config


def _generate_options(args: argparse.Namespace) -> dict[str, Any]:
    """--new-tokens and --cache: generate mode's, kept in the settings only where they differ from the
    defaults (8, dynamic), so a default generate run keeps one identity."""
    given = [o for o, v in (("--new-tokens", args.new_tokens), ("--cache", args.cache)) if v is not None]
    if args.mode != "generate":
        if given:
            raise ValueError(f"{' and '.join(given)}: only with --mode generate (this is --mode {args.mode})")
        return {}
    if args.new_tokens is not None and not 1 <= args.new_tokens <= 1024:
        raise ValueError(f"--new-tokens {args.new_tokens}: must be between 1 and 1024")
    out: dict[str, Any] = {}
    if args.new_tokens not in (None, 8):
        out["new_tokens"] = args.new_tokens
    if args.cache not in (None, "dynamic"):
        out["cache"] = args.cache
    return out


def _ref_cache(args: argparse.Namespace, db: str | None) -> str | None:
    """The reference cache directory (None: none), refused before any work if it cannot be written."""
    from harness.files import check_writable
    from harness.run.refcache import default_root

    if args.no_ref_cache or not (args.ref_cache or db):
        return None
    path = os.path.abspath(args.ref_cache) if args.ref_cache else str(default_root(db))
    check_writable(path, create_parents=True, directory=True)  # created by the first entry stored, not here
    return path


def _saved_rows(db: str, **run: Any) -> int:
    """Rows in the latest unfinished run of this (list, target, settings, shard): what --resume continues."""
    from harness.results.store import ResultStore

    try:
        with ResultStore(db, read_only=True) as store:
            run_id = store.latest_run(**run, unfinished_only=True, has_results=True)
            return len(store.results(run_id)) if run_id else 0
    except Exception:
        return 0


def cmd_check(args: argparse.Namespace) -> int:
    from harness.console import clean_row, terminal_text, verdict_lines
    from harness.fleet.runner import run_models
    from harness.models.model_list import find_entry
    from harness.outcomes import PASSING
    from harness.results.store import ResultStore, check_writable

    # One model: its worker forks from this process (one import of torch and transformers, not two) and
    # still isolates a segfault or a hang from the CLI.
    config = _run_config(args, jobs=1, retries=0, progress=False, fork_workers=True)
    if not args.db and not config.compile_cache:  # the DB is temporary: its caches would be too
        config.compile_cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                            "portharness", "compile-cache")
    entry = find_entry(args.model, task=args.task)
    if args.db:
        check_writable(args.db)  # before any write: see cmd_run
    config.ref_cache = _ref_cache(args, args.db)
    if not args.db:  # the DB is temporary; a repro of a diverging op must outlive it (an empty dir must not)
        config.repro_dir = tempfile.mkdtemp(prefix="portharness-repro-")
    try:
        with tempfile.TemporaryDirectory(prefix="portharness-check-") as tmp:
            db = args.db or os.path.join(tmp, "check.db")
            summary = run_models([entry], config, db, list_name=f"check:{entry.id}", argv=" ".join(sys.argv))
            with ResultStore(db, read_only=True) as store:
                row = clean_row(store.results(summary.run_id).iloc[0].to_dict())
    finally:
        if config.repro_dir and not args.db:
            with contextlib.suppress(OSError):
                os.rmdir(config.repro_dir)  # only when empty
    if args.json:
        print(json.dumps(row, indent=2, default=str))
    else:
        print(terminal_text(f"portharness check {entry.id} on {args.target}\n" + "\n".join(verdict_lines(row))))
    return 0 if row["outcome"] in PASSING or row["outcome"] == "skipped" else 1  # skipped: the mode does not apply


def cmd_run(args: argparse.Namespace) -> int:
    from harness.console import headline_line, outcome_table
    from harness.fleet.executor import executor_for
    from harness.fleet.runner import fleet_for, run_models, shard
    from harness.models.model_list import load_model_list
    from harness.results.dbfile import StoreWriteError
    from harness.results.store import check_writable

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
    executor = executor_for(args.executor)
    if args.ray_address is not None and not executor.address_option:
        raise ValueError(f"--ray-address {args.ray_address}: needs --executor ray")
    executor.check()  # its library missing (Ray): say so before anything else
    jobs = (args.jobs if args.jobs is not None else 0 if executor.all_devices_by_default
            else max(1, os.cpu_count() or 1))
    config = _run_config(args, jobs=jobs, retries=args.retries, spare=args.spare,
                         quarantine_after=args.quarantine_after, progress=not args.quiet,
                         rerun_flaky=args.rerun_flaky, executor=args.executor, ray_address=args.ray_address,
                         harvest=args.harvest)
    fleet = fleet_for(config)  # devices, spares, ranges (a cluster's too): before a line is printed or a file touched
    # --db can take rows (a regular file, ours, undamaged, with a schema we can update, on writable storage,
    # or a new file we can create) and --report can be written: checked before the banner and any write
    check_writable(args.db)
    if args.report:
        from harness.report import check_out

        check_out(args.report)
    config.ref_cache = _ref_cache(args, args.db)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.db)), exist_ok=True)
    except OSError as e:
        from harness.files import output_error

        raise output_error(args.db, e) from None
    if not os.path.exists(args.db):  # a new DB is made whole now: a disk too full for it says so before the banner
        from harness.results.store import ResultStore

        ResultStore(args.db).close()
    print(f"portharness: {len(entries)} models from {args.list} (shard {args.shard}) on {args.target} "
          f"{' '.join(f'{k}={v}' for k, v in config.settings.items())}, "
          + (f"{jobs} worker(s)" if executor.one_host else
             f"{jobs or len(fleet.active)} {executor.name} actor(s) on {len({d.split('/')[0] for d in fleet.active})} node(s)")
          + f" -> {args.db}"
          + (f" (reference cache {config.ref_cache})" if config.ref_cache else ""), file=sys.stderr)
    try:
        summary = run_models(entries, config, args.db, list_name=args.list, shard_spec=args.shard,
                             resume=args.resume, argv=" ".join(sys.argv))
    except StoreWriteError as e:
        saved = _saved_rows(args.db, list_name=args.list, target=config.target, settings=config.settings,
                            shard=args.shard)
        if not saved:
            raise
        print(f"portharness run: error: {e} The {saved} rows finished before it are saved: rerun with --resume "
              "once the DB can be written again", file=sys.stderr)
        return 1
    if args.resume:
        print(f"portharness: resumed run {summary.resumed_run} ({summary.resumed_skipped} models already done)"
              if summary.resumed_run else "portharness: no unfinished run matches (list, target, settings, shard); "
              "started a new one", file=sys.stderr)
    human = sys.stderr if args.json else sys.stdout  # with --json, stdout is the JSON alone
    counts = summary.run_counts or summary.counts  # the whole run's, a resume's earlier rows included
    done = sum(counts.values())
    print(f"\nrun {summary.run_id}: {done} models"
          + (f" ({summary.rows_written} now in {summary.wall_s:.1f}s, {summary.resumed_skipped} already done, resumed)"
             if summary.resumed_skipped else f" in {summary.wall_s:.1f}s"), file=human)
    print(headline_line(counts), file=human)
    print(outcome_table(counts, done), file=human)
    if summary.confirmed:  # pass_declared rows, run again at full precision
        c = summary.confirmed
        print(f"  at full precision: {c.get('confirmed', 0)} pass_declared confirmed, {c.get('unconfirmed', 0)} "
              f"unconfirmed, {c.get('hidden drift', 0)} drift(s) the declared precision hid", file=human)
    if summary.with_fallback:
        print("  with CPU fallback: " + ", ".join(f"{o} {n}" for o, n in sorted(summary.with_fallback.items())),
              file=human)
    if summary.reruns:
        print(f"  re-ran {summary.reruns.get('models', 0)} model(s) whose attempts disagreed, {args.rerun_flaky}x each: "
              f"flaky {summary.reruns.get('flaky', 0)}, stable {summary.reruns.get('stable', 0)}", file=human)
    if summary.quarantined:
        print(f"  quarantined devices: {', '.join(summary.quarantined)}"
              + (f"; hot spares brought in: {', '.join(summary.spares_used)}" if summary.spares_used else ""), file=human)
    if summary.unfinished:
        print(f"  {summary.unfinished} models unfinished: rerun with --resume", file=sys.stderr)
    if summary.never_worked:
        print(f"portharness: {summary.never_worked}", file=sys.stderr)
    if args.report:
        from harness.files import OutputError
        from harness.report import build_report

        try:
            print(f"report: {build_report(args.db, args.report, run_id=summary.run_id)}", file=human)
        except OutputError as e:
            print(f"portharness run: error: {e}. The run's rows are saved in {args.db}; build the report again with "
                  f"`portharness report --db {args.db} --out {args.report}`", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(asdict(summary), indent=2))
    return 0 if not summary.unfinished and not summary.never_worked else 1


def cmd_zoo(args: argparse.Namespace) -> int:
    from harness.files import check_writable
    from harness.fleet.zoo import generate

    for path in (args.out, args.report):  # before an hour of candidates, not after
        if path:
            check_writable(path)
    counts = generate(args.out, jobs=args.jobs, limit=args.limit, timeout_s=args.timeout,
                      only=args.only.split(",") if args.only else None, report_path=args.report)
    print(f"candidates: {counts['candidates']}  kept: {counts['kept']}  "
          f"architectures: {counts['architectures']}  wall: {counts['wall_s']}s")
    for reason, n in counts["failed"].items():
        print(f"  failed {reason}: {n}")
    print(f"wrote {args.out}")
    return 0

