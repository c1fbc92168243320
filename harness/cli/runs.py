"""`check`, `run` and `zoo`: the commands that run models (their options resolved into a RunConfig here)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any


def _jobs(args: argparse.Namespace, executor: Any) -> int:
    """--jobs, or its default: one worker per core here, every device of a cluster (0)."""
    return args.jobs if args.jobs is not None else 0 if executor.all_devices_by_default else max(1, os.cpu_count() or 1)


def _workers(executor: Any, jobs: int, fleet: Any, queued: int, asked: int | None, target: str) -> str:
    """The banner's words for who runs the jobs (as many as the run starts: `policy.workers`): worker
    processes here, actors on a cluster's nodes. `asked`: the --jobs given, said when it was more, and why:
    the devices hold no more (one process each where the target's devices are exclusive), or the jobs."""
    from harness.backends import adapter_for
    from harness.fleet.executor import device_cap
    from harness.fleet.policy import workers

    adapter = adapter_for(target)
    cap = device_cap(executor, adapter)
    n = workers(jobs, queued, len(fleet.active), cap)
    why = "the jobs to run" if n >= queued else (
        f"{len(fleet.active)}, one per device: {adapter.kind}'s devices take one process each"
        if adapter.exclusive and executor.per_device is None else "the devices hold")
    capped = f" (--jobs {asked}: no more than {why})" if asked is not None and asked > n else ""
    if executor.one_host:
        return f"{n} worker(s){capped}"
    return f"{n} {executor.name} actor(s) on {len({d.split('/')[0] for d in fleet.active})} node(s){capped}"


def db_stopped(command: str, db: str, e: Exception) -> int:
    """A run whose DB stopped taking rows (full disk, lost mount): exit 1 with the --resume hint when rows
    were saved before it; re-raised (exit 2: an output that cannot be written) when none were."""
    from harness.console import terminal_text
    from harness.results.store import ResultStore

    try:
        with ResultStore(db, read_only=True) as store:
            run_id = store.latest_run(unfinished_only=True, has_results=True)
            saved = len(store.results(run_id)) if run_id else 0
    except Exception:
        saved = 0
    if not saved:
        raise e
    print(terminal_text(f"portharness {command}: error: {e} The {saved} rows finished before it are saved: rerun "
                        "with --resume once the DB can be written again", one_line=True), file=sys.stderr)
    return 1


def _run_config(args: argparse.Namespace, **overrides: Any):
    """Everything about the target checked before anything runs or is written (exit 2 otherwise)."""
    from harness.backends import resolve_target
    from harness.backends.base import UnsupportedSetting
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
                "compile", "amp", "compiler_bug", "dist_backend"):
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
    options.update(_parallel_options(args, adapter))
    from harness.run.compiled import check

    check(options)  # --compile, --dynamic, --amp: before the backend's own checks read them
    try:
        settings = adapter.check_settings(options)
    except UnsupportedSetting as e:
        raise ValueError(f"{args.flag_of(e.key)} is not an option of the {e.kind} backend") from None
    if args.seed:
        settings["seed"] = args.seed  # results depend on it: part of the run's identity (0 is the default)
    _acting(args, settings)
    given = {k: getattr(args, a) for k, a in (("compile_timeout_s", "compile_timeout"), ("perf_budget_s", "perf_budget"))
             if getattr(args, a) is not None}
    overrides.setdefault("collectives", _collectives(args, adapter))
    config = RunConfig(target=args.target, settings=settings, timeout_s=args.timeout, backends=modules,
                       load_timeout_s=args.load_timeout, compile_cache=args.compile_cache,
                       mem_cap_mb=args.mem_cap_mb or None, seed=args.seed, localize=not args.no_localize,
                       perf=args.perf, **given, **overrides)
    config.validate()
    return config


def _tp_models(text: str, entries: list[Any], list_name: str) -> None:
    """ValueError when a tensor-parallel spec meets a list none of whose models has a plan (each would be a
    skipped row: say so once instead)."""
    from harness.parallel.spec import parse
    from harness.parallel.wrap import planless

    if entries and parse(text).tp:
        without, unknown = planless(entries)
        if len(without) == len(entries):
            raise ValueError(f"--parallel {text}: none of the {len(entries)} model(s) of {list_name} declares a "
                             f"tensor-parallel plan (base_model_tp_plan), e.g. {', '.join(without[:3])}: nothing to "
                             "shard by; use ddp:N or fsdp:N, or a list of families that have one")


