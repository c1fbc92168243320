"""Bad input, third round (issue 33): one regression test per cause, each through the real CLI, with nothing
already recorded touched. Servers the Ray tests talk to listen on 127.0.0.1 only and stop with the test."""

from __future__ import annotations

import hashlib
import os
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import LIST_HEADER, list_rows

from harness.results.rows import ResultRow, RunInfo
from harness.results.store import ResultStore

EXACT = ["--precision", "highest", "--ops", "full"]


def cli(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if (not k.startswith("PORTHARNESS_") or k == "PORTHARNESS_SIM_NAMESPACE")}
    return subprocess.run([sys.executable, "-m", "harness.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**base, **(env or {})})


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def a_db(tmp_path: Path, lst: Path) -> Path:
    """A DB holding one unfinished run of `lst`: what no refused command may touch."""
    db = tmp_path / "r.db"
    settings = {"ops": "full", "precision": "highest"}
    with ResultStore(db) as st:
        rid = st.begin_run(RunInfo(list_name=str(lst), target="sim", settings=settings))
        st.record(ResultRow(run_id=rid, model_id="tiny/bert/base", target="sim", settings=settings, outcome="pass"))
    return db


def a_list(tmp_path: Path, pairs=(("bert", "base"),)) -> Path:
    lst = tmp_path / "l.csv"
    lst.write_text(LIST_HEADER + list_rows(list(pairs)))
    return lst


def refused(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    """`argv` through the CLI's main in this process (each case is refused before any worker or row; the
    first case of a test shows it end to end in a real process): its one line on stderr."""
    from harness.cli import main as cli_main

    capsys.readouterr()
    assert cli_main(argv) == 2, argv
    captured = capsys.readouterr()
    assert captured.out == "", argv
    return one_line(captured.err)


@pytest.fixture(name="clean_env")
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in [k for k in os.environ if k.startswith("PORTHARNESS_") and k != "PORTHARNESS_SIM_NAMESPACE"]:
        monkeypatch.delenv(k)


# cause 1: --compile-cache checked before the run -------------------------------------------------------------


def test_a_compile_cache_that_cannot_be_a_directory_is_refused_before_the_banner(
        tmp_path: Path, capsys: pytest.CaptureFixture, clean_env: None) -> None:
    lst = a_list(tmp_path)
    db = a_db(tmp_path, lst)
    before = digest(db)
    afile = tmp_path / "a-file"
    afile.write_text("not a directory\n")
    r = cli("run", "--list", lst, "--db", db, *EXACT, "--compile", "eager", "--compile-cache", afile, "--quiet",
            timeout=300)
    assert r.returncode == 2 and str(afile) in one_line(r.stderr) and "not a directory" in r.stderr, r.stderr[-2000:]
    assert digest(db) == before
    under = afile / "cache"
    line = refused(capsys, ["run", "--list", str(lst), "--db", str(db), *EXACT, "--compile", "eager",
                            "--compile-cache", str(under), "--quiet"])
    assert str(under) in line and "is a file, not a directory" in line, line
    line = refused(capsys, ["check", "tiny/bert/base", *EXACT, "--compile", "eager", "--compile-cache", str(afile)])
    assert str(afile) in line, line
    # storage that refuses every write even where access() says yes (procfs, to root): every model a crash before
    line = refused(capsys, ["run", "--list", str(lst), "--db", str(db), *EXACT, "--compile", "eager",
                            "--compile-cache", "/proc/portharness-cc", "--quiet"])
    assert "cannot write /proc/portharness-cc" in line, line
    # the default, <db>-compile-cache beside the DB, is checked as well
    (tmp_path / "r-compile-cache").write_text("in the way\n")
    line = refused(capsys, ["run", "--list", str(lst), "--db", str(db), *EXACT, "--compile", "eager", "--quiet"])
    assert "r-compile-cache" in line and "not a directory" in line, line
    assert digest(db) == before and not (tmp_path / "ref-cache").exists()


# cause 2: a damaged entry of portharness's own compile cache is retried in a fresh one -------------------------


def compile_rows(db: Path) -> list[dict]:
    with sqlite3.connect(db) as c:
        c.row_factory = sqlite3.Row
        return [dict(r) for r in c.execute("SELECT * FROM results ORDER BY finished_at")]


@pytest.mark.slow  # three Inductor compiles of a small model: about 1.5 min on two cores (see test_configs.py)
def test_a_damaged_compile_cache_is_retried_in_a_fresh_one_and_its_entries_dropped(tmp_path: Path, patho) -> None:
    """Inductor's kernels of a small model compiled into the run's cache, then truncated as a killed writer
    or a full disk leaves them: the next run passes (retried in a fresh cache, `compile_cache` rebuilt), the
    damaged files are gone, and the run after it passes from the shared cache again."""
    mid, path = patho("none")
    lst = tmp_path / "l.csv"
    lst.write_text(LIST_HEADER + patho.rows({mid: path}))
    db, cache = tmp_path / "r.db", tmp_path / "cc"
    args = ["run", "--list", lst, "--db", db, "--compile", "inductor", "--compile-cache", cache, "--jobs", "1",
            "--quiet", "--retries", "0"]
    r = cli(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert compile_rows(db)[-1]["outcome"] == "pass"
    damaged = sorted(cache.rglob("*.so"))
    assert damaged
    for so in damaged:
        with open(so, "r+b") as f:
            f.truncate(100)
    r = cli(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    row = compile_rows(db)[-1]
    assert row["outcome"] == "pass" and row["compile_cache"] == "rebuilt", (row["outcome"], row["compile_cache"],
                                                                           row["error_message"][:1500])
    assert not [so for so in cache.rglob("*.so") if so.stat().st_size == 100], "damaged kernels left behind"
    r = cli(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    row = compile_rows(db)[-1]
    assert row["outcome"] == "pass" and row["compile_cache"] in ("cold", "mixed", "warm"), row["compile_cache"]


def test_the_fresh_cache_retry_blames_only_what_it_must(tmp_path: Path) -> None:
    """The retry's rule on its own (no compiler): a failure the cache may have caused is tried in a fresh
    cache; a different outcome there drops what the fresh compile made anew, the same one stays blamed."""
    from harness.run.compiled import retry_in_fresh_cache

    shared = tmp_path / "shared"
    for rel, data in (("ab/cab.so", b"x" * 100), ("ab/other.so", b"kept"), ("fxgraph/f1/fkey/e1", b"old"),
                      ("zz/cmod.py", b"def call(args):\n    return (")):
        (shared / rel).parent.mkdir(parents=True, exist_ok=True)
        (shared / rel).write_bytes(data)
    failed = {"outcome": "compile_fail", "error_message": f"g++ {shared}/ab/cab.cpp: error: 'at::vec' has not been declared",
              "traceback": f'  File "{shared}/zz/cmod.py", line 2\nSyntaxError: unexpected EOF'}  # named only here

    def passes_there(fresh: str) -> dict:
        for rel in ("ab/cab.so", "fxgraph/f1/fkey/e2", "locks/cab.lock"):
            (Path(fresh) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(fresh) / rel).write_bytes(b"good")
        return {"outcome": "pass"}

    assert retry_in_fresh_cache(str(shared), failed, "pass", passes_there) == {"outcome": "pass", "compile_cache": "rebuilt"}
    assert sorted(str(p.relative_to(shared)) for p in shared.rglob("*") if p.is_file()) == ["ab/other.so"]
    again = retry_in_fresh_cache(str(shared), failed, "pass", lambda d: {"outcome": "compile_fail", "error_message": "x"})
    assert again == {"outcome": "compile_fail", "error_message": "x; the same in a fresh compile cache: not the cache's"}
    for fields, eager in (({"outcome": "drift", "compile_cache": "cold"}, "pass"),  # the cache served nothing
                          ({"outcome": "drift", "compile_cache": "warm"}, "drift"),  # eager drifts too
                          ({"outcome": "unsupported_op", "error_message": str(shared)}, "pass"),
                          ({"outcome": "crash", "device_fault": True, "error_message": str(shared)}, "pass")):
        assert retry_in_fresh_cache(str(shared), fields, eager, lambda d: pytest.fail("retried")) is None, fields
    warm = retry_in_fresh_cache(str(shared), {"outcome": "drift", "compile_cache": "warm"}, "pass_declared",
                                lambda d: {"outcome": "pass_declared"})
    assert warm == {"outcome": "pass_declared", "compile_cache": "rebuilt"}


# causes 3 and 4: --slow-ops factors and op names ----------------------------------------------------------------


def test_slow_ops_factors_must_be_finite_and_bounded_and_ops_must_exist(
        tmp_path: Path, capsys: pytest.CaptureFixture, clean_env: None) -> None:
    lst = a_list(tmp_path)
    db = a_db(tmp_path, lst)
    before = digest(db)
    r = cli("run", "--list", lst, "--db", db, "--perf", "--slow-ops", "aten::softmax:inf", "--quiet", timeout=300)
    assert r.returncode == 2 and "--slow-ops 'aten::softmax:inf'" in one_line(r.stderr), r.stderr[-2000:]
    for spec in ("aten::softmax:1e308", "aten::softmax:1e9", "aten::softmax:-inf", "aten::softmax:nan"):
        line = refused(capsys, ["run", "--list", str(lst), "--db", str(db), "--perf", "--slow-ops", spec, "--quiet"])
        assert f"--slow-ops {spec!r}" in line and "FACTOR from 1 to" in line, line
    for spec, op in (("aten::nope:3", "aten::nope"), ("aten::softmax:3,aten::softmaks:2", "aten::softmaks"),
                     ("aten::add.Nope:2", "aten::add.Nope")):
        line = refused(capsys, ["check", "tiny/bert/base", "--perf", "--slow-ops", spec])
        assert f"--slow-ops {spec!r}" in line and f"{op!r}" in line and "no such op" in line, line
    assert digest(db) == before


# cause 5: options that cannot act -------------------------------------------------------------------------------


def test_options_that_cannot_act_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture, clean_env: None) -> None:
    lst = a_list(tmp_path)
    db = a_db(tmp_path, lst)
    before = digest(db)
    r = cli("check", "tiny/bert/base", "--perf-budget", "2", timeout=300)
    assert r.returncode == 2 and r.stdout == "", r.stdout[-2000:] + r.stderr[-2000:]
    assert "--perf-budget 2.0: only with --perf" in one_line(r.stderr)
    for extra, message in ((["--perf-budget", "0.5"], "--perf-budget 0.5: only with --perf"),
                           (["--compile-cache", str(tmp_path / "cc")], f"--compile-cache {tmp_path / 'cc'}: only with --compile"),
                           (["--compile-timeout", "30"], "--compile-timeout 30.0: only with --compile"),
                           (["--slow-ops", "aten::softmax:3"], "--slow-ops 'aten::softmax:3': only with --perf"),
                           (["--backend-timeout", "30"], "--backend-timeout 30: only with --backend MODULE"),
                           (["--backend-timeout", "0"], "--backend-timeout 0: must be > 0 seconds"),
                           (["--numerics-bug", "cache-off-by-one"], "cache-off-by-one: only with --mode generate"),
                           (["--numerics-bug", "gelu-mixup,cache-off-by-one", "--mode", "train"],
                            "cache-off-by-one: only with --mode generate")):
        for cmd in (["run", "--list", str(lst), "--db", str(db), "--quiet"], ["check", "tiny/bert/base"]):
            line = refused(capsys, [*cmd, *extra])
            assert message in line, (extra, line)
    assert digest(db) == before and not (tmp_path / "cc").exists()


# causes 6 and 7: the perf baseline ------------------------------------------------------------------------------

S = {"ops": "young", "precision": "default"}


def _perf(ratio: float, ops: list[list], total: float) -> dict:
    from harness import speed

    rounds = [ratio * (1 + 0.001 * ((i % 7) - 3)) for i in range(60)]
    ref = [1e-3] * 60
    return {"ratio": speed.summarize(rounds), "target": speed.summarize([r * 1e-3 for r in rounds]),
            "reference": speed.summarize(ref), "profile": {"total_us": total, "ops": ops, "clock": "thread-cpu"}}


def _perf_db(path: Path, models: dict[str, dict]) -> None:
    with ResultStore(path) as st:
        rid = st.begin_run(RunInfo("smoke", "sim", S))
        for model, perf in models.items():
            st.record(ResultRow(run_id=rid, model_id=model, target="sim", settings=S, outcome="pass", perf=perf,
                                perf_ratio=perf["ratio"]["median"], perf_target_s=perf["target"]["median"],
                                perf_ref_s=perf["reference"]["median"], perf_rounds=60))
        st.finish_run(rid)


PROFILE = [[f"aten::op{i:02d}", 1000.0 - 50 * i] for i in range(20)]  # 20 ops: the baseline keeps 12


def test_a_perf_baseline_with_an_infinite_median_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "n.db"
    _perf_db(db, {"tiny/a": _perf(1.5, PROFILE, 11000.0), "tiny/b": _perf(1.2, PROFILE, 11000.0)})
    out = tmp_path / "expected"
    out.mkdir()
    assert cli("baseline", "update", "--db", db, "--out-dir", out).returncode == 0
    (perf_csv,) = out.glob("*.perf.csv")
    good = perf_csv.read_text()
    for bad in ("inf", "1e999", "-inf", "Infinity"):
        perf_csv.write_text(good.replace("tiny/a,ratio,1.5,", f"tiny/a,ratio,{bad},"))
        r = cli("baseline", "check", "--db", db, "--expected-dir", out)
        assert r.returncode == 2 and r.stdout == "", (bad, r.stdout[-2000:])
        line = one_line(r.stderr)
        assert f"{perf_csv}:" in line and f"median {bad!r}" in line and "finite" in line, line


@pytest.mark.long
def test_the_speed_gate_names_only_ops_both_sides_measured(tmp_path: Path) -> None:
    """Tonight's row keeps its whole profile, the baseline its top 12 ops: with identical profiles (the
    total a little higher: noise), op 13 is not "new in this run"; an op that really grew is named."""
    base, same, grew = tmp_path / "base.db", tmp_path / "same.db", tmp_path / "grew.db"
    _perf_db(base, {"tiny/a": _perf(1.0, PROFILE, 10500.0)})
    _perf_db(same, {"tiny/a": _perf(1.5, PROFILE, 10560.0)})
    _perf_db(grew, {"tiny/a": _perf(1.5, [[op, us * (3 if op == "aten::op03" else 1)] for op, us in PROFILE],
                                    10500.0 + 2 * 850.0)})
    out = tmp_path / "expected"
    out.mkdir()
    assert cli("baseline", "update", "--db", base, "--out-dir", out).returncode == 0
    r = cli("baseline", "check", "--db", same, "--expected-dir", out)
    assert r.returncode == 1 and "PERF REGRESSIONS" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    assert "new in this run" not in r.stdout and "aten::op12" not in r.stdout, r.stdout[-3000:]
    r = cli("baseline", "check", "--db", grew, "--expected-dir", out)
    assert r.returncode == 1 and "aten::op03 self time 3.0x" in r.stdout, r.stdout[-3000:]


# cause 8: unreadable allowlist and flaky files --------------------------------------------------------------------


@pytest.mark.long
def test_unreadable_allowlists_name_the_option_the_file_and_why(tmp_path: Path) -> None:
    db = tmp_path / "n.db"
    _perf_db(db, {"tiny/a": _perf(1.0, PROFILE, 10500.0)})
    latin = tmp_path / "noisy.txt"
    latin.write_bytes(b"tiny/a  # caf\xe9 \x82 shared host\n")
    folder = tmp_path / "a-dir"
    folder.mkdir()
    out = tmp_path / "expected"
    out.mkdir()
    assert cli("baseline", "update", "--db", db, "--out-dir", out).returncode == 0
    cases = [(["diff", "--db", db, "--base", "x", "--perf-allowlist"], "--perf-allowlist"),
             (["diff", "--db", db, "--base", "x", "--flaky-allowlist"], "--flaky-allowlist"),
             (["baseline", "check", "--db", db, "--expected-dir", out, "--flaky"], "--flaky"),
             (["baseline", "check", "--db", db, "--expected-dir", out, "--perf-allowlist"], "--perf-allowlist")]
    for argv, option in cases:
        r = cli(*argv, latin)
        line = one_line(r.stderr)
        assert r.returncode == 2 and f"{option} {latin}: not UTF-8 text" in line and "byte 0xe9" in line, line
        r = cli(*argv, folder)
        line = one_line(r.stderr)
        assert r.returncode == 2 and f"{option} {folder}: a directory, not a file" in line, line
        r = cli(*argv, tmp_path / "missing.txt")
        line = one_line(r.stderr)
        assert r.returncode == 2 and f"{option} {tmp_path / 'missing.txt'}: no such file" in line, line


# cause 9: --ray-address at something that answers but is not Ray -------------------------------------------------


@contextmanager
def a_server(handle: Callable[[socket.socket], None]) -> Iterator[int]:
    """A TCP server on 127.0.0.1 that runs `handle` on each connection (in a thread); its port."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            conn.settimeout(5)
            threading.Thread(target=_guarded, args=(handle, conn), daemon=True).start()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        t.join(5)
        srv.close()


def _guarded(handle: Callable[[socket.socket], None], conn: socket.socket) -> None:
    try:
        handle(conn)
    except OSError:
        pass
    finally:
        conn.close()


def http_server(conn: socket.socket) -> None:
    conn.recv(65536)
    conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\nConnection: close\r\n\r\nnot found")


def garbling_proxy(conn: socket.socket) -> None:
    for _ in range(20):  # answers every read with noise, as a proxy to the wrong service might
        if not conn.recv(65536):
            return
        conn.sendall(os.urandom(64))


def black_hole(conn: socket.socket) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # reads everything, answers nothing, until the client gives up
        try:
            if not conn.recv(65536):
                return
        except TimeoutError:
            continue


@pytest.mark.long
def test_a_ray_address_that_answers_but_is_not_ray_is_one_line_in_bounded_time(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    lst = a_list(tmp_path)
    db = a_db(tmp_path, lst)
    before = digest(db)
    for handle in (http_server, garbling_proxy, black_hole):
        with a_server(handle) as port:
            for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
                t0 = time.monotonic()
                r = cli("run", "--list", lst, "--db", db, *EXACT, "--executor", "ray", "--ray-address", address,
                        "--quiet", timeout=90)
                took = time.monotonic() - t0
                line = one_line(r.stderr)
                assert r.returncode == 2 and f"--ray-address {address}: " in line, (handle.__name__, line)
                assert "not a Ray cluster" in line and took < 45, (handle.__name__, address, took, line)
    assert digest(db) == before


# cause 10: argparse's errors are one line ----------------------------------------------------------------------------


def test_usage_errors_are_one_line_and_help_stays_whole() -> None:
    for argv, words in ((["run", "--mode", "nope"], "argument --mode: invalid choice: 'nope'"),
                        (["run", "--jobs", "x"], "argument --jobs: invalid int value: 'x'"),
                        (["check"], "the following arguments are required: model"),
                        (["run", "--ref-cache", "a", "--no-ref-cache"], "not allowed with argument"),
                        (["baseline", "update", "--db", "x", "--out", "a", "--out-dir", "b"], "not allowed with"),
                        (["cache", "prune", "--bogus"], "unrecognized arguments: --bogus"),
                        (["frobnicate"], "invalid choice: 'frobnicate'"),
                        ([], "the following arguments are required: command")):
        r = cli(*argv, timeout=120)
        line = one_line(r.stderr)
        assert r.returncode == 2 and r.stdout == "" and line.startswith("portharness") and words in line, (argv, line)
        assert "usage:" not in line and "--help" in line, line
    r = cli("run", "--help", timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: portharness run") and len(r.stdout.splitlines()) > 50


# the decision: a read-only, pre-filled shared reference cache is read, and nothing is stored in it ----------------


@pytest.mark.long
def test_a_read_only_shared_reference_cache_is_read_without_storing(tmp_path: Path, private_mounts) -> None:
    lst = a_list(tmp_path)
    filled = tmp_path / "filled"
    r = cli("run", "--list", lst, "--db", tmp_path / "fill.db", *EXACT, "--ref-cache", filled, "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    res = private_mounts(f"""
import shutil
ro, filled, lst, db = {str(tmp_path / "ro")!r}, {str(filled)!r}, {str(lst)!r}, {str(tmp_path / "night.db")!r}
tmpfs(ro, "64m")
shutil.copytree(filled, ro + "/cache")
read_only(ro)
before = snapshot(ro)
r = cli("run", "--list", lst, "--db", db, *{EXACT!r}, "--ref-cache", ro + "/cache", "--quiet")
import sqlite3
try:
    with sqlite3.connect(db) as c:
        got = c.execute("SELECT outcome, ref_cache FROM results").fetchall()
except sqlite3.Error:
    got = None
print(json.dumps({{"r": r, "rows": got, "same": snapshot(ro) == before}}))
""")
    assert res["r"]["rc"] == 0, res["r"]["err"][-3000:]
    assert res["rows"] == [["pass", "cached"]] and res["same"], res
    assert "read-only: entries are read, none stored" in res["r"]["err"], res["r"]["err"][-2000:]
