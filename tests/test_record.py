"""Tests for the SQLite result store: durability, upsert, refusal to touch foreign/corrupt files, merge."""

from __future__ import annotations

import hashlib
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.cli import main as cli_main
from harness.outcomes import OUTCOMES
from harness.results.dbfile import StoreError
from harness.results.merge import merge_stores
from harness.results.rows import CollectiveRow, ResultRow, RunInfo
from harness.results.store import ResultStore, canonical_json

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {"precision": "default", "ops": "young"}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _row(run_id: str, model: str, outcome: str = "pass", **kw) -> ResultRow:
    return ResultRow(
        run_id=run_id, model_id=model, target="sim", settings=dict(SETTINGS), outcome=outcome, **kw
    )


def test_create_reopen_and_roundtrip(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    with ResultStore(db) as st:
        rid = st.begin_run(
            RunInfo(list_name="smoke", target="sim", settings=SETTINGS, argv="run --list smoke")
        )
        st.record(
            _row(
                rid,
                "org/model-a",
                "drift",
                arch="BertModel",
                rmse_ratio=3.5,
                metrics={"logits": {"rmse_target": 1e-3, "ok": False, "shape": (1, 4), "dtype": "float32"}},
                attempts=[{"device": "sim:0", "outcome": "drift", "exit_code": 0, "duration_s": 1.5}],
                exit_code=0,
            )
        )
        st.finish_run(rid)
    with ResultStore(db, create=False) as st:
        assert st.latest_run() == rid
        assert st.latest_run(unfinished_only=True) is None
        df = st.results(rid)
        assert len(df) == 1
        row = df.iloc[0]
        assert row.model_id == "org/model-a" and row.outcome == "drift" and row.rmse_ratio == 3.5
        assert row.settings == SETTINGS
        assert row.settings_json == canonical_json(SETTINGS)
        assert row.metrics["logits"]["shape"] == [1, 4]
        assert row.attempts[0]["device"] == "sim:0"
        assert row.torch_version and row.harness_version == "0.1.0"
        runs = st.runs()
        assert list(runs.run_id) == [rid] and runs.iloc[0].n_results == 1 and runs.iloc[0].finished_at
        assert runs.iloc[0].torch_version and runs.iloc[0].host


def test_upsert_settings_order_irrelevant(tmp_path: Path) -> None:
    with ResultStore(tmp_path / "r.db") as st:
        rid = st.begin_run(RunInfo("smoke", "sim", SETTINGS))
        st.record(_row(rid, "m", "crash"))
        st.record(ResultRow(run_id=rid, model_id="m", target="sim", settings={"ops": "young", "precision": "default"}, outcome="pass"))
        df = st.results(rid)
        assert list(df.outcome) == ["pass"]
        assert st.finished_ids(rid) == {"m"}
        assert st.latest_run(settings={"ops": "young", "precision": "default"}) == rid
        assert st.latest_run(target="cuda") is None


def test_bad_input_errors(tmp_path: Path) -> None:
    with ResultStore(tmp_path / "r.db") as st:
        rid = st.begin_run(RunInfo("smoke", "sim", SETTINGS))
        with pytest.raises(ValueError, match="unknown outcome"):
            st.record(_row(rid, "m", "meh"))
        with pytest.raises(StoreError, match="unknown run id"):
            st.record(_row("nope", "m"))
        with pytest.raises(StoreError, match="unknown run id"):
            st.results("nope")
    assert set(OUTCOMES) >= {"pass", "drift", "flaky"}
    with pytest.raises(StoreError, match="does not exist"):
        ResultStore(tmp_path / "missing.db", create=False)


def test_corrupt_file_untouched(tmp_path: Path) -> None:
    db = tmp_path / "corrupt.db"
    db.write_bytes(os.urandom(8192))
    before = _digest(db)
    with pytest.raises(StoreError, match="corrupt.db"):
        ResultStore(db)
    assert _digest(db) == before
    # An SQLite header followed by garbage: also refused, also untouched.
    db2 = tmp_path / "half.db"
    db2.write_bytes(b"SQLite format 3\x00" + os.urandom(8192))
    before2 = _digest(db2)
    with pytest.raises(StoreError):
        ResultStore(db2)
    assert _digest(db2) == before2


def test_foreign_sqlite_untouched(tmp_path: Path) -> None:
    db = tmp_path / "other.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    con.execute("INSERT INTO users VALUES (1, 'x')")
    con.commit()
    con.close()
    before = _digest(db)
    with pytest.raises(StoreError, match="another application"):
        ResultStore(db)
    assert _digest(db) == before
    # A 'meta' table from someone else is not enough either.
    db2 = tmp_path / "meta.db"
    con = sqlite3.connect(db2)
    con.execute("CREATE TABLE meta (key TEXT, value TEXT)")
    con.execute("INSERT INTO meta VALUES ('app', 'otherapp')")
    con.commit()
    con.close()
    before2 = _digest(db2)
    with pytest.raises(StoreError, match="not a portharness DB"):
        ResultStore(db2)
    assert _digest(db2) == before2


def test_newer_schema_refused(tmp_path: Path) -> None:
    db = tmp_path / "new.db"
    ResultStore(db).close()
    con = sqlite3.connect(db)
    con.execute("UPDATE meta SET value='999' WHERE key='schema_version'")
    con.commit()
    con.close()
    before = _digest(db)
    with pytest.raises(StoreError, match="newer portharness"):
        ResultStore(db)
    assert _digest(db) == before


def test_empty_file_gets_schema(tmp_path: Path) -> None:
    db = tmp_path / "empty.db"
    db.touch()
    with ResultStore(db) as st:
        assert st.latest_run() is None
        assert st.results().empty and st.runs().empty and st.collectives().empty


_WRITER = textwrap.dedent(
    """
    import sys
    from harness.results.rows import ResultRow, RunInfo
    from harness.results.store import ResultStore
    st = ResultStore(sys.argv[1])
    rid = st.begin_run(RunInfo("smoke", "sim", {"ops": "young"}, run_id=sys.argv[2]))
    i = 0
    while True:
        st.record(ResultRow(run_id=rid, model_id=f"{sys.argv[3]}-{i:05d}", target="sim", settings={"ops": "young"}, outcome="pass", traceback="x" * 2000))
        print(f"{sys.argv[3]}-{i:05d}", flush=True)
        i += 1
    """
)


def _spawn_writer(db: Path, run_id: str, prefix: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(db), run_id, prefix], stdout=subprocess.PIPE, text=True, env=env
    )


