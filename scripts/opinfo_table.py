"""Per-op OpInfo conformance table of sim vs CPU, and sim's differences from the CPU by class.

Why a table and not just the test: at ``default`` precision sim is *meant* to differ (bf16 matmul
inputs), so the interesting output is how many samples of each op stay within the usual fp32
tolerance (rtol 1.3e-6, atol 1e-5, as ``torch.testing.assert_close``) and how far off the rest are.
``--precision highest`` compares bit for bit instead, errors included (same type and message).

``--fidelity`` is issue 39's sweep: every OpInfo under the ``full`` profile at ``highest``, all samples
in several dtypes, their gradients, ``error_inputs``, ``out=`` aliasing its own inputs, plus the
hand-written cases of ``harness.sim.contracts``; it prints the differences by class (a sample where
sim raises the standard missing-kernel error is counted apart, as ``unsupported``).

CSV columns: op, aten_ops (``;``-joined ATen overloads its samples dispatched on sim), passed,
skipped (outside the op profile, excluded op, nondeterministic CPU reference), failed, unsupported,
explained (differences whose cause is outside sim, ``conformance.EXPLAINED``), max_abs_err (largest
|sim - CPU| over compared samples; empty when none was compared).

    python scripts/opinfo_table.py --precision default --out opinfo.csv
    python scripts/opinfo_table.py --precision highest --samples 0 --ops add mm softmax
    python scripts/opinfo_table.py --fidelity -q --failures fidelity.txt
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

COLUMNS = ["op", "aten_ops", "passed", "skipped", "failed", "unsupported", "explained", "max_abs_err"]
FIDELITY_DTYPES = "float32,float64,float16,bfloat16,int64,bool,complex64"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", choices=["default", "highest"], default="default")
    ap.add_argument(
        "--profile", default="young", help="sim op profile samples must fit (young, full, a file)"
    )
    ap.add_argument("--samples", type=int, default=3, help="samples per op and dtype (0 = all)")
    ap.add_argument("--ops", nargs="*", help="only these OpInfo ids (default: all of op_db)")
    ap.add_argument("--dtypes", default="float32", help="comma-separated sample dtypes (those the CPU supports)")
    ap.add_argument("--grads", action="store_true", help="also compare gradients (float32 samples)")
    ap.add_argument("--errors", action="store_true", help="also compare OpInfo error_inputs")
    ap.add_argument("--aliases", action="store_true", help="also compare out= aliasing the op's inputs")
    ap.add_argument("--reference", action="store_true", help="reference_inputs instead of sample_inputs")
    ap.add_argument("--contracts", action="store_true", help="also run harness.sim.contracts")
    ap.add_argument("--fidelity", action="store_true",
                    help=f"all of the above at highest, full profile, all samples, dtypes {FIDELITY_DTYPES}")
    ap.add_argument("--out", type=Path, help="write the CSV here")
    ap.add_argument("--failures", type=Path, help="write one line per difference here")
    ap.add_argument("-q", "--quiet", action="store_true", help="print only the summary")
    ap.add_argument("--progress", action="store_true", help="name each op on stderr before running it")
    ap.add_argument("--isolate", action="store_true",
                    help="run the ops in a child process, restarted after a crash (which is reported per op)")
    ap.add_argument("--jsonl", type=Path, help=argparse.SUPPRESS)  # the child's side of --isolate
    ap.add_argument("--skip", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.fidelity:
        args.precision, args.profile, args.samples, args.dtypes = "highest", "full", 0, FIDELITY_DTYPES
        args.grads = args.errors = args.aliases = args.reference = args.contracts = True

    warnings.filterwarnings("ignore")
    if args.isolate:
        return _isolated(argv if argv is not None else sys.argv[1:], args)

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
    dtypes = [getattr(torch, name.strip()) for name in args.dtypes.split(",") if name.strip()]
    exact = args.precision == "highest"
    rows, failures = [], []
    log = args.jsonl.open("a", encoding="utf-8") if args.jsonl else None
    for op in db[args.skip:]:
        oid = conformance.opinfo_id(op)
        if args.progress:
            print(oid, file=sys.stderr, flush=True)
        if log:
            log.write(json.dumps({"start": oid}) + "\n")
            log.flush()
        results = conformance.run_op(
            op, limit=args.samples or None, mode=args.precision, exact=exact, profile=args.profile,
            dtypes=dtypes, grads=args.grads, errors=args.errors, aliases=args.aliases, reference=args.reference,
        )
        failures += [(oid, r) for r in results if r.status == "failed"]
        rows.append(_row(oid, conformance.summarize(results)))
        if log:
            log.write(json.dumps({"done": oid, "row": rows[-1], "failures": [
                _failure_dict(r) for r in results if r.status == "failed"]}) + "\n")
            log.flush()
    if log:
        return 0
    if args.contracts:
        _contracts(args, rows, failures)
    return _report(args, rows, failures, t0)


def _report(args, rows: list[dict], failures: list, t0: float) -> int:
    from harness.sim import conformance

    by_class = dict.fromkeys(conformance.CLASSES, 0)
    for _, r in failures:
        by_class[r.klass or "errors"] += 1

    if not args.quiet:
        print(f"{'op':<44}{'passed':>7}{'skipped':>8}{'failed':>7}{'unsup':>6}  max_abs_err")
        for r in rows:
            if r["passed"] or r["failed"] or r["unsupported"]:
                print(f"{r['op']:<44}{r['passed']:>7}{r['skipped']:>8}{r['failed']:>7}{r['unsupported']:>6}"
                      f"  {r['max_abs_err']}")
    tested = [r for r in rows if r["passed"] or r["failed"]]
    clean = [r for r in tested if not r["failed"]]
    print(
        f"\n{len(rows)} OpInfos, {len(tested)} with samples run on sim ({args.profile} profile, "
        f"precision {args.precision}): {len(clean)} all within tolerance, {len(tested) - len(clean)} with "
        f"failures; samples passed {sum(r['passed'] for r in rows)}, "
        f"failed {sum(r['failed'] for r in rows)}, unsupported {sum(r['unsupported'] for r in rows)}, "
        f"explained {sum(r['explained'] for r in rows)} (harness.sim.conformance.EXPLAINED), "
        f"skipped {sum(r['skipped'] for r in rows)}  ({time.perf_counter() - t0:.0f} s)"
    )
    print("differences by class: " + ", ".join(f"{k} {v}" for k, v in by_class.items()) + f"; total {len(failures)}")
    worst = sorted((r for r in tested if r["failed"]), key=lambda r: -float(r["max_abs_err"] or "inf"))[:10]
    if worst:
        print("largest errors: " + ", ".join(f"{r['op']} {r['max_abs_err']}" for r in worst))
    if args.failures:
        lines = [f"{r.klass or 'errors'}\t{oid}\t{r.kind}\t{r.dtype}\t{r.reason}" for oid, r in failures]
        args.failures.write_text("\n".join(lines) + "\n", encoding="utf-8")
        print(f"wrote {args.failures}")
    if args.out:
        from harness import csvio

        csvio.write(args.out, COLUMNS, [[r.get(c, "") for c in COLUMNS] for r in rows])
        print(f"wrote {args.out}")
    return 0


def _contracts(args, rows: list[dict], failures: list) -> None:
    from harness.sim import conformance, contracts

    results = []
    for c in contracts.all_contracts():
        r = contracts.run_contract(c, mode=args.precision)
        failures += [(f"contract {c.name}", r)] if r.status == "failed" else []
        results.append(r)
    rows.append(_row("(hand-written contracts)", conformance.summarize(results)))


def _failure_dict(r) -> dict:
    return {"status": r.status, "reason": r.reason, "kind": r.kind, "klass": r.klass, "dtype": r.dtype}


def _isolated(argv: list[str], args) -> int:
    """Run the sweep in child processes; an op that kills its child is reported as a crash (CPU kernels
    can corrupt the heap themselves, e.g. an out= grown under a kernel still reading it)."""
    import json as _json
    import subprocess
    import tempfile

    from harness.sim import conformance

    t0 = time.perf_counter()
    child = [a for a in argv if a != "--isolate"]
    child = [x for i, x in enumerate(child) if x not in ("--out", "--failures") and
             (i == 0 or child[i - 1] not in ("--out", "--failures"))]
    rows, failures, crashed = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "sweep.jsonl"
        skip, seen = 0, 0
        while True:
            env_cmd = [sys.executable, __file__, *child, "--jsonl", str(log), "--skip", str(skip)]
            proc = subprocess.run(env_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            lines = log.read_text(encoding="utf-8").splitlines()[seen:] if log.exists() else []
            seen += len(lines)
            last_start = None
            for line in lines:
                rec = _json.loads(line)
                if "start" in rec:
                    last_start = rec["start"]
                    skip += 1
                else:
                    last_start = None
                    rows.append(rec["row"])
                    failures += [(rec["done"], conformance.SampleResult(**f)) for f in rec["failures"]]
            if proc.returncode == 0 and last_start is None:
                break
            if last_start is None:
                print(proc.stderr[-2000:], file=sys.stderr)
                return 1
            crashed.append(last_start)
            print(f"{last_start}: the process died ({proc.stderr.strip().splitlines()[-1:] or proc.returncode})",
                  file=sys.stderr)
    if crashed:
        print(f"crashed (not counted as differences): {', '.join(crashed)}")
    if args.contracts:
        _contracts(args, rows, failures)
    return _report(args, rows, failures, t0)


def _row(oid: str, s: dict) -> dict:
    return {
        "op": oid,
        "aten_ops": ";".join(s["aten_ops"]),
        "passed": s["passed"],
        "skipped": s["skipped"],
        "failed": s["failed"],
        "unsupported": s["unsupported"],
        "explained": s["explained"],
        "max_abs_err": "" if s["max_abs_err"] is None else f"{s['max_abs_err']:.3g}",
    }


if __name__ == "__main__":
    raise SystemExit(main())
