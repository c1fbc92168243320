#!/usr/bin/env python
"""Measure the speed gate on this machine: how often two clean runs flag a model (false positives), and how
often a planted slowdown in sim is caught with the right op named.

    python scripts/perf_rates.py --list smoke --out artifacts/perf-rates [--slow-ops aten::softmax:3 ...]
        [--settings "--attn eager"] [--jobs 2] [--no-perf-run]

Runs, one after another (each `portharness run --perf` on sim, with ``--settings``): clean A, clean B, one
planted run per ``--slow-ops`` spec, and, with ``--no-perf-run``, a run without --perf (the time --perf
adds). Then:

- false positives: `diff` of A against B (the gate's own code, default threshold): models flagged / compared;
- catch rate: B against each planted run. A model *must* be caught when the planted op's share of its step makes a slowdown
  of at least the threshold: ``1 + (factor - 1) * share``, the share read from B's op profile (self time of
  the planted op over the step's; an upper bound, since sim's own dispatch time in that op is not slowed).
  Reported: the models that must be caught, those flagged, those whose flag names the op, and the flags among
  the others (with their measured slowdown).

Writes ``rates.json`` and prints a summary; numbers vary with the machine's load, so say what else ran.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.analysis.diff import diff_runs  # noqa: E402
from harness.results.store import ResultStore  # noqa: E402
from harness.sim.slowdown import parse_slow_ops  # noqa: E402


def run(db: Path, args: argparse.Namespace, *extra: str) -> tuple[str, float]:
    cmd = [sys.executable, "-m", "harness.cli", "run", "--list", args.list, "--target", "sim", "--db", str(db),
           "--jobs", str(args.jobs), "--quiet", *args.settings.split(), *extra]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    print(f"  {' '.join(cmd[3:])}: {wall:.0f} s (load average {load0:.1f} -> {os.getloadavg()[0]:.1f})", flush=True)
    with ResultStore(db, read_only=True) as st:
        return str(st.latest_run(has_results=True)), wall


def frame(db: Path):
    with ResultStore(db, read_only=True) as st:
        return st.results(st.latest_run(has_results=True))


def share(perf: dict, ops: list[str]) -> float:
    prof = (perf or {}).get("profile") or {}
    total = prof.get("total_us") or 0
    names = {o for o in ops} | {o.replace("aten::", "aten::_", 1) for o in ops}  # aten::softmax -> aten::_softmax too
    return sum(us for op, us in prof.get("ops") or [] if op in names) / total if total else 0.0


def catch(b, planted, spec: str, threshold: float) -> dict:
    """The planted run against clean B: which models must be caught (by B's op profile), which were."""
    (op, factor), *_ = parse_slow_ops(spec).items()
    b_perf = {r["model_id"]: r["perf"] for r in b.to_dict("records") if isinstance(r.get("perf"), dict) and r["perf"]}
    res = diff_runs(b, planted, perf_threshold=threshold)
    flagged = {ch.model_id: ch for ch in res.perf.regressions}
    must, others = [], []
    for model, perf in sorted(b_perf.items()):
        s = share(perf, [op])
        row = {"model": model, "share": round(s, 4), "predicted": round(1 + (factor - 1) * s, 3)}
        ch = flagged.get(model)
        if ch is not None:
            row.update(flagged=True, slowdown=round(ch.slowdown, 3), op=ch.op, detail=ch.detail)
        (must if row["predicted"] >= threshold else others).append(row)
    name = op.split("::")[1].lstrip("_")
    return {"slow_ops": spec, "compared": res.perf.compared, "must_catch": len(must),
            "caught": sum(1 for r in must if r.get("flagged")),
            "op_named": sum(1 for r in must if r.get("flagged") and name in (r.get("op") or "")),
            "flagged_among_others": [r for r in others if r.get("flagged")], "others": len(others), "must": must,
            "geomean": res.perf.geomean}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", default="smoke")
    ap.add_argument("--out", default="artifacts/perf-rates")
    ap.add_argument("--slow-ops", action="append", default=None, help="a planted run per spec (default aten::softmax:3)")
    ap.add_argument("--settings", default="", help="extra `portharness run` options for every run, e.g. '--attn eager'")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--threshold", type=float, default=1.2)
    ap.add_argument("--no-perf-run", action="store_true", help="also run once without --perf (the time --perf adds)")
    ap.add_argument("--reuse", action="store_true", help="reuse the DBs already in --out (analysis only)")
    args = ap.parse_args()
    specs = args.slow_ops or ["aten::softmax:3"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dbs = {"clean_a": out / "clean_a.db", "clean_b": out / "clean_b.db", "no_perf": out / "no_perf.db",
           **{spec: out / f"planted-{i}.db" for i, spec in enumerate(specs)}}
    walls: dict[str, float] = {}
    if not args.reuse:
        for p in dbs.values():
            for f in (p, p.with_name(p.name + "-wal"), p.with_name(p.name + "-shm")):
                f.unlink(missing_ok=True)
        print(f"runs on {os.cpu_count()} CPUs:", flush=True)
        walls["clean_a"] = run(dbs["clean_a"], args, "--perf")[1]
        walls["clean_b"] = run(dbs["clean_b"], args, "--perf")[1]
        for spec in specs:
            walls[spec] = run(dbs[spec], args, "--perf", "--slow-ops", spec)[1]
        if args.no_perf_run:
            walls["no_perf"] = run(dbs["no_perf"], args)[1]

    a, b = frame(dbs["clean_a"]), frame(dbs["clean_b"])
    clean = diff_runs(a, b, perf_threshold=args.threshold)
    planted = [catch(b, frame(dbs[spec]), spec, args.threshold) for spec in specs]
    perf_s = [r["phases"]["perf"]["s"] for r in b.to_dict("records")
              if isinstance(r.get("phases"), dict) and "perf" in r["phases"]]
    result = {
        "list": args.list, "settings": args.settings, "threshold": args.threshold, "walls_s": walls,
        "false_positives": {"compared": clean.perf.compared, "flagged": [ch.model_id for ch in clean.perf.regressions],
                            "details": [ch.detail for ch in clean.perf.regressions], "geomean": clean.perf.geomean},
        "planted": planted,
        "perf_phase_s": {"models": len(perf_s), "mean": sum(perf_s) / len(perf_s) if perf_s else None,
                         "total": sum(perf_s)},
    }
    (out / "rates.json").write_text(json.dumps(result, indent=1))
    fp = result["false_positives"]
    print(f"false positives (clean A vs clean B): {len(fp['flagged'])} of {fp['compared']} flagged "
          f"(head/base geomean {fp['geomean']:.3f}) {fp['flagged']} {fp['details']}")
    for pl in planted:
        print(f"planted {pl['slow_ops']}: {pl['must_catch']} model(s) where it makes >= {args.threshold}x "
              f"(1 + (factor - 1) x share); caught {pl['caught']}, op named {pl['op_named']}; flagged among the "
              f"other {pl['others']}: {len(pl['flagged_among_others'])}; head/base geomean {pl['geomean']:.3f}")
        for r in pl["must"]:
            print(f"  {r['model']}: share {r['share']:.1%}, predicted {r['predicted']}x, "
                  + (f"flagged: {r['detail']}" if r.get("flagged") else "NOT flagged"))
        for r in pl["flagged_among_others"]:
            print(f"  (other) {r['model']}: share {r['share']:.1%}, predicted {r['predicted']}x, flagged: {r['detail']}")
    ps = result["perf_phase_s"]
    if ps["models"]:
        print(f"--perf phase: {ps['mean']:.2f} s per model on average ({ps['models']} models, {ps['total']:.0f} s of "
              "worker time)")
    if walls:
        print("walls: " + ", ".join(f"{k} {v:.0f} s" for k, v in walls.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
