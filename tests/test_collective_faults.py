"""Collectives under one bad rank: scenario parsing, the straggler rule, and the measured scenarios."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sqlite3
import time

import pytest
import torch

from harness.comms.shaped import _FutureWork


def test_shaped_work_wait_raises_failed_future() -> None:
    """A blocking shaped collective whose message failed raises (it used to return, with stale data)."""
    fut: torch.futures.Future = torch.futures.Future()
    work = _FutureWork(fut)
    assert not work.is_completed()
    fut.set_exception(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        work.wait()
    ok: torch.futures.Future = torch.futures.Future()
    ok.set_result([torch.ones(1)])
    assert _FutureWork(ok).wait() and _FutureWork(ok).get_future() is ok


def test_sim_slow_fault_keeps_the_device_busy() -> None:
    """The sim's `slow` kind: each launch works (CPU time, not sleep) ``slow_s`` longer."""

    import harness.sim as sim
    from harness.sim import fault_injection as sim_faults

    x = torch.ones(64).to("sim:0")
    with sim.faults("sim:0", slow=1.0, slow_s=0.02):
        c0 = time.process_time()
        for _ in range(5):
            x = x + 1
        busy = time.process_time() - c0
        assert sim.injected_counts()["sim:0"]["slow"] == 5
    assert busy >= 0.1
    assert torch.equal(x.cpu(), torch.full((64,), 6.0))  # slow, not wrong
    parsed = sim_faults.parse_fault_spec("sim:1=slow:1.0@slow_s=0.002")
    assert parsed[1].slow_s == 0.002 and parsed[1].probabilities == {"slow": 1.0}


# ----------------------------------------------------------------------------------------------
# Scenarios and configuration (no processes)
# ----------------------------------------------------------------------------------------------


