"""The runner end to end: real tiny models, real worker processes, real `sim` faults (no mocks)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import LIST_HEADER, list_rows, rows_done

from harness.fleet.runner import RunConfig, run_models, shard
from harness.models.model_list import load_model_list
from harness.results.store import ResultStore

HEADER = LIST_HEADER
EXACT = {"precision": "highest", "ops": "full"}
FAST = [  # (arch, head) pairs that build and run in well under a second
    ("bert", "base"), ("bert", "masked-lm"), ("bert", "seq-cls"), ("bert", "token-cls"), ("bert", "qa"),
    ("gpt2", "base"), ("gpt2", "causal-lm"), ("gpt2", "seq-cls"), ("gpt2", "token-cls"),
    ("llama", "base"), ("llama", "causal-lm"), ("llama", "seq-cls"), ("llama", "token-cls"), ("llama", "qa"),
    ("distilbert", "base"), ("distilbert", "masked-lm"), ("distilbert", "seq-cls"), ("distilbert", "qa"),
    ("roberta", "base"), ("roberta", "masked-lm"), ("roberta", "causal-lm"), ("roberta", "seq-cls"),
    ("electra", "base"), ("electra", "masked-lm"), ("electra", "seq-cls"), ("electra", "token-cls"),
    ("mistral", "base"), ("mistral", "causal-lm"), ("qwen2", "base"), ("qwen2", "causal-lm"),
    ("opt", "base"), ("opt", "causal-lm"), ("vit", "base"), ("vit", "image-cls"),
]


def write_list(path: Path, pairs: list[tuple[str, str]], extra: str = "") -> Path:
    path.write_text(HEADER + list_rows(pairs) + extra)
    return path


def cli(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness.cli", *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )


def rows(db: Path) -> list[dict]:
    with ResultStore(db) as store:
        return store.results().to_dict("records")


def test_shard_partitions_the_list(tmp_path: Path) -> None:
    entries = load_model_list(str(write_list(tmp_path / "l.csv", FAST)))
    parts = [shard(entries, f"{i}/3") for i in (1, 2, 3)]
    ids = [e.id for p in parts for e in p]
    assert sorted(ids) == sorted(e.id for e in entries) and len(set(ids)) == len(ids)
    with pytest.raises(ValueError, match="i/N"):
        shard(entries, "4/3")


def test_bad_device_is_quarantined_and_its_models_rerun_elsewhere(tmp_path: Path, monkeypatch) -> None:
    """>=30 models; sim:1 has a NaN storm; sim:2 is a hot spare. Every model ends with a row and passes."""
    monkeypatch.setenv("PORTHARNESS_SIM_DEVICES", "3")
    monkeypatch.setenv("PORTHARNESS_SIM_FAULTS", "sim:1=nan:1.0")
    entries = load_model_list(str(write_list(tmp_path / "l.csv", FAST)))
    assert len(entries) >= 30
    db = tmp_path / "r.db"
    summary = run_models(entries, RunConfig(settings=EXACT, jobs=2, spare=1, retries=1, timeout_s=120,
                                            progress=False), db, list_name="fast")
    got = rows(db)
    assert len(got) == len(entries) == len({r["model_id"] for r in got})
    assert summary.quarantined == ["sim:1"]
    on_bad = [r for r in got if any(a["device"] == "sim:1" for a in r["attempts"])]
    assert on_bad, "the bad device never got work"
    for r in got:
        assert r["outcome"] == "pass", (r["model_id"], r["outcome"], r["attempts"])
        assert r["device"] != "sim:1"
    for r in on_bad:  # both attempts recorded: the NaN one on sim:1 and the clean re-run
        assert [a["device"] for a in r["attempts"]][0] == "sim:1"
        assert r["attempts"][-1]["outcome"] == "pass"
    assert summary.spares_used == ["sim:2"]


def test_crash_and_memory_runaway_cost_only_their_rows(tmp_path: Path, patho) -> None:
    dirs = dict(patho(b) for b in ("crash", "oom", "noisy"))
    lst = write_list(tmp_path / "l.csv", [("bert", "base"), ("gpt2", "causal-lm")], patho.rows(dirs))
    db = tmp_path / "r.db"
    entries = load_model_list(str(lst))
    summary = run_models(entries, RunConfig(settings=EXACT, jobs=2, retries=0, timeout_s=600, mem_cap_mb=2048,
                                            progress=False), db, list_name="patho")
    got = {r["model_id"]: r for r in rows(db)}
    assert set(got) == {e.id for e in entries}
    assert got["patho/crash"]["outcome"] == "crash"
    assert got["patho/crash"]["signal"] == signal.SIGSEGV
    # the worker's fatal-signal report (faulthandler on fd 2, its job's file) read back into the crash row
    assert got["patho/crash"]["traceback"].startswith("Fatal Python error: Segmentation fault")
    # what a model prints (Python, native code) is its row's, not the terminal's (tests/test_worker_output.py)
    assert got["patho/noisy"]["outcome"] == "pass"
    assert "noisy: a line on stdout" in got["patho/noisy"]["worker_output"]
    assert "noisy: USDT-like line from native code" in got["patho/noisy"]["worker_output"]
    assert "noisy" not in got["patho/crash"]["worker_output"]
    assert got["patho/oom"]["outcome"] == "oom"  # 8 GiB would fit this machine: only the cap stops it
    assert "allocate" in got["patho/oom"]["error_message"]
    assert got["tiny/bert/base"]["outcome"] == "pass" and got["tiny/gpt2/causal-lm"]["outcome"] == "pass"
    assert summary.unfinished == 0
    assert all(r["peak_rss_mb"] and r["peak_rss_mb"] > 50 for r in got.values() if r["outcome"] == "pass")


@pytest.mark.long
def test_hanging_model_times_out_and_the_run_completes(tmp_path: Path, patho) -> None:
    lst = tmp_path / "l.csv"
    lst.write_text(HEADER + patho.rows(dict([patho("hang"), patho("none")])))
    db = tmp_path / "r.db"
    t0 = time.monotonic()
    summary = run_models(load_model_list(str(lst)), RunConfig(settings=EXACT, jobs=1, retries=1, timeout_s=10,
                                                               progress=False), db, list_name="hang")
    got = {r["model_id"]: r for r in rows(db)}
    assert got["patho/hang"]["outcome"] == "timeout"
    assert got["patho/hang"]["signal"] == signal.SIGKILL
    attempts = got["patho/hang"]["attempts"]
    # retried once; no device had run a model yet, so once more after patho/none ran on one: its verdict
    assert [a["outcome"] for a in attempts] == ["timeout"] * 3 and [a["phase"] for a in attempts] == ["target"] * 3
    assert attempts[-1]["device"] == got["patho/none"]["device"]
    assert got["patho/none"]["outcome"] == "pass"
    assert summary.unfinished == 0 and time.monotonic() - t0 < 300


@pytest.mark.long
def test_loading_has_its_own_budget(tmp_path: Path, patho) -> None:
    """A load longer than --timeout is fine (the budget for running starts when loading ends); a load
    longer than --load-timeout is the reference side's timeout (the target never ran: `ref_timeout`, issue 48)
    that says it was still loading and which option to raise."""
    lst = tmp_path / "l.csv"
    lst.write_text(HEADER + patho.rows(dict([patho("slow-load:8"), patho("slow-load")])))
    db = tmp_path / "r.db"
    run_models(load_model_list(str(lst)), RunConfig(settings=EXACT, jobs=1, retries=0, timeout_s=5, load_timeout_s=20,
                                                    progress=False), db, list_name="slow")
    got = {r["model_id"]: r for r in rows(db)}
    assert got["patho/slow-load:8"]["outcome"] == "pass", got["patho/slow-load:8"]["error_message"]
    assert got["patho/slow-load:8"]["phases"]["load"]["s"] >= 8
    hung = got["patho/slow-load"]
    assert hung["outcome"] == "ref_timeout" and "still loading after 20s (--load-timeout)" in hung["error_message"]
    assert "raise --load-timeout" in hung["error_message"]


@pytest.mark.long
def test_kill_9_then_resume_loses_nothing(tmp_path: Path, patho) -> None:
    # A hanging model guarantees the run is still going when it is killed; on resume it times out.
    hang = patho.rows(dict([patho("hang")]))
    lst = write_list(tmp_path / "l.csv", FAST[:13], hang)
    db = tmp_path / "r.db"
    args = [sys.executable, "-m", "harness.cli", "run", "--list", str(lst), "--db", str(db), "--jobs", "2",
            "--precision", "highest", "--ops", "full", "--quiet", "--timeout", "20", "--retries", "0"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    done = rows_done(db, 4, 240)
    assert done >= 4, "run made no progress"
    os.killpg(proc.pid, signal.SIGKILL)  # the supervisor and every worker, mid-run
    proc.wait()
    before = {r["model_id"]: r for r in rows(db)}
    assert 4 <= len(before) < 14

    res = cli(*args[3:], "--resume")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "already done, resumed" in res.stdout
    after = rows(db)
    ids = [r["model_id"] for r in after]
    assert len(ids) == 14 == len(set(ids))
    by_id = {r["model_id"]: r for r in after}
    for mid, r in before.items():  # finished rows untouched
        assert by_id[mid]["finished_at"] == r["finished_at"] and by_id[mid]["outcome"] == r["outcome"]
    assert len({r["run_id"] for r in after}) == 1


def test_resume_refuses_a_corrupt_db_and_leaves_it_alone(tmp_path: Path) -> None:
    lst = write_list(tmp_path / "l.csv", FAST[:2])
    db = tmp_path / "r.db"
    db.write_bytes(b"this is not a database" * 100)
    before = db.read_bytes()
    res = cli("run", "--list", str(lst), "--db", str(db), "--resume")
    assert res.returncode == 2
    assert str(db) in res.stderr and "error" in res.stderr
    assert db.read_bytes() == before


@pytest.mark.long
def test_unknown_model_and_bad_list_exit_2(tmp_path: Path) -> None:
    res = cli("check", "tiny/bert/nonsense-head")
    assert res.returncode == 2 and "unknown" in res.stderr
    bad = tmp_path / "bad.csv"
    bad.write_text("id,source,task,colour\nx,tiny,base,red\n")
    res = cli("run", "--list", str(bad))
    assert res.returncode == 2 and "bad.csv:1" in res.stderr
    res = cli("check", "tiny/bert/base", "--precision", "fp8")
    assert res.returncode == 2 and "precision" in res.stderr


@pytest.mark.long
def test_check_json_row(tmp_path: Path) -> None:
    db = tmp_path / "c.db"
    res = cli("check", "tiny/bert/base", "--precision", "highest", "--json", "--db", str(db))
    assert res.returncode == 0, res.stdout + res.stderr
    row = json.loads(res.stdout)
    assert row["outcome"] == "pass" and row["settings"]["precision"] == "highest"
    assert set(row["metrics"]) >= {"last_hidden_state"}
    assert len(rows(db)) == 1
