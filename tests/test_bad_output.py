"""Outputs, through the real CLI: read-only media, a directory the user may not write, a parent that is a
file, a full disk, a device as --db, an old schema, stdout under --json, CSV exports. An output that
cannot be written ends in one line naming the path and the cause, exit 2 (1 once a run has saved rows,
with the --resume hint), and leaves nothing behind: no temporary file, no 0-byte file, no half-built
report, and every old file as it was."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import LIST_HEADER, list_rows

from harness.results.rows import ResultRow, RunInfo
from harness.results.store import ResultStore

ONE = LIST_HEADER + list_rows([("bert", "base")])
EXACT = ["--precision", "highest", "--ops", "full"]
NOBODY = 65534


def cli(*args: str, cwd: Path | None = None, uid: int | None = None, env: dict | None = None,
        timeout: float = 600) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if (not k.startswith("PORTHARNESS_") or k == "PORTHARNESS_SIM_NAMESPACE")}
    prefix = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if uid is not None else []
    return subprocess.run([*prefix, sys.executable, "-m", "harness.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**base, **(env or {})}, cwd=cwd)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _one(tmp_path: Path) -> Path:
    lst = tmp_path / "l.csv"
    lst.write_text(ONE)
    return lst


def unfinished_run(db: Path, lst: Path, done: list[str]) -> str:
    settings = {"ops": "full", "precision": "highest"}
    with ResultStore(db) as st:
        rid = st.begin_run(RunInfo(list_name=str(lst), target="sim", settings=dict(settings)))
        for m in done:
            st.record(ResultRow(run_id=rid, model_id=m, target="sim", settings=dict(settings), outcome="pass"))
    return rid


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def _db(write_synthetic_db, path: Path) -> Path:
    write_synthetic_db(path, 12, runs=1, collectives=False)
    return path


# ----------------------------------------------------------------------------------------------------
# item 2: read-only media, a directory the user may not write, a parent that is a file
# ----------------------------------------------------------------------------------------------------


@pytest.mark.long
def test_every_writer_refuses_read_only_media_in_one_line(tmp_path: Path, private_mounts, write_synthetic_db) -> None:
    db = _db(write_synthetic_db, tmp_path / "r.db")
    (tmp_path / "one.csv").write_text(ONE)
    ro = tmp_path / "ro"
    res = private_mounts(f"""
