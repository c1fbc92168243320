"""Blame the right party on rude hardware (issue 25), through the real CLI.

The test backend (npu_toy, pip-installed next to portharness) reports errors late, keeps its tensors
behind an op server that can die and come back, words its missing ops as real backends do, segfaults
or hangs; `sim` with three devices kills or hangs on two of them. Each test is one item of the issue:
the verdicts must land on the model when the model failed and on the device when the device did.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pathological_models
from conftest import LIST_HEADER, list_rows

from harness.results.store import ResultStore

EXACT = ["--precision", "highest", "--ops", "full"]


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


def test_late_errors_stay_with_the_model_that_caused_them(toy_python: Path, tmp_path: Path) -> None:
    """25.2: bert's layer norm fails, reported at the next synchronizing call; bert stops at a missing op
    before one. The next model (which passes alone) must not inherit the error; run and check agree on
    bert's verdict."""
    none = build(tmp_path, "none")
    lst = patho_list(tmp_path / "l.csv", {"z/none": none}, [("bert", "masked-lm")])
    env = {"TOY_LATE_ERRORS": "1", "TOY_BROKEN_OPS": "native_layer_norm:cannot"}
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


def test_a_healthy_single_device_run_finishes_with_its_device_in_service(toy_python: Path, tmp_path: Path) -> None:
    """25.1: one device; two models crash once then hit a missing op on the retry (the same device: not
    "elsewhere"; unsupported_op: not a clean run); two adjacent models segfault every time (the device's
    canary re-runs and clears it). Nothing strikes the device; every model gets its own verdict."""
    none, crash = build(tmp_path, "none"), build(tmp_path, "crash")
    lst = patho_list(tmp_path / "l.csv", {
        "m1/none": none, "m2/crash-once": build(tmp_path, "crash-once:a"), "m3/crash-once": build(tmp_path, "crash-once:b"),
        "m4/none": none, "m5/crash": crash, "m6/crash": crash, "m7/none": none})
    r = run_cli(toy_python, "run", "--list", lst, "--target", "toy", "--db", tmp_path / "r.db", "--jobs", "1",
                "--retries", "1", "--quarantine-after", "2", "--quiet")
    assert r.returncode == 0 and "quarantining" not in r.stderr, r.stderr[-3000:]
    got = {mid: row["outcome"] for mid, row in rows(tmp_path / "r.db").items()}
    assert got == {"m1/none": "pass", "m2/crash-once": "unsupported_op", "m3/crash-once": "unsupported_op",
                   "m4/none": "pass", "m5/crash": "crash", "m6/crash": "crash", "m7/none": "pass"}, got


