#!/usr/bin/env python
"""Measure the speed gate on this machine, on a quiet host and on a busy one, side by side: how often two
clean runs flag a model (false positives), how often a planted slowdown is caught with the right op named,
how many models the gate leaves inconclusive, and what --perf costs.

    python scripts/perf_rates.py --list smoke --out artifacts/perf-rates [--jobs 2]
        [--slow-ops aten::addmm:2 ...] [--plant layer_norm:12 ...] [--busy cpu,mem] [--hosts quiet,busy]
        [--settings "--attn eager"] [--no-cost] [--reuse]

For each host (``quiet``: nothing started here, whatever else the machine runs is printed beside; ``busy``:
one neighbour per core from tests/busy_host.py, the kinds of ``--busy`` in turn, started before each run and
killed after it), one after another, each `portharness run --perf` on sim: clean A, clean B, one planted run
per ``--slow-ops`` spec (sim's kernel, through the harness) and per ``--plant`` spec (tests/planted_slowdown.py
loaded as a ``--backend`` module: the harness knows nothing of it), and (unless ``--no-cost``) the same list
without --perf between A and B: B's wall over it, both with the reference cache A filled, is the cost of
--perf. Then per host:

- false positives: `diff` of A against B (the gate's own code, default threshold): regressions, and the
  models left inconclusive (the host too disturbed to decide);
- catch: B against each planted run. A model *must* be caught when the plant makes its step at least the
  threshold slower. That is measured, not predicted, once for both hosts: each model once more in a process
  of its own on the quiet host, its step timed as --perf times it (`harness.run.perf.measure`, sim's clock)
  beside a second step with the slowdown planted, the two interleaved round by round; the model's slowdown
  is the median of the per-round ratios, and it must be caught when that interval lies at or above the
  threshold (those whose median alone reaches it are borderline). Reported: caught (a regression), of
  those the ones naming the op, inconclusive, and missed (passed as unchanged: the failure that counts),
  and the flags among the others.

Writes ``rates.json`` and prints the table; numbers vary with the machine's load, so the load average and
/proc/pressure/cpu are printed beside every run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(TESTS))

from busy_host import busy_neighbours  # noqa: E402

from harness.analysis.diff import diff_runs  # noqa: E402
from harness.results.store import ResultStore  # noqa: E402
from harness.run.perf import psi_cpu_some  # noqa: E402
from harness.sim.slowdown import parse_slow_ops  # noqa: E402

PLANT_ENV = "PLANTED_SLOWDOWN"


def host_line() -> str:
    psi = psi_cpu_some()
    return f"load {os.getloadavg()[0]:.1f}" + (f", cpu some {psi:.0f}%" if psi is not None else "")


def run(db: Path, args: argparse.Namespace, busy: bool, *extra: str, env: dict[str, str] | None = None) -> float:
    cmd = [sys.executable, "-m", "harness.cli", "run", "--list", args.list, "--target", "sim", "--db", str(db),
           "--jobs", str(args.jobs), "--quiet", *shlex.split(args.settings), *extra]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    with busy_neighbours(args.busy.split(",")) if busy else nullcontext():
        before = host_line()
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        wall = time.perf_counter() - t0
        after = host_line()
    print(f"  {'busy' if busy else 'quiet'}: {' '.join(cmd[3:])}: {wall:.0f} s ({before} -> {after})", flush=True)
    return wall


def frame(db: Path) -> Any:
    with ResultStore(db, read_only=True) as st:
        return st.results(st.latest_run(has_results=True))


def plant_env(spec: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, PLANT_ENV: spec}


def plants(args: argparse.Namespace) -> dict[str, tuple[str, str]]:
    """Label -> (kind, spec): ``sim`` (--slow-ops) or ``ext`` (tests/planted_slowdown.py)."""
    return {**{s: ("sim", s) for s in args.slow_ops}, **{f"ext:{s}": ("ext", s) for s in args.plant}}


def plant_op(kind: str, spec: str) -> str:
    if kind == "sim":
        return next(iter(parse_slow_ops(spec)))
    return {"layer_norm": "aten::native_layer_norm"}[spec.split(":")[0]]


# ----------------------------------------------------------------------------------------------
# Each model's true slowdown under a plant: paired rounds in one process
# ----------------------------------------------------------------------------------------------


_measured: set[str] = set()  # plants whose true slowdowns this invocation measured (once for both hosts)


def true_slowdowns(args: argparse.Namespace, label: str, out: Path) -> dict[str, dict]:
    """Each model's slowdown under the plant ``label``, measured in one process (`_paired` in a child)."""
    path = out / f"true-{label.replace(':', '_')}.json"
    if label not in _measured and not (args.reuse and path.exists()):
        _measured.add(label)
        kind, spec = plants(args)[label]
        cmd = [sys.executable, __file__, "--paired", f"{kind}={spec}", "--list", args.list, "--settings",
               args.settings, "--out", str(out), "--perf-budget", str(args.perf_budget), "--limit", str(args.limit)]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env={**plant_env(""), "PORTHARNESS_SIM_DEVICES": "1"})
        print(f"  paired clean/planted {label}, one process: {time.perf_counter() - t0:.0f} s ({host_line()})",
              flush=True)
    return json.loads(path.read_text())