ro, db, lst = {str(ro)!r}, {str(db)!r}, {str(tmp_path / "one.csv")!r}
tmpfs(ro)
import shutil; shutil.copy(db, ro + "/old.db")
read_only(ro)
before = snapshot(ro)
out = {{
    "report": cli("report", "--db", db, "--out", ro + "/site"),
    "matrix": cli("matrix", "--db", db, "--out", ro + "/m.csv"),
    "baseline": cli("baseline", "update", "--db", db, "--out", ro + "/e.csv"),
    "trend": cli("trend", "append", "--db", db, "--history", ro + "/h.jsonl"),
    "merge": cli("merge", "--out", ro + "/m.db", db),
    "run-new-db": cli("run", "--list", lst, "--db", ro + "/new.db", "--quiet"),
    "run-old-db": cli("run", "--list", lst, "--db", ro + "/old.db", "--quiet"),
}}
print(json.dumps({{"out": out, "same": snapshot(ro) == before}}))
""")
    for name, r in res["out"].items():
        assert r["rc"] == 2, (name, r["err"][-3000:])
        line = one_line(r["err"])  # no banner, no traceback
        assert "read-only file system (EROFS)" in line or "is read-only" in line, (name, line)
        assert str(ro) in line, (name, line)
    assert "old.db is read-only (read-only file system (EROFS))" in res["out"]["run-old-db"]["err"]
    assert res["same"]


def test_a_directory_the_user_may_not_write(tmp_path: Path, write_synthetic_db) -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the CLI as an unprivileged user (uid 65534)")
    shared = Path(tempfile.mkdtemp(prefix="portharness-eacces-"))  # tmp_path is private to root
    try:
        shared.chmod(0o755)
        db = _db(write_synthetic_db, shared / "r.db")
        db.chmod(0o644)
        (shared / "site").mkdir(mode=0o755)
        probe = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-c",
                 "import harness.report.build, harness.analysis.matrix"]  # the commands below import these
        if subprocess.run(probe, capture_output=True, cwd=shared, timeout=120).returncode != 0:
            pytest.skip("the unprivileged user (uid 65534) cannot run this checkout's Python")
        r = cli("report", "--db", db, "--out", shared / "site", uid=NOBODY, cwd=shared)
        assert r.returncode == 2 and one_line(r.stderr).endswith(
            f"cannot write {shared / 'site'}: permission denied (EACCES); nothing was written"), r.stderr[-3000:]
        r = cli("matrix", "--db", db, "--out", shared / "m.csv", uid=NOBODY, cwd=shared)
        assert r.returncode == 2 and "permission denied (EACCES)" in one_line(r.stderr) and r.stdout == ""
        left = sorted(p.name for p in shared.iterdir() if not p.name.startswith("r.db-"))
        assert left == ["r.db", "site"] and not any((shared / "site").iterdir())
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_parent_that_is_a_file_or_missing(tmp_path: Path, write_synthetic_db) -> None:
    db = _db(write_synthetic_db, tmp_path / "r.db")
    lst = tmp_path / "one.csv"
    lst.write_text(ONE)
    afile = tmp_path / "file"
    afile.write_text("x")
    r = cli("run", "--list", lst, "--db", afile / "x.db", "--quiet")
    assert r.returncode == 2 and "a file, not a directory (ENOTDIR)" in one_line(r.stderr), r.stderr[-3000:]
    r = cli("matrix", "--db", db, "--out", tmp_path / "missing" / "m.csv")
    assert r.returncode == 2 and f"directory {tmp_path / 'missing'} does not exist" in one_line(r.stderr)
    assert r.stdout == ""  # refused before the tables are printed
    r = cli("report", "--db", db, "--out", afile / "site")
    assert r.returncode == 2 and "(ENOTDIR)" in one_line(r.stderr), r.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("r.db-")) == ["file", "one.csv", "r.db"]


# ----------------------------------------------------------------------------------------------------
# item 3: checked before the banner: the report target, --db a regular file, the schema
# ----------------------------------------------------------------------------------------------------


@pytest.mark.long
def test_run_checks_its_outputs_before_the_banner(tmp_path: Path) -> None:
    lst = _one(tmp_path)
    existing = tmp_path / "existing.html"
    existing.write_text("<html>mine</html>")
    db = tmp_path / "r.db"
    r = cli("run", "--list", str(lst), "--db", str(db), *EXACT, "--report", str(existing), "--quiet")
    assert r.returncode == 2 and "report output" in one_line(r.stderr), r.stderr[-2000:]
    assert not db.exists() and existing.read_text() == "<html>mine</html>"  # no model ran, no row written
    if os.geteuid() == 0 and hasattr(os, "mknod"):  # device files of our own: /dev itself is left alone
        try:
            os.mknod(tmp_path / "null", 0o666 | 0o020000, os.makedev(1, 3))
            os.mknod(tmp_path / "full", 0o666 | 0o020000, os.makedev(1, 7))
        except OSError:
            pass
    os.mkfifo(tmp_path / "fifo")
    for dev in [p for p in (tmp_path / "null", tmp_path / "full", tmp_path / "fifo") if p.exists()]:
        r = cli("run", "--list", str(lst), "--db", str(dev), *EXACT, "--quiet", timeout=120)
        assert r.returncode == 2 and "is not a regular file" in one_line(r.stderr), (dev, r.stderr[-2000:])
    assert sorted(p.name for p in tmp_path.iterdir() if "journal" in p.name or "-wal" in p.name) == []


def _sql(db: Path, *statements: str) -> None:
    c = sqlite3.connect(db, isolation_level=None)
    try:
        for s in statements:
            c.execute(s)
    finally:
        c.close()


@pytest.mark.long
def test_an_older_schema_is_updated_whole_or_refused_untouched(tmp_path: Path) -> None:
    lst = _one(tmp_path)
    old = tmp_path / "old.db"
    unfinished_run(old, lst, ["tiny/gpt2/base"])
    # a DB from before these columns existed
    _sql(old, "ALTER TABLE runs DROP COLUMN host", "ALTER TABLE results DROP COLUMN peak_rss_mb")
    r = cli("run", "--list", str(lst), "--db", str(old), *EXACT, "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    with ResultStore(old) as st:
        assert len(st.runs()) == 2 and set(st.results().model_id) == {"tiny/gpt2/base", "tiny/bert/base"}
    broken = tmp_path / "broken.db"
    unfinished_run(broken, lst, ["tiny/gpt2/base"])
    # not a column that can be added: refused before anything (no WAL: any write would change the file)
    _sql(broken, "ALTER TABLE runs DROP COLUMN target", "PRAGMA journal_mode=DELETE")
    before = digest(broken)
    r = cli("run", "--list", str(lst), "--db", str(broken), *EXACT, "--quiet")
    assert r.returncode == 2 and "lacks runs.target, which cannot be added" in one_line(r.stderr), r.stderr[-2000:]
    assert digest(broken) == before and not Path(f"{broken}-wal").exists()


# ----------------------------------------------------------------------------------------------------
# item 5: stdout is JSON alone with --json; item 10: no empty repro directory left by `check`
# ----------------------------------------------------------------------------------------------------


@pytest.mark.long
def test_json_stdout_is_json_only(tmp_path: Path) -> None:
    """A backend that prints while being imported (here, in the workers and in the CLI), and `run --json`."""
    (tmp_path / "noisy.py").write_text("print('hello from noisy')\n")
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {"PYTHONPATH": str(tmp_path), "TMPDIR": str(temp)}
    r = cli("check", "tiny/bert/base", *EXACT, "--backend", "noisy", "--json", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["outcome"] == "pass" and "hello from noisy" in r.stderr
    assert "--backend noisy printed to stdout while being imported" in r.stderr
    assert not list(temp.glob("portharness-repro-*"))  # 10: nothing diverged, so no repro dir is left behind
    r = cli("run", "--list", str(_one(tmp_path)), "--db", str(tmp_path / "r.db"), *EXACT, "--jobs", "1",
            "--json", "--quiet", env={**env, "PORTHARNESS_BACKENDS": "noisy"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["counts"] == {"pass": 1}
    assert "numerics matched" in r.stderr  # the human summary, on stderr


# ----------------------------------------------------------------------------------------------------
# item 6: one CSV writer for every export
# ----------------------------------------------------------------------------------------------------


EVIL = ("=cmd|' /C calc'!A0", "+1+1", "@SUM(A1)", "-2", "'=quoted", "plain")


def test_baseline_files_defuse_formulas_and_read_them_back(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    with ResultStore(db) as st:
        rid = st.begin_run(RunInfo("l", "sim", {"ops": "young"}))
        for m in EVIL:
            st.record(ResultRow(run_id=rid, model_id=m, target="sim", settings={"ops": "young"}, outcome="pass"))
    exp = tmp_path / "e.csv"
    r = cli("baseline", "update", "--db", str(db), "--out", str(exp))
    assert r.returncode == 0, r.stderr
    cells = [line.split(",")[0] for line in exp.read_text().splitlines() if not line.startswith("#")][1:]
    assert sorted(cells) == sorted(["'=cmd|' /C calc'!A0", "'+1+1", "'@SUM(A1)", "'-2", "''=quoted", "plain"])
    r = cli("baseline", "check", "--db", str(db), "--expected", str(exp), "--json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    checked = json.loads(r.stdout)["checks"][0]
    assert checked["counts"]["pass"] == len(EVIL) and checked["models"] == []  # read back as written: none new/missing


# ----------------------------------------------------------------------------------------------------
# item 2: a full disk
# ----------------------------------------------------------------------------------------------------


@pytest.mark.long
def test_a_full_disk_leaves_every_old_file_as_it_was(tmp_path: Path, private_mounts, write_synthetic_db) -> None:
    db = _db(write_synthetic_db, tmp_path / "r.db")
    (tmp_path / "one.csv").write_text(ONE)
    full = tmp_path / "full"
    res = private_mounts(f"""
