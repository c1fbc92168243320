"""Benchmark what each collective setting costs on a target, as a ratio vs the fused baseline.

Not a timed test: run it by hand (``python scripts/bench_collectives.py [--target sim] [--db x.db]``,
same arguments as ``portharness collectives``). Prints the full table, then the headline: skinny vs
fused per op and size, and the DDP step ratio, each with its p10-p90 spread over paired repeats.
"""

from __future__ import annotations

import sys

from harness.bench import collectives as hc
from harness.cli import build_parser, collectives_config


def headline(result: hc.BenchResult, setting: str = "skinny") -> str:
    """The lines that answer "what does <setting> cost": ratio [p10-p90] per op x size, and DDP."""
    lines = [f"{setting} vs {hc.BASELINE} (median ratio of paired repeats, p10-p90):"]
    for m in result.measurements:
        if m.setting != setting:
            continue
        # "slower" only when even the p10 paired ratio is above 1: most repeats agree, not one outlier.
        verdict = "slower" if m.ratio_p10 > 1.0 else ("faster" if m.ratio_p90 < 1.0 else "within noise")
        size = hc.fmt_size(m.size_bytes)
        spread = f"[{m.ratio_p10:.2f}-{m.ratio_p90:.2f}]"
        lines.append(f"  {m.op:<21} {size:>9}  x{m.ratio:5.2f}  {spread}  {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(["collectives", *(sys.argv[1:] if argv is None else argv)])
    try:
        result = hc.run_benchmark(collectives_config(args))
    except ValueError as exc:
        print(f"bench_collectives: error: {exc}", file=sys.stderr)
        return 2
    print(hc.format_table(result))
    print()
    for setting in result.config.settings:
        if setting.split(":")[0] == "skinny":
            print(headline(result, setting))
    if args.db:
        run_id = hc.record(result, args.db, argv=" ".join(sys.argv))
        print(f"recorded run {run_id} in {args.db}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
