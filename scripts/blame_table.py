"""Who gets blamed when the hardware is rude: each misbehaviour of the test backend, one short run each.

For every misbehaviour (late errors, a lost and returning device server, one device, each wording of a
missing op, a wrong-shape kernel, a dying or hanging device, allocator exhaustion; issue 32: the backend
registered as a Python backend does, with a device module made at run time and no __file__, a client
with a reconnect window, tensor-subclass parameters under --compile with and without the reference
cache, --perf without allocator statistics) this runs the real CLI on a small list and reads the rows
back: how many, which outcomes, and how many landed on the wrong party (a model blamed for the device,
the device for a model, another model's error, or a compiled row's eager re-check saying the wrong
thing). The scenarios are those of tests/test_rude_backend.py; the right party for each row is written
next to it. A row reads `outcome`, then `/eager X` for a compiled row re-checked eagerly and `/timed` or
`/untimed` under --perf.

    python scripts/blame_table.py                       # this checkout
    python scripts/blame_table.py --harness-root OLD    # another checkout's harness, same backend

The test backend (tests/toy_backend) is pip-installed into a throwaway venv that sees this environment.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

import pathological_models  # noqa: E402
from conftest import LIST_HEADER, list_rows, make_toy_env  # noqa: E402


@dataclass
class Step:
    """One CLI run; `right` maps a model id to the outcomes that blame the right party (none: no row)."""

    args: list[str]
    right: dict[str, set[str]]
    env: dict[str, str] = field(default_factory=dict)


def cli(python: Path, args: list[str], env: dict[str, str], root: str | None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PORTHARNESS_", "TOY_", "PATHO_"))}
    if root:
        base["PYTHONPATH"] = root
    # cwd outside any checkout: `python -m` puts it first on sys.path, before PYTHONPATH's harness
    return subprocess.run([str(python), "-m", "harness.cli", *args], capture_output=True, text=True, timeout=900,
                          env={**base, **env}, cwd=tempfile.gettempdir())


def outcomes(db: Path, perf: bool = False) -> dict[str, str]:
    import sqlite3

    if not db.exists():
        return {}
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        got = con.execute("SELECT model_id, outcome, eager_outcome, perf_rounds FROM results ORDER BY rowid").fetchall()
    except sqlite3.Error:
        return {}
    finally:
        con.close()
    out = {}
    for model, outcome, eager, rounds in got:  # later rows of a model (resume) win
        out[model] = outcome + (f"/eager {eager}" if eager else "") + (("/timed" if rounds else "/untimed") if perf else "")
    return out


def server(python: Path, tmp: Path, port: int, kill: Path | None) -> tuple[subprocess.Popen, int]:
    port_file = tmp / f"port-{time.monotonic_ns()}"
    args = [str(python), "-m", "npu_toy.remote", "--port", str(port), "--port-file", str(port_file), "--max-s", "900"]
    args += ["--kill-file", str(kill)] if kill else []
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TOY_")}, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(1200):
        if port_file.exists():
            return proc, int(port_file.read_text())
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the toy device server did not start within 120 s")


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--harness-root", help="run this checkout's harness package (PYTHONPATH) instead")
    ns = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="blame-"))
    toy = make_toy_env(tmp / "toy")
    me = Path(sys.executable)
    b = {k: pathological_models.build(tmp, k) for k in
         ("none", "crash", "crash-once:a", "crash-once:b", "kill-device-once", "norm", "oom-ref", "no-fake")}

    def lst(name: str, patho: dict[str, str], tiny: list[tuple[str, str]] = ()) -> str:
        p = tmp / f"{name}.csv"
        p.write_text(LIST_HEADER + list_rows(list(tiny)) + pathological_models.list_rows({m: b[k] for m, k in patho.items()}))
        return str(p)

    dev = {"device_error"}
    rows_table: list[tuple[str, int, str, int, str, float]] = []

    def scenario(name: str, python: Path, steps: list[Step], db: Path) -> None:
        rcs, wrong, seen, said, t0 = [], 0, {}, "", time.monotonic()
        for s in steps:
            r = cli(python, [*s.args, "--db", str(db), "--quiet"], s.env, ns.harness_root)
            rcs.append(r.returncode)
            seen = outcomes(db, "--perf" in s.args)  # what the DB holds after the last step is what a reader sees
            wrong = sum(1 for m, o in seen.items() if m in s.right and o not in s.right[m])
            said = (r.stderr.strip().splitlines() or [""])[-1][:140]
            if "--resume" in s.args:  # the summary is the whole run's, not the resumed part's
                print("\n".join(f"    {x}" for x in r.stdout.splitlines() if "models (" in x or "ran " in x), flush=True)
        counts = ", ".join(f"{o} {n}" for o, n in sorted(Counter(seen.values()).items())) or f"none ({said})"
        rows_table.append((name, len(seen), counts, wrong, "/".join(map(str, rcs)), time.monotonic() - t0))
        print(f"{name}: rows {len(seen)} [{counts}] wrong party {wrong} rc {rcs} ({time.monotonic() - t0:.0f} s)",
              flush=True)

    toy_run = ["run", "--target", "toy", "--jobs", "1"]
    scenario("late error (next sync)", toy, [Step(
        [*toy_run, "--list", lst("late", {"z/none": "none"}, [("bert", "masked-lm")]), "--retries", "0"],
        {"z/none": {"pass"}, "tiny/bert/masked-lm": {"unsupported_op"}},
        {"TOY_LATE_ERRORS": "1", "TOY_BROKEN_OPS": "native_layer_norm:cannot"})], tmp / "late.db")
    single = {"m1/none": "none", "m2/crash-once": "crash-once:a", "m3/crash-once": "crash-once:b", "m4/none": "none",
              "m5/crash": "crash", "m6/crash": "crash", "m7/none": "none"}
    scenario("one device, models that crash", toy, [Step(
        [*toy_run, "--list", lst("single", single), "--retries", "1", "--quarantine-after", "2"],
        {m: ({"pass"} if k == "none" else {"unsupported_op"} if "once" in k else {"crash"}) for m, k in single.items()})],
        tmp / "single.db")
    for i, (embedding, sum_) in enumerate((("cannot", "remote"), ("bare", "dtype"))):
        scenario(f"missing op worded '{embedding}' / '{sum_}'", toy, [Step(
            [*toy_run, "--list", lst(f"words{i}", {"z/none": "none"}, [("patchtst", "base")])],
            {"z/none": {"unsupported_op"}, "tiny/patchtst/base": {"unsupported_op"}},
            {"TOY_BROKEN_OPS": f"embedding:{embedding},sum:{sum_}"})], tmp / f"words{i}.db")
    scenario("wrong-shape kernel", toy, [Step(
        [*toy_run, "--list", lst("norm", {"z/norm": "norm"})], {"z/norm": {"drift"}},
        {"TOY_BROKEN_OPS": "native_layer_norm:shape"})], tmp / "norm.db")
    three = lst("three", {"a/none": "none", "b/none": "none", "c/none": "none"})
    scenario("dying device (SIGSEGV)", toy, [Step([*toy_run, "--list", three],
             {m: dev for m in ("a/none", "b/none", "c/none")}, {"TOY_FAULT": "segv"})], tmp / "segv.db")
    scenario("hanging device", toy, [Step([*toy_run, "--list", three, "--timeout", "10"],
             {m: dev for m in ("a/none", "b/none", "c/none")}, {"TOY_FAULT": "hang"})], tmp / "hang.db")
    scenario("device allocator exhausted", toy, [Step(
        [*toy_run, "--list", lst("mem", {"a/none": "none"}, [("bert", "base")])],
        {"a/none": {"oom"}, "tiny/bert/base": {"oom"}}, {"TOY_MEM_MB": "0.001"})], tmp / "mem.db")

    kill = tmp / "kill-server"
    proc, port = server(toy, tmp, 0, kill)
    stop(proc)
    srv = {"TOY_SERVER": f"127.0.0.1:{port}", "TOY_TIMEOUT": "5", "PATHO_KILL_FILE": str(kill)}
    srv_list = lst("server", {"x1/none": "none", "x2/kill": "kill-device-once", "x3/none": "none"}, [("llama", "base")])
    scenario("no device server", toy, [Step([*toy_run, "--list", srv_list],
             {m: dev for m in ("tiny/llama/base", "x1/none", "x2/kill", "x3/none")}, srv)], tmp / "nosrv.db")
    proc = None
    try:
        proc, _ = server(toy, tmp, port, kill)
        first = Step([*toy_run, "--list", srv_list],
                     {"tiny/llama/base": {"unsupported_op"}, "x1/none": {"pass"}, "x2/kill": dev, "x3/none": dev}, srv)
        scenario("device server lost mid-run", toy, [first], tmp / "lost.db")
        stop(proc)
        kill.unlink(missing_ok=True)
        proc, _ = server(toy, tmp, port, None)
        scenario("  ... server back, --resume", toy, [Step(
            [*toy_run, "--list", srv_list, "--resume"],
            {"tiny/llama/base": {"unsupported_op"}, "x1/none": {"pass"}, "x2/kill": {"pass"}, "x3/none": {"pass"}}, srv)],
            tmp / "lost.db")
    finally:
        stop(proc)

    # Issue 32: npu_toy registered as a Python backend may do it (a device module made at run time, no
    # __file__), its client waiting out a reconnect window before it gives up ("could not reach the server
    # again"); tiny models seed the device while they are built, after the server died too.
    syn = {"TOY_SYNTHETIC_MODULE": "1"}
    scenario("synthetic module: missing op worded 'remote' / 'kernel'", toy, [Step(
        [*toy_run, "--list", lst("words-syn", {"z/none": "none"}, [("patchtst", "base")])],
        {"z/none": {"unsupported_op"}, "tiny/patchtst/base": {"unsupported_op"}},
        {**syn, "TOY_BROKEN_OPS": "embedding:remote,sum:kernel"})], tmp / "words-syn.db")
    kill2 = tmp / "kill-server-syn"
    proc, port2 = server(toy, tmp, 0, kill2)
    stop(proc)
    srv2 = {**syn, "TOY_RECONNECT_S": "5", "TOY_SERVER": f"127.0.0.1:{port2}", "TOY_TIMEOUT": "5",
            "PATHO_KILL_FILE": str(kill2)}
    syn_list = tmp / "server-syn.csv"  # run in id order: a1, a2 (kills the server), the tiny ones, z3
    syn_list.write_text(LIST_HEADER + list_rows([("gpt2", "base"), ("llama", "base")]) + pathological_models.list_rows(
        {"a1/none": b["none"], "a2/kill": pathological_models.build(tmp / "syn", "kill-device-once"),
         "z3/none": b["none"]}))
    every = ("a1/none", "a2/kill", "tiny/gpt2/base", "tiny/llama/base", "z3/none")
    gone = lst("server-syn-gone", {"x1/none": "none", "x3/none": "none"}, [("gpt2", "base"), ("llama", "base")])
    scenario("synthetic: no device server (client retries 5 s)", toy, [Step(  # the tiny ones are built first
        [*toy_run, "--list", gone], {m: dev for m in ("tiny/gpt2/base", "tiny/llama/base", "x1/none", "x3/none")},
        srv2)], tmp / "nosrv-syn.db")
    proc = None
    try:
        proc, _ = server(toy, tmp, port2, kill2)
        scenario("synthetic: device server lost mid-run", toy, [Step(
            [*toy_run, "--list", str(syn_list)], {"a1/none": {"pass"}, **{m: dev for m in every[1:]}}, srv2)],
            tmp / "lost-syn.db")
        stop(proc)
        kill2.unlink(missing_ok=True)
        proc, _ = server(toy, tmp, port2, None)
        scenario("  ... server back, --resume", toy, [Step(
            [*toy_run, "--list", str(syn_list), "--resume"],
            {"a1/none": {"pass"}, "a2/kill": {"pass"}, "tiny/gpt2/base": {"unsupported_op"},
             "tiny/llama/base": {"unsupported_op"}, "z3/none": {"pass"}}, srv2)], tmp / "lost-syn.db")
    finally:
        stop(proc)
    # Tensor-subclass parameters (moved by swap_tensors) under --compile: the eager re-check of a compiled row
    # must say the same without the reference cache, while it fills and once it is warm.
    comp = lst("compiled", {"m/none": "none", "m/nofake": "no-fake", "m/norm": "norm"})
    sub = {"TOY_SUBCLASS_PARAMS": "1", "TOY_BROKEN_OPS": "native_layer_norm:cannot"}
    right_c = {"m/none": {"compile_fail/eager pass", "pass"}, "m/nofake": {"compile_fail/eager pass"},
               "m/norm": {"compile_fail/eager unsupported_op", "unsupported_op/eager unsupported_op"}}
    for backend in ("inductor", "aot_eager"):
        cache = ["--ref-cache", str(tmp / f"ref-cache-{backend}")]
        for name, extra in (("no cache", ["--no-ref-cache"]), ("filling the cache", cache), ("cache warm", cache)):
            scenario(f"--compile {backend}, subclass params, {name}", toy, [Step(
                [*toy_run, "--list", comp, "--compile", backend, *extra], right_c, sub)],
                tmp / f"comp-{backend}-{name.replace(' ', '-')}.db")
    scenario("--perf, no allocator statistics", toy, [Step(
        [*toy_run, "--list", lst("perf", {"z/none": "none"}), "--perf", "--perf-budget", "0.3"],
        {"z/none": {"pass/timed"}})], tmp / "perf.db")

    sim3 = {"PORTHARNESS_SIM_DEVICES": "3"}
    tiny3 = lst("tiny3", {}, [("bert", "base"), ("gpt2", "base"), ("llama", "base")])
    exact = ["--precision", "highest", "--ops", "full", "--jobs", "2", "--spare", "1"]
    for kind, extra in (("crash", []), ("hang", ["--timeout", "8"])):
        scenario(f"sim: 2 of 3 devices {kind}, 1 spare", me, [Step(
            ["run", "--list", tiny3, *exact, "--fault", f"sim:0={kind}:1.0;sim:1={kind}:1.0", *extra],
            {m: {"pass"} for m in ("tiny/bert/base", "tiny/gpt2/base", "tiny/llama/base")}, sim3)], tmp / f"sim-{kind}.db")
    scenario("host allocator exhausted (cpu ref)", me, [Step(
        ["run", "--list", lst("oomref", {"patho/oom-ref": "oom-ref"}), "--target", "cpu", "--mem-cap-mb", "2048", "--jobs", "1"],
        {"patho/oom-ref": {"oom"}})], tmp / "oomref.db")
    scenario("--mem-cap-mb 16 (worker cannot start)", me, [Step(
        ["run", "--list", lst("cap", {}, [("bert", "base"), ("gpt2", "base")]), "--target", "cpu", "--mem-cap-mb", "16",
         "--jobs", "1"], {"tiny/bert/base": set(), "tiny/gpt2/base": set()})], tmp / "cap.db")

    print("\n| misbehaviour | rows | outcomes | wrong party | exit | s |\n|---|---|---|---|---|---|")
    for name, n, counts, wrong, rcs, secs in rows_table:
        print(f"| {name} | {n} | {counts} | {wrong} | {rcs} | {secs:.0f} |")
    print(f"\nrows on the wrong party: {sum(r[3] for r in rows_table)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
