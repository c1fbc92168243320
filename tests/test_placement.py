"""Process placement: sim's devices across processes (ownership, the shared budget, turns, visibility, release
after kill -9), the adapter's placement answers, the fleet's cap, and `portharness placement`'s rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20

# A Python process that runs the lines it is sent (one statement per line, `out` sent back as JSON): two of
# them are two processes using one simulated device.
_REPL = r"""
import json, os, sys, time, traceback
import torch, harness.sim
from harness.sim import placement
print(json.dumps({"pid": os.getpid()}), flush=True)
for line in sys.stdin:
    out = None
    try:
        exec(line)
        msg = {"out": out}
    except BaseException as e:
        msg = {"error": type(e).__name__, "message": str(e)}
    print(json.dumps(msg), flush=True)
"""


class Proc:
    """One such process, with its own environment (sim's switches) on top of this test's."""

    def __init__(self, **env: str) -> None:  # started now, waited for at first use: several start at once
        self.p = subprocess.Popen([sys.executable, "-c", _REPL], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, env={**os.environ, "PYTHONPATH": str(ROOT), **env})
        self._pid: int | None = None

    @property
    def pid(self) -> int:
        if self._pid is None:
            self._pid = json.loads(self.p.stdout.readline())["pid"]
        return self._pid

    def __call__(self, line: str) -> dict[str, Any]:
        assert self.pid
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(30)


@pytest.fixture(name="procs")
def _procs():
    made: list[Proc] = []

    def make(**env: str) -> Proc:
        made.append(Proc(**env))
        return made[-1]

    yield make
    for p in made:
        p.close()


ALLOC = 'x = torch.empty(48 << 20, dtype=torch.uint8, device="sim:0"); out = [v >> 20 for v in torch.sim.mem_get_info(0)]'
INFO = "out = [v >> 20 for v in torch.sim.mem_get_info(0)]"


def _names(namespace: str) -> list[str]:
    """The abstract socket names sim holds in `namespace` (what would be left behind)."""
    return [line.split()[-1] for line in Path("/proc/net/unix").read_text().splitlines()
            if f"portharness-sim:{namespace}:" in line]


linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sim models ownership on Linux only")


@pytest.mark.long
@linux
def test_a_second_process_is_refused_at_first_use_naming_the_holder(procs) -> None:
    """The issue's case, exclusive (the default): two processes each open sim:0 on a 64 MiB device and
    allocate 48 MiB. The second is refused at once, naming the first's pid; once the first exits, it is not."""
    a, b = procs(PORTHARNESS_SIM_MEMORY_MB="64"), procs(PORTHARNESS_SIM_MEMORY_MB="64")
    assert a(ALLOC) == {"out": [16, 64]}
    assert a("out = placement.holders(0)")["out"] == [[a.pid, "exclusive"]]
    t0 = time.monotonic()
    refused = b(ALLOC)
    took = time.monotonic() - t0
    assert refused["error"] == "RuntimeError" and refused["message"].startswith(
        f"sim:0 is in use by process {a.pid} (sim's devices are exclusive"), refused
    assert took < 2.0, took  # at first use, not a hang
    assert b(INFO)["message"] == refused["message"]  # asking its memory is a use too
    assert b('y = torch.ones(2, device="sim:1"); out = y.sum().item()') == {"out": 2.0}  # another device is free
    assert b("out = placement.holders(0)")["out"] == [[a.pid, "exclusive"]]
    a.close()
    assert b(ALLOC) == {"out": [16, 64]}


@pytest.mark.long
@linux
def test_a_shared_device_is_one_budget_and_reports_the_shared_truth(procs) -> None:
    env = {"PORTHARNESS_SIM_MEMORY_MB": "64", "PORTHARNESS_SIM_SHARING": "shared"}
    a, b = procs(**env), procs(**env)
    assert a(ALLOC) == {"out": [16, 64]}
    oom = b(ALLOC)
    assert oom["error"] == "OutOfMemoryError", oom
    assert oom["message"].startswith("sim:0 out of memory. Tried to allocate 48.00 MiB. sim:0 has a total capacity "
                                     "of 64.00 MiB of which 16.00 MiB is free.")
    assert f"Process {a.pid} has 48.00 MiB memory in use" in oom["message"]
    assert b(INFO) == {"out": [16, 64]}
    assert b('z = torch.empty(16 << 20, dtype=torch.uint8, device="sim:0"); out = torch.sim.memory_allocated(0)') == {
        "out": 16 * MIB}  # memory_allocated stays this process's own, as on CUDA
    assert a(INFO) == {"out": [0, 64]}
    assert b("out = sorted(placement.tenants(0).items())")["out"] == sorted([[a.pid, 48 * MIB], [b.pid, 16 * MIB]])
    # an exclusive newcomer is refused by the sharers, naming both
    c = procs(PORTHARNESS_SIM_MEMORY_MB="64")
    refused = c(INFO)["message"]
    assert refused.startswith("sim:0 is in use by processes ") and str(a.pid) in refused and str(b.pid) in refused


@pytest.mark.long
@linux
def test_kill_9_releases_the_device_and_leaves_nothing_behind(procs) -> None:
    namespace = os.environ["PORTHARNESS_SIM_NAMESPACE"]
    shm = sorted(os.listdir("/dev/shm"))
    a = procs(PORTHARNESS_SIM_MEMORY_MB="64")
    assert a(ALLOC)["out"] == [16, 64]
    assert len(_names(namespace)) == 1
    os.kill(a.pid, signal.SIGKILL)
    a.p.wait(10)
    assert _names(namespace) == []
    b = procs(PORTHARNESS_SIM_MEMORY_MB="64")
    assert b(ALLOC)["out"] == [16, 64]
    b.close()
    # shared: a co-tenant's bytes are the budget's until it dies; then they are taken back
    env = {"PORTHARNESS_SIM_MEMORY_MB": "64", "PORTHARNESS_SIM_SHARING": "shared"}
    c, d = procs(**env), procs(**env)
    assert c(ALLOC)["out"] == [16, 64] and d(INFO)["out"] == [16, 64]
    os.kill(c.pid, signal.SIGKILL)
    c.p.wait(10)
    assert d(ALLOC) == {"out": [16, 64]}
    d.close()
    assert _names(namespace) == [] and sorted(os.listdir("/dev/shm")) == shm


@pytest.mark.long
@linux
def test_kernels_of_a_shared_device_take_turns(procs) -> None:
    """A kernel kept busy for long (a planted 1000x slowdown) holds a shared device: another process's kernel
    there waits for it; on another device it does not."""
    env = {"PORTHARNESS_SIM_SHARING": "shared", "PORTHARNESS_SIM_OPS": "full"}
    slow, quick = procs(**env), procs(**env)
    for p in (slow, quick):
        p('m = torch.ones(384, 384, device="sim:0"); t = torch.ones(4, device="sim:0"); m @ m; out = 0')  # warm
    # 1000 x a ~1 ms kernel: a second or more; "go" is printed as it starts, its result when it ends
    slow.p.stdin.write('harness.sim.set_slow_ops("aten::mm:1000"); print(json.dumps({"out": "go"}), flush=True); '
                       't0 = time.perf_counter(); m @ m; out = time.perf_counter() - t0\n')
    slow.p.stdin.flush()
    assert json.loads(slow.p.stdout.readline()) == {"out": "go"}
    time.sleep(0.05)
    waited = quick('t0 = time.perf_counter(); (t + 1).sum().item(); out = time.perf_counter() - t0')["out"]
    other = quick('u = torch.ones(4, device="sim:1"); t0 = time.perf_counter(); (u + 1).sum().item(); '
                  'out = time.perf_counter() - t0')["out"]
    busy = json.loads(slow.p.stdout.readline())["out"]
    assert waited > 0.2 and waited < busy + 0.5 and other < waited / 4, (busy, waited, other)


def test_visibility_and_the_per_process_fraction(procs) -> None:
    p = procs(PORTHARNESS_SIM_VISIBLE_DEVICES="1", PORTHARNESS_SIM_MEMORY_MB="64")
    assert p("out = [torch.sim.device_count(), placement.physical_index(0), torch.sim.get_device_name(0)]")["out"] == [
        1, 1, "portharness sim accelerator 1"]
    assert "out of range: 1 visible simulated devices" in p('torch.ones(1, device="sim:1")')["message"]
    assert p("out = placement.holders(0)")["out"] == []
    p('x = torch.ones(1, device="sim:0"); out = 0')
    assert p("out = placement.holders(0)")["out"] == [[p.pid, "exclusive"]]
    capped = p('torch.sim.set_per_process_memory_fraction(0.5, 0); torch.empty(40 << 20, dtype=torch.uint8, device="sim:0")')
    assert capped["error"] == "OutOfMemoryError" and "This process may use 32.00 MiB of sim:0 (physical sim:1) " \
        "(set_per_process_memory_fraction(0.500000))" in capped["message"], capped
    bad = subprocess.run([sys.executable, "-c", "import harness.sim"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "PORTHARNESS_SIM_VISIBLE_DEVICES": "0,5"})
    assert bad.returncode == 1 and ("ValueError: PORTHARNESS_SIM_VISIBLE_DEVICES='0,5': '5' names no device; expected "
                                    "distinct indices of the 2 simulated devices (0..1)") in bad.stderr


# ----------------------------------------------------------------------------------------------
# The adapter and the fleet (no processes)
# ----------------------------------------------------------------------------------------------


def test_the_adapter_knows_visibility_sharing_and_the_holder(monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.backends import adapter_for
    from harness.backends.errors import IN_USE, parse_in_use

    for p in IN_USE:
        assert p.regex.search(p.example), p.name
    assert parse_in_use(IN_USE[0].example).holder == 1234 and parse_in_use(IN_USE[1].example).holder == 1234
    assert parse_in_use("CUDA error: CUDA-capable device(s) is/are busy or unavailable").holder is None
    assert parse_in_use("CUDA error: out of memory") is None
    cuda, sim, cpu = adapter_for("cuda"), adapter_for("sim"), adapter_for("cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert cuda.visible_env([1]) == {"CUDA_VISIBLE_DEVICES": "3"} and cuda.sharing() == "unknown"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert cuda.visible_env([0, 1]) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert cpu.visible_env([0]) == {} and cpu.sharing() == "shared" and not cpu.exclusive
    assert sim.visible_env([1]) == {"PORTHARNESS_SIM_VISIBLE_DEVICES": "1"} and sim.exclusive
    assert sim.is_device_fault(RuntimeError(IN_USE[0].example))  # another process holding it: run elsewhere
    monkeypatch.setenv("PORTHARNESS_SIM_SHARING", "shared")
    assert sim.sharing() == "shared" and not sim.exclusive
    monkeypatch.setenv("PORTHARNESS_SIM_SHARING", "both")
    with pytest.raises(ValueError, match="PORTHARNESS_SIM_SHARING='both': expected exclusive or shared"):
        sim.sharing()


def test_a_vendor_adapter_says_how_its_devices_are_placed() -> None:
    """A `--backend` module's adapter: its visibility variable shows each per-chip process its own chip, its
    own words name the holder, its sharing reaches the fleet; the scenarios' plans follow it."""
    from harness.backends import Adapter, adapter_for, register_adapter
    from harness.backends.errors import InUse
    from harness.bench.placement import PlacementConfig, plan
    from harness.fleet.executor import LocalExecutor, device_cap

    class Npu(Adapter):
        visibility_variable = "ASCEND_RT_VISIBLE_DEVICES"

        def sharing(self) -> str:
            return "exclusive"

        def refusal(self, exc: BaseException) -> InUse | None:
            m = str(exc)
            return InUse(m, int(m.split()[-1])) if m.startswith("npu busy: held by") else None

    register_adapter("npu-vendor", Npu)
    npu = adapter_for("npu-vendor:1")
    cfg = PlacementConfig(target="npu-vendor")
    chips = plan(cfg, "per-chip", npu, ["npu-vendor:0", "npu-vendor:1"], "npu-vendor:0")
    assert [(r["devices"], r["env"]["ASCEND_RT_VISIBLE_DEVICES"]) for r in chips.roles.values()] == [
        (["npu-vendor:0"], "0"), (["npu-vendor:0"], "1")]
    assert npu.refusal(RuntimeError("npu busy: held by 77")) == InUse("npu busy: held by 77", 77)
    assert device_cap(LocalExecutor(), npu) == 1
    rl = plan(cfg, "rl", npu, ["npu-vendor:0", "npu-vendor:1"], "npu-vendor:1")
    assert rl.link == ("trainer", "generator") and rl.stages[0] == {"trainer": "alone", "generator": "collect"}
    assert all(r["devices"] == ["npu-vendor:1"] for r in rl.roles.values())
    assert list(plan(cfg, "shared:3", npu, [], "npu-vendor:0").roles) == ["p0", "p1", "p2"]


def test_the_local_pool_puts_one_worker_on_an_exclusive_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from collections import Counter

    from harness.backends import adapter_for
    from harness.fleet.executor import LocalExecutor, RayExecutor, device_cap
    from harness.fleet.policy import Fleet, pick_device, workers

    sim, local = adapter_for("sim"), LocalExecutor()
    assert device_cap(local, sim) == 1 and device_cap(RayExecutor(), sim) == 1
    assert workers(4, 10, 2, device_cap(local, sim)) == 2
    fleet = Fleet(["sim:0", "sim:1"])
    assert pick_device(fleet, Counter({"sim:0": 1, "sim:1": 1}), cap=device_cap(local, sim)) is None
    monkeypatch.setenv("PORTHARNESS_SIM_SHARING", "shared")
    assert device_cap(local, sim) is None and workers(4, 10, 2, None) == 4
    assert device_cap(local, adapter_for("cpu")) is None


# ----------------------------------------------------------------------------------------------
# portharness placement
# ----------------------------------------------------------------------------------------------


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_bad_input_is_one_line(capsys: pytest.CaptureFixture) -> None:
    from harness.cli import main

    for argv, said in [
        (["--scenarios", "shared:1"], "--scenarios shared:1: K processes on one device must be from 2 to 16"),
        (["--scenarios", "per-chip,swap"], "--scenarios 'swap': unknown scenario; expected per-chip, host, shared:K"),
        (["--steps", "1"], "--steps 1: from 3"),
        (["--target", "sim:7"], "--target sim:7: device index 7 out of range"),
    ]:
        assert main(["placement", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err
    bad = _cli("placement", "--target", "sim", env={"PORTHARNESS_SIM_VISIBLE_DEVICES": "3"}, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "PORTHARNESS_SIM_VISIBLE_DEVICES='3': '3' names " \
        "no device" in bad.stderr, bad.stderr


def _rows(out: str) -> dict[str, dict[str, Any]]:
    return {r["scenario"]: r for r in json.loads(out)["rows"]}


QUICK = ["--steps", "4", "--warmup", "1", "--timeout", "240"]


@pytest.mark.long
def test_every_scenario_on_cpu_is_allowed_and_identical(tmp_path: Path) -> None:
    r = _cli("placement", "--target", "cpu", "--json", "--db", str(tmp_path / "p.db"), *QUICK)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(r.stdout)
    assert list(rows) == ["per-chip", "host", "shared:2", "rl"]
    for name, row in rows.items():
        assert row["result"] == "allowed" and row["identical"] is True and row["mode"] == "shared", (name, row)
        assert row["slowdown"] > 0 and row["slowdown_lo"] <= row["slowdown"] <= row["slowdown_hi"]
    assert rows["rl"]["latest_weights"] is True and rows["rl"]["handoff_ms"] > 0
    assert rows["per-chip"]["visibility"] == "not restricted (the backend names no visibility variable)"
    assert len(rows["shared:2"]["per_process"]) == 2
    from harness.report import build_report

    site = build_report(tmp_path / "p.db", tmp_path / "site").parent
    page = (site / "placement.html").read_text()
    assert "shared:2" in page and "latest weights" in page and 'href="placement.html"' in (site / "index.html").read_text()


@pytest.mark.long
def test_sim_exclusive_refuses_a_second_process_and_shared_allows_it(tmp_path: Path) -> None:
    db = tmp_path / "p.db"
    r = _cli("placement", "--target", "sim", "--json", "--db", str(db), *QUICK)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(r.stdout)
    assert rows["per-chip"]["result"] == "allowed" and rows["per-chip"]["identical"] is True
    assert rows["per-chip"]["visibility"] == "each process saw only its own device (PORTHARNESS_SIM_VISIBLE_DEVICES)"
    assert [p["identity"] for p in rows["per-chip"]["per_process"]] == [["portharness sim accelerator 0"],
                                                                        ["portharness sim accelerator 1"]]
    assert rows["host"]["result"] == "allowed" and rows["host"]["per_process"][0]["devices"] == ["sim:0", "sim:1"]
    for name, second in (("shared:2", "p1"), ("rl", "generator")):
        row = rows[name]
        holder = row["per_process"][0]
        assert row["result"] == "refused" and row["refused_role"] == second and row["mode"] == "exclusive"
        assert row["refusal"].startswith(f"sim:0 is in use by process {holder['pid']} ") and row["holder"] == holder["pid"]
        assert row["holder_role"] == holder["role"] and row["refusal_s"] < 1.0 and row["identical"] is None
    shared = _cli("placement", "--target", "sim", "--json", "--db", str(db), *QUICK,
                  env={"PORTHARNESS_SIM_SHARING": "shared"})
    assert shared.returncode == 0, shared.stderr[-3000:]
    rows = _rows(shared.stdout)
    for name, row in rows.items():
        assert row["result"] == "allowed" and row["identical"] is True and row["mode"] == "shared", (name, row)
    assert rows["rl"]["latest_weights"] is True
    assert all(p["peak_mb"] > 0 for p in rows["shared:2"]["per_process"])
    from harness.results.store import ResultStore

    with ResultStore(db, read_only=True) as store:
        stored = store.placements()
    assert sorted(zip(stored["mode"], stored["scenario"], stored["result"], strict=True)) == sorted(
        [("exclusive", "per-chip", "allowed"), ("exclusive", "host", "allowed"), ("exclusive", "shared:2", "refused"),
         ("exclusive", "rl", "refused")] + [("shared", s, "allowed") for s in ("per-chip", "host", "shared:2", "rl")])


@pytest.mark.long
def test_a_process_that_hangs_is_a_timeout_row_naming_it_and_nothing_is_left(tmp_path: Path) -> None:
    r = _cli("placement", "--target", "cpu", "--scenarios", "rl", "--json", "--backend", "placement_freeze",
             "--steps", "4", "--timeout", "25", env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "FREEZE_ROLE": "generator"})
    assert r.returncode == 1, r.stderr[-3000:]
    row = _rows(r.stdout)["rl"]
    gen = next(p for p in row["per_process"] if p["role"] == "generator")
    # the frozen generator is named as stopped; the trainer, blocked handing it weights, as waiting
    assert row["result"] == "timeout" and f"generator (pid {gen['pid']}, collecting the trainer's weights, " \
        "stopped)" in row["error"], row["error"]
    assert "portharness placement: rl: timeout: past the 25 s deadline" in r.stderr
    for p in row["per_process"]:
        with pytest.raises(ProcessLookupError):
            os.kill(p["pid"], 0)


@pytest.mark.long
def test_the_local_pool_runs_one_worker_per_exclusive_device(tmp_path: Path) -> None:
    lst = tmp_path / "l.csv"
    lst.write_text("id,source,arch,task,modality,inputs,tags,revision,trust_remote_code,atol,rtol,path\n" + "".join(
        f"tiny/{a}/{h},tiny,{a},{h},text,,,,,,,\n" for a, h in (("bert", "base"), ("bert", "masked-lm"), ("bert", "seq-cls"))))
    r = _cli("run", "--list", str(lst), "--target", "sim:0", "--jobs", "3", "--db", str(tmp_path / "r.db"), "--quiet",
             "--ops", "full")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "1 worker(s) (--jobs 3: no more than 1, one per device: sim's devices take one process each)" in r.stderr
    assert "in use by process" not in r.stdout + r.stderr