def _paired(which: str, args: argparse.Namespace, out: Path) -> None:
    """In this process: every model of the list through the real pipeline with --perf, whose timing (the
    same `measure` call) gets a ``planted`` step beside ``target``: the target step with the plant in."""
    import harness.run.perf as perf
    from harness.backends import adapter_for
    from harness.cli.options import build_parser
    from harness.models.model_list import load_model_list
    from harness.run.pipeline import Task, run_one
    from harness.sim import slow_ops
    from harness.speed import ratios, summarize

    kind, spec = which.split("=", 1)

    @contextmanager
    def planting() -> Iterator[None]:
        if kind == "sim":
            with slow_ops(spec):
                yield
            return
        import planted_slowdown

        undo = planted_slowdown.plant(spec)
        try:
            yield
        finally:
            undo()

    measure = perf.measure

    def paired(steps: dict, **kw: Any) -> dict[str, Any]:
        target = steps["target"]

        def planted() -> None:
            with planting():
                target()

        res = measure({"target": target, "planted": planted}, **{**kw, "adaptive": False})
        samples = res["perf"].get("samples_us") or {}
        if samples.get("target") and samples.get("planted"):
            res["perf"]["slowdown"] = summarize(ratios(samples["planted"], samples["target"]))
        return res

    perf.measure = paired
    opts = build_parser().parse_args(["run", "--list", args.list, *shlex.split(args.settings)])
    options = {"precision": opts.precision, **{k: getattr(opts, k) for k in ("ops", "attn") if getattr(opts, k)}}
    settings = adapter_for("sim").check_settings(options)
    result = {}
    entries = load_model_list(args.list)
    for entry in entries[:args.limit] if args.limit else entries:
        m = run_one(Task(entry=asdict(entry), target="sim:0", settings=settings, localize=False, perf=True,
                         perf_budget_s=args.perf_budget))
        slow = (m.perf or {}).get("slowdown") if isinstance(m.perf, dict) else None
        if slow:
            result[entry.id] = {"median": round(slow["median"], 4), "lo": round(slow["lo"], 4),
                                "hi": round(slow["hi"], 4), "n": slow["n"]}
    label = spec if kind == "sim" else f"ext:{spec}"
    (out / f"true-{label.replace(':', '_')}.json").write_text(json.dumps(result, indent=1))


# ----------------------------------------------------------------------------------------------
# The gate's answers
# ----------------------------------------------------------------------------------------------


def false_positives(a: Any, b: Any, threshold: float) -> dict[str, Any]:
    res = diff_runs(a, b, perf_threshold=threshold).perf
    return {"compared": res.compared, "flagged": [c.model_id for c in res.regressions],
            "details": [c.detail for c in res.regressions], "inconclusive": [c.model_id for c in res.inconclusive],
            "kernels": [f"{k.model_id}: {k.detail}" for k in res.kernels], "geomean": res.geomean}