def test_a_lost_device_server_is_the_devices_then_resume_finishes_the_run(toy_python: Path, tmp_path: Path) -> None:
    """25.3 and 25.6: with no device server at all the run ends non-zero with one line saying so, its rows
    device_error (not load_fail: the loader wraps the client's ConnectionRefusedError); the server dying
    mid-run gives pending device_error rows, quarantine and a stop; once it is back, --resume runs them
    and prints the whole run's counts."""
    none = build(tmp_path, "none")
    lst = patho_list(tmp_path / "l.csv", {"x1/none": none, "x2/kill": build(tmp_path, "kill-device-once"),
                                          "x3/none": none}, [("llama", "base")])
    server, kill = ToyServer(toy_python, tmp_path), tmp_path / "kill-server"
    db = tmp_path / "r.db"
    args = ["run", "--list", lst, "--target", "toy", "--db", db, "--jobs", "1", "--quiet"]
    try:
        port = server.start(kill_file=kill)
        server.stop()  # nothing listens on its port now
        env = {"TOY_SERVER": f"127.0.0.1:{port}", "TOY_TIMEOUT": "5", "PATHO_KILL_FILE": str(kill)}
        r = run_cli(toy_python, *args, env=env)
        assert r.returncode == 1, r.stderr[-3000:]
        line = [x for x in r.stderr.splitlines() if "never ran a model" in x]
        assert len(line) == 1 and "ConnectionRefusedError" in line[0], r.stderr[-3000:]
        got = rows(db)
        assert {x["outcome"] for x in got.values()} == {"device_error"} and len(got) == 2, got
        loading = got["tiny/llama/base"]  # a tiny model seeds every device while it is built
        assert loading["error_type"] == "ConnectionRefusedError" and "load phase" in loading["error_message"], loading
        assert "not counted: device_error 2" in r.stdout

        server.start(kill_file=kill)  # up; x2/kill takes it down mid-run
        r = run_cli(toy_python, *args, "--resume", env=env)
        assert r.returncode == 1 and "never ran" not in r.stderr, r.stderr[-3000:]
        got = rows(db)
        assert got["tiny/llama/base"]["outcome"] == "unsupported_op" and got["x1/none"]["outcome"] == "pass"
        lost = [got["x2/kill"], got["x3/none"]]
        assert all(x["outcome"] == "device_error" and x["device_fault"] for x in lost), got
        assert {x["error_type"] for x in lost} <= {"ConnectionRefusedError", "ConnectionResetError", "BrokenPipeError"}

        kill.unlink()
        server.start()  # back, on the same port
        r = run_cli(toy_python, *args, "--resume", env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        got = rows(db)
        assert [got[m]["outcome"] for m in ("x1/none", "x2/kill", "x3/none")] == ["pass"] * 3, got
        assert ": 4 models (2 now" in r.stdout and "2 already done, resumed" in r.stdout, r.stdout
        assert "ran 75.0% (3/4)" in r.stdout, r.stdout
    finally:
        server.stop()


def test_resume_prints_the_whole_runs_counts(toy_python: Path, tmp_path: Path) -> None:
    """25.6: a run stopped by a dead device, resumed: the summary is the run's, not the resumed part's."""
    none = build(tmp_path, "none")
    lst = patho_list(tmp_path / "l.csv", {"a/none": none, "b/kill": build(tmp_path, "kill-device-once"),
                                          "c/none": none, "d/none": none})
    dead = tmp_path / "toy-dead"
    env = {"TOY_DEAD_FILE": str(dead), "PATHO_KILL_FILE": str(dead)}
    args = ["run", "--list", lst, "--target", "toy", "--db", tmp_path / "r.db", "--jobs", "1", "--quiet"]
    r = run_cli(toy_python, *args, env=env)
    assert r.returncode == 1 and "quarantining toy:0" in r.stderr, r.stderr[-3000:]
    dead.unlink()
    r = run_cli(toy_python, *args, "--resume", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert ": 4 models (3 now" in r.stdout and "1 already done, resumed" in r.stdout, r.stdout
    assert "ran 100.0% (4/4)" in r.stdout and "pass                        4" in r.stdout, r.stdout


def test_each_real_wording_of_a_missing_op_names_the_op(toy_python: Path, tmp_path: Path) -> None:
    """25.4: kernels broken in each backend's words: unsupported_op naming the ATen op every time (never
    a crash), with the dtype when the message names one."""
    lst = patho_list(tmp_path / "l.csv", {"z/none": build(tmp_path, "none")}, [("patchtst", "base")])
    for i, (embedding, sum_) in enumerate((("cannot", "remote"), ("bare", "dtype"))):
        db = tmp_path / f"{i}.db"
        r = run_cli(toy_python, "run", "--list", lst, "--target", "toy", "--db", db, "--jobs", "1", "--quiet",
                    env={"TOY_BROKEN_OPS": f"embedding:{embedding},sum:{sum_}"})
        assert r.returncode == 0, r.stderr[-3000:]
        got = {mid: (x["outcome"], x["unsupported_op"], x["unsupported_dtype"]) for mid, x in rows(db).items()}
        assert got == {"z/none": ("unsupported_op", "aten::embedding", ""),
                       "tiny/patchtst/base": ("unsupported_op", "aten::sum", "Bool" if sum_ == "dtype" else "")}, got


def test_a_kernel_with_a_wrong_shape_is_a_drift_naming_it(toy_python: Path, tmp_path: Path) -> None:
    """25.5: layer norm's mean/rstd come back a dimension short: the op check's finding, not a crash."""
    lst = patho_list(tmp_path / "l.csv", {"z/norm": build(tmp_path, "norm")})
    r = run_cli(toy_python, "run", "--list", lst, "--target", "toy", "--db", tmp_path / "r.db", "--jobs", "1", "--quiet",
                env={"TOY_BROKEN_OPS": "native_layer_norm:shape"})
    assert r.returncode == 0, r.stderr[-3000:]
    row = rows(tmp_path / "r.db")["z/norm"]
    assert row["outcome"] == "drift" and row["first_drift_op"] == "aten::native_layer_norm", row["error_message"]
    assert "shape [" in row["error_message"] and "vs expected" in row["error_message"]
    assert row["first_drift_op_module"] == ""  # the top module's (not the first parameter's: no data pointers)


def test_a_device_that_kills_every_model_is_quarantined_not_the_models(toy_python: Path, tmp_path: Path) -> None:
    """25.8 on one device: every model's worker segfaults; nothing ever survives there. The device is
    quarantined, no row blames a model, and the run says the target never worked."""
    none = build(tmp_path, "none")
    lst = patho_list(tmp_path / "l.csv", {"a/none": none, "b/none": none, "c/none": none})
    r = run_cli(toy_python, "run", "--list", lst, "--target", "toy", "--db", tmp_path / "r.db", "--jobs", "1", "--quiet",
                env={"TOY_FAULT": "segv"})
    assert r.returncode == 1 and "quarantining toy:0" in r.stderr and "never ran a model" in r.stderr, r.stderr[-3000:]
    got = rows(tmp_path / "r.db")
    assert got and {x["outcome"] for x in got.values()} == {"device_error"}, got


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
