"""Per-op OpInfo conformance table of sim vs CPU, for the report.

Why a table and not just the test: at ``default`` precision sim is *meant* to differ (bf16 matmul
inputs), so the interesting output is how many samples of each op stay within the usual fp32
tolerance (rtol 1.3e-6, atol 1e-5, as ``torch.testing.assert_close``) and how far off the rest are.
``--precision highest`` compares exactly instead (what tests/test_opinfo_conformance.py asserts).

CSV columns: op, aten_ops (``;``-joined ATen overloads its samples dispatched on sim), passed,
skipped (outside the op profile, CPU reference rejects the sample, excluded op), failed,
max_abs_err (largest |sim - CPU| over compared samples; empty when none was compared).

    python scripts/opinfo_table.py --precision default --out opinfo.csv
    python scripts/opinfo_table.py --precision highest --samples 0 --ops add mm softmax
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

COLUMNS = ["op", "aten_ops", "passed", "skipped", "failed", "max_abs_err"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", choices=["default", "highest"], default="default")
    ap.add_argument(
        "--profile", default="young", help="sim op profile samples must fit (young, full, a file)"
    )
    ap.add_argument("--samples", type=int, default=3, help="samples per op (0 = all)")
    ap.add_argument("--ops", nargs="*", help="only these OpInfo ids (default: all of op_db)")
    ap.add_argument("--out", type=Path, help="write the CSV here")
    ap.add_argument("-q", "--quiet", action="store_true", help="print only the summary")
    args = ap.parse_args(argv)

    warnings.filterwarnings("ignore")
    import torch

    from harness.sim import conformance

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    db = conformance.op_db()
    if args.ops:
        wanted = set(args.ops)
        db = [op for op in db if conformance.opinfo_id(op) in wanted]
        missing = wanted - {conformance.opinfo_id(op) for op in db}
        if missing:
            print(f"unknown OpInfo ids: {', '.join(sorted(missing))}", file=sys.stderr)
            return 2
    exact = args.precision == "highest"
    rows = []
    for op in db:
        results = conformance.run_op(
            op, limit=args.samples or None, mode=args.precision, exact=exact, profile=args.profile
        )
        s = conformance.summarize(results)
        rows.append(
            {
                "op": conformance.opinfo_id(op),
                "aten_ops": ";".join(s["aten_ops"]),
                "passed": s["passed"],
                "skipped": s["skipped"],
                "failed": s["failed"],
                "max_abs_err": "" if s["max_abs_err"] is None else f"{s['max_abs_err']:.3g}",
            }
        )

    if not args.quiet:
        print(f"{'op':<44}{'passed':>7}{'skipped':>8}{'failed':>7}  max_abs_err")
        for r in rows:
            if r["passed"] or r["failed"]:
                print(f"{r['op']:<44}{r['passed']:>7}{r['skipped']:>8}{r['failed']:>7}  {r['max_abs_err']}")
    tested = [r for r in rows if r["passed"] or r["failed"]]
    clean = [r for r in tested if not r["failed"]]
    print(
        f"\n{len(rows)} OpInfos, {len(tested)} with samples run on sim ({args.profile} profile, "
        f"precision {args.precision}): {len(clean)} all within tolerance, {len(tested) - len(clean)} with "
        f"failures; samples passed {sum(r['passed'] for r in rows)}, "
        f"failed {sum(r['failed'] for r in rows)}, "
        f"skipped {sum(r['skipped'] for r in rows)}  ({time.perf_counter() - t0:.0f} s)"
    )
    worst = sorted((r for r in tested if r["failed"]), key=lambda r: -float(r["max_abs_err"] or "inf"))[:10]
    if worst:
        print("largest errors: " + ", ".join(f"{r['op']} {r['max_abs_err']}" for r in worst))
    if args.out:
        from harness import csvio

        csvio.write(args.out, COLUMNS, [[r.get(c, "") for c in COLUMNS] for r in rows])
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
