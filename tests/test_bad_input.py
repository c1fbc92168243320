"""Bad input, damaged or read-only DBs, resume identity, device faults and signals: one test per case,
each through the real CLI (subprocesses), with nothing already recorded touched."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import LIST_HEADER, list_rows

from harness.results.merge import merge_stores
from harness.results.rows import ResultRow, RunInfo
from harness.results.store import ResultStore

EXACT = ["--precision", "highest", "--ops", "full"]
EXACT_SETTINGS = {"ops": "full", "precision": "highest"}
PAIRS = [("bert", "base"), ("gpt2", "base"), ("llama", "base"), ("opt", "base")]


def cli(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if (not k.startswith("PORTHARNESS_") or k == "PORTHARNESS_SIM_NAMESPACE")}
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**base, **(env or {})})


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def a_list(tmp_path: Path, pairs=PAIRS, name: str = "l.csv") -> Path:
    lst = tmp_path / name
    lst.write_text(LIST_HEADER + list_rows(pairs))
    return lst


def unfinished_run(db: Path, lst: Path, done: list[str], settings=EXACT_SETTINGS, shard: str = "1/1") -> str:
    """A run interrupted after `done` models, as a kill -9 would leave it."""
    with ResultStore(db) as st:
        rid = st.begin_run(RunInfo(list_name=str(lst), target="sim", settings=dict(settings), shard=shard))
        for m in done:
            st.record(ResultRow(run_id=rid, model_id=m, target="sim", settings=dict(settings), outcome="pass"))
    return rid


# 1. validation before any run row; --resume never picks an empty run ------------------------------


@pytest.mark.long
def test_bad_options_write_nothing_and_resume_finds_the_real_run(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.cli import main as cli_main

    lst = a_list(tmp_path)
    db = tmp_path / "r.db"
    rid = unfinished_run(db, lst, ["tiny/bert/base", "tiny/gpt2/base", "tiny/llama/base"])
    before = digest(db)
    r = cli("run", "--list", str(lst), "--db", str(db), *EXACT, "--target", "foo", timeout=120)  # a real process
    assert r.returncode == 2 and "torch knows no device 'foo'" in r.stderr, r.stderr[-1500:]
    assert len(r.stderr.strip().splitlines()) == 1 and digest(db) == before, r.stderr
    for k in [k for k in os.environ if k.startswith("PORTHARNESS_") and k != "PORTHARNESS_SIM_NAMESPACE"]:
        monkeypatch.delenv(k)
    capsys.readouterr()
    # the rest in this process: each is refused before any worker or row, which the first showed end to end
    for bad, message in ((["--spare", "5"], "--spare 5 leaves no active device"),
                         (["--jobs", "0"], "--jobs 0"), (["--jobs", "-3"], "--jobs -3"),
                         (["--timeout", "0"], "--timeout 0"), (["--timeout", "-5"], "--timeout -5"),
                         (["--mem-cap-mb", "-100"], "--mem-cap-mb -100"), (["--limit", "-1"], "--limit -1"),
                         (["--shard", "3/2"], "bad shard"), (["--retries", "-1"], "--retries -1")):
        assert cli_main(["run", "--list", str(lst), "--db", str(db), *EXACT, *bad]) == 2, bad
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (bad, err)
        assert digest(db) == before, bad  # nothing written, not even an empty run row
    with ResultStore(db) as st:  # an empty run left by an older portharness must not win the resume
        st.begin_run(RunInfo(list_name=str(lst), target="sim", settings=dict(EXACT_SETTINGS)))
    r = cli("run", "--list", str(lst), "--db", str(db), *EXACT, "--resume", "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resumed run {rid} (3 models already done)" in r.stderr
    with ResultStore(db) as st:
        assert len(st.results(rid)) == 4


# 3. worker start-up deadline ------------------------------------------------------------------------


@pytest.mark.long
def test_workers_that_never_start_end_the_run_with_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    from harness.fleet.runner import RunConfig, WorkerStartupError, run_models
    from harness.models.model_list import load_model_list

    # A backend module that hangs while a worker loads it (the supervisor imports it fine).
    (tmp_path / "stuck_backend.py").write_text(
        "import multiprocessing, time\nif multiprocessing.parent_process() is not None:\n    time.sleep(3600)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cfg = RunConfig(settings=dict(EXACT_SETTINGS), startup_timeout_s=2, backends=["stuck_backend"], progress=False)
    t0 = time.monotonic()
    with pytest.raises(WorkerStartupError, match="not ready within 2s"):
        run_models(load_model_list(str(a_list(tmp_path, PAIRS[:1]))), cfg, tmp_path / "r.db")
    assert time.monotonic() - t0 < 120


# 4. a malformed op profile is refused by the CLI -----------------------------------------------------


def test_malformed_profile_is_bad_input(tmp_path: Path) -> None:
    prof = tmp_path / "ops.txt"
    prof.write_text("aten::add.Tensor\naten::mul, aten::div\n")
    r = cli("run", "--list", str(a_list(tmp_path)), "--db", str(tmp_path / "r.db"), "--ops", str(prof))
    assert r.returncode == 2 and f"{prof}:2: bad op name" in r.stderr
    assert not (tmp_path / "r.db").exists()


# 5. read-only media -----------------------------------------------------------------------------------


def test_a_db_on_read_only_media_is_readable(tmp_path: Path) -> None:
    """A real read-only mount (tmpfs remounted ro in a user namespace), holding a DB whose last rows are
    still in its -wal file: plain mode=ro cannot open it (no -shm can be created)."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("needs unshare -rm (user + mount namespaces) to mount read-only media")
    db = tmp_path / "w.db"
    st = ResultStore(db)  # kept open: the -wal file holds the committed rows
    rid = st.begin_run(RunInfo("l", "sim", {"ops": "young"}))
    st.record(ResultRow(run_id=rid, model_id="m/1", target="sim", settings={"ops": "young"}, outcome="pass"))
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    shutil.copy(db, src / "w.db")
    shutil.copy(f"{db}-wal", src / "w.db-wal")
    py = sys.executable
    script = f"""set -e
mount -t tmpfs none {mnt}; cp {src}/w.db {src}/w.db-wal {mnt}/; mount -o remount,ro {mnt}
{py} -m harness.cli matrix --db {mnt}/w.db
{py} -m harness.cli report --db {mnt}/w.db --out {tmp_path}/site
{py} -m harness.cli diff --base-db {mnt}/w.db --head-db {mnt}/w.db --base {rid} --head {rid}
{py} -m harness.cli merge --out {tmp_path}/merged.db {mnt}/w.db"""
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=600)
    st.close()
    assert r.returncode == 0, r.stderr[-2000:]
    assert "m/1" in r.stdout and "merged 1 rows" in r.stdout and "corrupt" not in r.stderr