def catch(b: Any, planted: Any, op: str, threshold: float, true: dict[str, dict]) -> dict[str, Any]:
    """The planted run against clean B: which models must be caught (measured slowdown >= threshold), which were
    (a regression), which the gate left inconclusive, which it passed as unchanged (missed)."""
    res = diff_runs(b, planted, perf_threshold=threshold).perf
    # a step regression, or (the step not one) a kernel regression: either is caught; the kernel gate's own
    # count says how many only it caught
    verdicts: dict[str, tuple[str, Any]] = {c.model_id: ("inconclusive", c) for c in res.inconclusive}
    verdicts |= {k.model_id: ("caught", k) for k in res.kernels} | {c.model_id: ("caught", c) for c in res.regressions}
    by_kernel = {k.model_id for k in res.kernels} - {c.model_id for c in res.regressions}
    must, borderline, others = [], [], []
    name = op.split("::")[1].lstrip("_")
    for model in sorted(set(b["model_id"])):
        t = true.get(model)
        if t is None:
            continue
        how, ch = verdicts.get(model, ("missed", None))
        row = {"model": model, "true": t["median"], "true_lo": t["lo"], "true_hi": t["hi"], "verdict": how,
               "slowdown": round(ch.slowdown, 3) if ch else None, "op": ch.op if ch else "",
               "named": bool(ch and name in ch.op), "detail": ch.detail if ch else "",
               "share": getattr(ch, "op_share", None) if ch else None, "kernel": model in by_kernel}
        (must if t["lo"] >= threshold else borderline if t["median"] >= threshold else others).append(row)
    count = {v: sum(1 for r in must if r["verdict"] == v) for v in ("caught", "inconclusive", "missed")}
    return {"op": op, "compared": res.compared, "must_catch": len(must), **count,
            "op_named": sum(1 for r in must if r["verdict"] == "caught" and r["named"]),
            "by_kernel": sum(1 for r in must if r["verdict"] == "caught" and r["kernel"]),
            "shares": [r["share"] for r in must if r["verdict"] == "caught" and r["named"]],
            "flagged_among_others": [r for r in others if r["verdict"] == "caught"], "others": len(others),
            "must": must, "borderline": borderline, "geomean": res.geomean}


# ----------------------------------------------------------------------------------------------


def measure_host(args: argparse.Namespace, out: Path, host: str) -> dict[str, Any]:
    busy = host == "busy"
    dbs = {"clean_a": out / f"{host}-clean_a.db", "clean_b": out / f"{host}-clean_b.db",
           "no_perf": out / f"{host}-no_perf.db",
           **{label: out / f"{host}-planted-{i}.db" for i, label in enumerate(plants(args))}}
    walls_path = out / f"{host}-walls.json"
    walls: dict[str, float] = json.loads(walls_path.read_text()) if args.reuse and walls_path.exists() else {}
    if not args.reuse:
        for p in dbs.values():
            for f in (p, p.with_name(p.name + "-wal"), p.with_name(p.name + "-shm")):
                f.unlink(missing_ok=True)
        print(f"{host} host ({os.cpu_count()} CPUs" + (f"; neighbours: {args.busy}, one per core" if busy else "")
              + "):", flush=True)
        walls["clean_a"] = run(dbs["clean_a"], args, busy, "--perf")
        if not args.no_cost:
            walls["no_perf"] = run(dbs["no_perf"], args, busy)  # after A, like B: the same warm reference cache
        walls["clean_b"] = run(dbs["clean_b"], args, busy, "--perf")
        for label, (kind, spec) in plants(args).items():
            if kind == "sim":
                walls[label] = run(dbs[label], args, busy, "--perf", "--slow-ops", spec)
            else:
                walls[label] = run(dbs[label], args, busy, "--perf", "--backend", "planted_slowdown",
                                   env=plant_env(spec))
        walls_path.write_text(json.dumps(walls))
    a, b = frame(dbs["clean_a"]), frame(dbs["clean_b"])
    planted = {label: catch(b, frame(dbs[label]), plant_op(*plants(args)[label]), args.threshold,
                            true_slowdowns(args, label, out)) for label in plants(args)}
    perf_s = [r["phases"]["perf"]["s"] for r in b.to_dict("records")
              if isinstance(r.get("phases"), dict) and "perf" in r["phases"]]
    waits = [float(r["perf"].get("quiet_wait_s") or 0) for r in b.to_dict("records") if isinstance(r.get("perf"), dict)]
    return {"walls_s": walls, "false_positives": false_positives(a, b, args.threshold), "planted": planted,
            "cost": walls["clean_b"] / walls["no_perf"] if walls.get("no_perf") else None,
            "perf_phase_s": {"models": len(perf_s), "total": round(sum(perf_s), 1), "waits": round(sum(waits), 1)}}