def _collectives(args: argparse.Namespace, adapter: Any) -> list[str]:
    """--collectives (each setting checked by the target's adapter), or the run's own setting alone where --perf
    times a parallel step without it; [] without --perf."""
    from harness.parallel.timing import DEFAULT

    given = getattr(args, "collectives", None)
    if given is not None and not (args.parallel and args.perf):
        raise ValueError(f"--collectives {given}: only with --parallel and --perf (what each setting costs a model's "
                         "parallel step)")
    if not (args.parallel and args.perf):
        return []
    names = [n.strip() for n in (given or DEFAULT).split(",") if n.strip()]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"--collectives {given}: name each setting once, e.g. fused,skinny,bucket:1m")
    for name in names:
        if name != DEFAULT:
            adapter.collective_setting(name)  # ValueError: not a setting of this backend
    return names


def _listed_parallel(entries: list[Any], given: str | None) -> str:
    """The first spec a list's `parallel` column spreads a model by ("" none); ValueError naming a model whose
    cell is no spec."""
    from harness.parallel.spec import chosen

    return next((way for e in entries if e.parallel and (way := chosen(e.id, e.parallel, given))), "")


def _parallel_options(args: argparse.Namespace, adapter: Any) -> dict[str, Any]:
    """--parallel (canonical: one spelling per identity) and --dist-backend, checked before anything runs: a
    spec that reads, a target with a process-group backend, and what --parallel cannot run beside yet. A list
    whose `parallel` column spreads a model is checked the same way (`listed_parallel`)."""
    listed = getattr(args, "listed_parallel", "")
    if args.parallel is None and not listed:
        if args.dist_backend is not None:
            raise ValueError(f"--dist-backend {args.dist_backend}: only with --parallel (the ranks' process groups)")
        return {}
    from harness.parallel.spec import parse

    spec = parse(args.parallel or listed)
    what = f"--parallel {spec}" if args.parallel else f"the list's parallel {spec}"
    if getattr(args, "harvest", False):
        raise ValueError(f"{what}: not with --harvest yet (the reference's op calls are one device's)")
    if getattr(args, "executor", "local") != "local" and adapter.ray_assigns:
        raise ValueError(f"{what}: not with --executor ray on {adapter.kind} yet (Ray picks its chips "
                         "itself; the group's worker would have to learn which its bundles got); run it with the local executor")
    if args.dist_backend is None:
        adapter.dist_backend()  # ValueError when the target's device type has no c10d backend
    return {"parallel": str(spec)} if args.parallel else {}


# Options that act only beside another (option, the one it needs, what it is): refused alone, as --dynamic,
# --compiler-bug, --new-tokens and --cache are, rather than accepted and silently ignored.
_NEEDS = (("perf_budget", "--perf-budget", "perf", "--perf", "the time --perf spends timing each model"),
          ("slow_ops", "--slow-ops", "perf", "--perf", "only timing sees a planted slowdown"),
          ("compile_timeout", "--compile-timeout", "compile", "--compile BACKEND", "the compiler's own deadline"),
          ("compile_cache", "--compile-cache", "compile", "--compile BACKEND", "it holds compiled code"))


def _acting(args: argparse.Namespace, settings: dict[str, Any]) -> None:
    """ValueError naming an option given without the one it acts with (see `_NEEDS`)."""
    for key, flag, needs, needs_flag, why in _NEEDS:
        value = getattr(args, key)
        if value is not None and not (args.perf if needs == "perf" else needs in settings):
            shown = repr(value) if key == "slow_ops" else value
            raise ValueError(f"{flag} {shown}: only with {needs_flag} ({why})")


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
    """The reference cache directory (None: none), refused before any work if it cannot be written, unless
    it is a filled cache on read-only storage (a fleet's shared copy, mounted read-only): then it is read and
    nothing is stored (each entry it lacks is computed, its row says why it was not stored)."""
    from harness.files import OutputError, check_writable
    from harness.run.refcache import default_root, is_cache

    if args.no_ref_cache or not (args.ref_cache or db):
        return None
    path = os.path.abspath(args.ref_cache) if args.ref_cache else str(default_root(db))
    try:
        check_writable(path, create_parents=True, directory=True)  # created by the first entry stored, not here
    except OutputError:
        if not (is_cache(Path(path)) and os.access(path, os.R_OK | os.X_OK)):
            raise
    return path


