"""Bad input, fourth round (issue 48): one regression test per cause, through the real CLI where the cause is
the CLI's, with nothing already recorded touched. Numbered as the issue numbers its 16 causes."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import LIST_HEADER, list_rows

from harness.results.rows import ResultRow, RunInfo
from harness.results.store import ResultStore

EXACT = ["--precision", "highest", "--ops", "full"]
ESC = "\x1b[31m"
ENV = {k: v for k, v in os.environ.items() if (not k.startswith("PORTHARNESS_") or k == "PORTHARNESS_SIM_NAMESPACE")}


def cli(*args: object, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def refused(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    """`argv` through the CLI's main in this process: exit 2, nothing on stdout, its one line on stderr."""
    from harness.cli import main as cli_main

    capsys.readouterr()
    assert cli_main([str(a) for a in argv]) == 2, argv
    captured = capsys.readouterr()
    assert captured.out == "", argv
    return one_line(captured.err)


def a_list(tmp_path: Path, pairs=(("bert", "base"),), name: str = "l.csv") -> Path:
    lst = tmp_path / name
    lst.write_text(LIST_HEADER + list_rows(list(pairs)))
    return lst


def results(db: Path, where: str = "1") -> list[dict]:
    with sqlite3.connect(db) as c:
        c.row_factory = sqlite3.Row
        return [dict(r) for r in c.execute(f"SELECT r.*, u.list_name, u.finished_at AS run_finished FROM results r "
                                           f"JOIN runs u USING (run_id) WHERE {where} ORDER BY r.model_id")]


@pytest.fixture(name="clean_env")
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in [k for k in os.environ if k.startswith("PORTHARNESS_") and k != "PORTHARNESS_SIM_NAMESPACE"]:
        monkeypatch.delenv(k)


def harvested_db(tmp_path: Path, lst: Path, ops: tuple[str, ...] = ("aten::gelu.default", "aten::mm.default"),
                 name: str = "h.db") -> tuple[Path, dict[str, dict]]:
    """A DB holding a harvest of `lst`'s models (real signatures, recorded as `ops harvest` records them):
    an `ops` run needs no harvest of its own."""
    from harness.models.model_list import load_model_list
    from harness.ops.harvest import Harvest
    from harness.results import variations as rv

    x, w = torch.randn(4, 8), torch.randn(8, 4)
    with torch.no_grad(), Harvest() as h:
        torch.nn.functional.gelu(x) if "aten::gelu.default" in ops else None
        x @ w if "aten::mm.default" in ops else None
    found = h.result()
    db = tmp_path / name
    with ResultStore(db) as st:
        rid = st.begin_run(RunInfo(list_name=rv.harvest_list(str(lst)), target="cpu", settings={}))
        for e in load_model_list(str(lst)):
            st.record(ResultRow(run_id=rid, model_id=e.id, target="cpu", settings={}, outcome="pass"))
            rv.record_harvest(st, rid, e.id, {}, found)
        st.finish_run(rid)
    return db, found["specs"]


# 1: a timeout on the reference side is the reference's outcome ---------------------------------------------


def test_1_a_death_by_timeout_is_the_reference_sides_in_its_phases_and_the_targets_after(tmp_path: Path) -> None:
    """The supervisor's word on a job killed for time, phase by phase (a table): in load, the CPU reference, the
    fp64 oracle, the expected reference or a harvest the target never ran: `ref_timeout`, naming the phase and
    the option to raise; on the device it is the target's `timeout`."""
    from harness.fleet.budgets import Budgets, JobClock
    from harness.fleet.executor import death
    from harness.outcomes import REFERENCE_SIDE, headline

    class Killed:  # what `death` reads of a worker the pool killed for time
        job = type("J", (), {"id": "m"})()
        device = key = "sim:0"
        host = ""
        noun = "worker"
        killed_for = "timeout"
        cause = ""
        found = None

        def __init__(self, phase: str) -> None:
            self.clock = JobClock(phase=phase, started=0.0, phase_started=0.0)

        def death(self) -> tuple[int | None, int]:
            return None, signal.SIGKILL

    table = {"load": ("ref_timeout", "--load-timeout"), "reference": ("ref_timeout", "--timeout"),
             "oracle": ("ref_timeout", "--timeout"), "expected": ("ref_timeout", "--timeout"),
             "harvest": ("ref_timeout", "--timeout"), "target": ("timeout", ""), "confirm": ("timeout", ""),
             "localize": ("timeout", ""), "": ("timeout", "")}
    for phase, (outcome, flag) in table.items():
        m = death(Killed(phase), Budgets(timeout_s=0.001, load_s=5.0))
        assert m.outcome == outcome, (phase, m.outcome)
        if flag:
            assert f"raise {flag}" in m.error_message and "before the target ran" in m.error_message, m.error_message
    assert "ref_timeout" in REFERENCE_SIDE
    assert headline({"ref_timeout": 3, "pass": 1})["ran_pct"] == 100.0  # outside ran %