def test_kill9_loses_nothing_committed(tmp_path: Path) -> None:
    """Two writer processes share a DB; both are SIGKILLed mid-loop; every acknowledged row survives."""
    db = tmp_path / "k.db"
    ResultStore(db).close()
    procs = [_spawn_writer(db, "run-kill", p) for p in ("a", "b")]
    acked: list[str] = []
    try:
        for proc in procs:
            assert proc.stdout is not None
            for _ in range(40):
                line = proc.stdout.readline()
                assert line, "writer died early"
                acked.append(line.strip())
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
    for proc in procs:
        out, _ = proc.communicate(timeout=30)
        acked.extend(out.split())  # rows acknowledged between our last read and the kill
        assert proc.returncode == -signal.SIGKILL
    with ResultStore(db, create=False) as st:
        present = st.finished_ids("run-kill")
    assert set(acked) <= present
    assert len(acked) >= 80


def _make_shard(path: Path, shard: str, models: list[str], outcome: str = "pass") -> str:
    with ResultStore(path) as st:
        rid = st.begin_run(RunInfo("tiny-zoo", "sim", SETTINGS, shard=shard))
        for m in models:
            st.record(_row(rid, m, outcome))
        st.record_collective(
            CollectiveRow(
                run_id=rid,
                target="sim",
                backend="gloo",
                world_size=2,
                op="all_reduce",
                size_bytes=1 << 20,
                setting=f"bucket{shard[0]}",
                settings={"bucket": shard[0]},
                baseline_setting="default",
                median_s=0.01,
                p10_s=0.009,
                p90_s=0.012,
                repeats=10,
                ratio=1.1,
                ratio_p10=1.0,
                ratio_p90=1.2,
            )
        )
        st.finish_run(rid)
    return rid


def test_merge_combines_shards(tmp_path: Path) -> None:
    a, b = tmp_path / "shard-1.db", tmp_path / "shard-2.db"
    _make_shard(a, "1/2", ["m1", "m2"])
    _make_shard(b, "2/2", ["m3"])
    out = tmp_path / "merged.db"
    n = merge_stores(out, [a, b]).rows
    assert n == 5  # 3 results + 2 collectives
    with ResultStore(out, create=False) as st:
        runs = st.runs()
        assert len(runs) == 1 and runs.iloc[0].shard == "1/1" and runs.iloc[0].finished_at
        rid = runs.iloc[0].run_id
        assert st.finished_ids(rid) == {"m1", "m2", "m3"}
        assert len(st.collectives(rid)) == 2
    # Merging again is idempotent (upsert).
    assert merge_stores(out, [a, b]).rows == 5
    with ResultStore(out, create=False) as st:
        assert len(st.results()) == 3


def test_merge_partial_and_separate(tmp_path: Path) -> None:
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    _make_shard(a, "1/3", ["m1"])
    _make_shard(b, "3/3", ["m3"])
    out = tmp_path / "m.db"
    merge_stores(out, [a, b])
    with ResultStore(out, create=False) as st:
        assert list(st.runs().shard) == ["1,3/3"]
    out2 = tmp_path / "m2.db"
    merge_stores(out2, [a, b], combine_shards=False)
    with ResultStore(out2, create=False) as st:
        assert len(st.runs()) == 2


def test_merge_rejects_foreign_and_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.db"
    _make_shard(good, "1/1", ["m1"])
    foreign = tmp_path / "foreign.db"
    con = sqlite3.connect(foreign)
    con.execute("CREATE TABLE t (x)")
    con.commit()
    con.close()
    before = _digest(foreign)
    out = tmp_path / "out.db"
    with pytest.raises(StoreError, match="foreign.db"):
        merge_stores(out, [good, foreign])
    assert _digest(foreign) == before
    assert not out.exists()  # validated every source before creating anything
    rc = cli_main(["merge", "--out", str(out), str(good), str(tmp_path / "nope.db")])
    assert rc == 2 and "nope.db" in capsys.readouterr().err
    rc = cli_main(["merge", "--out", str(out), str(good)])
    assert rc == 0 and "merged 2 rows" in capsys.readouterr().out
    with pytest.raises(StoreError, match="also the destination"):
        merge_stores(good, [good])


def test_read_only_db_is_readable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A DB without write permission (CI artifact, read-only mount) opens read-only for reports."""
    db = tmp_path / "ro.db"
    rid = _make_shard(db, "1/1", ["m1", "m2"])
    before = _digest(db)
    monkeypatch.setattr("harness.results.writable.os.access", lambda *a, **k: False)  # root ignores chmod
    with ResultStore(db, create=False) as st:
        assert st.read_only and st.finished_ids(rid) == {"m1", "m2"}
        with pytest.raises(StoreError, match="read-only"):
            st.record(_row(rid, "m3"))
    assert _digest(db) == before