def table(result: dict[str, Any], threshold: float) -> list[str]:
    hosts = list(result["hosts"])
    rows: list[tuple[str, list[str]]] = []

    def add(label: str, cell: Any) -> None:
        rows.append((label, [cell(result["hosts"][h]) for h in hosts]))

    add("false positives (clean A vs B)", lambda r: f"{len(r['false_positives']['flagged']) + len(r['false_positives'].get('kernels', []))} of "
        f"{r['false_positives']['compared']}")
    add("  of which kernel regressions", lambda r: str(len(r["false_positives"].get("kernels", []))))
    add("  inconclusive", lambda r: str(len(r["false_positives"]["inconclusive"])))
    for label in next(iter(result["hosts"].values()))["planted"]:
        add(f"planted {label}: must catch", lambda r, k=label: str(r["planted"][k]["must_catch"]))
        add("  caught (op named)", lambda r, k=label: f"{r['planted'][k]['caught']} ({r['planted'][k]['op_named']})")
        add("  of those, by the kernel gate alone", lambda r, k=label: str(r["planted"][k].get("by_kernel", 0)))
        add("  inconclusive", lambda r, k=label: str(r["planted"][k]["inconclusive"]))
        add("  missed (passed as unchanged)", lambda r, k=label: str(r["planted"][k]["missed"]))
        add("  flagged among the others", lambda r, k=label: f"{len(r['planted'][k]['flagged_among_others'])} of "
            f"{r['planted'][k]['others']}")
        add("  share of the added time (caught)", lambda r, k=label: " ".join(
            f"{s:.0%}" for s in sorted(x for x in r["planted"][k]["shares"] if x is not None)) or "-")
    add("--perf run / without (wall)", lambda r: (f"{r['walls_s']['clean_b']:.0f} s / {r['walls_s']['no_perf']:.0f} s "
        f"= {r['cost']:.1f}x") if r.get("cost") else "-")
    add("perf phase, worker time (clean B)", lambda r: f"{r['perf_phase_s']['total']:.0f} s, "
        f"{r['perf_phase_s']['models']} models")
    add("  waiting for the host alone", lambda r: f"{r['perf_phase_s'].get('waits', 0):.0f} s")
    width = max(len(label) for label, _ in rows) + 2
    cols = [max(len(h), *(len(c[i]) for _, c in rows)) + 2 for i, h in enumerate(hosts)]
    head = f"threshold {threshold:g}x"
    out = [f"{head:{width}}" + "".join(f"{h:>{w}}" for h, w in zip(hosts, cols, strict=True))]
    out += [f"{label:{width}}" + "".join(f"{c:>{w}}" for c, w in zip(cells, cols, strict=True)) for label, cells in rows]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", default="smoke")
    ap.add_argument("--out", default="artifacts/perf-rates")
    ap.add_argument("--slow-ops", action="append", default=None,
                    help="a planted run per sim spec (default aten::addmm:2: most models' largest op, so most models "
                         "get a slowdown to catch; softmax only where attention is eager)")
    ap.add_argument("--plant", action="append", default=None,
                    help="a planted run per tests/planted_slowdown.py spec (default layer_norm:12)")
    ap.add_argument("--hosts", default="quiet,busy", help="which hosts to measure, in this order (default quiet,busy)")
    ap.add_argument("--busy", default="cpu,mem", help="the busy host's neighbours, one per core, kinds in turn")
    ap.add_argument("--settings", default="", help="extra `portharness run` options for every run, e.g. '--attn eager'")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--threshold", type=float, default=1.2)
    ap.add_argument("--no-cost", action="store_true", help="skip the run without --perf (the cost of --perf)")
    ap.add_argument("--reuse", action="store_true", help="reuse the DBs already in --out (analysis only)")
    ap.add_argument("--perf-budget", type=float, default=1.0, help="--perf-budget of the paired measurement")
    ap.add_argument("--paired", default=None, help=argparse.SUPPRESS)  # the child of `true_slowdowns`
    args = ap.parse_args()
    args.slow_ops = args.slow_ops if args.slow_ops is not None else ["aten::addmm:2"]
    args.plant = args.plant if args.plant is not None else ["layer_norm:12"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.paired:
        _paired(args.paired, args, out)
        return 0
    hosts = [h for h in args.hosts.split(",") if h]
    if not set(hosts) <= {"quiet", "busy"}:
        ap.error(f"--hosts {args.hosts}: quiet and/or busy")
    result: dict[str, Any] = {"list": args.list, "settings": args.settings, "threshold": args.threshold,
                              "jobs": args.jobs, "busy": args.busy, "cpus": os.cpu_count(), "hosts": {}}
    for host in hosts:
        result["hosts"][host] = measure_host(args, out, host)
    (out / "rates.json").write_text(json.dumps(result, indent=1))
    print()
    print("\n".join(table(result, args.threshold)))
    for host, r in result["hosts"].items():
        for d in r["false_positives"]["details"]:
            print(f"  ({host}) false positive: {d}")
        for label, pl in r["planted"].items():
            for row in pl["must"]:
                if row["verdict"] != "caught":
                    print(f"  ({host}, {label}) {row['model']}: measured {row['true']}x [{row['true_lo']}-"
                          f"{row['true_hi']}], {row['verdict']}" + (f": {row['detail']}" if row["detail"] else ""))
    print(f"\nwrote {out / 'rates.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
