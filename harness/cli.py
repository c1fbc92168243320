"""`portharness` command line: check one model, run a list, and read the results.

Stages live in their own modules (model_list -> load -> worker/runner -> compare -> record -> matrix
-> report); this file only parses arguments and maps errors to clear messages and exit codes:
0 = success (for `check`: the model passed), 1 = the check/diff found a problem, 2 = bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from typing import Any

DEFAULT_DB = "results/portharness.db"


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="sim", help="device to test: sim, sim:1, cuda, xpu, cpu, ... (default sim)")
    p.add_argument(
        "--precision",
        default="default",
        help="sim: default (bf16 matmul inputs) or highest; other targets: torch float32 matmul precision",
    )
    p.add_argument("--ops", default="young", help="sim op profile: young (default), full, or a profile file")
    p.add_argument(
        "--attn",
        default=None,
        choices=["eager", "sdpa", "flex_attention"],
        help="force an attention implementation (flex_attention reproduces the classic coverage gap)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per model before its worker is killed")
    p.add_argument("--mem-cap-mb", type=int, default=8192, help="extra memory a worker may take (0 = no cap)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fault",
        default=None,
        help="inject sim faults, e.g. 'sim:1=nan:1.0' (sets PORTHARNESS_SIM_FAULTS for the workers)",
    )
    p.add_argument("--no-localize", action="store_true", help="skip the per-module drift localization")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    from harness.sim.opset import profile_names

    settings: dict[str, Any] = {"precision": args.precision}
    if args.target.split(":")[0] == "sim":
        if args.precision not in ("default", "highest"):
            raise ValueError(f"--precision {args.precision!r}: sim supports 'default' or 'highest'")
        if args.ops not in profile_names() and not os.path.isfile(args.ops):
            raise ValueError(f"--ops {args.ops!r}: expected one of {', '.join(profile_names())} or a profile file")
        settings["ops"] = args.ops
    elif args.precision not in ("default", "highest", "high", "medium"):
        raise ValueError(f"--precision {args.precision!r}: expected default, highest, high or medium")
    if args.attn:
        settings["attn"] = args.attn
    return settings


def _config(args: argparse.Namespace, **overrides: Any):
    from harness.run.runner import RunConfig

    if args.fault:
        from harness.sim.faults import parse_fault_spec

        parse_fault_spec(args.fault)  # validate before any worker starts
        os.environ["PORTHARNESS_SIM_FAULTS"] = args.fault
    return RunConfig(
        target=args.target,
        settings=_settings(args),
        timeout_s=args.timeout,
        mem_cap_mb=args.mem_cap_mb or None,
        seed=args.seed,
        localize=not args.no_localize,
        **overrides,
    )


# ---------------------------------------------------------------- check


def _verdict_table(row: dict[str, Any]) -> str:
    keys = [
        ("outcome", "outcome"),
        ("model", "model_id"),
        ("arch / task", None),
        ("target", "device"),
        ("settings", None),
        ("unsupported op", "unsupported_op"),
        ("error", None),
        ("first drifting module", None),
        ("rmse ratio (<=1 ok)", "rmse_ratio"),
        ("max abs err", "max_abs_err"),
        ("max rel err", "max_rel_err"),
        ("min cosine", "min_cosine"),
        ("load / ref / target s", None),
        ("peak RSS MB", "peak_rss_mb"),
    ]
    lines = []
    for label, key in keys:
        if key is not None:
            val = row.get(key)
        elif label == "arch / task":
            val = f"{row.get('arch', '')} / {row.get('task', '')}"
        elif label == "settings":
            val = " ".join(f"{k}={v}" for k, v in sorted(row.get("settings", {}).items()))
        elif label == "error":
            parts = [row.get("error_type") or "", row.get("error_message") or ""]
            val = ": ".join(p for p in parts if p) or None
        elif label == "first drifting module":
            m = row.get("first_drift_module")
            val = f"{m} ({row.get('first_drift_module_type', '')})" if m else None
        else:
            ts = [row.get(k) for k in ("load_time_s", "ref_time_s", "target_time_s")]
            val = " / ".join("-" if t is None else f"{t:.3f}" for t in ts)
        if val in (None, "", " / "):
            continue
        if isinstance(val, float):
            val = f"{val:.4g}"
        lines.append(f"  {label:<24} {str(val)[:300]}")
    metrics = row.get("metrics") or {}
    if metrics:
        lines.append("  outputs:")
        for name, m in metrics.items():
            ok = "ok  " if m.get("ok") else "FAIL"
            ratio = m.get("rmse_ratio")
            ratio_s = "-" if ratio is None else f"{ratio:.3g}"
            mabs = m.get("max_abs")
            mabs_s = "-" if mabs is None else f"{mabs:.3g}"
            lines.append(f"    {ok} {name:<28} rmse_ratio={ratio_s:<9} max_abs={mabs_s} {m.get('note', '')}")
    return "\n".join(lines)


def cmd_check(args: argparse.Namespace) -> int:
    from harness.models.model_list import find_entry
    from harness.run.runner import run_models

    config = _config(args, jobs=1, retries=0, progress=False)  # validate settings before any lookup
    entry = find_entry(args.model)
    db = args.db
    tmp = None
    if db is None:
        import tempfile

        tmp = tempfile.TemporaryDirectory(prefix="portharness-check-")
        db = os.path.join(tmp.name, "check.db")
    try:
        summary = run_models([entry], config, db, list_name=f"check:{entry.id}", argv=" ".join(sys.argv))
        from harness.results.store import ResultStore

        with ResultStore(db) as store:
            df = store.results(summary.run_id)
        row = df.iloc[0].to_dict()
    finally:
        if tmp is not None:
            tmp.cleanup()
    row = {k: (None if _isnan(v) else v) for k, v in row.items()}
    if args.json:
        print(json.dumps(row, indent=2, default=str))
    else:
        print(f"portharness check {entry.id} on {args.target}")
        print(_verdict_table(row))
        if row.get("traceback") and row["outcome"] not in ("pass", "drift"):
            print("  traceback (trimmed):")
            print("    " + row["traceback"].replace("\n", "\n    "))
    return 0 if row["outcome"] == "pass" else 1


def _isnan(v: Any) -> bool:
    return isinstance(v, float) and v != v


# ---------------------------------------------------------------- run


def cmd_run(args: argparse.Namespace) -> int:
    from harness.models.model_list import load_model_list
    from harness.run.runner import run_models, shard

    entries = load_model_list(args.list)
    if args.only:
        wanted = set(args.only.split(","))
        entries = [e for e in entries if e.id in wanted or e.arch in wanted]
    entries = shard(entries, args.shard)
    if args.limit:
        entries = entries[: args.limit]
    if not entries:
        print(f"portharness: nothing to run ({args.list}, shard {args.shard}, limit {args.limit})", file=sys.stderr)
        return 2
    config = _config(
        args, jobs=args.jobs, retries=args.retries, spare=args.spare, quarantine_after=args.quarantine_after,
        progress=not args.quiet,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.db)), exist_ok=True)
    print(
        f"portharness: {len(entries)} models from {args.list} (shard {args.shard}) on {args.target} "
        f"{' '.join(f'{k}={v}' for k, v in config.settings.items())}, {args.jobs} worker(s) -> {args.db}",
        file=sys.stderr,
    )
    summary = run_models(
        entries, config, args.db, list_name=args.list, shard_spec=args.shard, resume=args.resume,
        argv=" ".join(sys.argv),
    )
    total_done = summary.rows_written
    print(f"\nrun {summary.run_id}: {total_done} models in {summary.wall_s:.1f}s"
          + (f" ({summary.resumed_skipped} already done, resumed)" if summary.resumed_skipped else ""))
    for outcome, n in sorted(summary.counts.items(), key=lambda kv: -kv[1]):
        print(f"  {outcome:<22} {n:>6}  {n / max(total_done, 1):6.1%}")
    if summary.quarantined:
        print(f"  quarantined devices: {', '.join(summary.quarantined)}"
              + (f"; hot spares brought in: {', '.join(summary.spares_used)}" if summary.spares_used else ""))
    if summary.unfinished:
        print(f"  {summary.unfinished} models unfinished: rerun with --resume", file=sys.stderr)
    if args.report:
        from harness.report.build import build_report

        path = build_report(args.db, args.report, run_id=summary.run_id)
        print(f"report: {path}")
    if args.json:
        print(json.dumps(asdict(summary), indent=2))
    return 0 if not summary.unfinished else 1


# ---------------------------------------------------------------- wiring


def _delegate(module: str, func: str):
    def run(args: argparse.Namespace) -> int:
        import importlib

        return int(getattr(importlib.import_module(module), func)(args) or 0)

    return run


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="portharness",
        description="Backend-portability and numerical-conformance harness for PyTorch accelerators.",
    )
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("check", help="run one model on reference and target; exit 0 only on pass")
    p.add_argument("model", help="model id: tiny/<arch>/<head>, a hub id, or a local save_pretrained dir")
    _add_target_args(p)
    p.add_argument("--json", action="store_true", help="print the full result row as JSON")
    p.add_argument("--db", default=None, help="also record the row in this result DB")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("run", help="run a model list on a target, recording every outcome")
    p.add_argument("--list", default="tiny-zoo", help="model list name (model_lists/NAME.csv) or path")
    _add_target_args(p)
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 1)), help="worker processes")
    p.add_argument("--shard", default="1/1", help="run shard i of N (i/N)")
    p.add_argument("--db", default=DEFAULT_DB, help=f"result DB (default {DEFAULT_DB})")
    p.add_argument("--resume", action="store_true", help="continue the latest unfinished matching run")
    p.add_argument("--limit", type=int, default=0, help="only the first N models (after sharding)")
    p.add_argument("--only", default="", help="comma-separated model ids or architectures to run")
    p.add_argument("--retries", type=int, default=1, help="retries for crashes/timeouts/device errors")
    p.add_argument("--spare", type=int, default=0, help="devices kept idle as hot spares")
    p.add_argument("--quarantine-after", type=int, default=2, help="device strikes before quarantine")
    p.add_argument("--report", default=None, help="build the HTML report into this directory afterwards")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the run summary as JSON")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("matrix", help="models x (target, settings) outcome matrix and pass rates")
    p.add_argument("--db", default=DEFAULT_DB)
    p.add_argument("--run", default=None, help="run id (default: latest)")
    p.add_argument("--by", choices=["arch", "task", "modality"], default=None)
    p.add_argument("--ops", action="store_true", help="rank missing ops by models they would unblock")
    p.add_argument("--opinfo", default=None, help="OpInfo conformance CSV to join into the op ranking")
    p.add_argument("--out", default=None, help="export the matrix (.csv, .json, .parquet)")
    p.set_defaults(func=_delegate("harness.analysis.matrix", "main_matrix"))

    p = sub.add_parser("diff", help="compare two runs; exit 1 on regressions (CI gate)")
    p.add_argument("--db", default=DEFAULT_DB)
    p.add_argument("--base", default=None, help="base run id")
    p.add_argument("--head", default=None, help="head run id")
    p.add_argument("--base-db", default=None)
    p.add_argument("--head-db", default=None)
    p.add_argument("--drift-factor", type=float, default=None, help="rmse-ratio growth counted as regression")
    p.add_argument("--flaky-allowlist", default=None, help="file of model ids known to be flaky")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_delegate("harness.analysis.diff", "main_diff"))

    p = sub.add_parser("report", help="build the static HTML report")
    p.add_argument("--db", default=DEFAULT_DB)
    p.add_argument("--out", default="reports/site")
    p.add_argument("--run", default=None)
    p.add_argument("--base", default=None, help="base run for the diff page")
    p.add_argument("--base-db", default=None, help="previous night's DB for the diff page")
    p.add_argument("--opinfo", default=None, help="OpInfo conformance CSV (scripts/opinfo_table.py)")
    p.set_defaults(func=_delegate("harness.report.build", "main_report"))

    p = sub.add_parser("merge", help="merge shard DBs into one")
    p.add_argument("--out", required=True)
    p.add_argument("dbs", nargs="+")
    p.set_defaults(func=_delegate("harness.results.store", "main_merge"))

    p = sub.add_parser("collectives", help="benchmark collective settings on the target")
    p.add_argument("--target", default="sim")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="comma-separated message sizes in bytes")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--settings", type=lambda s: s.split(","), default=None, help="comma-separated setting names")
    p.add_argument("--no-ddp", dest="ddp", action="store_false", help="skip the DDP training-step benchmark")
    p.add_argument("--db", default=None, help="record rows in this result DB")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_delegate("harness.bench.collectives", "main_collectives"))

    p = sub.add_parser("zoo", help="regenerate the tiny-zoo list from the installed transformers")
    p.add_argument("zoo_args", nargs=argparse.REMAINDER, help="arguments for python -m harness.models.zoo")
    p.set_defaults(func=lambda a: __import__("harness.models.zoo", fromlist=["main"]).main(a.zoo_args))
    return ap


def _is_input_error(e: Exception) -> bool:
    """Bad input the user can fix (list, id, DB, settings, hub): a message, not a traceback.

    Imported only once something failed: subcommands like `report` or `diff` shouldn't pay for
    importing torch (via harness.models.load) at start-up."""
    from harness.models.model_list import ModelListError, UnknownModelError
    from harness.results.store import StoreError

    if isinstance(e, ModelListError | UnknownModelError | StoreError | ValueError):
        return True
    load = sys.modules.get("harness.models.load")
    return load is not None and isinstance(e, load.LoadError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except Exception as e:
        if not _is_input_error(e):
            raise
        print(f"portharness: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("portharness: interrupted; finished rows are saved (use --resume)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
