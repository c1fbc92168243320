"""Commands that read result DBs: matrix, diff, report, merge, and the nightly baseline, trend and groups."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RATE_LABELS = {"ran_pct": "ran %", "matched_pct": "matched %", "pass_pct": "pass %"}  # columns as printed


def cmd_matrix(args: argparse.Namespace) -> int:
    from harness.analysis import matrix as mx
    from harness.console import confirm_line, headline_line, outcome_line, print_frame, terminal_text
    from harness.outcomes import OUTCOMES

    if args.out:
        mx.check_export_path(args.out)  # before the tables are printed
    rid, df = mx.load_results(args.db, args.run)
    counts = mx.outcome_counts(df)
    total = sum(counts.values())
    print(f"run {rid}: {total} result(s); {headline_line(counts).strip()}")
    print(outcome_line(counts))
    confirmed = mx.confirm_counts(df)
    if confirmed:
        print(confirm_line(confirmed))
    mat = mx.matrix(df)
    if not args.perf:  # --perf asks for the speed tables: the outcome matrix would push them off the screen
        print_frame("matrix", mat)
    if args.by:
        rates = mx.pass_rates(df, args.by)
        empty = [o for o in OUTCOMES if o in rates and not rates[o].any()]
        print_frame(f"ran % and numerics matched % by {args.by} (pass % = fp32-exact)",
                    rates.drop(columns=empty).rename(columns=RATE_LABELS))
    if args.ops:
        from harness.analysis.worklist import format_worklist, load

        print_frame("missing ops (implement X -> +N models)", mx.op_coverage(df, args.opinfo))
        work = load(args.db, rid)  # this configuration's op run, joined with these rows
        print("\n" + terminal_text(format_worklist(work, limit=args.ops_limit)))
        if not work.empty:
            print_frame("op worklist (per op: failing variations; models blocked now, drifts explained; per the "
                        "harvest: models that would run, models calling a failing variation)",
                        work.ranking[work.ranking["failing"] > 0].drop(columns=["suggestion"]))
    speed = mx.perf_summary(df)
    if not speed.empty:
        print_frame("speed (--perf): geometric means per configuration", speed)
    if args.perf:
        print_frame("speed per model (median ms; ratio = target / reference, per interleaved round)", mx.perf_table(df))
    if args.out:
        print(terminal_text(f"\nwrote {mx.export(mx.perf_table(df) if args.perf else mat, args.out)}"))
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from harness.analysis.diff import diff_runs, format_summary, load_allowlist, resolve_runs
    from harness.analysis.perfgate import read_allowlist
    from harness.console import terminal_text

    if not args.perf_regression > 1:
        raise ValueError(f"--perf-regression {args.perf_regression}: must be > 1 (1.2 = 20% slower)")
    perf_allowlist = read_allowlist(args.perf_allowlist)  # before anything is read or printed
    flaky_allowlist = load_allowlist(args.flaky_allowlist)
    (base_id, base_df), (head_id, head_df) = resolve_runs(
        db=args.db, base=args.base, head=args.head, base_db=args.base_db, head_db=args.head_db, night=args.night
    )
    res = diff_runs(base_df, head_df, base_run=base_id, head_run=head_id, drift_factor=args.drift_factor,
                    flaky_allowlist=flaky_allowlist, perf_threshold=args.perf_regression, perf_allowlist=perf_allowlist)
    print(json.dumps(res.to_dict(), indent=1) if args.json else terminal_text(format_summary(res)))
    return 1 if res.failed else 0


def cmd_report(args: argparse.Namespace) -> int:
    import time

    from harness.report import build_report

    t0 = time.perf_counter()
    index = build_report(args.db, args.out, run_id=args.run, base_run=args.base, base_db=args.base_db,
                         opinfo_csv=args.opinfo, history=args.history, night=args.night, command=args.check_command)
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


def cmd_baseline(args: argparse.Namespace) -> int:
    from harness.analysis import nights
    from harness.analysis.baseline import format_check
    from harness.console import terminal_text

    if args.baseline_command == "update":
        print("\n".join(nights.update_baselines(args.db, run_id=args.run, out=args.out, out_dir=args.out_dir)))
        return 0
    from harness.analysis.perfgate import read_allowlist

    if not args.perf_regression > 1:
        raise ValueError(f"--perf-regression {args.perf_regression}: must be > 1 (1.2 = 20% slower)")
    results = nights.check_baselines(args.db, run_id=args.run, expected=args.expected,
                                     expected_dir=args.expected_dir, flaky=args.flaky,
                                     perf_threshold=args.perf_regression, perf_allowlist=read_allowlist(args.perf_allowlist))
    ok = all(r.ok for r in results)
    out = {"ok": ok, "checks": [r.to_dict() for r in results]}
    print(json.dumps(out, indent=1) if args.json else terminal_text("\n\n".join(format_check(r) for r in results)))
    return 0 if ok else 1


def cmd_trend(args: argparse.Namespace) -> int:
    from harness.analysis import trend

    if args.trend_command == "append":
        print(trend.append_night(args.db, args.history, date=args.date, summary=args.summary))
        return 0
    if not Path(args.history).exists():  # a directory, a FIFO: read_history names the trouble
        raise FileNotFoundError(f"history file {args.history} does not exist")
    entries = trend.read_history(args.history)
    print(json.dumps(entries, indent=1) if args.json else trend.format_history(entries))
    return 0


def cmd_groups(args: argparse.Namespace) -> int:
    from harness.analysis.fingerprint import format_groups, group_failures
    from harness.analysis.matrix import load_results, with_config
    from harness.console import terminal_text

    rid, df = load_results(args.db, args.run)
    groups = group_failures(with_config(df))
    if args.json:
        print(json.dumps({"run_id": rid, "groups": [g.to_dict() for g in groups]}, indent=1))
    else:
        print(terminal_text(f"run {rid}: " + format_groups(groups, limit=args.limit)))
    return 0