@pytest.mark.long
def test_1_on_the_rude_backend_too(toy_python: Path, tmp_path: Path) -> None:
    """The rude test backend (a Python package, its device module without __file__, odd error wording): a
    reference that outlasts --timeout is the reference side's there too, and its device is never struck."""
    lst = a_list(tmp_path, (("bert", "base"),))
    db = tmp_path / "r.db"
    r = subprocess.run([str(toy_python), "-m", "harness.cli", "run", "--list", str(lst), "--db", str(db), "--target",
                        "toy", "--timeout", "0.001", "--retries", "0", "--no-ref-cache", "--quiet"],
                       capture_output=True, text=True, timeout=600,
                       env={k: v for k, v in ENV.items() if not k.startswith(("TOY_", "PATHO_"))})
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = results(db)
    assert row["outcome"] == "ref_timeout" and "before the target ran" in row["error_message"], row["error_message"]
    assert "quarantin" not in r.stderr


@pytest.mark.long
def test_1_a_run_whose_reference_outlasts_timeout_blames_no_device(tmp_path: Path) -> None:
    lst = a_list(tmp_path, (("bert", "base"), ("gpt2", "causal-lm")))
    db = tmp_path / "r.db"
    r = cli("run", "--list", lst, "--db", db, "--timeout", "0.001", "--retries", "0", "--no-ref-cache", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = results(db)
    assert [x["outcome"] for x in rows] == ["ref_timeout", "ref_timeout"], [x["error_message"] for x in rows]
    assert all("before the target ran" in x["error_message"] and "raise --timeout" in x["error_message"]
               for x in rows), [x["error_message"] for x in rows]  # in whichever reference phase the clock caught it
    assert "not counted: ref_timeout 2" in r.stdout and "ran - (0/0)" in r.stdout, r.stdout


# 2, 3: generated repro scripts never run data, one file per (id, op) -----------------------------------------

HOSTILE = 'evil"""+__import__(\'os\').system(\'touch pwned\')+"""x'


def _repro(tmp_path: Path, model_id: str, where: str | None = None) -> Path:
    from harness.backends.contracts import contract
    from harness.run.opcheck import OpFailure, repro_preamble, write_repro

    x = torch.randn(2, 8)
    failure = OpFailure(op="aten::gelu", module="act", param="", inputs=["float32[2, 8]"], output="0: float32[2, 8]",
                        ratio=9.0, max_abs=None, note="", args=([x], {}), func=torch.ops.aten.gelu.default)
    return write_repro(failure, contract=contract("fp32"), target="cpu", preamble=repro_preamble(["json"]),
                       model_id=model_id, directory=tmp_path / "repro", where=where)


def test_2_a_repro_made_from_a_hostile_id_runs_the_op_and_nothing_else(tmp_path: Path) -> None:
    for made in (_repro(tmp_path, HOSTILE), _repro(tmp_path, "v", where=f"Op variation {HOSTILE}, run alone")):
        r = subprocess.run([sys.executable, made.name], cwd=made.parent, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "verdict: within the declared precision" in r.stdout, r.stdout  # the op ran, on the CPU, and agreed
        assert not (made.parent / "pwned").exists()
        text = made.read_text()
        assert HOSTILE not in text.split("FOUND = ", 1)[0]  # no id in the docstring or anywhere before the literal
        found = ast.literal_eval(text.split("FOUND = ", 1)[1].split("\n", 1)[0])  # a literal, nothing more
        assert HOSTILE in found["where"] and found["op"] == "aten::gelu"


def test_3_two_ids_that_leave_no_ascii_get_two_repros_and_two_pages() -> None:
    from harness.files import safe_name

    assert safe_name("模型") != safe_name("型号") and safe_name("a/b") != safe_name("a_b")
    assert safe_name("模型--aten::gelu") != safe_name("型号--aten::gelu")


def test_3_repro_files_are_one_per_model(tmp_path: Path) -> None:
    a, b = _repro(tmp_path, "模型"), _repro(tmp_path, "型号")
    assert a != b and a.is_file() and b.is_file()
    assert "模型" in a.read_text() and "型号" in b.read_text()


@pytest.mark.long
def test_2_a_hostile_list_id_through_the_cli_gives_a_repro_that_runs_safely(tmp_path: Path) -> None:
    from harness.models.tiny import build_tiny

    ckpt = tmp_path / "ckpt"
    build_tiny("bert", "base").save_pretrained(ckpt)
    lst = tmp_path / "l.csv"
    rows = [[HOSTILE, "local"], ["模型", "local"], ["型号", "local"]]
    import csv

    with open(lst, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(LIST_HEADER.strip().split(","))
        for mid, source in rows:
            w.writerow([mid, source, "bert", "base", "text", "", "", "", "", "", "", str(ckpt)])
    db = tmp_path / "r.db"
    r = cli("run", "--list", lst, "--db", db, *EXACT, "--numerics-bug", "gelu-mixup", "--no-ref-cache", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    got = {x["model_id"]: x for x in results(db)}
    assert {x["outcome"] for x in got.values()} == {"drift"}
    paths = {m: Path(x["repro_path"]) for m, x in got.items()}
    assert len(set(paths.values())) == 3
    for m, path in paths.items():
        path = path if path.is_absolute() else tmp_path / path
        found = ast.literal_eval(path.read_text().split("FOUND = ", 1)[1].split("\n", 1)[0])
        assert found["where"].startswith(f"Model {m}, module ")  # its own model's repro
        run = subprocess.run([sys.executable, path.name], cwd=path.parent, capture_output=True, text=True, timeout=300,
                             env=ENV)
        assert run.returncode == 0 and "BEYOND the declared precision" in run.stdout, run.stderr[-2000:]
    assert not list(tmp_path.rglob("pwned"))


# 4: a narrower resume is refused; the run closes only when all it planned has its row -------------------------


def _unfinished_run(db: Path, lst: Path, ids: list[str], done: list[str], settings: dict) -> str:
    with ResultStore(db) as st:
        rid = st.begin_run(RunInfo(list_name=str(lst), target="sim", settings=settings))
        st.plan(rid, ids)
        for mid in done:
            st.record(ResultRow(run_id=rid, model_id=mid, target="sim", settings=settings, outcome="pass"))
    return rid


def test_4_a_resume_narrowed_by_limit_or_only_is_refused_before_anything_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture, clean_env: None) -> None:
    pairs = [("bert", "base"), ("gpt2", "causal-lm"), ("llama", "causal-lm"), ("t5", "base")]
    lst = a_list(tmp_path, pairs)
    ids = [f"tiny/{a}/{h}" for a, h in pairs]
    db = tmp_path / "r.db"
    settings = {"ops": "full", "precision": "highest"}
    rid = _unfinished_run(db, lst, ids, ids[:1], settings)
    before = digest(db)
    for narrow in (["--limit", "2"], ["--only", "tiny/bert/base,tiny/gpt2/causal-lm"], ["--only", "llama"]):
        line = refused(capsys, ["run", "--list", lst, "--db", db, *EXACT, "--resume", "--quiet", *narrow])
        assert f"run {rid} has" in line and "unfinished job(s) this selection leaves out" in line, line
        assert digest(db) == before
    from harness.fleet.policy import left_out

    assert left_out(ids, ids[:1], ids[:2]) == set(ids[2:])
    assert left_out([], [], ids[:1]) == set()  # a run from before plans were kept: nothing can be told


def test_4_an_op_resume_narrowed_by_only_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                     clean_env: None) -> None:
    from harness.results import variations as rv

    lst = a_list(tmp_path)
    db, specs = harvested_db(tmp_path, lst)
    settings = rv.op_settings({"ops": "full", "precision": "highest"})
    with ResultStore(db) as st:
        rid = st.begin_run(RunInfo(list_name=rv.ops_list(str(lst)), target="sim", settings=settings))
        st.plan(rid, list(specs))
    before = digest(db)
    line = refused(capsys, ["ops", "--list", lst, "--db", db, *EXACT, "--resume", "--only", "gelu", "--quiet"])
    assert f"run {rid} has 1 unfinished job(s)" in line and "aten::mm.default#" in line, line
    assert digest(db) == before


@pytest.mark.long
def test_4_kill_minus_9_then_a_narrower_resume_loses_nothing(tmp_path: Path) -> None:
    pairs = [("bert", "base"), ("gpt2", "causal-lm"), ("llama", "causal-lm"), ("t5", "base"), ("vit", "base"),
             ("albert", "base")]
    lst = a_list(tmp_path, pairs)
    db = tmp_path / "r.db"
    args = ["run", "--list", lst, "--db", db, *EXACT, "--jobs", "1", "--quiet", "--no-ref-cache"]
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", *map(str, args)], env=ENV, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and (not db.exists() or len(results(db)) < 2):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    done = len(results(db))
    assert 2 <= done < len(pairs)
    r = cli(*args, "--resume", "--limit", "1")
    assert r.returncode == 2 and "leaves out" in one_line(r.stderr), r.stderr[-2000:]
    r = cli(*args, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = results(db)
    assert len(rows) == len(pairs) and len({x["run_id"] for x in rows}) == 1 and rows[0]["run_finished"]


# 5: nothing is written before every input is checked ----------------------------------------------------------


def test_5_ops_refuses_an_only_that_names_no_op_before_harvesting(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                   clean_env: None) -> None:
    lst = a_list(tmp_path)
    fresh = tmp_path / "fresh.db"
    line = refused(capsys, ["ops", "--list", lst, "--db", fresh, "--only", "zz", "--quiet"])
    assert "--only zz: no op of that name in torch" in line, line
    assert not fresh.exists()
    line = refused(capsys, ["ops", "harvest", "--list", lst, "--db", fresh, "--only", "gelu,aten::sort.nope"])
    assert "aten::sort.nope" in line and not fresh.exists()


# 6, 7: the harvest takes the fleet's options; its --json is JSON alone ----------------------------------------


@pytest.mark.long
def test_6_7_ops_harvest_takes_shard_and_limit_and_its_json_is_json(tmp_path: Path) -> None:
    pairs = [("bert", "base"), ("gpt2", "causal-lm"), ("llama", "causal-lm"), ("t5", "base"), ("vit", "base"),
             ("albert", "base")]
    lst = a_list(tmp_path, pairs)
    db = tmp_path / "h.db"
    r = cli("ops", "harvest", "--list", lst, "--db", db, "--shard", "1/3", "--limit", "1", "--json", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)  # stdout is the JSON alone
    assert summary["total"] == 1 and summary["counts"] == {"pass": 1}
    assert [x["model_id"] for x in results(db)] == ["tiny/albert/base"]  # shard 1/3 of the sorted ids, the first
    assert results(db)[0]["list_name"] == f"harvest:{lst}"


# 8: ops says --resume when its DB stops taking rows ----------------------------------------------------------


@pytest.mark.long
def test_8_an_op_run_whose_disk_fills_exits_1_and_says_resume(tmp_path: Path, private_mounts) -> None:
    lst = a_list(tmp_path)
    db, _ = harvested_db(tmp_path, lst)
    full = tmp_path / "full"
    res = private_mounts(f"""
import shutil
full = {str(full)!r}
tmpfs(full, "8m")
shutil.copy({str(db)!r}, full + "/r.db")
args = [sys.executable, "-m", "harness.cli", "ops", "--list", {str(lst)!r}, "--db", full + "/r.db", *{EXACT!r},
        "--jobs", "2", "--retries", "0", "--timeout", "8", "--quarantine-after", "9", "--quiet",
        "--fault", "sim:1=hang:1.0"]
proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
deadline = time.time() + 300
while rows(full + "/r.db") < 2 and time.time() < deadline and proc.poll() is None:  # the harvest's 1, then one op
    time.sleep(0.05)
fill(full)
out, err = proc.communicate(timeout=300)
print(json.dumps({{"rc": proc.returncode, "err": err, "rows": rows(full + "/r.db")}}))
""")
    assert res["rc"] == 1, res["err"][-3000:]
    assert "no space left on the device (ENOSPC)" in res["err"] and "Traceback" not in res["err"], res["err"][-3000:]
    assert "rows finished before it are saved: rerun with --resume" in res["err"]


# 9: a damaged JSON cell names its table, row and column ------------------------------------------------------


def test_9_malformed_json_in_a_db_is_one_line_naming_where(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                          clean_env: None) -> None:
    lst = a_list(tmp_path)
    for i, (table, column, value) in enumerate((("variations", "spec", "[1,2,3]"), ("variations", "spec", "null"),
                                                ("variations", "spec", "{not json"), ("op_uses", "uses", "{not json"),
                                                ("op_uses", "uses", "[1]"))):
        db, _ = harvested_db(tmp_path, lst, name=f"h{i}.db")
        with sqlite3.connect(db) as c:
            c.execute(f"UPDATE {table} SET {column}=?", (value,))
        before = digest(db)
        line = refused(capsys, ["ops", "--list", lst, "--db", db, *EXACT, "--quiet"])
        assert f"table {table}" in line and f"column {column}" in line and "damaged" in line, (value, line)
        assert digest(db) == before
    db, _ = harvested_db(tmp_path, lst, name="r.db")
    with ResultStore(db) as st:
        rid = st.begin_run(RunInfo(list_name=str(lst), target="sim", settings={}))
        st.record(ResultRow(run_id=rid, model_id="tiny/bert/base", target="sim", settings={}, outcome="pass"))
    with sqlite3.connect(db) as c:
        c.execute("UPDATE results SET metrics='{not json' WHERE run_id=?", (rid,))
    line = refused(capsys, ["matrix", "--db", db])
    assert "table results" in line and "tiny/bert/base" in line and "column metrics" in line, line


# 10: what comes from the user or a DB cannot act on the terminal ---------------------------------------------


def test_10_errors_and_tables_show_control_characters_escaped(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                              clean_env: None) -> None:
    lst = a_list(tmp_path)
    for argv in (["run", "--list", tmp_path / f"{ESC}nope.csv", "--db", tmp_path / "x.db"],
                 ["ops", "--list", lst, "--db", tmp_path / "x.db", "--only", f"{ESC}zz"],
                 ["run", "--list", lst, "--db", tmp_path / "x.db", "--numerics-bug", f"{ESC}x"]):
        line = refused(capsys, argv)
        assert "\x1b" not in line and "\\x1b[31m" in line, line
    from harness.cli import main as cli_main

    db = tmp_path / "m.db"
    with ResultStore(db) as st:
        rid = st.begin_run(RunInfo(list_name=str(lst), target="sim", settings={}))
        st.record(ResultRow(run_id=rid, model_id="tiny/bert/base", target="sim", settings={}, outcome="unsupported_op",
                            unsupported_op=f"aten::{ESC}evil"))
    capsys.readouterr()
    assert cli_main(["matrix", "--db", str(db), "--ops"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "aten::\\x1b[31mevil" in out, out[-2000:]


# 11: one spelling per run identity ---------------------------------------------------------------------------


def test_11_settings_that_mean_the_same_make_one_identity(clean_env: None) -> None:
    from harness.cli.options import build_parser
    from harness.cli.runs import _run_config

    def settings(*extra: str) -> dict:
        args = build_parser().parse_args(["run", "--list", "x.csv", "--db", "x.db", *extra])
        return _run_config(args, jobs=1).settings

    assert settings("--numerics-bug", "gelu-mixup,softmax-no-max") == settings("--numerics-bug", "softmax-no-max,gelu-mixup")
    assert settings("--numerics-bug", "gelu-mixup,gelu-mixup") == settings("--numerics-bug", "gelu-mixup")
    assert settings("--fault", "sim:0=nan:1.0") == settings("--fault", "sim:0=nan:1.00")
    assert (settings("--fault", "sim:1=crash:0.5,nan:1;sim:0=hang:.5@seed=3")
            == settings("--fault", "sim:0=hang:0.50@seed=3;sim:1=nan:1.0,crash:0.5"))
    assert settings("--fault", "sim:0=nan:1.0@seed=1") != settings("--fault", "sim:0=nan:1.0")
    assert (settings("--perf", "--slow-ops", "aten::gelu:2,aten::_softmax:3")
            == settings("--perf", "--slow-ops", "aten::_softmax:3.0,aten::gelu:2.00"))


# 12: a model whose harvest failed is harvested again, and the banner names what lacks one ----------------------


def test_12_a_failed_harvest_is_tried_again(tmp_path: Path) -> None:
    from harness.cli.ops import _to_harvest
    from harness.models.model_list import load_model_list

    lst = a_list(tmp_path, (("bert", "base"), ("gpt2", "causal-lm")))
    db, _ = harvested_db(tmp_path, a_list(tmp_path, (("bert", "base"),), name="one.csv"))
    with ResultStore(db) as st:
        rid = st.begin_run(RunInfo(list_name=f"harvest:{lst}", target="cpu", settings={}))
        st.record(ResultRow(run_id=rid, model_id="tiny/gpt2/causal-lm", target="cpu", settings={}, outcome="load_fail"))
        st.finish_run(rid)
        todo = _to_harvest(st, load_model_list(str(lst)), {})
    assert [e.id for e in todo] == ["tiny/gpt2/causal-lm"]


@pytest.mark.long
def test_12_a_checkpoint_fixed_after_its_harvest_failed_gets_its_variations(tmp_path: Path) -> None:
    from harness.models.tiny import build_tiny

    ckpt = tmp_path / "ckpt"
    lst = tmp_path / "l.csv"
    lst.write_text(LIST_HEADER + list_rows([("bert", "base")]) + f"mine,local,bert,base,text,,,,,,,{ckpt}\n")
    db = tmp_path / "r.db"
    args = ["ops", "--list", lst, "--db", db, *EXACT, "--only", "gelu", "--quiet"]
    r = cli(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "of 1 of 2 model(s)" in r.stderr and "1 without a harvest: mine load_fail" in r.stderr, r.stderr[-2000:]
    build_tiny("bert", "base").save_pretrained(ckpt)
    r = cli(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "of 2 of 2 model(s)" in r.stderr and "without a harvest" not in r.stderr, r.stderr[-2000:]


# 13: a clean pass elsewhere after a death is flaky at every precision -----------------------------------------


@pytest.mark.parametrize("clean", ["pass", "pass_declared"])
def test_13_a_death_then_a_clean_match_on_another_device_is_flaky(clean: str) -> None:
    from harness.fleet import policy
    from harness.results.rows import Measurement

    fleet = policy.Fleet(["sim:0", "sim:1"], retries=1)
    job = policy.Job("m")
    first = policy.settle(fleet, job, Measurement(model_id="m", outcome="crash"), "sim:0", 1.0, phase="target")
    assert first.retry
    out = policy.settle(fleet, job, Measurement(model_id="m", outcome=clean), "sim:1", 1.0)
    assert out.outcome == "flaky" and fleet.strikes["sim:0"] == 1 and job.last.outcome == clean


# 14: a harvest is no model run --------------------------------------------------------------------------------


def test_14_matrix_and_report_refuse_a_db_holding_only_a_harvest(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                 clean_env: None) -> None:
    lst = a_list(tmp_path)
    db, _ = harvested_db(tmp_path, lst)
    before = digest(db)
    line = refused(capsys, ["matrix", "--db", db])
    assert "holds only the harvest" in line and "no model results" in line, line
    line = refused(capsys, ["report", "--db", db, "--out", tmp_path / "site"])
    assert "holds only the harvest" in line, line
    with sqlite3.connect(db) as c:
        rid = c.execute("SELECT run_id FROM runs").fetchone()[0]
    line = refused(capsys, ["matrix", "--db", db, "--run", rid])
    assert f"run {rid} is a harvest" in line, line
    assert digest(db) == before and not (tmp_path / "site").exists()


# 15: words that say what happens ------------------------------------------------------------------------------


def test_15_the_banner_says_the_workers_that_run_and_options_by_their_flag(
        tmp_path: Path, capsys: pytest.CaptureFixture, clean_env: None) -> None:
    from harness.cli.runs import _workers
    from harness.fleet.executor import LocalExecutor, RayExecutor
    from harness.fleet.policy import Fleet, workers

    local, ray = LocalExecutor(), RayExecutor()
    fleet = Fleet(["sim:0", "sim:1"])
    assert _workers(local, 100000000, fleet, 2, 100000000, "sim") == (
        "2 worker(s) (--jobs 100000000: no more than the jobs to run)")
    assert _workers(local, 2, fleet, 5, None, "sim") == "2 worker(s)"
    assert _workers(local, 4, fleet, 5, 4, "sim") == (  # sim's devices are exclusive: one worker each
        "2 worker(s) (--jobs 4: no more than 2, one per device: sim's devices take one process each)")
    assert _workers(ray, 100000000, Fleet(["a/sim:0", "a/sim:1"]), 5, 100000000, "sim") == (
        "2 ray actor(s) on 1 node(s) (--jobs 100000000: no more than the devices hold)")
    assert workers(0, 5, 2, 1) == 2 and workers(3, 1, 2, None) == 1 and workers(0, 0, 2, 1) == 1
    line = refused(capsys, ["run", "--list", a_list(tmp_path), "--db", tmp_path / "x.db", "--target", "cpu",
                            "--numerics-bug", "gelu-mixup"])
    assert line.endswith("error: --numerics-bug is not an option of the cpu backend"), line


# 16: a reference-cache entry is served only to the key its index records whole ------------------------------


def test_16_an_entry_whose_index_names_another_version_is_recomputed(tmp_path: Path) -> None:
    from harness.run import refcache
    from harness.run.refkey import key_of

    parts = {"format": 1, "model": {"id": "m"}, "versions": {"torch": torch.__version__, "code": "abc"}}
    key = key_of(parts)
    cache = refcache.RefCache(tmp_path / "rc")
    assert cache.put(key, {"x": torch.ones(2)}, {}, parts) == "stored"
    assert cache.get(key, parts)[0] is not None
    index = cache.path(key) / refcache.INDEX
    body = json.loads(index.read_text())["body"]
    body["components"]["versions"]["torch"] = "1.0.0"
    index.write_text(refcache._index_text(body))  # a consistent index: its own checksum matches
    hit, note = cache.get(key, parts)
    assert hit is None and "another versions" in note and "1.0.0" in note, note
    assert not cache.path(key).exists()  # removed: the next run stores a true one


def test_2_a_report_copies_only_repro_scripts_portharness_wrote(tmp_path: Path) -> None:
    """A DB names any path it likes as a row's repro: a secret beside it must not be published with the site."""
    from harness.report.build import build_report

    secret = tmp_path / "id_rsa.py"
    secret.write_text("PRIVATE KEY\n")
    ours = _repro(tmp_path, "m")
    db = tmp_path / "r.db"
    with ResultStore(db) as st:
        rid = st.begin_run(RunInfo(list_name="l.csv", target="sim", settings={}))
        for mid, path in (("a", secret), ("b", ours)):
            st.record(ResultRow(run_id=rid, model_id=mid, target="sim", settings={}, outcome="drift",
                                repro_path=str(path)))
    build_report(db, tmp_path / "site")
    copied = sorted(p.name for p in (tmp_path / "site" / "repro").iterdir())
    assert copied == sorted([ours.name, ours.with_suffix(".pt").name]), copied