def _read_only(path: str) -> bool:
    return not os.access(path, os.W_OK) if os.path.isdir(path) else False


def cmd_check(args: argparse.Namespace) -> int:
    from harness.models.model_list import find_entry

    # The model first: a typo in its id is answered before torch and transformers are imported (seconds).
    entry = find_entry(args.model, task=args.task)
    entry = replace(entry, parallel="")  # one model: --parallel says how, not a list's column
    from harness.console import clean_row, terminal_text, verdict_lines
    from harness.fleet.runconfig import check_compile_cache
    from harness.fleet.runner import run_models
    from harness.outcomes import PASSING
    from harness.results.store import ResultStore
    from harness.results.writable import check_writable

    # One model: its worker forks from this process (one import of torch and transformers, not two) and
    # still isolates a segfault or a hang from the CLI.
    config = _run_config(args, jobs=1, retries=0, progress=False, fork_workers=True)
    if "compile" in config.settings and not args.db and not config.compile_cache:  # a temporary DB's caches would be too
        config.compile_cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                            "portharness", "compile-cache")
    if args.db:
        check_writable(args.db)  # before any write: see cmd_run
    config.ref_cache = _ref_cache(args, args.db)
    check_compile_cache(config, args.db or "")  # without --db: the default set above
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
    from harness.console import confirm_line, headline_line, outcome_table, terminal_text
    from harness.fleet.executor import executor_for
    from harness.fleet.resume import check_resume
    from harness.fleet.runconfig import check_compile_cache
    from harness.fleet.runner import fleet_for, run_models, shard
    from harness.models.model_list import load_model_list
    from harness.results.dbfile import StoreWriteError
    from harness.results.writable import check_writable

    entries = load_model_list(args.list)
    if args.only:
        wanted = set(args.only.split(","))
        entries = [e for e in entries if e.id in wanted or e.arch in wanted]
    entries = shard(entries, args.shard)
    if args.parallel is not None:
        _tp_models(args.parallel, entries, args.list)
    args.listed_parallel = _listed_parallel(entries, args.parallel)
    if args.limit < 0:
        raise ValueError(f"--limit {args.limit}: must be >= 0 (0: no limit)")
    if args.limit:
        entries = entries[: args.limit]
    if not entries:
        raise ValueError(f"nothing to run ({args.list}, shard {args.shard}, limit {args.limit})")
    executor = executor_for(args.executor)
    executor.check()  # its library missing (Ray): say so before anything else
    jobs = _jobs(args, executor)
    config = _run_config(args, jobs=jobs, retries=args.retries, spare=args.spare,
                         quarantine_after=args.quarantine_after, progress=not args.quiet,
                         rerun_flaky=args.rerun_flaky, executor=args.executor, ray_address=args.ray_address,
                         harvest=args.harvest)
    # --db can take rows (a regular file, ours, undamaged, with a schema we can update, on writable storage,
    # or a new file we can create), --report can be written, the caches kept: checked before the banner and any
    # write, and before a Ray instance is started for the fleet
    check_writable(args.db)
    if args.resume:  # a narrower resume is refused before anything is written
        check_resume(args.db, [e.id for e in entries], args.list, config.target, config.settings, args.shard)
    if args.report:
        from harness.report import check_out

        check_out(args.report)
    config.ref_cache = _ref_cache(args, args.db)
    check_compile_cache(config, args.db)
    fleet = fleet_for(config, entries)  # devices, spares, ranges (a cluster's too), each model's spread: before a line
    # is printed or a file touched
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.db)), exist_ok=True)
    except OSError as e:
        from harness.files import output_error

        raise output_error(args.db, e) from None
    if not os.path.exists(args.db):  # a new DB is made whole now: a disk too full for it says so before the banner
        from harness.results.store import ResultStore

        ResultStore(args.db).close()
    print(terminal_text(
        f"portharness: {len(entries)} models from {args.list} (shard {args.shard}) on {args.target} "
        f"{' '.join(f'{k}={v}' for k, v in config.settings.items())}, "
        + _workers(executor, jobs, fleet, len(entries), args.jobs, args.target) + f" -> {args.db}"
        + (f" (reference cache {config.ref_cache}"
           + (", read-only: entries are read, none stored)" if _read_only(config.ref_cache) else ")")
           if config.ref_cache else ""), one_line=True), file=sys.stderr)
    try:
        summary = run_models(entries, config, args.db, list_name=args.list, shard_spec=args.shard,
                             resume=args.resume, argv=" ".join(sys.argv))
    except StoreWriteError as e:
        return db_stopped("run", args.db, e)
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
        print(confirm_line(summary.confirmed), file=human)
    if summary.with_fallback:
        print("  with CPU fallback: " + ", ".join(f"{o} {n}" for o, n in sorted(summary.with_fallback.items())),
              file=human)
    if summary.reruns:
        print(f"  re-ran {summary.reruns.get('models', 0)} model(s) whose attempts disagreed, {args.rerun_flaky}x each: "
              f"flaky {summary.reruns.get('flaky', 0)}, stable {summary.reruns.get('stable', 0)}", file=human)
    if summary.quarantined:
        print(f"  quarantined devices: {', '.join(summary.quarantined)}"
              + (f"; hot spares brought in: {', '.join(summary.spares_used)}" if summary.spares_used else ""), file=human)
    if config.collectives:
        _settings_summary(args.db, summary.run_id, human)
    elif config.perf:
        _speed_summary(args.db, summary.run_id, human)
    if summary.unfinished:
        print(f"  {summary.unfinished} models unfinished: rerun with --resume", file=sys.stderr)
    if summary.never_worked:
        print(terminal_text(f"portharness: {summary.never_worked}", one_line=True), file=sys.stderr)
    if args.report:
        from harness.files import OutputError
        from harness.report import build_report

        try:
            print(f"report: {build_report(args.db, args.report, run_id=summary.run_id, command=args.check_command)}",
                  file=human)
        except OutputError as e:
            print(terminal_text(f"portharness run: error: {e}. The run's rows are saved in {args.db}; build the report "
                                f"again with `portharness report --db {args.db} --out {args.report}`", one_line=True),
                  file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(asdict(summary), indent=2))
    return 0 if not summary.unfinished and not summary.never_worked else 1


