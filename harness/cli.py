"""`portharness` command line: every option is defined here, once; each command calls a stage's API.

One exit-code policy for all commands: 0 = success (for `check`: the model passed, within fp32 or the declared precision), 1 = the check,
diff or run found a problem, 2 = bad input (one line on stderr, nothing written), 130 = Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from harness.models.heads import HEADS

DEFAULT_DB = "results/portharness.db"


# ---------------------------------------------------------------- options


def _target_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="sim", help="device to test: sim, sim:1, cuda, xpu, cpu, ... (default sim)")
    p.add_argument(
        "--precision",
        default="default",
        help="sim: default (bf16 matmul inputs) or highest; other targets: torch float32 matmul precision",
    )
    p.add_argument("--ops", default=None, help="sim op profile: young (default), full, or a profile file")
    p.add_argument("--attn", default=None, choices=["eager", "sdpa", "flex_attention"],
                   help="force an attention implementation (flex_attention reproduces the classic coverage gap)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds per model after loading before its worker is killed")
    p.add_argument("--load-timeout", type=float, default=900.0,
                   help="seconds a model may take to load (its own budget: real checkpoints load slowly)")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16", "auto"],
                   help="load weights as fp32 (default: the reference is fp32), bf16, fp16, or auto "
                        "(the checkpoint's torch_dtype)")
    p.add_argument("--oracle-max-params", type=int, default=None, metavar="N",
                   help="largest model judged against an fp64 oracle (beyond: the cosine/allclose fallback)")
    p.add_argument("--mem-cap-mb", type=int, default=8192, help="extra memory a worker may take (0 = no cap)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fault", default=None,
                   help="inject sim faults, e.g. 'sim:1=nan:1.0' (sets PORTHARNESS_SIM_FAULTS for the workers)")
    p.add_argument("--no-localize", action="store_true", help="skip the per-module drift localization")
    p.add_argument("--declared-precision", default=None, metavar="CONTRACT",
                   help="numerics contract the target declares: fp32 (default for other backends), tf32, bf16-matmul, "
                        "fp16-matmul; sim declares bf16-matmul at --precision default, fp32 at highest")
    p.add_argument("--numerics-bug", dest="numerics", default=None, metavar="KINDS",
                   help="sim: plant quiet kernel bugs (bf16-accumulate, softmax-no-max, approx-exp, gelu-mixup, "
                        "grad-scale; comma-separated) to see the verdict catch them")
    p.add_argument("--op-check", default="auto", choices=["auto", "all", "sampled", "off"],
                   help="kernel-conformance check (each op judged on its own inputs against the CPU): every call "
                        "(all), the first calls of each op signature (sampled), or none; auto = all up to 50M "
                        "parameters, sampled above")
    p.add_argument("--no-op-check", dest="op_check", action="store_const", const="off", help="same as --op-check off")
    p.add_argument("--fallback", default=None, choices=["off", "cpu"],
                   help="sim: run ops outside the op profile on the host and count them (cpu) instead of failing")
    _backend_option(p)


def _backend_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", action="append", default=[], metavar="MODULE",
                   help="import MODULE to register the target's backend (repeatable; also PORTHARNESS_BACKENDS="
                        "mod1,mod2); entry-point backends load by themselves")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="portharness",
               description="Backend-portability and numerical-conformance harness for PyTorch accelerators.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("check", help="run one model on reference and target; exit 0 on pass / pass_declared")
    p.add_argument("model", help="model id: tiny/<arch>/<head>, a hub id, or a local save_pretrained dir")
    _target_options(p)
    p.add_argument("--task", default=None, choices=sorted(HEADS), metavar="TASK",
                   help="head to load a local or hub checkpoint with (default: the one it was saved with, from "
                        "its config's architectures; base for hub ids)")
    p.add_argument("--json", action="store_true", help="print the full result row as JSON")
    p.add_argument("--db", default=None, help="also record the row in this result DB")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("run", help="run a model list on a target, recording every outcome")
    p.add_argument("--list", default="tiny-zoo", help="model list name (model_lists/NAME.csv) or path")
    _target_options(p)
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 1)), help="worker processes")
    p.add_argument("--shard", default="1/1", help="run shard i of N (i/N)")
    p.add_argument("--db", default=DEFAULT_DB, help=f"result DB (default {DEFAULT_DB})")
    p.add_argument("--resume", action="store_true", help="continue the latest unfinished matching run")
    p.add_argument("--limit", type=int, default=0, help="only the first N models (after sharding)")
    p.add_argument("--only", default="", help="comma-separated model ids or architectures to run")
    p.add_argument("--retries", type=int, default=1, help="retries for crashes/timeouts/device errors")
    p.add_argument("--rerun-flaky", type=int, default=0, metavar="N",
                   help="re-run each model whose attempts disagreed N more times; flaky only if it really flips")
    p.add_argument("--spare", type=int, default=0, help="devices kept idle as hot spares")
    p.add_argument("--quarantine-after", type=int, default=2, help="device strikes before quarantine")
    p.add_argument("--report", default=None, help="build the HTML report into this directory afterwards")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the run summary as JSON")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("matrix", help="models x (target, settings) outcome matrix and pass rates")
    p.add_argument("--db", default=DEFAULT_DB)
    p.add_argument("--run", default=None, help="run id (default: latest)")
    p.add_argument("--by", choices=["arch", "task", "modality"], default=None, help="also print pass rates by this")
    p.add_argument("--ops", action="store_true", help="rank missing ops by models they would unblock")
    p.add_argument("--opinfo", default=None, help="OpInfo conformance CSV to join into the op ranking")
    p.add_argument("--out", default=None, help="export the matrix (.csv, .json, .parquet)")
    p.set_defaults(func=cmd_matrix)

    p = sub.add_parser("diff", help="compare two runs; exit 1 on regressions (CI gate)")
    p.add_argument("--db", default=None, help="DB holding both runs (or the head run with --base-db)")
    p.add_argument("--base", default=None, help="base run id (default: previous comparable run)")
    p.add_argument("--head", default=None, help="head run id (default: latest run)")
    p.add_argument("--base-db", default=None, help="DB of the base run (its latest run)")
    p.add_argument("--head-db", default=None, help="DB of the head run (its latest run)")
    p.add_argument("--drift-factor", type=float, default=2.0, help="rmse-ratio growth counted as regression")
    p.add_argument("--flaky-allowlist", default=None, help="file of model ids known to be flaky")
    p.add_argument("--night", action="store_true",
                   help="with --base-db/--head-db: compare every configuration's latest run (merged nightly DBs)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("report", help="build the static HTML report")
    p.add_argument("--db", default=DEFAULT_DB)
    p.add_argument("--out", default="reports/site")
    p.add_argument("--run", default=None, help="run id (default: latest)")
    p.add_argument("--base", default=None, help="base run for the diff page")
    p.add_argument("--base-db", default=None, help="previous night's DB for the diff page")
    p.add_argument("--opinfo", default=None, help="OpInfo conformance CSV (scripts/opinfo_table.py)")
    p.add_argument("--history", default=None, help="nightly history file (portharness trend append): adds the trend page")
    p.add_argument("--night", action="store_true",
                   help="show the latest run of every configuration in the DB (a merged nightly DB with several settings)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("merge", help="merge shard DBs into one")
    p.add_argument("--out", required=True, help="destination DB (created if missing)")
    p.add_argument("dbs", nargs="+", help="shard DBs to merge")
    p.add_argument("--no-combine", action="store_true", help="keep per-shard runs separate")
    p.set_defaults(func=cmd_merge)

    p = sub.add_parser("collectives", help="benchmark collective settings on the target")
    p.add_argument("--target", default="sim", help="sim, cpu (gloo) or cuda (nccl)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--sizes", default=None, help="comma-separated byte counts, k/m suffixes allowed (default 4k,64k,1m,16m)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--settings", default=None, help="comma-separated setting names (fused, skinny[:N], bucket:N, "
                   "cap:N, per-device, per-host[:k])")
    p.add_argument("--no-ddp", dest="ddp", action="store_false", help="skip the DDP training-step benchmark")
    _backend_option(p)
    p.add_argument("--db", default=None, help="record rows in this result DB")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds; with --faults: the detection budget (default 10; the collective timeout is half, "
                   "the stall watchdog a fifth); else the collective timeout (default 300)")
    g = p.add_argument_group("fault scenarios (one bad rank in a DDP job; exit 1 if one goes undetected or unnamed)")
    g.add_argument("--faults", default=None,
                   help="run these scenarios instead of timing settings: comma-separated hang, slow[:F], nan, die, "
                   "flap[:F], none, or all (default settings: fused)")
    g.add_argument("--fault-rank", type=int, default=1, help="the bad rank (default 1)")
    g.add_argument("--fault-step", type=int, default=5, help="the step it goes bad at (default 5)")
    g.add_argument("--steps", type=int, default=20, help="training steps per scenario (default 20)")
    g.add_argument("--spare", type=int, default=0, help="hot spare ranks: a die/hang recovers onto one (default 0)")
    g.add_argument("--straggler-excess", type=float, default=None,
                   help="straggler bar above the peers' mean (default 0.1 on cuda, 0.5 where ranks share cores)")
    p.set_defaults(func=cmd_collectives)

    p = sub.add_parser("zoo", help="regenerate the tiny-zoo list from the installed transformers")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "model_lists" / "tiny-zoo.csv"))
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2)))
    p.add_argument("--limit", type=int, default=None, help="only the first N candidates (for a quick look)")
    p.add_argument("--only", default=None, help="comma-separated model types or type/task pairs")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per candidate")
    p.add_argument("--report", default=None, help="write every candidate's result as JSON here")
    p.set_defaults(func=cmd_zoo)
    _nightly_parsers(sub)
    return ap


def _nightly_parsers(sub: Any) -> None:
    """`baseline`, `trend` and `groups`: what a nightly job gates on and keeps."""
    p = sub.add_parser("baseline", help="expected outcomes per configuration: write them, check a run against them")
    p.set_defaults(func=cmd_baseline)
    b = p.add_subparsers(dest="baseline_command", required=True)
    p = b.add_parser("update", help="write the expected file(s) from a run")
    p.add_argument("--db", required=True)
    p.add_argument("--run", help="run id (default: the DB's run, or the one --out is named for)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--out", help="expected file, e.g. model_lists/expected/<list>--<target>--<settings>.csv")
    g.add_argument("--out-dir", help="write one conventionally named file per configuration in the DB")
    p = b.add_parser("check", help="classify a run against its expected file; exit 1 on new failures or unexpected passes")
    p.add_argument("--db", required=True)
    p.add_argument("--run", help="run id (default: the latest run of the file's configuration)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--expected", help="expected file")
    g.add_argument("--expected-dir", help="check every configuration in the DB against its file here")
    p.add_argument("--flaky", help="flaky list: 'model-or-pattern  # reason' per line")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("trend", help="nightly history: append a night's summary, show the trend")
    p.set_defaults(func=cmd_trend)
    t = p.add_subparsers(dest="trend_command", required=True)
    p = t.add_parser("append", help="append the DB's night (latest run per configuration) to the history file")
    p.add_argument("--db", required=True)
    p.add_argument("--history", required=True, help="history file (JSON lines; created on the first night)")
    p.add_argument("--date", help="the night's date (default: each run's start date)")
    p.add_argument("--summary", help="also write the night's headline as a Markdown table here")
    p = t.add_parser("show", help="print the trend per configuration")
    p.add_argument("--history", required=True)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("groups", help="failures grouped by fingerprint (outcome, op or module type, error line)")
    p.add_argument("--db", default=DEFAULT_DB)
    p.add_argument("--run", help="run id (default: latest)")
    p.add_argument("--limit", type=int, default=30, help="groups to print")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_groups)


# ---------------------------------------------------------------- check / run


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
    done = summary.rows_written
    print(f"\nrun {summary.run_id}: {done} models in {summary.wall_s:.1f}s"
          + (f" ({summary.resumed_skipped} already done, resumed)" if summary.resumed_skipped else ""))
    print(headline_line(summary.counts))
    print(outcome_table(summary.counts, done))
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
    if args.report:
        from harness.report import build_report

        print(f"report: {build_report(args.db, args.report, run_id=summary.run_id)}")
    if args.json:
        print(json.dumps(asdict(summary), indent=2))
    return 0 if not summary.unfinished else 1


# ---------------------------------------------------------------- reading results


def cmd_matrix(args: argparse.Namespace) -> int:
    from harness.analysis import matrix as mx
    from harness.console import headline_line, outcome_line, print_frame
    from harness.outcomes import OUTCOMES

    rid, df = mx.load_results(args.db, args.run)
    counts = mx.outcome_counts(df)
    total = sum(counts.values())
    print(f"run {rid}: {total} result(s); {headline_line(counts).strip()}")
    print(outcome_line(counts))
    mat = mx.matrix(df)
    print_frame("matrix", mat)
    if args.by:
        rates = mx.pass_rates(df, args.by)
        empty = [o for o in OUTCOMES if o != "pass" and o in rates and not rates[o].any()]
        print_frame(f"pass rate by {args.by}", rates.drop(columns=empty))
    if args.ops:
        print_frame("missing ops (implement X -> +N models)", mx.op_coverage(df, args.opinfo))
    if args.out:
        print(f"\nwrote {mx.export(mat, args.out)}")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from harness.analysis.diff import diff_runs, format_summary, load_allowlist, resolve_runs

    (base_id, base_df), (head_id, head_df) = resolve_runs(
        db=args.db, base=args.base, head=args.head, base_db=args.base_db, head_db=args.head_db, night=args.night
    )
    res = diff_runs(base_df, head_df, base_run=base_id, head_run=head_id, drift_factor=args.drift_factor,
                    flaky_allowlist=load_allowlist(args.flaky_allowlist))
    print(json.dumps(res.to_dict(), indent=1) if args.json else format_summary(res))
    return 1 if res.regressions else 0


def cmd_report(args: argparse.Namespace) -> int:
    import time

    from harness.report import build_report

    t0 = time.perf_counter()
    index = build_report(args.db, args.out, run_id=args.run, base_run=args.base, base_db=args.base_db,
                         opinfo_csv=args.opinfo, history=args.history, night=args.night)
    print(f"report written to {index} in {time.perf_counter() - t0:.2f}s "
          f"(open it from disk: file://{index.resolve()})")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    from harness.results.merge import merge_stores

    res = merge_stores(args.out, args.dbs, combine_shards=not args.no_combine)
    print(f"merged {res.rows} rows from {len(args.dbs)} DB(s) into {args.out}")
    if res.overlaps:
        print(f"  {len(res.overlaps)} key(s) appeared in more than one DB (overlapping shards?); kept the row of "
              "the finished, most complete attempt:", file=sys.stderr)
        for line in res.overlaps[:20]:
            print(f"    {line}", file=sys.stderr)
    return 0


def collectives_config(args: argparse.Namespace):
    """The benchmark configuration `portharness collectives` arguments describe (validated)."""
    from harness.backends import backend_modules, load_backends
    from harness.bench import collectives as bench

    modules = backend_modules(args.backend)
    load_backends(modules)
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


def cmd_collective_faults(args: argparse.Namespace) -> int:
    from harness.bench import faultmatrix

    cfg = collective_faults_config(args)
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


# ---------------------------------------------------------------- nightly: baseline, trend, groups


def cmd_baseline(args: argparse.Namespace) -> int:
    from harness.analysis import nights
    from harness.analysis.baseline import format_check

    if args.baseline_command == "update":
        print("\n".join(nights.update_baselines(args.db, run_id=args.run, out=args.out, out_dir=args.out_dir)))
        return 0
    results = nights.check_baselines(args.db, run_id=args.run, expected=args.expected,
                                     expected_dir=args.expected_dir, flaky=args.flaky)
    ok = all(r.ok for r in results)
    out = {"ok": ok, "checks": [r.to_dict() for r in results]}
    print(json.dumps(out, indent=1) if args.json else "\n\n".join(format_check(r) for r in results))
    return 0 if ok else 1


def cmd_trend(args: argparse.Namespace) -> int:
    from harness.analysis import trend

    if args.trend_command == "append":
        print(trend.append_night(args.db, args.history, date=args.date, summary=args.summary))
        return 0
    if not Path(args.history).is_file():
        raise FileNotFoundError(f"history file {args.history} does not exist")
    entries = trend.read_history(args.history)
    print(json.dumps(entries, indent=1) if args.json else trend.format_history(entries))
    return 0


def cmd_groups(args: argparse.Namespace) -> int:
    from harness.analysis.fingerprint import format_groups, group_failures
    from harness.analysis.matrix import load_results, with_config

    rid, df = load_results(args.db, args.run)
    groups = group_failures(with_config(df))
    if args.json:
        print(json.dumps({"run_id": rid, "groups": [g.to_dict() for g in groups]}, indent=1))
    else:
        print(f"run {rid}: " + format_groups(groups, limit=args.limit))
    return 0


# ---------------------------------------------------------------- exit policy


def _is_input_error(e: Exception) -> bool:
    """Bad input the user can fix (list, id, DB, settings, file, hub): a message, not a traceback.

    Classes are looked up only once something failed: `report` or `diff` shouldn't pay for importing
    torch (via harness.models.load) at start-up."""
    from harness.models.model_list import ModelListError, UnknownModelError
    from harness.results.dbfile import StoreError

    if isinstance(e, ModelListError | UnknownModelError | StoreError | ValueError | FileNotFoundError):
        return True
    load = sys.modules.get("harness.models.load")
    return load is not None and isinstance(e, load.LoadError)


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C: every `finally` runs (workers are stopped), then exit 143."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt as e:
        name = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
        print(f"portharness: {name}; finished rows are saved (use --resume)", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    except Exception as e:
        startup = sys.modules.get("harness.run.runner")
        if startup is not None and isinstance(e, startup.WorkerStartupError):
            print(f"portharness {args.command}: error: {e}", file=sys.stderr)
            return 1
        if not _is_input_error(e):
            raise
        print(f"portharness {args.command}: error: {e}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