full, db, lst = {str(full)!r}, {str(db)!r}, {str(tmp_path / "one.csv")!r}
tmpfs(full, "4m")
made = [cli("report", "--db", db, "--out", full + "/site"), cli("matrix", "--db", db, "--out", full + "/m.csv"),
        cli("baseline", "update", "--db", db, "--out", full + "/e.csv"),
        cli("trend", "append", "--db", db, "--history", full + "/h.jsonl"), cli("merge", "--out", full + "/m.db", db)]
assert all(r["rc"] == 0 for r in made), made
fill(full)
before = snapshot(full)
out = {{
    "report": cli("report", "--db", db, "--out", full + "/site"),
    "report-new": cli("report", "--db", db, "--out", full + "/site2"),
    "matrix": cli("matrix", "--db", db, "--out", full + "/m.csv"),
    "matrix-new": cli("matrix", "--db", db, "--out", full + "/m2.csv"),
    "baseline": cli("baseline", "update", "--db", db, "--out", full + "/e.csv"),
    "trend": cli("trend", "append", "--db", db, "--history", full + "/h.jsonl", "--date", "2030-01-01"),
    "merge-new": cli("merge", "--out", full + "/m2.db", db),
    "run-new-db": cli("run", "--list", lst, "--db", full + "/new.db", "--quiet"),
}}
print(json.dumps({{"out": out, "before": before, "after": snapshot(full),
                   "names": sorted(os.listdir(full)), "site": sorted(os.listdir(full + "/site"))}}))
