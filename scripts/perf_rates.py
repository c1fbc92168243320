#!/usr/bin/env python
"""Measure the speed gate on this machine: how often two clean runs flag a model (false positives), and how
often a planted slowdown in sim is caught with the right op named.

    python scripts/perf_rates.py --list smoke --out artifacts/perf-rates [--slow-ops aten::softmax:3 ...]
        [--settings "--attn eager"] [--jobs 2] [--no-perf-run]

Runs, one after another (each `portharness run --perf` on sim, with ``--settings``): clean A, clean B, one
planted run per ``--slow-ops`` spec, and, with ``--no-perf-run``, a run without --perf (the time --perf
adds). Then:

- false positives: `diff` of A against B (the gate's own code, default threshold): models flagged / compared;
- catch rate: B against each planted run. A model *must* be caught when the plant makes its step at least the
  threshold slower. That is measured, not predicted: each model once more in this process, its step timed
  as --perf times it (`harness.run.perf.measure`, sim's clock), with a second step beside it that runs the
  same step with the op planted (`harness.sim.slow_ops`), the two interleaved round by round; the model's
  slowdown is the median of the per-round ratios (both in one process a few ms apart: the machine's load
  cancels), and it must be caught when that measurement's interval lies at or above the threshold
  (those whose median alone reaches it are listed as borderline). The prediction from B's op profile, ``1 + (factor - 1) * share`` (the op's self time over the
  profile's), is printed beside it: the profiler's per-call cost inflates small ops, so it overstates.
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
from dataclasses import asdict
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


def true_slowdowns(args: argparse.Namespace, models: list[str], spec: str, out: Path) -> dict[str, dict]:
    """Each model's slowdown under the plant `spec`, measured in one process (`_paired` in a child)."""
    path = out / f"true-{spec.replace(':', '_')}.json"
    if not (args.reuse and path.exists()):
        cmd = [sys.executable, __file__, "--paired", spec, "--list", args.list, "--settings", args.settings,
               "--out", str(out), "--perf-budget", str(args.perf_budget)]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env={**os.environ, "PORTHARNESS_SIM_DEVICES": "1"})
        print(f"  paired clean/planted {spec}, one process: {time.perf_counter() - t0:.0f} s", flush=True)
    got = json.loads(path.read_text())
    return {m: got[m] for m in models if m in got}


def _paired(spec: str, args: argparse.Namespace, out: Path) -> None:
    """In this process: every model of the list through the real pipeline with --perf, whose timing (the
    same `measure` call) gets a ``planted`` step beside ``target``: the target step with `spec` planted."""
    import shlex

    import harness.run.perf as perf
    from harness.backends import adapter_for
    from harness.cli.options import build_parser
    from harness.models.model_list import load_model_list
    from harness.run.pipeline import Task, run_one
    from harness.sim import slow_ops
    from harness.speed import ratios, summarize

    measure = perf.measure

    def paired(steps: dict, **kw):
        target = steps["target"]

        def planted() -> None:
            with slow_ops(spec):
                target()

        res = measure({"target": target, "planted": planted}, **kw)
        samples = res["perf"].get("samples_us") or {}
        if samples.get("target") and samples.get("planted"):
            res["perf"]["slowdown"] = summarize(ratios(samples["planted"], samples["target"]))
        return res

    perf.measure = paired
    opts = build_parser().parse_args(["run", "--list", args.list, *shlex.split(args.settings)])
    options = {"precision": opts.precision, **{k: getattr(opts, k) for k in ("ops", "attn") if getattr(opts, k)}}
    settings = adapter_for("sim").check_settings(options)
    result = {}
    for entry in load_model_list(args.list):
        m = run_one(Task(entry=asdict(entry), target="sim:0", settings=settings, localize=False, perf=True,
                         perf_budget_s=args.perf_budget))
        slow = (m.perf or {}).get("slowdown") if isinstance(m.perf, dict) else None
        if slow:
            result[entry.id] = {"median": round(slow["median"], 4), "lo": round(slow["lo"], 4),
                                "hi": round(slow["hi"], 4), "n": slow["n"]}
    (out / f"true-{spec.replace(':', '_')}.json").write_text(json.dumps(result, indent=1))