# 6. damaged pages ---------------------------------------------------------------------------------------


def test_damaged_pages_are_refused_and_the_file_left_alone(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    with ResultStore(db) as st:
        rid = st.begin_run(RunInfo("l", "sim", {"ops": "young"}))
        for i in range(200):
            st.record(ResultRow(run_id=rid, model_id=f"m{i}", target="sim", settings={"ops": "young"},
                                outcome="pass", traceback="x" * 500))
    data = bytearray(db.read_bytes())
    data[4096 * 5 : 4096 * 5 + 16] = b"\xff" * 16  # inside a data page: the header and meta stay intact
    db.write_bytes(bytes(data))
    before = digest(db)
    r = cli("run", "--list", str(a_list(tmp_path)), "--db", str(db), *EXACT)
    assert r.returncode == 2 and "integrity" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert digest(db) == before


# 7. a run's identity: shard, seed, fault injection ------------------------------------------------------


@pytest.mark.long
def test_resume_matches_shard_seed_and_faults(tmp_path: Path) -> None:
    lst = a_list(tmp_path)
    db = tmp_path / "r.db"
    one = unfinished_run(db, lst, ["tiny/bert/base"], shard="1/2")
    two = unfinished_run(db, lst, ["tiny/gpt2/base"], shard="2/2")
    r = cli("run", "--list", str(lst), "--db", str(db), *EXACT, "--shard", "1/2", "--resume", "--quiet")
    assert r.returncode == 0 and f"resumed run {one}" in r.stderr, r.stderr[-2000:]
    with ResultStore(db) as st:
        runs = st.runs().set_index("run_id")
        assert runs.loc[one].finished_at and not runs.loc[two].finished_at  # shard 2's run untouched
        assert set(st.results(two).model_id) == {"tiny/gpt2/base"}
    r = cli("run", "--list", str(lst), "--db", str(db), *EXACT, "--shard", "2/2", "--seed", "7", "--resume",
            "--quiet")
    assert r.returncode == 0 and "no unfinished run matches" in r.stderr, r.stderr[-2000:]
    with ResultStore(db) as st:
        assert set(st.results(two).model_id) == {"tiny/gpt2/base"}  # another seed never mixes into it
        seeded = st.latest_run(settings={**EXACT_SETTINGS, "seed": 7})
        assert seeded and len(st.results(seeded)) == 2
    unfinished_run(db, lst, ["tiny/bert/base"], shard="1/1")
    r = cli("run", "--list", str(lst), "--db", str(db), *EXACT, "--fault", "sim:0=nan:0.5", "--resume", "--quiet")
    assert "no unfinished run matches" in r.stderr  # a resume with faults is another experiment


# 8. device errors are never a model's result ------------------------------------------------------------


@pytest.mark.long
def test_device_errors_rerun_on_a_healthy_device(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    env = {"PORTHARNESS_SIM_DEVICES": "3", "PORTHARNESS_SIM_FAULTS": "sim:0=error:1.0;sim:1=error:1.0"}
    r = cli("run", "--list", str(a_list(tmp_path)), "--db", str(db), *EXACT, "--jobs", "2", "--spare", "1",
            "--quiet", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    with ResultStore(db) as st:
        rows = st.results().to_dict("records")
    assert len(rows) == 4
    for row in rows:
        assert row["outcome"] == "pass" and row["device"] == "sim:2", (row["model_id"], row["outcome"], row["attempts"])
        assert all(a["outcome"] == "device_error" for a in row["attempts"][:-1])
    assert "quarantining sim:0" in r.stderr and "quarantining sim:1" in r.stderr


# 9. signals leave no process behind and a resumable run ------------------------------------------------


def _session_pids(sid: int) -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if os.getsid(int(p.name)) == sid:
                    pids.append(int(p.name))
            except (ProcessLookupError, PermissionError):
                pass
    return pids


def _wait_gone(sid: int, seconds: float = 30.0) -> list[int]:
    deadline = time.time() + seconds
    while time.time() < deadline:
        left = _session_pids(sid)
        if not left:
            return []
        time.sleep(0.3)
    return _session_pids(sid)


def _as_a_shell_starts_it() -> None:
    """A shell starts a foreground command with Ctrl-C's default action and no signal blocked; a test
    process may have inherited otherwise (an ignored SIGINT survives exec, and Python then installs no
    KeyboardInterrupt handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _signal_state(pid: int) -> str:
    try:
        return " ".join(line.strip() for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                        if line.startswith(("SigBlk", "SigIgn", "SigCgt")))
    except OSError as e:
        return f"(no /proc status: {e})"


def _start_mid_run(tmp_path: Path, patho, name: str) -> tuple[subprocess.Popen, Path, list[str]]:
    lst = tmp_path / f"{name}.csv"
    lst.write_text(LIST_HEADER + list_rows(PAIRS[:2]) + patho.rows(dict([patho("hang")])))
    db = tmp_path / f"{name}.db"
    args = ["run", "--list", str(lst), "--db", str(db), *EXACT, "--jobs", "2", "--quiet", "--timeout", "300",
            "--retries", "0"]
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=_as_a_shell_starts_it)
    deadline = time.time() + 240
    while time.time() < deadline:  # the two quick models done, the hanging one in flight
        time.sleep(0.3)
        if db.exists():
            try:
                with sqlite3.connect(db, timeout=5) as c:
                    if c.execute("SELECT count(*) FROM results").fetchone()[0] >= 2:
                        break
            except sqlite3.OperationalError:
                pass
    time.sleep(1.0)
    return proc, db, args


@pytest.mark.long
def test_sigterm_stops_cleanly_and_resumably(tmp_path: Path, patho) -> None:
    proc, db, args = _start_mid_run(tmp_path, patho, "term")
    sid = os.getsid(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    assert "terminated (SIGTERM); finished rows are saved (use --resume)" in err
    assert _wait_gone(sid) == []  # workers (one hung), forkserver, resource tracker: all gone
    with ResultStore(db) as st:
        assert len(st.results()) == 2 and not st.runs().iloc[0].finished_at


@pytest.mark.long
def test_kill_9_of_the_supervisor_leaves_no_process(tmp_path: Path, patho) -> None:
    proc, db, args = _start_mid_run(tmp_path, patho, "kill")
    sid = os.getsid(proc.pid)
    assert len(_session_pids(sid)) >= 3  # supervisor, forkserver, workers
    os.kill(proc.pid, signal.SIGKILL)  # the supervisor alone, not its process group
    proc.communicate(timeout=60)
    assert _wait_gone(sid) == []


# 10. diff refuses incomparable runs unless they are named ------------------------------------------------


def test_diff_of_incomparable_runs(tmp_path: Path) -> None:
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    with ResultStore(a) as st:
        ra = st.begin_run(RunInfo("smoke", "sim", {"ops": "young"}))
        st.record(ResultRow(run_id=ra, model_id="m", target="sim", settings={"ops": "young"}, outcome="pass"))
    with ResultStore(b) as st:
        rb = st.begin_run(RunInfo("tiny-zoo", "sim", {"ops": "full"}))
        st.record(ResultRow(run_id=rb, model_id="m", target="sim", settings={"ops": "full"}, outcome="crash"))
    r = cli("diff", "--base-db", str(a), "--head-db", str(b))
    assert r.returncode == 2 and "not comparable: different list, settings" in r.stderr, r.stderr
    r = cli("diff", "--base-db", str(a), "--head-db", str(b), "--base", ra, "--head", rb)
    assert r.returncode in (0, 1), r.stderr  # named explicitly: compared as asked


# 11. CSV formulas, a UTF-8 BOM, overlapping shards ------------------------------------------------------


def test_csv_export_defuses_formulas(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    with ResultStore(db) as st:
        rid = st.begin_run(RunInfo("l", "sim", {"ops": "young"}))
        for m in ("=cmd|' /C calc'!A0", "+1+1", "@SUM(A1)", "-2", "plain"):
            st.record(ResultRow(run_id=rid, model_id=m, target="sim", settings={"ops": "young"}, outcome="pass"))
    out = tmp_path / "m.csv"
    assert cli("matrix", "--db", str(db), "--out", str(out)).returncode == 0
    cells = [line.split(",")[0] for line in out.read_text().splitlines()[1:]]
    assert sorted(cells) == sorted(["'=cmd|' /C calc'!A0", "'+1+1", "'@SUM(A1)", "'-2", "plain"])


def test_a_list_saved_with_a_bom_is_read(tmp_path: Path) -> None:
    from harness.models.model_list import load_model_list

    lst = tmp_path / "bom.csv"
    lst.write_bytes(b"\xef\xbb\xbf" + (LIST_HEADER + list_rows(PAIRS[:1])).encode())
    assert [e.id for e in load_model_list(str(lst))] == ["tiny/bert/base"]


def test_merge_reports_overlaps_and_keeps_the_finished_attempt(tmp_path: Path) -> None:
    a, b = tmp_path / "shard-1.db", tmp_path / "shard-2.db"
    rows = {}
    for db, shard, outcome, finish in ((a, "1/2", "pass", True), (b, "2/2", "device_error", False)):
        with ResultStore(db) as st:
            rid = st.begin_run(RunInfo("l", "sim", {"ops": "young"}, shard=shard))
            st.record(ResultRow(run_id=rid, model_id="shared", target="sim", settings={"ops": "young"},
                                outcome=outcome, attempts=[{"device": "sim:0", "outcome": outcome}]))
            st.record(ResultRow(run_id=rid, model_id=f"only-{shard[0]}", target="sim", settings={"ops": "young"},
                                outcome="pass"))
            if finish:
                st.finish_run(rid)
        rows[shard] = rid
    res = merge_stores(tmp_path / "m.db", [a, b])
    assert res.rows == 3 and len(res.overlaps) == 1 and "kept shard-1.db" in res.overlaps[0]
    with ResultStore(tmp_path / "m.db") as st:
        by = {r["model_id"]: r for r in st.results().to_dict("records")}
    assert by["shared"]["outcome"] == "pass"
    r = cli("merge", "--out", str(tmp_path / "m2.db"), str(b), str(a))  # order does not matter
    assert "merged 3 rows" in r.stdout and "1 key(s) appeared in more than one DB" in r.stderr


# ---------------------------------------------------------------------------------------------------------
# Second round (issue 26): one regression test per item
# ---------------------------------------------------------------------------------------------------------


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-3000:]
    return lines[0]


# item 1: ranges checked before any work -------------------------------------------------------------------------


def test_out_of_range_values_are_refused_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.cli import main as cli_main

    lst = a_list(tmp_path, PAIRS[:1])
    db = tmp_path / "r.db"
    unfinished_run(db, lst, [])
    before = digest(db)
    r = cli("run", "--list", str(lst), "--db", str(db), *EXACT, "--seed", "-1", "--quiet")  # a real process
    assert r.returncode == 2 and "--seed -1: must be from 0 to 2**32 - 1" in one_line(r.stderr), r.stderr[-2000:]
    for k in [k for k in os.environ if k.startswith("PORTHARNESS_") and k != "PORTHARNESS_SIM_NAMESPACE"]:
        monkeypatch.delenv(k)
    capsys.readouterr()
    for bad, message in ((["--seed", "1180591620717411303424"], "--seed 1180591620717411303424: must be from 0"),
                         (["--oracle-max-params", "-5"], "--oracle-max-params -5: must be >= 0"),
                         (["--fault", "sim:9=error:1.0"], "sim:9 does not exist, sim has 2 device(s)")):
        assert cli_main(["run", "--list", str(lst), "--db", str(db), *EXACT, *bad, "--quiet"]) == 2, bad
        assert message in one_line(capsys.readouterr().err), bad
        assert digest(db) == before, bad
    r = cli("check", "tiny/bert/base", "--seed", "-1")
    assert r.returncode == 2 and "--seed -1" in one_line(r.stderr) and r.stdout == "", r.stderr[-2000:]


@pytest.mark.long
def test_ray_executor_bad_input_is_one_line(tmp_path: Path) -> None:
    """Ray missing, an address that answers nothing or is no address, an address without the Ray executor:
    one line each, exit 2, nothing written (no Ray cluster needed)."""
    import importlib.util

    lst = a_list(tmp_path, PAIRS[:1])
    db = tmp_path / "r.db"
    unfinished_run(db, lst, [])
    before = digest(db)
    no_ray = tmp_path / "no-ray" / "ray"
    no_ray.mkdir(parents=True)
    (no_ray / "__init__.py").write_text("raise ImportError(\"No module named 'ray'\")\n")
    cases = [(["--ray-address", "auto"], {}, "--ray-address auto: needs --executor ray"),
             (["--executor", "ray"], {"PYTHONPATH": str(no_ray.parent)},
              "--executor ray needs Ray on this machine and on every node: pip install 'portharness[ray]'")]
    if importlib.util.find_spec("ray") is not None:
        cases += [(["--executor", "ray", "--ray-address", "127.0.0.1:1"], {}, "--ray-address 127.0.0.1:1: nothing answers"),
                  (["--executor", "ray", "--ray-address", "head-node"], {}, "expected auto, HOST:PORT or ray://HOST:PORT")]
    for bad, env, message in cases:
        r = cli("run", "--list", str(lst), "--db", str(db), *EXACT, *bad, "--quiet", env=env, timeout=120)
        assert r.returncode == 2 and message in one_line(r.stderr), (bad, r.stderr[-2000:])
        assert digest(db) == before, bad


def test_collectives_ranges_and_the_machine_s_size(tmp_path: Path) -> None:
    r = cli("collectives", "--timeout", "0", "--no-ddp", "--sizes", "4k", "--repeats", "1")
    assert r.returncode == 2 and "timeout must be > 0 seconds" in one_line(r.stderr), r.stderr[-2000:]
    # Refused from the configuration alone: not one of the thousand ranks is started.
    r = cli("collectives", "--world-size", "1000", "--no-ddp", "--sizes", "4k", "--repeats", "1")
    assert r.returncode == 2 and "world size 1000: this machine can hold at most" in one_line(r.stderr), r.stderr


# item 4: hostile --backend modules (items 2, 3, 5, 6 and an empty repro dir: test_bad_output.py) -------


HOSTILE = {
    "exits3": ("import sys\nsys.exit(3)\n", "importing it called sys.exit(3)"),
    "exits0": ("import sys\nsys.exit(0)\n", "importing it called sys.exit(0)"),
    "osexit": ("import os\nos._exit(0)\n", "importing it ended the process (exit code 0, e.g. os._exit)"),
    "segv": ("import ctypes\nctypes.string_at(0)\n", "importing it killed the process (SIGSEGV)"),
    "hangs": ("import time\ntime.sleep(3600)\n", "importing it did not finish within 3s"),
    "raises": ("raise RuntimeError('driver 1.2 not found')\n", "importing it raised RuntimeError: driver 1.2 not found"),
}


@pytest.mark.long
def test_hostile_backend_modules_are_named_and_stopped(tmp_path: Path) -> None:
    for name, (code, _) in HOSTILE.items():
        (tmp_path / f"{name}.py").write_text(code)
    env = {"PYTHONPATH": str(tmp_path)}
    for name, (_, what) in HOSTILE.items():
        r = cli("check", "tiny/bert/base", "--backend", name, "--backend-timeout", "3", "--json", env=env, timeout=120)
        assert r.returncode == 2 and r.stdout == "", (name, r.returncode, r.stdout[-500:], r.stderr[-2000:])
        line = one_line(r.stderr)
        assert line.startswith(f"portharness check: error: --backend {name}: ") and what in line, (name, line)
    r = cli("run", "--list", str(a_list(tmp_path, PAIRS[:1])), "--db", str(tmp_path / "r.db"), "--quiet",
            env={**env, "PORTHARNESS_BACKENDS": "exits3"}, timeout=120)
    assert r.returncode == 2 and "--backend exits3: importing it called sys.exit(3)" in one_line(r.stderr)
    assert not (tmp_path / "r.db").exists()


# item 7: expected files -----------------------------------------------------------------------------------


def test_expected_files_know_the_outcomes_and_take_a_bom(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    with ResultStore(db) as st:
        rid = st.begin_run(RunInfo("l", "sim", {"ops": "young"}))
        st.record(ResultRow(run_id=rid, model_id="tiny/bert/base", target="sim", settings={"ops": "young"},
                            outcome="pass"))
    exp = tmp_path / "e.csv"
    assert cli("baseline", "update", "--db", str(db), "--out", str(exp)).returncode == 0
    text = exp.read_text()
    bad = tmp_path / "bad.csv"
    bad.write_text(text.replace("tiny/bert/base,pass,", "tiny/bert/base,frobnicated,"))
    r = cli("baseline", "check", "--db", str(db), "--expected", str(bad))
    assert r.returncode == 2 and "unknown outcome 'frobnicated' for 'tiny/bert/base'" in one_line(r.stderr), r.stderr
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbf" + text.encode())
    r = cli("baseline", "check", "--db", str(db), "--expected", str(bom))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


# item 8: merge ranks the destination's rows too ----------------------------------------------------------------


def test_merging_an_older_copy_of_a_shard_loses_nothing(tmp_path: Path) -> None:
    v1, v2, night = tmp_path / "b_v1.db", tmp_path / "b_v2.db", tmp_path / "night.db"
    rid = unfinished_run(v1, Path("l"), [], settings={"ops": "young"})
    with ResultStore(v1) as st:
        for m in ("a", "b"):
            st.record(ResultRow(run_id=rid, model_id=m, target="sim", settings={"ops": "young"}, outcome="device_error"))
    shutil.copy(v1, v2)
    with ResultStore(v2) as st:  # the same run, resumed later: both rows passed, the run finished
        for m in ("a", "b"):
            st.record(ResultRow(run_id=rid, model_id=m, target="sim", settings={"ops": "young"}, outcome="pass",
                                attempts=[{"device": "sim:0", "outcome": "device_error"}, {"device": "sim:1",
                                                                                           "outcome": "pass"}]))
        st.finish_run(rid)
    for src in (v2, v1):  # the newer copy first, then the older one
        r = cli("merge", "--out", str(night), str(src))
        assert r.returncode == 0, r.stderr
    assert "kept night.db" in r.stderr
    with ResultStore(night) as st:
        assert dict(zip(st.results().model_id, st.results().outcome, strict=True)) == {"a": "pass", "b": "pass"}
        assert st.runs().iloc[0].finished_at  # still finished


# item 9: diff: one comparability rule for one DB and two -------------------------------------------------------


def test_diff_with_only_a_base_named_checks_comparability(tmp_path: Path) -> None:
    db = tmp_path / "d.db"
    with ResultStore(db) as st:
        ids = []
        for seed in (0, 5):
            settings = {"ops": "young", **({"seed": seed} if seed else {})}
            rid = st.begin_run(RunInfo("smoke", "sim", settings, run_id=f"seed{seed}"))
            st.record(ResultRow(run_id=rid, model_id="m", target="sim", settings=settings, outcome="pass"))
            ids.append(rid)
    r = cli("diff", "--db", str(db), "--base", "seed0")  # head: the latest run, seed 5
    assert r.returncode == 2 and "not comparable: different settings" in one_line(r.stderr), r.stdout + r.stderr
    r = cli("diff", "--db", str(db), "--base", "seed0", "--head", "seed5")  # both named: compared as asked
    assert r.returncode == 0, r.stderr


# item 10: control characters; Ctrl-C to the process group -------------------------------------------------------


def test_matrix_shows_control_characters_instead_of_running_them(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    with ResultStore(db) as st:
        rid = st.begin_run(RunInfo("l", "sim", {"ops": "young"}))
        for m in ("evil\x1b[2J\x1b[31mred", "tag[/b]markup"):
            st.record(ResultRow(run_id=rid, model_id=m, target="sim", settings={"ops": "young"}, outcome="pass"))
    r = cli("matrix", "--db", str(db))
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "evil\\x1b[2J\\x1b[31mred" in r.stdout and "tag[/b]markup" in r.stdout


@pytest.mark.long
def test_ctrl_c_to_the_process_group_prints_one_clean_message(tmp_path: Path, patho) -> None:
    proc, db, _ = _start_mid_run(tmp_path, patho, "intr")
    sid = os.getsid(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: every process of the group
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # stuck: fail with where the supervisor is (faulthandler on SIGUSR1)
        state = _signal_state(proc.pid)  # SIGINT (2) is mask 0x2: blocked, ignored or caught?
        proc.send_signal(signal.SIGUSR1)
        time.sleep(3)
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"still running 60 s after Ctrl-C; its signal state: {state}; its stacks:\n{err[-6000:]}")
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "portharness: interrupted; finished rows are saved (use --resume)"
    assert _wait_gone(sid) == []
    with ResultStore(db) as st:
        assert len(st.results()) == 2 and not st.runs().iloc[0].finished_at