""")
    for name, r in res["out"].items():
        assert r["rc"] == 2, (name, r["err"][-3000:])
        lines = r["err"].strip().splitlines()  # one line, `run` too: a new DB is made whole before its banner
        assert len(lines) == 1 and "no space left on the device (ENOSPC)" in lines[0] and str(full) in lines[0], \
            (name, r["err"][-3000:])
        assert "Traceback" not in r["err"], (name, r["err"][-3000:])
    assert res["after"] == res["before"]  # the old site, CSV, expected file, history and DB: byte for byte
    assert res["names"] == [".filler", "e.csv", "h.jsonl", "m.csv", "m.db", "site"]  # no temp file, nothing new
    assert not [n for n in res["site"] if n.startswith(".portharness-new") or n.startswith(".models-new")]
    empty = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # sha256 of 0 bytes
    assert res["before"]["site/index.html"] != empty and any(k.startswith("site/models/") for k in res["before"])


def test_a_merge_that_fills_the_disk_changes_nothing(tmp_path: Path, private_mounts, write_synthetic_db) -> None:
    small, big = tmp_path / "small.db", tmp_path / "big.db"
    write_synthetic_db(small, 5, runs=1, collectives=False)
    write_synthetic_db(big, 300, runs=1, seed=1, collectives=False)
    full = tmp_path / "full"
    res = private_mounts(f"""
full = {str(full)!r}
tmpfs(full, "4m")
assert cli("merge", "--out", full + "/night.db", {str(small)!r})["rc"] == 0
import sqlite3
fill(full, leave=96 << 10)  # room for a few of the big DB's {os.path.getsize(big) >> 10} KiB of rows
r = cli("merge", "--out", full + "/night.db", {str(big)!r})
with sqlite3.connect(f"file:{{full}}/night.db?mode=ro", uri=True) as c:
    n = [c.execute(f"SELECT count(*) FROM {{t}}").fetchone()[0] for t in ("runs", "results")]
print(json.dumps({{"r": r, "rows": n, "names": sorted(os.listdir(full))}}))
""")
    assert res["r"]["rc"] == 2 and "no space left on the device (ENOSPC)" in one_line(res["r"]["err"])
    assert res["rows"] == [1, 5]  # one transaction: neither the big DB's run nor any of its rows half-merged
    assert not [n for n in res["names"] if n.endswith(".tmp")]


@pytest.mark.long
def test_a_disk_that_fills_mid_run_keeps_the_rows_and_says_resume(tmp_path: Path, private_mounts, patho) -> None:
    lst = tmp_path / "l.csv"
    lst.write_text(ONE + patho.rows(dict([patho("hang")])))
    full = tmp_path / "full"
    res = private_mounts(f"""
full = {str(full)!r}
tmpfs(full, "8m")
args = [sys.executable, "-m", "harness.cli", "run", "--list", {str(lst)!r}, "--db", full + "/r.db", *{EXACT!r},
        "--jobs", "2", "--retries", "0", "--timeout", "10", "--quiet"]
proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
deadline = time.time() + 300
while rows(full + "/r.db") < 1 and time.time() < deadline and proc.poll() is None:  # tiny/bert done, hang in flight
    time.sleep(0.2)
fill(full)
out, err = proc.communicate(timeout=300)
print(json.dumps({{"rc": proc.returncode, "err": err, "rows": rows(full + "/r.db")}}))
""")
    assert res["rc"] == 1, res["err"][-3000:]
    assert "no space left on the device (ENOSPC)" in res["err"] and "Traceback" not in res["err"], res["err"][-3000:]
    assert "The 1 rows finished before it are saved: rerun with --resume once the DB can be written" in res["err"]
    assert res["rows"] == 1


def test_json_outputs_are_unaffected(tmp_path: Path, write_synthetic_db) -> None:
    """Export formats other than CSV go through the same atomic writer."""
    db = _db(write_synthetic_db, tmp_path / "r.db")
    r = cli("matrix", "--db", db, "--out", tmp_path / "m.json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads((tmp_path / "m.json").read_text())) == 12
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("r.db-")) == ["m.json", "r.db"]
