"""The peer conformance suite (PyPI ``torchcts``) on sim and on the CPU as its control: one table per suite.

torchcts reads a ``manifest.py`` from its working directory. This script writes two from the suite's own
template (``complete`` by default) into ``--out``: sim's (``"device_name": "sim"``, ``"backend_import":
"harness.sim"``, two devices, the capabilities sim lacks declared off, see ``SIM_UNSUPPORTED``) and the
CPU control's (the same template on ``cpu``, one device). sim runs at ``--precision highest --ops full``
(``PORTHARNESS_SIM_PRECISION``/``PORTHARNESS_SIM_OPS``), where it is meant to be the CPU bit for bit.

A case counts per suite as: passed; failed (FAIL or ERROR on sim); sim-only (failed on sim, passed on
the CPU); accelerator (failed on sim, a case the CPU control does not run: accelerator-only surfaces);
declared (run on the CPU, skipped on sim because its manifest declares the capability off); skipped.
``failed - sim-only - accelerator`` fail on the CPU too (the suite's or torch's). ``--failures`` lists
every sim failure with its class and message.

torchcts is not a dependency of portharness: ``pip install --no-deps torchcts==0.4.1`` (it warns that
torch 2.13 is outside its validated range). Each side is one ``torchcts run`` (minutes to an hour on
two cores, by level); ``--from`` re-reads earlier results instead.

    python scripts/cts_table.py --level 2
    python scripts/cts_table.py --level 4 --report-levels 2 4 --out /tmp/cts --failures fails.txt
    python scripts/cts_table.py --suites rng memory --level 4 -n 2
    python scripts/cts_table.py --from /tmp/cts --report-levels 2 4
"""

from __future__ import annotations

import argparse
import collections
import glob
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# torchcts' suites (directories of the package) this table runs; ``opinfo`` is OpInfo's per-op sweep,
# which scripts/opinfo_table.py --fidelity runs against the CPU sample by sample.
SUITES = ["operators", "generated", "autograd", "compiler", "device_api", "dtypes", "errors", "memory",
          "multi_device", "rng", "serialization", "strides", "stress", "training", "workloads"]

# Capabilities sim does not have, declared off in its manifest (torchcts then skips their cases), and why.
SIM_UNSUPPORTED = {
    "sparse": "sim simulates strided tensors only: no SparsesSim/SparseCsrsim kernels",
    "nested": "NestedTensorImpl on sim's strided storage is not implemented (nested_tensor fails)",
    "native_quantization": "no QuantizedPrivateUse1 kernels: the CPU's quantized kernels take CPU tensors",
}

FAILED = ("FAIL", "ERROR")
COLUMNS = ["passed", "failed", "sim-only", "accelerator", "declared", "skipped"]


def template_manifest(template: str) -> dict:
    """The manifest dict of torchcts' ``manifest.<template>.py``."""
    spec = importlib.util.find_spec("torchcts")
    if spec is None or spec.origin is None:
        raise SystemExit("torchcts is not installed: pip install --no-deps torchcts==0.4.1")
    path = Path(spec.origin).parent / "templates" / f"manifest.{template}.py"
    mod_spec = importlib.util.spec_from_file_location(f"torchcts_manifest_{template}", path)
    assert mod_spec is not None and mod_spec.loader is not None
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod.manifest


def write_manifest(directory: Path, template: str, side: str) -> Path:
    """``directory/manifest.py`` for `side` (``sim`` or ``cpu``) from torchcts' `template`."""
    base = template_manifest(template)
    overrides: dict = {"device_name": side, "backend_import": "harness.sim" if side == "sim" else None,
                       "device_count": 2 if side == "sim" else 1}
    caps: dict = {"multi_device": side == "sim"}
    if side == "sim":
        caps.update({name: False for name in SIM_UNSUPPORTED})
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "manifest.py"
    path.write_text(
        f'"""torchcts manifest for {side}: the {template!r} template with the overrides below (scripts/cts_table.py)."""\n'
        "import importlib.util\nfrom pathlib import Path\n\nimport torchcts\n\n"
        f"_path = Path(torchcts.__file__).parent / 'templates' / 'manifest.{template}.py'\n"
        "_spec = importlib.util.spec_from_file_location('_template', _path)\n"
        "_mod = importlib.util.module_from_spec(_spec)\n_spec.loader.exec_module(_mod)\n"
        "manifest = dict(_mod.manifest)\n"
        f"manifest.update({overrides!r})\n"
        f"manifest['capabilities'] = {{**manifest['capabilities'], **{caps!r}}}\n"
    )
    assert base["capabilities"].keys() >= caps.keys(), "the template lacks a capability this script sets"
    return path