def test_parse_scenarios() -> None:
    from harness.bench.faults import FaultSpec, parse_scenario, parse_scenarios

    assert parse_scenario("hang") == FaultSpec("hang")
    assert parse_scenario(" Slow:2.5 ") == FaultSpec("slow", 2.5)
    assert parse_scenario("slow").name == "slow:3" and parse_scenario("flap").name == "flap:3"
    assert [s.name for s in parse_scenarios("all")] == ["hang", "slow:3", "nan", "die", "flap:3"]
    assert [s.name for s in parse_scenarios("nan, none ,nan,slow:4")] == ["nan", "none", "slow:4"]
    assert parse_scenario("die").recoverable and not parse_scenario("nan").recoverable
    for bad, msg in [
        ("crash", "unknown fault scenario 'crash'"),
        ("slow:1", "bad slowdown factor"),
        ("slow:x", "bad slowdown factor"),
        ("flap:-2", "bad slowdown factor"),
        ("hang:3", "takes no value"),
        ("", "no fault scenarios"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse_scenarios(bad)


@pytest.mark.parametrize(
    ("changes", "msg"),
    [
        ({"target": "tpu"}, "unknown target"),
        ({"world_size": 1}, "world size"),
        ({"fault_rank": 2}, "fault rank 2 is not a rank"),
        ({"fault_step": 1}, "fault step must be from 2"),
        ({"fault_step": 19}, "fault step must be from 2"),
        ({"steps": 3}, "steps must be >= 4"),
        ({"spare": 9}, "spare must be"),
        ({"timeout_s": 0.0}, "timeout must be"),
        ({"scenarios": ["slow:0.5"]}, "bad slowdown factor"),
        ({"settings": ["per-host:3"]}, "does not divide world size"),
        ({"straggler_excess": 0.0}, "straggler excess"),
    ],
)
def test_fault_config_validation(changes: dict, msg: str) -> None:
    from harness.bench.faults import FaultConfig

    with pytest.raises(ValueError, match=msg):
        FaultConfig(**changes).validate()


def test_fault_config_derived_timeouts() -> None:
    from harness.bench.faults import FaultConfig

    cfg = FaultConfig(timeout_s=10)
    cfg.validate()
    assert (cfg.collective_timeout_s, cfg.stall_s) == (5.0, 2.0)
    assert cfg.excess == 0.5 and FaultConfig(target="cuda").excess == 0.10  # shared host cores vs own GPU
    assert FaultConfig(straggler_excess=0.2).excess == 0.2


def test_injector_sizes_slowdown_from_healthy_steps() -> None:
    """slow:F adds (F-1) x the rank's own healthy median; flap only on its seeded half of the steps."""
    from harness.bench.faults import Injector, flap_step, parse_scenario

    fired: list[int] = []
    inj = Injector(parse_scenario("slow:3"), bad=True, mode="harness", fault_step=4, on_fire=fired.append)
    for step, t in enumerate([0.5, 0.010, 0.012, 0.011]):  # step 0 (warm-up) is not a baseline
        inj.observe(step, t)
    assert inj.extra_s(3) == 0.0 and inj.extra_s(4) == pytest.approx(2 * 0.011)
    inj.at_collective(4, None)  # works 22 ms, says so first
    assert fired == [4] and inj.injected_at is not None
    healthy = Injector(parse_scenario("slow:3"), bad=False, mode="harness", fault_step=4)
    healthy.observe(1, 0.01)
    assert healthy.extra_s(10) == 0.0
    flap = Injector(parse_scenario("flap:3"), bad=True, mode="harness", fault_step=2)
    flap.observe(1, 0.01)
    slow_steps = [s for s in range(2, 40) if flap.extra_s(s) > 0]
    assert slow_steps == [s for s in range(2, 40) if flap_step(0, s)] and 10 < len(slow_steps) < 28
    none = Injector(parse_scenario("none"), bad=True, mode="harness", fault_step=2)
    none.at_collective(5, None)
    assert none.injected_at is None


def test_injector_nan_fills_the_bucket_once() -> None:
    from harness.bench.faults import Injector, parse_scenario

    inj = Injector(parse_scenario("nan"), bad=True, mode="harness", fault_step=3)
    buf = torch.ones(4)
    inj.at_collective(2, buf)
    assert torch.isfinite(buf).all()
    inj.at_collective(3, buf)
    assert torch.isnan(buf).all()
    buf = torch.ones(4)
    inj.at_collective(4, buf)
    assert torch.isfinite(buf).all()


# ----------------------------------------------------------------------------------------------
# The watchdog's statistics (pure functions, no processes)
# ----------------------------------------------------------------------------------------------


def _healthy_steps(n_ranks: int, n_steps: int, seed: int, base: float = 0.010, noise: float = 0.04) -> dict:
    """Per-rank compute times of a healthy job on dedicated devices: the same work, +-4% jitter."""
    import random

    rng = random.Random(seed)
    return {r: {s: base * (1 + rng.uniform(-noise, noise)) for s in range(n_steps)} for r in range(n_ranks)}


def _flags_over_steps(compute: dict, n_steps: int, excess: float = 0.10) -> list[tuple[int, int]]:
    from harness.bench.watchdog import STRAGGLER_MIN_STEPS, straggler_flags, window_samples

    out = []
    for step in range(2, n_steps):
        samples = window_samples(compute, step, skip={0, 1})
        if min(len(x) for x in samples.values()) >= STRAGGLER_MIN_STEPS:
            out += [(step, r) for r in sorted(straggler_flags(samples, excess=excess))]
    return out


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_straggler_rule_no_false_flags_over_20_healthy_steps(world: int) -> None:
    """Megatron's rule (> 1 std and > 10% above the mean) never fires on a healthy 20-step job."""
    for seed in range(25):
        assert _flags_over_steps(_healthy_steps(world, 20, seed), 20) == [], seed


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_straggler_rule_flags_slow3_and_only_it(world: int) -> None:
    for seed in range(25):
        compute = _healthy_steps(world, 20, seed)
        for s in range(5, 20):
            compute[1][s] *= 3.0  # slow:3 from step 5
        flags = _flags_over_steps(compute, 20)
        assert flags and all(r == 1 for _, r in flags), (seed, flags)
        assert min(s for s, _ in flags) <= 6  # within two steps of turning slow


def test_straggler_rule_is_leave_one_out() -> None:
    """With the rank itself in the statistics, the slower of two is exactly 1 std above their mean."""
    import statistics

    from harness.bench.watchdog import straggler_flags

    a, b = [0.010] * 5, [0.030] * 5
    pooled = a + b
    assert statistics.fmean(b) == pytest.approx(statistics.fmean(pooled) + statistics.pstdev(pooled))
    assert straggler_flags({0: a, 1: b}) == {1}
    assert straggler_flags({0: [0.010, 0.012], 1: [0.0105, 0.0108]}) == set()  # within 10%
    assert straggler_flags({0: [0.010] * 3, 1: [0.0115] * 3}, excess=0.5) == set()
    assert straggler_flags({0: [0.01]}) == set() and straggler_flags({}) == set()


def test_stalled_ranks_and_rates() -> None:
    from harness.bench.watchdog import rank_in_text, stalled_ranks, step_rate

    arrivals = {0: 100.0, 2: 100.5}
    assert stalled_ranks(arrivals, [0, 1, 2, 3], now=101.9, stall_s=2.0) == []
    assert stalled_ranks(arrivals, [0, 1, 2, 3], now=102.1, stall_s=2.0) == [1, 3]
    assert stalled_ranks({}, [0, 1], now=1e9, stall_s=2.0) == []
    ends = {0: 10.0, 1: 11.0, 2: 12.0, 3: 13.0, 4: 15.0}
    assert step_rate(ends, 1, 3) == pytest.approx(1.0)
    assert step_rate(ends, 3, 4, skipped=1) == 0.0
    assert step_rate(ends, 3, 7) is None
    assert rank_in_text("Watchdog caught collective operation timeout: rank 3 ...") == 3
    assert rank_in_text("[Rank:12] NCCL error") == 12
    assert rank_in_text("Connection closed by peer [127.0.0.1]:4242") is None


# ----------------------------------------------------------------------------------------------
# The scenarios, measured (rank processes under a supervisor; every run has hard deadlines)
# ----------------------------------------------------------------------------------------------

# Tight enough that a broken run fails the test in well under a minute, loose enough for a busy host.
BOUNDS = {"startup_s": 90.0, "deadline_s": 40.0}


def _gone(pids: dict) -> bool:
    """No process of the scenario survived it (the supervisor's process group was killed)."""
    for pid in pids.values():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        with open(f"/proc/{pid}/stat") as fh:  # a zombie not yet reaped by its parent is gone too
            if fh.read().split(")")[-1].split()[0] != "Z":
                return False
    return True


def _check_matrix(matrix, *, timeout_s: float) -> None:
    """Everything the issue asks of each scenario, with the rows' own words on failure."""
    by = {r.scenario: r for r in matrix.results}
    assert set(by) == {"none", "hang", "slow:3", "nan", "die", "flap:3"}
    for r in matrix.results:
        info = r.as_dict()
        info.pop("detections")
        assert not r.timed_out and r.clean_exit and _gone(r.pids), info
        assert r.completed_steps == r.steps == 20, info
        if r.scenario == "none":
            assert not r.detected and r.false_flags == 0, info  # 0 false flags over 20 healthy steps
            continue
        assert r.detected and r.detect_s is not None and r.detect_s < timeout_s, info
        assert r.rank_named and r.named_rank == r.fault_rank, info
        assert r.false_flags == 0, info
    assert by["nan"].nan_caught and by["nan"].detected_by == "finite_check"
    assert by["slow:3"].flagged and by["slow:3"].detected_by == "straggler" and by["slow:3"].slowdown > 2.0
    assert by["flap:3"].flagged
    assert by["hang"].detected_by == "stall"  # the rank that never arrived at the all_reduce
    for name in ("hang", "die"):
        r = by[name]
        # Recovered onto the spare: the remaining steps ran, and the final parameters are bit for bit
        # those of a fault-free run that re-formed its group at the same step.
        assert r.recovered and r.restart_step == r.fault_step and r.steps_lost == 1, r.as_dict()
        assert r.params_consistent and r.params_match, (r.params_digest, r.reference_digest)
        assert r.resume_s is not None and r.resume_s < timeout_s
    assert [ref.restart_step for ref in matrix.references] == [5]


@pytest.mark.long
def test_fault_matrix_on_sim_world_2() -> None:
    """Every scenario on the sim process group (sim device faults), with a hot spare."""
    from harness.bench.faultmatrix import run_matrix
    from harness.bench.faults import ALL, FaultConfig

    cfg = FaultConfig(target="sim", world_size=2, scenarios=list(ALL), spare=1, **BOUNDS)
    _check_matrix(run_matrix(cfg), timeout_s=cfg.timeout_s)


@pytest.mark.long
def test_fault_matrix_on_gloo_world_4_via_cli(tmp_path) -> None:
    """Every scenario on gloo (injected at the collective) through the CLI: JSON, rows, report page."""
    from harness.bench.faultmatrix import FaultMatrix
    from harness.bench.faultresult import ScenarioResult
    from harness.bench.faults import FaultConfig
    from harness.cli import main
    from harness.report.build import build_report
    from harness.results.store import ResultStore

    db = tmp_path / "faults.db"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["collectives", "--target", "cpu", "--world-size", "4", "--faults", "all", "--spare", "1",
                   "--fault-rank", "2", "--db", str(db), "--json"])
    payload = json.loads(buf.getvalue())
    assert payload["backend"] == "gloo" and payload["world_size"] == 4
    fields = set(ScenarioResult.__dataclass_fields__)
    results = [ScenarioResult(**{k: v for k, v in r.items() if k in fields}) for r in payload["rows"]]
    refs = [ScenarioResult(target="cpu", backend="gloo", world_size=4, setting=r["setting"], scenario="none",
                           fault_rank=-1, fault_step=5, steps=20, spare=1, timeout_s=10.0,
                           restart_step=r["restart_step"]) for r in payload["references"]]
    _check_matrix(FaultMatrix(FaultConfig(**payload["config"]), results, refs, payload["wall_s"]), timeout_s=10.0)
    assert rc == 0 and all(r.fault_rank == 2 for r in results if r.scenario != "none")

    with ResultStore(db, create=False) as st:
        rows = st.collective_faults()
        run = st.runs().iloc[0]
    assert len(rows) == 6 and run.list_name == "collective-faults"
    assert set(rows.scenario) == {"none", "hang", "slow:3", "nan", "die", "flap:3"}
    assert rows.detected[rows.scenario != "none"].all() and rows.rank_named[rows.scenario != "none"].all()
    assert (rows.params_match[rows.scenario.isin(["hang", "die"])] == 1).all()

    site = tmp_path / "site"
    build_report(db, site)
    page = (site / "collective-faults.html").read_text()
    assert "Collective faults" in (site / "index.html").read_text()  # in the nav
    assert "gloo · world 4 · fused" in page and "rank 2 named" in page and "parameters match" in page
    assert "NaN caught before the optimizer step" in page and "flagged as a straggler" in page


@pytest.mark.long
def test_no_spare_world_3_healthy_ranks_exit_cleanly() -> None:
    """Without a spare the job stops; the survivors get an error (not a hang) and leave by themselves."""
    from harness.bench.faultrun import run_scenarios
    from harness.bench.faults import FaultConfig

    cfg = FaultConfig(target="sim", world_size=3, fault_rank=0, spare=0, **BOUNDS)
    hang, die = run_scenarios(cfg, [("hang", "fused"), ("die", "fused")])
    for r in (hang, die):
        assert r.detected and r.rank_named and r.named_rank == 0 and r.detect_s < cfg.timeout_s, r.as_dict()
        assert r.clean_exit and r.recovered is False and r.completed_steps == cfg.fault_step, r.as_dict()
        assert _gone(r.pids)
    assert die.exit_codes["r0"] == -11  # the sim kernel segfaulted
    assert hang.exit_codes["r0"] == -9  # evicted by the supervisor


@pytest.mark.long
def test_job_deadline_kills_the_scenario() -> None:
    """A job that cannot finish in its deadline is killed, with every process, and says so."""
    from harness.bench.faultrun import run_scenario
    from harness.bench.faults import FaultConfig

    cfg = FaultConfig(target="cpu", world_size=2, steps=100_000, deadline_s=2.0, startup_s=60.0)
    t0 = time.time()
    r = run_scenario(cfg, "none")
    assert r.timed_out and "deadline" in r.error and not r.clean_exit
    assert _gone(r.pids) and time.time() - t0 < 60


# ----------------------------------------------------------------------------------------------
# Rows in the store (no processes)
# ----------------------------------------------------------------------------------------------


def _fault_row(run_id: str, scenario: str, **changes):
    from harness.results.rows import CollectiveFaultRow

    values = dict(
        run_id=run_id, target="cpu", backend="gloo", world_size=2, setting="fused", scenario=scenario,
        settings={"kind": "collective-fault"}, fault_rank=1, fault_step=5, steps=20, spare=1, timeout_s=10.0,
        detected=True, detected_by="stall", detect_s=2.0, rank_named=True, named_rank=1, named_by="stall",
        backend_error=False, backend_error_s=None, clean_exit=True, nan_caught=None, flagged=None, false_flags=0,
        throughput_loss=0.5, recovered=1, restart_step=5, steps_lost=1, resume_s=2.5, params_match=1,
        completed_steps=20, timed_out=False, wall_s=3.0,
    )
    values.update(changes)
    return CollectiveFaultRow(**values)


def test_fault_rows_store_read_and_merge(tmp_path) -> None:
    from harness.results.merge import merge_stores
    from harness.results.rows import RunInfo
    from harness.results.store import ResultStore

    db = tmp_path / "a.db"
    with ResultStore(db) as st:
        rid = st.begin_run(RunInfo("collective-faults", "cpu", {"kind": "collective-fault"}))
        st.record_collective_fault(_fault_row(rid, "hang"))
        st.record_collective_fault(_fault_row(rid, "nan", nan_caught=1, recovered=None, params_match=None))
        st.record_collective_fault(_fault_row(rid, "hang", detect_s=2.2))  # same key: replaces
        st.finish_run(rid)
        df = st.collective_faults(rid)
        assert st.latest_run(has_collective_faults=True) == rid
    assert list(df.scenario) == ["hang", "nan"] and df.detect_s.tolist() == [2.2, 2.0]
    nan = df[df.scenario == "nan"].iloc[0]
    assert nan.nan_caught == 1 and (nan.recovered is None or math.isnan(nan.recovered))  # not applicable
    merged = tmp_path / "m.db"
    assert merge_stores(merged, [db]).rows == 2
    with ResultStore(merged, create=False) as st:
        assert len(st.collective_faults()) == 2


def test_db_from_before_the_fault_table(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An older DB has no collective_faults table: readable as empty, gets it when opened for writing."""
    from harness.results.merge import merge_stores
    from harness.results.rows import RunInfo
    from harness.results.store import ResultStore

    db = tmp_path / "old.db"
    with ResultStore(db) as st:
        st.begin_run(RunInfo("smoke", "sim", {}))
    con = sqlite3.connect(db)
    con.execute("DROP TABLE collective_faults")
    con.commit()
    con.close()
    with monkeypatch.context() as m:
        m.setattr("harness.results.store.may_write", lambda path: False)  # read-only (root ignores chmod)
        with ResultStore(db, create=False) as st:
            assert st.read_only and st.collective_faults().empty
            assert st.latest_run(has_collective_faults=True) is None and st.raw_rows("collective_faults") == []
        assert merge_stores(tmp_path / "m.db", [db]).rows == 0
    with ResultStore(db) as st:  # writable: the table is added, nothing else changes
        rid = st.latest_run()
        st.record_collective_fault(_fault_row(rid, "die"))
        assert len(st.collective_faults()) == 1


def test_collective_faults_page_from_rows(tmp_path) -> None:
    """The report's grid from stored rows: verdict per cell, untrusted text escaped, page only when needed."""
    from harness.report.build import build_report
    from harness.results.rows import RunInfo
    from harness.results.store import ResultStore

    evil = "<script>alert(1)</script>"
    db = tmp_path / "r.db"
    with ResultStore(db) as st:
        rid = st.begin_run(RunInfo("collective-faults", "cpu", {"kind": "collective-fault"}))
        st.record_collective_fault(_fault_row(rid, "none", fault_rank=-1, detected=False, detected_by="",
                                              detect_s=None, rank_named=False, named_rank=None, recovered=None,
                                              params_match=None))
        st.record_collective_fault(_fault_row(rid, "die", detected_by="exit", error=evil))
        st.record_collective_fault(_fault_row(rid, "slow:3", world_size=4, detected=False, detected_by="",
                                              detect_s=None, rank_named=False, named_rank=None, flagged=0,
                                              recovered=None, params_match=None))
        st.finish_run(rid)
    with ResultStore(db) as st:  # a later run of one backend: its rows replace those they overlap
        rid2 = st.begin_run(RunInfo("collective-faults", "cpu", {"kind": "collective-fault", "again": 1}))
        st.record_collective_fault(_fault_row(rid2, "hang", detect_s=0.5))
        st.finish_run(rid2)
    site = tmp_path / "site"
    build_report(db, site)
    page = (site / "collective-faults.html").read_text()
    assert "detected in 0.50 s by stall" in page and "detected in 2.00 s by stall" not in page
    assert rid in page and rid2 in page  # both runs feed the grid
    assert evil not in page and "&lt;script&gt;" in page
    assert "gloo · world 2 · fused" in page and "gloo · world 4 · fused" in page and "not run" in page
    assert "detected in 2.00 s by exit" in page and "recovered, resumed in 2.50 s; parameters match" in page
    assert "NOT detected" in page and "not flagged as a straggler" in page and "healthy: not flagged" in page
    assert 'href="collective-faults.html"' in (site / "index.html").read_text()
    other = tmp_path / "other.db"  # a DB without fault rows: no page, no nav entry, no stale page left
    with ResultStore(other) as st:
        st.finish_run(st.begin_run(RunInfo("smoke", "sim", {})))
    build_report(other, site)
    assert not (site / "collective-faults.html").exists()
    assert "collective-faults.html" not in (site / "index.html").read_text()
