"""Blame the right party on rude hardware (issues 25 and 32), through the real CLI.

The test backend (npu_toy, pip-installed next to portharness) reports errors late, keeps its tensors
behind an op server that can die and come back, words its missing ops as real backends do, segfaults
or hangs; `sim` with three devices kills or hangs on two of them. Each test is one item of the issue:
the verdicts must land on the model when the model failed and on the device when the device did.

Every toy scenario runs in two shapes of the backend (`shape`): ``plain`` (its device module an instance
of a class in its package) and ``synthetic`` (a module object made at run time, no ``__file__``, as
`torch.utils.backend_registration` lets a Python backend register it). The default suite runs the
synthetic shape where it decides a verdict (a relayed missing op, a lost device server: the backend's
code must be recognised without its file); ``-m slow`` runs it on every scenario.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pathological_models
import pytest
from conftest import LIST_HEADER, list_rows

from harness.results.store import ResultStore

EXACT = ["--precision", "highest", "--ops", "full"]
SHAPES = {"plain": {}, "synthetic": {"TOY_SYNTHETIC_MODULE": "1"}}
BOTH_SHAPES = pytest.mark.parametrize("shape", ["plain", "synthetic"])  # the shape decides the verdict
SHAPES_SLOW = pytest.mark.parametrize("shape", ["plain", pytest.param("synthetic", marks=pytest.mark.slow)])


def run_cli(python: Path, *args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PORTHARNESS_", "TOY_", "PATHO_"))}
    return subprocess.run([str(python), "-m", "harness.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**base, **(env or {})})


def rows(db: Path) -> dict[str, dict]:
    with ResultStore(db, create=False) as st:
        return {r["model_id"]: r for r in st.results().to_dict("records")}


def patho_list(path: Path, models: dict[str, Path], tiny: list[tuple[str, str]] = ()) -> Path:
    path.write_text(LIST_HEADER + list_rows(list(tiny)) + pathological_models.list_rows(models))
    return path


def build(root: Path, behaviour: str) -> Path:
    return pathological_models.build(root, behaviour)


class ToyServer:
    """The toy device server in its own process, on a port it keeps across restarts."""

    def __init__(self, python: Path, tmp: Path) -> None:
        self.python, self.tmp, self.port, self.proc = python, tmp, 0, None

    def start(self, kill_file: Path | None = None) -> int:
        port_file = self.tmp / f"port-{time.monotonic_ns()}"
        args = [str(self.python), "-m", "npu_toy.remote", "--port", str(self.port), "--port-file", str(port_file),
                "--max-s", "600"] + (["--kill-file", str(kill_file)] if kill_file else [])
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("TOY_")}, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
        self.proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not port_file.exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.proc.stderr and self.proc.stderr.read()
            time.sleep(0.1)
        self.port = int(port_file.read_text())
        return self.port

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@SHAPES_SLOW
@pytest.mark.long
def test_late_errors_stay_with_the_model_that_caused_them(toy_python: Path, tmp_path: Path, shape: str) -> None:
    """25.2: bert's layer norm fails, reported at the next synchronizing call; bert stops at a missing op
    before one. The next model (which passes alone) must not inherit the error; run and check agree on
    bert's verdict."""
    none = build(tmp_path, "none")
    lst = patho_list(tmp_path / "l.csv", {"z/none": none}, [("bert", "masked-lm")])
    env = {**SHAPES[shape], "TOY_LATE_ERRORS": "1", "TOY_BROKEN_OPS": "native_layer_norm:cannot"}
    r = run_cli(toy_python, "run", "--list", lst, "--target", "toy", "--db", tmp_path / "r.db", "--jobs", "1",
                "--retries", "0", "--quiet", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = rows(tmp_path / "r.db")
    assert got["z/none"]["outcome"] == "pass", got["z/none"]["error_message"]
    bert = got["tiny/bert/masked-lm"]
    assert (bert["outcome"], bert["unsupported_op"]) == ("unsupported_op", "aten::native_layer_norm"), bert
    assert "reported late" in bert["error_message"] and "aten::all" in bert["error_message"]  # both kept
    c = run_cli(toy_python, "check", "tiny/bert/masked-lm", "--target", "toy", "--json", env=env)
    alone = json.loads(c.stdout)
    assert (alone["outcome"], alone["unsupported_op"]) == (bert["outcome"], bert["unsupported_op"]), c.stderr[-2000:]


@pytest.mark.long
@SHAPES_SLOW
def test_a_healthy_single_device_run_finishes_with_its_device_in_service(toy_python: Path, tmp_path: Path,
                                                                         shape: str) -> None:
    """25.1: one device; two models crash once then hit a missing op on the retry (the same device: not
    "elsewhere"; unsupported_op: not a clean run); two adjacent models segfault every time (the device's
    canary re-runs and clears it). Nothing strikes the device; every model gets its own verdict."""
    none, crash = build(tmp_path, "none"), build(tmp_path, "crash")
    lst = patho_list(tmp_path / "l.csv", {
        "m1/none": none, "m2/crash-once": build(tmp_path, "crash-once:a"), "m3/crash-once": build(tmp_path, "crash-once:b"),
        "m4/none": none, "m5/crash": crash, "m6/crash": crash, "m7/none": none})
    r = run_cli(toy_python, "run", "--list", lst, "--target", "toy", "--db", tmp_path / "r.db", "--jobs", "1",
                "--retries", "1", "--quarantine-after", "2", "--quiet", env=SHAPES[shape])
    assert r.returncode == 0 and "quarantining" not in r.stderr, r.stderr[-3000:]
    got = {mid: row["outcome"] for mid, row in rows(tmp_path / "r.db").items()}
    assert got == {"m1/none": "pass", "m2/crash-once": "unsupported_op", "m3/crash-once": "unsupported_op",
                   "m4/none": "pass", "m5/crash": "crash", "m6/crash": "crash", "m7/none": "pass"}, got


@pytest.mark.parametrize("shape", ["plain", "synthetic"])
@pytest.mark.long
def test_a_lost_device_server_is_the_devices_then_resume_finishes_the_run(toy_python: Path, tmp_path: Path,
                                                                          shape: str) -> None:
    """25.3, 25.6 and 32.1: no device server at all, or one dying mid-run, gives device_error rows only,
    never the model's load_fail or ref_fail: seeding while a model is built (and again before its
    reference) talks to the device. A refused connection quarantines the device at once, so the run
    stops, resumable, after one model waited out the client's reconnect window (the synthetic shape has
    one: 2 s, then "could not reach the server again"); once the server is back, --resume finishes every
    model and prints the whole run's counts."""
    none = build(tmp_path, "none")
    lst = tmp_path / "l.csv"  # models run in id order: a1, a2 (kills the server), then the tiny ones, then z3
    lst.write_text(LIST_HEADER + list_rows([("gpt2", "base"), ("llama", "base")]) + pathological_models.list_rows(
        {"a1/none": none, "a2/kill": build(tmp_path, "kill-device-once"), "z3/none": none}))
    server, kill = ToyServer(toy_python, tmp_path), tmp_path / "kill-server"
    db = tmp_path / "r.db"
    args = ["run", "--list", lst, "--target", "toy", "--db", db, "--jobs", "1", "--quiet"]
    window = {"TOY_RECONNECT_S": "2"} if shape == "synthetic" else {}
    refused = "could not reach the server again" if window else "ConnectionRefusedError"
    try:
        port = server.start(kill_file=kill)
        server.stop()  # nothing listens on its port now
        env = {**SHAPES[shape], **window, "TOY_SERVER": f"127.0.0.1:{port}", "TOY_TIMEOUT": "5",
               "PATHO_KILL_FILE": str(kill)}
        r = run_cli(toy_python, *args, env=env)
        assert r.returncode == 1, r.stderr[-3000:]
        line = [x for x in r.stderr.splitlines() if "never ran a model" in x]
        assert len(line) == 1 and refused in line[0], r.stderr[-3000:]
        assert "quarantining toy:0: its backend's client could not reach it" in r.stderr, r.stderr[-3000:]
        got = rows(db)
        assert list(got) == ["a1/none"], got  # the device is out at the first refusal: no other model waits
        first = got["a1/none"]  # its reference seeds the device too
        assert first["outcome"] == "device_error" and first["device_fault"] and first["device_unreachable"], first
        assert refused in f"{first['error_type']}: {first['error_message']}", first["error_message"]
        assert "not counted: device_error 1" in r.stdout and "5 models unfinished" in r.stderr, (r.stdout, r.stderr)

        server.start(kill_file=kill)  # up; a2/kill takes it down mid-run
        r = run_cli(toy_python, *args, "--resume", env=env)
        assert r.returncode == 1 and "never ran" not in r.stderr, r.stderr[-3000:]
        got = rows(db)
        assert got["a1/none"]["outcome"] == "pass", got["a1/none"]["error_message"]
        lost = [got["a2/kill"], got["tiny/gpt2/base"]]  # killed under it; then refused while being built
        assert all(x["outcome"] == "device_error" and x["device_fault"] for x in lost), got
        assert {x["error_type"] for x in lost} <= {"ConnectionRefusedError", "ConnectionResetError", "BrokenPipeError",
                                                   "ConnectionError"}, [x["error_type"] for x in lost]
        assert "load phase" in got["tiny/gpt2/base"]["error_message"], got["tiny/gpt2/base"]["error_message"]
        assert set(got) == {"a1/none", "a2/kill", "tiny/gpt2/base"}, got  # stopped at the refusal

        kill.unlink()
        server.start()  # back, on the same port
        r = run_cli(toy_python, *args, "--resume", env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        got = rows(db)
        assert [got[m]["outcome"] for m in ("a1/none", "a2/kill", "z3/none")] == ["pass"] * 3, got
        assert got["tiny/llama/base"]["outcome"] == "unsupported_op"
        assert got["tiny/gpt2/base"]["outcome"] not in ("device_error", "load_fail", "ref_fail"), got["tiny/gpt2/base"]
        assert ": 5 models (4 now" in r.stdout and "1 already done, resumed" in r.stdout, r.stdout
    finally:
        server.stop()


@SHAPES_SLOW
@pytest.mark.long
def test_resume_prints_the_whole_runs_counts(toy_python: Path, tmp_path: Path, shape: str) -> None:
    """25.6: a run stopped by a dead device, resumed: the summary is the run's, not the resumed part's."""
    none = build(tmp_path, "none")
    lst = patho_list(tmp_path / "l.csv", {"a/none": none, "b/kill": build(tmp_path, "kill-device-once"),
                                          "c/none": none, "d/none": none})
    dead = tmp_path / "toy-dead"
    env = {**SHAPES[shape], "TOY_DEAD_FILE": str(dead), "PATHO_KILL_FILE": str(dead)}
    args = ["run", "--list", lst, "--target", "toy", "--db", tmp_path / "r.db", "--jobs", "1", "--quiet"]
    r = run_cli(toy_python, *args, env=env)
    assert r.returncode == 1 and "quarantining toy:0" in r.stderr, r.stderr[-3000:]
    dead.unlink()
    r = run_cli(toy_python, *args, "--resume", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert ": 4 models (3 now" in r.stdout and "1 already done, resumed" in r.stdout, r.stdout
    assert "ran 100.0% (4/4)" in r.stdout and "pass                        4" in r.stdout, r.stdout


WORDINGS = [("cannot", "remote"), ("bare", "dtype"), ("kernel", "kernel")]  # (embedding's, sum's)


@pytest.mark.parametrize("shape, wordings", [
    ("plain", WORDINGS),
    ("synthetic", [("kernel", "remote")]),  # the shape decides the relayed one: always
    pytest.param("synthetic", WORDINGS, marks=pytest.mark.slow, id="synthetic-all"),
])
@pytest.mark.long
def test_each_real_wording_of_a_missing_op_names_the_op(toy_python: Path, tmp_path: Path, shape: str,
                                                        wordings: list[tuple[str, str]]) -> None:
    """25.4 and 32.1/32.4: kernels broken in each backend's words: unsupported_op naming the ATen op every
    time (never a crash), with the dtype when the message names one. The remote executor's relayed
    dispatcher error counts in both shapes (its code is known without its device module's file); an op
    named before its kernel's dtype words keeps the dtype."""
    lst = patho_list(tmp_path / "l.csv", {"z/none": build(tmp_path, "none")}, [("patchtst", "base")])
    dtype = {"dtype": "Bool", "kernel": "Bool"}  # sum's first input; embedding's is its Float weight
    for i, (embedding, sum_) in enumerate(wordings):
        db = tmp_path / f"{i}.db"
        r = run_cli(toy_python, "run", "--list", lst, "--target", "toy", "--db", db, "--jobs", "1", "--quiet",
                    env={**SHAPES[shape], "TOY_BROKEN_OPS": f"embedding:{embedding},sum:{sum_}"})
        assert r.returncode == 0, r.stderr[-3000:]
        got = {mid: (x["outcome"], x["unsupported_op"], x["unsupported_dtype"]) for mid, x in rows(db).items()}
        assert got == {"z/none": ("unsupported_op", "aten::embedding", "Float" if embedding == "kernel" else ""),
                       "tiny/patchtst/base": ("unsupported_op", "aten::sum", dtype.get(sum_, ""))}, (shape, got)


@SHAPES_SLOW
@pytest.mark.long
def test_a_kernel_with_a_wrong_shape_is_a_drift_naming_it(toy_python: Path, tmp_path: Path, shape: str) -> None:
    """25.5: layer norm's mean/rstd come back a dimension short: the op check's finding, not a crash."""
    lst = patho_list(tmp_path / "l.csv", {"z/norm": build(tmp_path, "norm")})
    r = run_cli(toy_python, "run", "--list", lst, "--target", "toy", "--db", tmp_path / "r.db", "--jobs", "1", "--quiet",
                env={**SHAPES[shape], "TOY_BROKEN_OPS": "native_layer_norm:shape"})
    assert r.returncode == 0, r.stderr[-3000:]
    row = rows(tmp_path / "r.db")["z/norm"]
    assert row["outcome"] == "drift" and row["first_drift_op"] == "aten::native_layer_norm", row["error_message"]
    assert "shape [" in row["error_message"] and "vs expected" in row["error_message"]
    assert row["first_drift_op_module"] == ""  # the top module's (not the first parameter's: no data pointers)


@SHAPES_SLOW
@pytest.mark.long
def test_a_device_that_kills_every_model_is_quarantined_not_the_models(toy_python: Path, tmp_path: Path,
                                                                        shape: str) -> None:
    """25.8 on one device: every model's worker segfaults; nothing ever survives there. The device is
    quarantined, no row blames a model, and the run says the target never worked."""
    none = build(tmp_path, "none")
    lst = patho_list(tmp_path / "l.csv", {"a/none": none, "b/none": none, "c/none": none})
    r = run_cli(toy_python, "run", "--list", lst, "--target", "toy", "--db", tmp_path / "r.db", "--jobs", "1", "--quiet",
                env={**SHAPES[shape], "TOY_FAULT": "segv"})
    assert r.returncode == 1 and "quarantining toy:0" in r.stderr and "never ran a model" in r.stderr, r.stderr[-3000:]
    got = rows(tmp_path / "r.db")
    assert got and {x["outcome"] for x in got.values()} == {"device_error"}, got


@pytest.mark.long
def test_two_devices_that_kill_or_hang_are_quarantined_and_the_spare_decides(tmp_path: Path) -> None:
    """25.8: three sim devices, one spare; sim:0 and sim:1 segfault (then: hang) on every kernel. Both
    are quarantined, the spare comes in, every model's result comes from sim:2."""
    lst = tmp_path / "l.csv"
    lst.write_text(LIST_HEADER + list_rows([("bert", "base"), ("gpt2", "base"), ("llama", "base")]))
    for kind, extra in (("crash", []), ("hang", ["--timeout", "8"])):
        db = tmp_path / f"{kind}.db"
        r = run_cli(Path(sys.executable), "run", "--list", lst, "--db", db, *EXACT, "--jobs", "2", "--spare", "1",
                    "--fault", f"sim:0={kind}:1.0;sim:1={kind}:1.0", "--quiet", *extra,
                    env={"PORTHARNESS_SIM_DEVICES": "3"})
        assert r.returncode == 0, (kind, r.stderr[-3000:])
        assert "quarantining sim:0" in r.stderr and "quarantining sim:1" in r.stderr and "hot spare sim:2" in r.stderr
        for row in rows(db).values():
            assert (row["outcome"], row["device"]) == ("pass", "sim:2"), (kind, row["model_id"], row["attempts"])


@pytest.mark.long
def test_memory_exhaustion_is_oom_and_a_cap_too_small_for_the_worker_is_one_error(tmp_path: Path) -> None:
    """25.9: a forward that exhausts the capped allocator on the CPU reference is `oom` (reference phase),
    not ref_fail; a cap too small for the worker's own imports stops the run once (exit 2), no rows."""
    lst = patho_list(tmp_path / "l.csv", {"patho/oom-ref": build(tmp_path, "oom-ref")})
    db = tmp_path / "r.db"
    r = run_cli(Path(sys.executable), "run", "--list", lst, "--db", db, "--target", "cpu", "--mem-cap-mb", "2048",
                "--jobs", "1", "--quiet")
    row = rows(db)["patho/oom-ref"]
    assert row["outcome"] == "oom" and "reference phase" in row["error_message"], row["error_message"]
    tiny = tmp_path / "t.csv"
    tiny.write_text(LIST_HEADER + list_rows([("bert", "base"), ("gpt2", "base")]))
    r = run_cli(Path(sys.executable), "run", "--list", tiny, "--db", tmp_path / "cap.db", "--target", "cpu",
                "--mem-cap-mb", "16", "--jobs", "1", "--quiet")
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(r.stderr.strip().splitlines()) == 2 and "--mem-cap-mb 16: too small" in r.stderr, r.stderr
    assert not rows(tmp_path / "cap.db")


_WHOSE = re.compile(r"^(compiled only; eager on \S+ passes \([^)]*\)|eager on \S+ fails too \([^)]*\))")


def _whose(db: Path) -> dict[str, tuple[str, str, str]]:
    """Each compiled row's outcome, eager outcome and "whose failure" words (the message's head)."""
    out = {}
    for mid, x in rows(db).items():
        m = _WHOSE.match(x["error_message"])
        out[mid] = (x["outcome"], x["eager_outcome"], m.group(1) if m else "")
    return out


@pytest.mark.parametrize("backend", ["toy", "sim"])
@pytest.mark.long
def test_compiled_rows_say_the_same_without_the_cache_filling_it_and_warm(toy_python: Path, tmp_path: Path,
                                                                          backend: str) -> None:
    """32.2: a compiled row that fails is re-checked eagerly on the same device; with the reference cache
    (the default of `run`) no CPU copy is kept, and the re-check must not move the just-compiled model
    again: a backend that moves parameters by swap_tensors (the toy's tensor-subclass parameters) refuses
    ("Couldn't swap Embedding.weight") while Dynamo holds them. A run without the cache, one that fills it
    and one that finds it warm give every compiled row the same outcome and the same words."""
    patho = {"m/nofake": build(tmp_path, "no-fake")}  # Dynamo cannot trace it; eagerly it runs anywhere
    if backend == "toy":  # Inductor cannot generate code for toy: every row is re-checked eagerly; norm fails there
        patho["m/norm"] = build(tmp_path, "norm")
        python, env = toy_python, {"TOY_SUBCLASS_PARAMS": "1", "TOY_BROKEN_OPS": "native_layer_norm:cannot"}
        args, device = ["--target", "toy", "--compile", "inductor"], "toy:0"
    else:
        python, env, args, device = Path(sys.executable), {}, ["--target", "sim", "--compile", "eager"], "sim:0"
    lst = patho_list(tmp_path / "l.csv", patho)
    said = {}
    cache = ["--ref-cache", str(tmp_path / "ref-cache")]
    for name, extra in (("without", ["--no-ref-cache"]), ("filling", cache), ("warm", cache)):
        db = tmp_path / f"{name}.db"
        r = run_cli(python, "run", "--list", lst, *args, "--db", db, "--jobs", "1", "--quiet", *extra, env=env)
        assert r.returncode == 0, (name, r.stderr[-3000:])
        said[name] = _whose(db)
        if name == "warm":
            assert {x["ref_cache"] for x in rows(db).values()} == {"cached"}, name
    assert said["without"] == said["filling"] == said["warm"], said
    assert said["warm"]["m/nofake"] == ("compile_fail", "pass", f"compiled only; eager on {device} passes (pass)")
    if backend == "toy":
        assert said["warm"]["m/norm"] == ("compile_fail", "unsupported_op",
                                          f"eager on {device} fails too (unsupported_op: aten::native_layer_norm)")


@SHAPES_SLOW
@pytest.mark.long
def test_perf_on_a_backend_without_memory_statistics_keeps_its_timing(toy_python: Path, tmp_path: Path,
                                                                       shape: str) -> None:
    """32.3: the toy keeps no allocator statistics (torch.accelerator says its allocator is not a
    DeviceAllocator): the row has its timing, its peak memory absent."""
    lst = patho_list(tmp_path / "l.csv", {"z/none": build(tmp_path, "none")})
    r = run_cli(toy_python, "run", "--list", lst, "--target", "toy", "--db", tmp_path / "r.db", "--jobs", "1",
                "--perf", "--perf-budget", "0.3", "--quiet", env=SHAPES[shape])
    assert r.returncode == 0, r.stderr[-3000:]
    row = rows(tmp_path / "r.db")["z/none"]
    perf = json.loads(row["perf"]) if isinstance(row["perf"], str) else row["perf"]
    assert row["outcome"] == "pass" and "error" not in perf, perf
    peak = row["perf_peak_mem_mb"]
    assert row["perf_rounds"] >= 5 and row["perf_target_s"] > 0 and (peak is None or peak != peak), row  # NaN: none
