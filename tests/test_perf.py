"""--perf end to end: the timing through the real worker on sim, the rows it leaves, the gates that read them
(`diff`, `baseline check`), and a planted slowdown caught with its op named.

No assertion here reads a clock: the statistics have their own tests (test_speed.py); these check that the
numbers are there, go where they should, and that the gate fires on rows built to fire it. The catch rate
and the false-positive rate over the smoke list are measured by scripts/perf_rates.py, not asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import speed
from harness.analysis.perfbase import perf_path, read_perf
from harness.cli import main as cli_main
from harness.console import verdict_lines
from harness.results.rows import ResultRow, RunInfo
from harness.results.store import ResultStore

S = {"ops": "young", "precision": "default"}


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


@pytest.mark.long
def test_check_perf_reports_latency_spread_rounds_and_profile() -> None:
    res = cli("check", "tiny/gpt2/causal-lm", "--target", "sim", "--perf", "--perf-budget", "0.3", "--json")
    row = json.loads(res.stdout)
    assert res.returncode == 0 and row["outcome"] in ("pass", "pass_declared"), res.stderr[-2000:]
    perf = row["perf"]
    for side in ("target", "reference", "ratio"):
        s = perf[side]
        assert s["n"] >= 5 and s["lo"] <= s["median"] <= s["hi"] and s["median"] > 0, side
    assert row["perf_target_s"] == perf["target"]["median"] and row["perf_ref_s"] == perf["reference"]["median"]
    assert row["perf_ratio"] == perf["ratio"]["median"] and row["perf_rounds"] == perf["target"]["n"]
    assert perf["clock"] == "thread-cpu" and perf["wall"]["target"]["n"] == perf["target"]["n"] and perf["threads"] == 1
    assert row["perf_peak_mem_mb"] > 0  # sim's device module reports its allocations
    ops = dict(perf["profile"]["ops"])
    assert "aten::addmm" in ops and perf["profile"]["total_us"] >= sum(ops.values()) * 0.99
    # the profile on the step's clock, held against the timed step; the host's signs over the rounds
    prof = perf["profile"]
    assert prof["clock"] == "thread-cpu" and prof["step_us"] == pytest.approx(perf["target"]["median"] * 1e6, rel=1e-3)
    assert prof["covers"] == pytest.approx(prof["total_us"] / prof["step_us"], rel=1e-2)
    assert 0.9 <= prof["covers"] <= 1.1 or "per step" in prof["note"]
    assert {"wait_share", "load_per_core", "spread"} <= perf["host"].keys()
    assert "perf" in row["phases"] and row["perf_speedup"] is None  # no --compile: nothing to speed up
    human = "\n".join(verdict_lines(row))  # what `check` without --json prints of the same row
    assert "target/reference" in human and "slowest ops (self time)" in human and "aten::addmm" in human


def test_a_backend_without_memory_statistics_keeps_its_timing() -> None:
    """Issue 32.3: a Python backend's torch.accelerator allocator is not a DeviceAllocator; resetting its
    peak raises. Peak memory is absent, the timing is not."""
    from harness.backends import Adapter
    from harness.run.perf import measure

    def no_allocator() -> None:
        raise RuntimeError("device_allocator INTERNAL ASSERT FAILED: Allocator for toy is not a DeviceAllocator.")

    out = measure({"target": lambda: None}, budget_s=0.05, reset_peak=no_allocator, peak_mb=lambda: 12.0)
    assert out["perf_rounds"] >= 5 and out["perf_target_s"] is not None and "error" not in out["perf"], out["perf"]
    assert out.get("perf_peak_mem_mb") is None and "not a DeviceAllocator" in out["perf"]["peak_mem_error"]
    adapter = Adapter("toy")
    adapter._memory_api = lambda name: (lambda device: no_allocator())  # what torch.accelerator answers
    assert adapter.reset_peak_memory("cpu") is False and adapter.peak_memory_mb("cpu") is None
    adapter._memory_api = lambda name: None  # no statistics at all
    assert adapter.reset_peak_memory("cpu") is False


def test_perf_options_are_checked_before_anything_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for args, message in [
        (("--slow-ops", "aten::softmax"), "--slow-ops 'aten::softmax': bad entry"),
        (("--perf", "--perf-budget", "0"), "--perf-budget 0.0: must be > 0"),
        (("--perf", "--perf-budget", "100", "--timeout", "300"), "a slow model may take 5x that, past --timeout 300"),
    ]:
        assert cli_main(["run", "--list", "smoke", "--limit", "1", "--db", str(tmp_path / "x.db"), *args]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "x.db").exists()


def test_the_nightly_times_one_configuration() -> None:
    """The workflow's default settings (its input and the matrix's fallback, which must agree): exactly one
    configuration runs with --perf, and every settings string is options `run` accepts."""
    import shlex

    import yaml

    from harness.cli.options import build_parser

    text = (Path(__file__).resolve().parents[1] / ".github" / "workflows" / "nightly.yml").read_text()
    flow = yaml.safe_load(text)
    default = flow[True]["workflow_dispatch"]["inputs"]["settings"]["default"]  # YAML reads the `on:` key as True
    assert f"fromJSON(inputs.settings || '{default}')" in text
    settings = json.loads(default)
    assert sum("--perf" in shlex.split(s) for s in settings) == 1
    for s in settings:
        build_parser().parse_args(["run", "--list", "smoke", *shlex.split(s)])


def test_a_planted_slowdown_is_measured_flagged_and_named() -> None:
    """The measurement and the gate together, in-process on sim: the same step timed clean and with sim's
    softmax kernel planted 30x slower (through the adapter's settings, as `--slow-ops` does), compared as
    the gate compares two rows. The planted run is several times slower (about 4x measured on a loaded
    2-core host, where the step's own noise is within 1.3x): far past any noise; the gate's rules near
    the noise are tested on given samples in test_speed.py."""
    from types import SimpleNamespace

    import torch

    import harness.sim  # noqa: F401  (registers the device)
    from harness.analysis.perfgate import compare_perf
    from harness.backends import adapter_for
    from harness.run.modes import Plan
    from harness.run.perf import measure_model

    def step(model: torch.nn.Module, inputs: dict) -> dict:
        h = model(inputs["x"])
        return {"y": torch.softmax(h @ h.transpose(-1, -2), dim=-1).sum(-1).cpu()}

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    plan = Plan(step, {"x": torch.randn(4, 64, 16)})
    target = SimpleNamespace(model=torch.nn.Linear(16, 16).to("sim").requires_grad_(False),
                             inputs={"x": plan.inputs["x"].to("sim")})
    adapter = adapter_for("sim")
    with torch.no_grad():
        clean, slow = (measure_model(plan, model, target, "sim", adapter, settings, 0.1)["perf"]
                       for settings in ({}, {"slow_ops": "aten::softmax:30"}))
    assert "error" not in clean and "error" not in slow, (clean.get("error"), slow.get("error"))
    compared = compare_perf("m", "c", clean, slow)
    assert compared is not None
    change, shift = compared
    assert shift.regressed and change.quantity == "ratio" and change.op == "aten::_softmax", change
    assert "aten::_softmax self time" in change.detail
    assert compare_perf("m", "c", slow, clean)[1].faster  # and back: faster, not a regression


def _measurement(ratio: float, seed: int, softmax_us: float, host: dict | None = None) -> dict:
    import math
    import random

    rng = random.Random(seed)
    noise = 0.2 if host else 0.03  # a busy host's rounds spread
    rounds = [ratio * math.exp(rng.gauss(0, noise)) for _ in range(100)]
    ref = [1e-3 * math.exp(rng.gauss(0, 0.03)) for _ in range(100)]
    total = 900.0 + softmax_us
    return {"ratio": speed.summarize(rounds), "target": speed.summarize([r * x for r, x in zip(rounds, ref, strict=True)]),
            "reference": speed.summarize(ref), **({"host": host} if host else {}),
            "profile": {"total_us": total, "ops": [["aten::addmm", 600.0], ["aten::gelu", 300.0],
                                                   ["aten::_softmax", softmax_us]], "clock": "host", "rounds": 5}}


def _perf_db(path: Path, nights: list[dict[str, tuple[float, float]]], first: int = 0,
             host: dict | None = None) -> list[str]:
    """One run per night (``night<first>``, ...); each model: (ratio, softmax µs) or None for a crash
    without a speed."""
    ids = []
    with ResultStore(path) as st:
        for n, models in enumerate(nights, first):
            rid = st.begin_run(RunInfo("smoke", "sim", S, run_id=f"night{n}", started_at=f"2026-01-0{n + 1}T00:00:00Z"))
            for i, (model, spec) in enumerate(sorted(models.items())):
                if spec is None:
                    st.record(ResultRow(run_id=rid, model_id=model, target="sim", settings=S, outcome="crash"))
                    continue
                perf = _measurement(spec[0], seed=100 * n + i, softmax_us=spec[1], host=host)
                st.record(ResultRow(run_id=rid, model_id=model, target="sim", settings=S, outcome="pass",
                                    perf=perf, perf_ratio=perf["ratio"]["median"], perf_target_s=perf["target"]["median"],
                                    perf_ref_s=perf["reference"]["median"], perf_rounds=100))
            st.finish_run(rid)
            ids.append(rid)
    return ids


NIGHT0 = {"tiny/a": (1.5, 100.0), "tiny/b": (1.2, 100.0), "tiny/c": (2.0, 100.0), "tiny/d": (1.4, 100.0)}
NIGHT1 = {"tiny/a": (1.52, 100.0), "tiny/b": (1.9, 410.0), "tiny/c": (2.0, 100.0), "tiny/d": None}


def test_diff_gates_on_perf_regressions_and_names_the_op(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "n.db"
    _perf_db(db, [NIGHT0, NIGHT1])
    assert cli_main(["diff", "--db", str(db)]) == 1
    out = capsys.readouterr().out
    assert "PERF REGRESSIONS > 1.2x (1):" in out and "tiny/b" in out
    assert "aten::_softmax self time 4.1x" in out and "RESULT: 1 regression(s), 1 perf regression(s)" in out
    assert cli_main(["diff", "--db", str(db), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["n_perf_regressions"] == 1 and data["perf"]["compared"] == 3  # a, b, c (d crashed: no speed)
    (reg,) = data["perf"]["regressions"]
    assert reg["model_id"] == "tiny/b" and reg["op"] == "aten::_softmax" and reg["quantity"] == "ratio"
    allow = tmp_path / "noisy.txt"
    allow.write_text("tiny/b  # shares the host with the shards\n")
    assert cli_main(["diff", "--db", str(db), "--perf-allowlist", str(allow), "--perf-regression", "1.2"]) == 1  # d crashed
    assert "perf allowlist (slower, not counted) (1)" in capsys.readouterr().out
    assert cli_main(["diff", "--db", str(db), "--perf-regression", "2"]) == 1  # 1.58x is under 2x: d's crash remains
    assert "PERF REGRESSIONS" not in capsys.readouterr().out
    assert cli_main(["diff", "--db", str(db), "--perf-regression", "1"]) == 2
    assert "--perf-regression 1.0: must be > 1" in capsys.readouterr().err
    assert cli_main(["diff", "--db", str(db), "--perf-allowlist", str(tmp_path / "none.txt")]) == 2


BUSY = {"wait_share": 0.6, "others_cores": 1.5, "load_per_core": 8.0, "spread": 0.2}


def test_a_busy_host_makes_a_slowdown_inconclusive_not_a_regression(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Two nights on a busy host: b 1.15x slower, within what such a host drifts: listed apart with the
    reason, the gate passes; a 2x slowdown is beyond it and still gates. A perf baseline from such a night
    says it was."""
    db = tmp_path / "busy.db"
    _perf_db(db, [NIGHT0, {**NIGHT0, "tiny/b": (1.38, 160.0)}], host=BUSY)
    assert cli_main(["diff", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "PERF REGRESSIONS" not in out and "perf inconclusive: the host could not tell" in out
    assert "base and head: the timed thread waited for a CPU 60% of the time" in out
    assert "RESULT: no regressions, 4 perf inconclusive (not counted)" in out
    from harness.report import build_report

    build_report(db, tmp_path / "site")
    page = (tmp_path / "site" / "diff.html").read_text()
    assert "Perf inconclusive: the host was too disturbed to tell" in page and "waited for a CPU 60%" in page
    model = next(p for p in (tmp_path / "site" / "models").iterdir() if p.name.startswith("tiny_b")).read_text()
    assert "host disturbed while timed: the timed thread waited for a CPU 60% of the time" in model
    db2 = tmp_path / "busy2.db"
    _perf_db(db2, [NIGHT0, {**NIGHT0, "tiny/b": (2.4, 900.0)}], host=BUSY)
    assert cli_main(["diff", "--db", str(db2), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert [c["model_id"] for c in data["perf"]["regressions"]] == ["tiny/b"] and data["n_perf_inconclusive"] == 3
    assert "waited for a CPU" in data["perf"]["regressions"][0]["why"]
    one = tmp_path / "one.db"
    _perf_db(one, [NIGHT0], host=BUSY)
    assert cli_main(["baseline", "update", "--db", str(one), "--out-dir", str(tmp_path)]) == 0
    assert "4 of them timed on a disturbed host" in capsys.readouterr().out


def test_baseline_keeps_the_speed_and_checks_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db0, db1 = tmp_path / "n0.db", tmp_path / "n1.db"
    _perf_db(db0, [NIGHT0])
    _perf_db(db1, [{**NIGHT0, "tiny/c": (3.0, 100.0)}])
    out = tmp_path / "expected"
    out.mkdir()
    assert cli_main(["baseline", "update", "--db", str(db0), "--out-dir", str(out)]) == 0
    assert "the speed of 4 models timed with --perf" in capsys.readouterr().out
    (expected,) = sorted(out.glob("*.perf.csv"))
    config, perfs = read_perf(expected)
    assert config.target == "sim" and sorted(perfs) == sorted(NIGHT0)
    assert perfs["tiny/b"]["ratio"]["median"] == pytest.approx(1.2, rel=0.02) and perfs["tiny/b"]["profile"]["ops"]
    assert perf_path(str(expected).replace(".perf.csv", ".csv")) == expected
    assert cli_main(["baseline", "check", "--db", str(db0), "--expected-dir", str(out)]) == 0
    capsys.readouterr()
    assert cli_main(["baseline", "check", "--db", str(db1), "--expected-dir", str(out), "--json"]) == 1
    (chk,) = json.loads(capsys.readouterr().out)["checks"]
    assert chk["counts"]["new_failure"] == 0 and [r["model_id"] for r in chk["perf"]["regressions"]] == ["tiny/c"]
    assert "1 perf regression(s) of 4 timed" in chk["verdict"]
    # a malformed perf baseline is bad input, named by line
    text = expected.read_text().replace("tiny/a,ratio,", "tiny/a,speed,")
    expected.write_text(text)
    assert cli_main(["baseline", "check", "--db", str(db1), "--expected-dir", str(out)]) == 2
    assert "quantity 'speed' for 'tiny/a'" in capsys.readouterr().err


def test_report_shows_speed_spread_and_perf_regressions(tmp_path: Path) -> None:
    from harness.analysis.trend import append_night
    from harness.report import build_report

    db, hist = tmp_path / "n.db", tmp_path / "history.jsonl"
    _perf_db(db, [NIGHT0, NIGHT1])
    for n in (0, 1):
        one = tmp_path / f"n{n}.db"
        _perf_db(one, [[NIGHT0, NIGHT1][n]], first=n)
        append_night(one, hist, date=f"2026-01-0{n + 1}")
    assert [json.loads(line)["perf"]["models"] for line in hist.read_text().splitlines()] == [4, 3]
    site = tmp_path / "site"
    build_report(db, site, history=hist)
    index = (site / "index.html").read_text()
    assert 'id="speed-geomean"' in index and 'id="perf-regressions"' in index
    diff = (site / "diff.html").read_text()
    assert 'id="n-perf-regressions">1 perf regression(s)' in diff and "aten::_softmax self time 4.1x" in diff
    page = next(p for p in (site / "models").iterdir() if p.name.startswith("tiny_b"))
    text = page.read_text()
    assert 'class="spread"' in text and "target / reference" in text and "aten::_softmax" in text
    trend = (site / "trend.html").read_text()
    assert trend.count('<div class="speed-trend">') == 1 and trend.count('class="point ratio"') == 2


def test_old_dbs_without_perf_columns_still_read(tmp_path: Path) -> None:
    import sqlite3

    db = tmp_path / "old.db"
    _perf_db(db, [NIGHT0])
    con = sqlite3.connect(db)
    for col in ("perf_ratio", "perf"):
        con.execute(f"ALTER TABLE results DROP COLUMN {col}")
    con.commit()
    con.close()
    with ResultStore(db, read_only=True) as st:
        assert st.history()["perf_ratio"].isna().all() and st.perf(["night0"]).empty
    with ResultStore(db) as st:  # opened for writing: the columns come back, empty
        assert st.perf(["night0"]).empty and "perf" in st.results("night0").columns


@pytest.mark.slow
def test_planted_slowdown_is_caught_and_the_op_named(tmp_path: Path) -> None:
    """Two real runs of two models on sim: clean, then with softmax 30x slower (large enough to leave noise
    far behind on any machine); the diff of the named runs flags both and names softmax."""
    db = tmp_path / "p.db"
    models = "tiny/vit/image-cls,tiny/gpt2/causal-lm"
    base = ("run", "--list", "smoke", "--only", models, "--target", "sim", "--attn", "eager", "--db", str(db),
            "--perf", "--perf-budget", "1", "--jobs", "2", "--quiet", "--json")
    runs = []
    for extra in ((), ("--slow-ops", "aten::softmax:30")):
        res = cli(*base, *extra)
        assert res.returncode == 0, res.stderr[-2000:]
        runs.append(json.loads(res.stdout)["run_id"])
    res = cli("diff", "--db", str(db), "--base", runs[0], "--head", runs[1], "--json")
    data = json.loads(res.stdout)
    assert res.returncode == 1 and data["n_regressions"] == 0, res.stdout[-3000:]
    flagged = {r["model_id"]: r for r in data["perf"]["regressions"]}
    assert sorted(flagged) == sorted(models.split(","))
    assert all("softmax" in r["op"] for r in flagged.values()), flagged


@pytest.mark.long
def test_timed_steps_of_a_run_with_two_workers_take_the_host_alone_and_leave_no_lock(tmp_path: Path) -> None:
    """--perf with two workers: each worker's phases go through the run's quiet lock (harness.fleet.quiet;
    its ordering is tests/test_quiet.py), every timed model keeps its speed, and the lock files go with
    the run. Its TMPDIR is deep, as a CI workspace's can be: too deep for the forkserver's socket as such."""
    tmp = tmp_path / ("tmp" + "-deep" * 12)
    tmp.mkdir()
    res = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--list", "smoke", "--only",
                          "tiny/vit/image-cls,tiny/gpt2/causal-lm,tiny/bert/masked-lm", "--target", "sim",
                          "--db", str(tmp_path / "q.db"), "--perf", "--perf-budget", "0.2", "--jobs", "2",
                          "--quiet", "--json"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TMPDIR": str(tmp)})
    assert res.returncode == 0, res.stderr[-2000:]
    with ResultStore(tmp_path / "q.db", read_only=True) as st:
        rows = st.results(json.loads(res.stdout)["run_id"])
    assert len(rows) == 3 and rows["perf_target_s"].notna().all(), rows[["model_id", "perf_target_s"]]
    assert not list(tmp.glob(".perf-quiet-*")), list(tmp.iterdir())
    assert all(isinstance(p.get("quiet_wait_s"), float) for p in rows["perf"]), rows["perf"]  # the price, kept


# ----------------------------------------------------------------------------------------------
# A shared host: busy neighbours beside the runs (tests/busy_host.py), one per core
# ----------------------------------------------------------------------------------------------


def _busy_run(db: Path, *extra: str, env: dict[str, str] | None = None, only: str = "") -> str:
    from busy_host import busy_neighbours

    args = ("run", "--list", "smoke", "--target", "sim", "--db", str(db), "--perf", "--jobs", "2", "--quiet", "--json",
            *(("--only", only) if only else ()), *extra)
    with busy_neighbours(("cpu", "mem"), lifetime_s=1200):
        res = subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True,
                             timeout=1200, env=env or dict(os.environ))
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)["run_id"]


@pytest.mark.slow
def test_two_identical_runs_on_a_busy_host_raise_no_perf_regression(tmp_path: Path) -> None:
    """The README's sequence, each run beside one CPU-bound and one memory-bound neighbour per core: no perf
    regression; what the host was too disturbed to decide is inconclusive, listed apart with the reason."""
    db = tmp_path / "s.db"
    runs = [_busy_run(db), _busy_run(db)]
    res = cli("diff", "--db", str(db), "--base", runs[0], "--head", runs[1], "--json")
    data = json.loads(res.stdout)
    assert res.returncode == 0 and data["n_perf_regressions"] == 0, res.stdout[-3000:]
    assert data["perf"]["compared"] >= 40
    assert all(c["why"] for c in data["perf"]["inconclusive"]), data["perf"]["inconclusive"]
    text = cli("diff", "--db", str(db), "--base", runs[0], "--head", runs[1]).stdout
    assert "PERF REGRESSIONS" not in text
    assert not data["perf"]["inconclusive"] or "perf inconclusive: the host could not tell" in text


@pytest.mark.slow
def test_a_slowdown_planted_from_outside_is_flagged_or_inconclusive_on_a_busy_host(tmp_path: Path) -> None:
    """A normalization kernel doing 12x its work on the device, planted by a backend module the harness
    knows nothing of (tests/planted_slowdown.py), beside busy neighbours: every model it makes far slower is
    flagged (naming aten::native_layer_norm) or, at worst, inconclusive; none passes as unchanged."""
    tests = Path(__file__).resolve().parent
    models = "tiny/vit/image-cls,tiny/deit/image-cls,tiny/beit/image-cls,tiny/dinov2/base"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)])}
    db = tmp_path / "p.db"
    base = _busy_run(db, only=models, env=env)
    head = _busy_run(db, "--backend", "planted_slowdown", only=models, env={**env, "PLANTED_SLOWDOWN": "layer_norm:12"})
    data = json.loads(cli("diff", "--db", str(db), "--base", base, "--head", head, "--json").stdout)
    flagged = {c["model_id"]: c for c in data["perf"]["regressions"]}
    open_ = {c["model_id"] for c in data["perf"]["inconclusive"]}
    assert set(flagged) | open_ == set(models.split(",")), data["perf"]
    assert all(c["op"] == "aten::native_layer_norm" for c in flagged.values()), flagged