def _settings_summary(db: str, run_id: str, out: Any) -> None:
    """`run --parallel --perf`'s last line: which collective setting was fastest for how many models."""
    from harness.parallel.timing import fastest
    from harness.results.store import ResultStore
    from harness.speed import geomean

    with ResultStore(db, read_only=True) as store:
        rows = store.results(run_id)
    wins: dict[str, list[float]] = {}
    for c in rows["collectives"] if "collectives" in rows.columns else []:
        won = fastest(c) if isinstance(c, dict) else None
        if won is not None:
            wins.setdefault(won[0], []).append(won[1])
    if not wins:
        print("  collective settings (--perf): no model was timed", file=out)
        return
    print("  collective settings (--perf), fastest beyond the rounds' noise: " + "; ".join(
        f"{n} for {len(v)} model(s) (by {geomean(v):.2f}x over the baseline)" for n, v in
        sorted(wins.items(), key=lambda kv: -len(kv[1]))), file=out)


def _speed_summary(db: str, run_id: str, out: Any, slowest: int = 5) -> None:
    """`run --perf`'s last lines: the geometric means of the run, and its models slowest against the CPU."""
    from harness.analysis import matrix as mx
    from harness.console import print_frame

    _, df = mx.load_results(db, run_id)
    table = mx.perf_table(df)
    if table.empty:
        print("  speed (--perf): no model was timed", file=out)
        return
    if out is not sys.stdout:  # --json: stdout is the JSON alone; one line here
        for r in mx.perf_summary(df).to_dict("records"):
            print(f"  speed (--perf) {r['config']}: {r['models']} models, geomean target {r['geomean_target_ms']} ms, "
                  f"target/reference {r['geomean_ratio']}x", file=out)
        return
    print_frame("speed (--perf): geometric means per configuration", mx.perf_summary(df))
    top = table.sort_values("ratio", ascending=False, na_position="last").head(slowest).reset_index(drop=True)
    if top["config"].nunique() == 1:
        top = top.drop(columns="config")  # one configuration: the table above names it
    print_frame(f"slowest against the CPU reference (top {slowest}; all: portharness matrix --perf --db {db})", top)


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