def catch(b, planted, spec: str, threshold: float, true: dict[str, dict]) -> dict:
    """The planted run against clean B: which models must be caught (measured slowdown >= threshold), which were."""
    (op, factor), *_ = parse_slow_ops(spec).items()
    b_perf = {r["model_id"]: r["perf"] for r in b.to_dict("records") if isinstance(r.get("perf"), dict) and r["perf"]}
    res = diff_runs(b, planted, perf_threshold=threshold)
    flagged = {ch.model_id: ch for ch in res.perf.regressions}
    must, borderline, others = [], [], []
    for model, perf in sorted(b_perf.items()):
        s = share(perf, [op])
        t = true.get(model, {})
        row = {"model": model, "share": round(s, 4), "predicted": round(1 + (factor - 1) * s, 3),
               "true": t.get("median"), "true_lo": t.get("lo"), "true_hi": t.get("hi")}
        ch = flagged.get(model)
        if ch is not None:
            row.update(flagged=True, slowdown=round(ch.slowdown, 3), op=ch.op, detail=ch.detail)
        # must: surely at least the threshold (the paired interval's low end); borderline: the median is, the
        # interval's low end is not (a gate with any threshold catches those about half the time)
        if (row["true_lo"] or 0) >= threshold:
            must.append(row)
        elif (row["true"] or 0) >= threshold:
            borderline.append(row)
        else:
            others.append(row)
    name = op.split("::")[1].lstrip("_")
    return {"slow_ops": spec, "compared": res.perf.compared, "must_catch": len(must),
            "caught": sum(1 for r in must if r.get("flagged")),
            "op_named": sum(1 for r in must if r.get("flagged") and name in (r.get("op") or "")),
            "flagged_among_others": [r for r in others if r.get("flagged")], "others": len(others), "must": must,
            "near": [r for r in others if (r["true"] or 0) >= 1 + 0.9 * (threshold - 1)],
            "borderline": borderline, "borderline_caught": sum(1 for r in borderline if r.get("flagged")),
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
    ap.add_argument("--perf-budget", type=float, default=1.0, help="--perf-budget of the paired measurement")
    ap.add_argument("--paired", default=None, help=argparse.SUPPRESS)  # the child of `true_slowdowns`
    args = ap.parse_args()
    specs = args.slow_ops or ["aten::softmax:3"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.paired:
        _paired(args.paired, args, out)
        return 0
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
    models = sorted(b["model_id"])
    planted = [catch(b, frame(dbs[spec]), spec, args.threshold, true_slowdowns(args, models, spec, out))
               for spec in specs]
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
              f"(measured in one process, interval at or above it); caught {pl['caught']}, op named {pl['op_named']}; flagged among the "
              f"other {pl['others']}: {len(pl['flagged_among_others'])}; head/base geomean {pl['geomean']:.3f}")
        for r in pl["must"]:
            print(f"  {r['model']}: measured {r['true']}x [{r['true_lo']}-{r['true_hi']}], share {r['share']:.1%}, "
                  f"predicted {r['predicted']}x, " + (f"flagged: {r['detail']}" if r.get("flagged") else "NOT flagged"))
        for r in pl["flagged_among_others"]:
            print(f"  (other) {r['model']}: measured {r['true']}x, share {r['share']:.1%}, predicted {r['predicted']}x, "
                  f"flagged: {r['detail']}")
        for label, rows in ((f"borderline: median >= {args.threshold}x, interval below", pl["borderline"]),
                            ("other, measured just below the threshold", pl["near"])):
            for r in rows:
                print(f"  ({label}) {r['model']}: measured {r['true']}x [{r['true_lo']}-{r['true_hi']}], "
                      + (f"flagged: {r['detail']}" if r.get("flagged") else "not flagged"))
    ps = result["perf_phase_s"]
    if ps["models"]:
        print(f"--perf phase: {ps['mean']:.2f} s per model on average ({ps['models']} models, {ps['total']:.0f} s of "
              "worker time)")
    if walls:
        print("walls: " + ", ".join(f"{k} {v:.0f} s" for k, v in walls.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