def run_side(side: str, out: Path, args: argparse.Namespace) -> float:
    """One ``torchcts run`` for `side` with its manifest in ``out/side``; returns its wall time in seconds."""
    work = out / side
    write_manifest(work, args.template, side)
    results = work / "results"
    import torchcts

    root = Path(torchcts.__file__).parent
    env = dict(os.environ, TORCHCTS_NON_INTERACTIVE="1")
    # scripts/ for the cts_speedups plugin (torchcts 0.4.1's collection, memoized: a third of the time)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "scripts"), *filter(None, [env.get("PYTHONPATH")])])
    if side == "sim":
        # highest/full: sim is the CPU bit for bit; shared: xdist workers use the same devices
        env.update(PORTHARNESS_SIM_PRECISION="highest", PORTHARNESS_SIM_OPS="full",
                   PORTHARNESS_SIM_SHARING="shared", PORTHARNESS_SIM_NAMESPACE=f"cts-{os.getpid()}")
    cmd = [sys.executable, "-m", "torchcts", "run", "--non-interactive", "--level", str(args.level),
           "-n", str(args.workers), "-p", "cts_speedups", "--results-dir", str(results), *[str(root / s) for s in args.suites],
           *args.pytest_args]
    print(f"[{side}] {' '.join(cmd)}", file=sys.stderr, flush=True)
    start = time.monotonic()
    with open(work / "run.log", "w") as log:
        rc = subprocess.call(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
    elapsed = time.monotonic() - start
    (work / "run.json").write_text(json.dumps({"wall_s": round(elapsed, 1), "rc": rc, "level": args.level,
                                               "workers": args.workers, "cores": os.cpu_count()}) + "\n")
    print(f"[{side}] rc {rc}, {elapsed:.0f} s, log {work / 'run.log'}", file=sys.stderr, flush=True)
    return elapsed


def load_results(results: Path) -> dict[str, dict]:
    """Case id (from the suite directory on) -> torchcts' record, merged over xdist workers' artifacts."""
    from torchcts.core.result_artifacts import load_result_artifact

    files = sorted(glob.glob(str(results / "*_latest.json"))) or sorted(glob.glob(str(results / "*_latest.gw*.json")))
    merged: dict[str, dict] = {}
    for f in files:
        data = load_result_artifact(f)
        for key, rec in data.get("skips", {}).items():
            merged.setdefault(case_id(key), {**rec, "status": "SKIP"})
        for key, rec in data["results"].items():
            merged[case_id(key)] = rec
    return merged


def case_id(nodeid: str) -> str:
    return nodeid.split("torchcts/", 1)[-1]


def classify(sim: dict[str, dict], cpu: dict[str, dict], max_level: int,
             suites: list[str]) -> dict[str, collections.Counter]:
    """Per suite: the counts of COLUMNS over the cases at semantic level <= max_level (a row per suite in
    `suites` even where none is at that level)."""
    table: dict[str, collections.Counter] = {s: collections.Counter() for s in suites}
    for cid, rec in sim.items():
        level = rec.get("semantic_level")
        if level is not None and level > max_level:
            continue
        suite = cid.split("/", 1)[0]
        table.setdefault(suite, collections.Counter())
        status, control = rec["status"], cpu.get(cid, {}).get("status")
        if status == "PASS":
            table[suite]["passed"] += 1
        elif status in FAILED:
            table[suite]["failed"] += 1
            if control == "PASS":
                table[suite]["sim-only"] += 1
            elif control not in FAILED:
                table[suite]["accelerator"] += 1
        elif control in ("PASS", *FAILED) and is_declared(rec):
            table[suite]["declared"] += 1
        else:
            table[suite]["skipped"] += 1
    return table


def is_declared(rec: dict) -> bool:
    """Whether torchcts skipped the case for a capability sim's manifest declares off."""
    text = " ".join(str(rec.get(k) or "") for k in ("capability", "detail", "skip_detail", "error_message"))
    return rec.get("capability") in SIM_UNSUPPORTED or any(name in text for name in SIM_UNSUPPORTED)


def render(table: dict[str, collections.Counter], title: str) -> str:
    width = max([len("suite"), *map(len, table)]) + 2
    lines = [title, "suite".ljust(width) + "".join(c.rjust(12) for c in COLUMNS)]
    total: collections.Counter = collections.Counter()
    for suite in sorted(table):
        total.update(table[suite])
        lines.append(suite.ljust(width) + "".join(str(table[suite][c]).rjust(12) for c in COLUMNS))
    lines.append("total".ljust(width) + "".join(str(total[c]).rjust(12) for c in COLUMNS))
    return "\n".join(lines)


def failures(sim: dict[str, dict], cpu: dict[str, dict], max_level: int) -> list[str]:
    rows = []
    for cid, rec in sorted(sim.items()):
        if rec["status"] not in FAILED or (rec.get("semantic_level") or 0) > max_level:
            continue
        control = cpu.get(cid, {}).get("status")
        kind = "sim-only" if control == "PASS" else "both" if control in FAILED else "accelerator"
        msg = " ".join(str(rec.get("error_message") or "").split())[:300]
        rows.append(f"{kind}\tL{rec.get('semantic_level')}\t{cid}\t{rec.get('error_type')}: {msg}")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--level", type=int, default=2, help="run the cases of semantic level <= this (1-8)")
    ap.add_argument("--report-levels", type=int, nargs="*", help="print a table per level cut (default: --level)")
    ap.add_argument("--template", default="complete", help="torchcts manifest template (complete, smoke, ...)")
    ap.add_argument("--suites", nargs="*", default=SUITES, help=f"torchcts suites (default: {' '.join(SUITES)})")
    ap.add_argument("-n", "--workers", type=int, default=1, help="pytest-xdist workers per side")
    ap.add_argument("--out", type=Path, help="manifests, results and logs (default: a new temporary directory)")
    ap.add_argument("--from", dest="from_dir", type=Path, help="re-read the results of an earlier --out")
    ap.add_argument("--sides", nargs="*", default=["sim", "cpu"], choices=["sim", "cpu"], help="which to run")
    ap.add_argument("--failures", type=Path, help="write sim's failures here, one a line, with their class")
    ap.add_argument("--timeout", type=float, default=4 * 3600, help="seconds per side")
    ap.add_argument("pytest_args", nargs="*", help="after --: passed on to torchcts/pytest (e.g. -k name)")
    args = ap.parse_args(argv)
    unknown = set(args.suites) - set(SUITES) - {"opinfo"}
    if unknown:
        ap.error(f"unknown suites: {sorted(unknown)}")

    out = args.from_dir or args.out or Path(tempfile.mkdtemp(prefix="cts_table_"))
    if args.from_dir is None:
        for side in args.sides:
            run_side(side, out, args)
    runs = {side: json.loads((out / side / "run.json").read_text()) if (out / side / "run.json").exists() else {}
            for side in ("sim", "cpu")}
    sim, cpu = load_results(out / "sim" / "results"), load_results(out / "cpu" / "results")
    if not sim:
        raise SystemExit(f"no sim results under {out / 'sim' / 'results'}: see {out / 'sim' / 'run.log'}")
    walls = ", ".join(f"{side} {r['wall_s']:.0f} s (level {r['level']}, -n {r['workers']}, {r['cores']} cores)"
                      for side, r in runs.items() if r)
    for level in args.report_levels or [args.level]:
        title = f"torchcts {args.template}, level <= {level}, sim (highest, full) vs CPU control; wall: {walls}"
        print(render(classify(sim, cpu, level, args.suites), title) + "\n")
    if args.failures:
        args.failures.write_text("\n".join(failures(sim, cpu, max(args.report_levels or [args.level]))) + "\n")
    print(f"results: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
