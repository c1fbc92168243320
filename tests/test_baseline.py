"""Expected-outcome baselines: the file, the classification, the CLI's exit codes, and real runs on sim
(a planted regression from an op profile without an op, a fix that must update the file, a model made
flaky by a probabilistic sim fault and labelled by --rerun-flaky)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LIST_HEADER, list_rows

from harness.analysis import baseline as bl
from harness.analysis.baseline import Config, Expected, classify
from harness.cli import main as cli_main
from harness.outcomes import MATCHED, OUTCOMES
from harness.results.rows import ResultRow, RunInfo
from harness.results.store import ResultStore

REPO = Path(__file__).resolve().parents[1]
YOUNG = REPO / "harness" / "sim" / "profiles" / "young.txt"
S = {"ops": "young", "precision": "default"}


# ----------------------------------------------------------------------------------------------
# Names and the file
# ----------------------------------------------------------------------------------------------


def test_file_names_follow_the_convention() -> None:
    assert bl.settings_slug({"precision": "highest", "ops": "full"}) == "ops=full-precision=highest"
    assert Config.of("model_lists/smoke.csv", "sim", {"precision": "default", "ops": "young"}).file_name == (
        "smoke--sim--ops=young-precision=default.csv")
    odd = Config.of("/tmp/x/two.csv", "sim:1", {"fault": "sim:1=nan:1.0;sim:0=error:0.1", "ops": "/a b/p.txt"})
    assert odd.file_name == "two--sim_1--fault=sim_1=nan_1.0_sim_0=error_0.1-ops=a_b_p.txt.csv"
    assert bl.settings_slug({}) == "default"
    assert Config.of("smoke", "sim", {"b": 1, "a": "x"}) == Config.of("smoke.csv", "sim", {"a": "x", "b": 1})


def test_expected_file_round_trip_is_sorted_and_names_its_configuration(tmp_path: Path) -> None:
    cfg = Config.of("smoke", "sim", S)
    rows = [Expected("tiny/z", "drift", "Linear"), Expected("tiny/a,comma", "unsupported_op", "aten::a, aten::b"),
            Expected("tiny/m", "pass")]
    path = bl.write_expected(tmp_path / cfg.file_name, cfg, rows, command="portharness baseline update ...")
    text = path.read_text()
    assert text.splitlines()[1:4] == ["# list: smoke", "# target: sim", '# settings: {"ops":"young","precision":"default"}']
    body = text.split("model,outcome,detail\n", 1)[1].splitlines()
    assert body == ['"tiny/a,comma",unsupported_op,"aten::a, aten::b"', "tiny/m,pass,", "tiny/z,drift,Linear"]
    back = bl.read_expected(path)
    assert back.config == cfg and list(back.rows) == ["tiny/a,comma", "tiny/m", "tiny/z"]
    assert back.rows["tiny/a,comma"] == rows[1]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("model,outcome,detail\na,pass,\n", "header lacks '# list"),
        ("# list: s\n# target: sim\n# settings: [1]\nmodel,outcome,detail\n", "must be a JSON object"),
        ("# list: s\n# target: sim\n# settings: {}\nmodel,result\n", ":4: expected the header row"),
        ("# list: s\n# target: sim\n# settings: {}\nmodel,outcome,detail\na,pass,\na,drift,\n", ":6: model 'a' is listed twice"),
        ("# list: s\n# target: sim\n# settings: {}\nmodel,outcome,detail\na,pass\n", ":5: expected 3 cells"),
    ],
)
def test_a_malformed_expected_file_says_where(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "e.csv").write_text(text)
    with pytest.raises(ValueError, match=message):
        bl.read_expected(tmp_path / "e.csv")


def test_flaky_entries_need_a_reason(tmp_path: Path) -> None:
    f = tmp_path / "flaky.txt"
    f.write_text("# known flaky\ntiny/whisper/*  # nondeterministic feature extractor\n\ntiny/a  # races\n")
    assert bl.read_flaky(f) == {"tiny/whisper/*": "nondeterministic feature extractor", "tiny/a": "races"}
    f.write_text("tiny/b\n")
    with pytest.raises(ValueError, match=r"flaky.txt:1: flaky entry 'tiny/b' has no reason"):
        bl.read_flaky(f)


# ----------------------------------------------------------------------------------------------
# Classification
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expected", "actual", "flaky", "status"),
    [
        ("pass", "pass", None, "pass"),
        ("drift", "drift", None, "expected_failure"),
        ("pass", "drift", None, "new_failure"),
        ("drift", "unsupported_op", None, "new_failure"),  # a worse failure
        ("timeout", "oom", None, "new_failure"),  # a different failure of the same severity
        ("drift", "pass", None, "unexpected_pass"),
        ("pass", "pass_declared", None, "pass"),  # matched either way (same severity): a note, not a failure
        ("pass_declared", "pass", None, "pass"),
        ("drift", "pass_declared", None, "unexpected_pass"),
        ("unsupported_op", "drift", None, "unexpected_pass"),  # improved: the file must say so
        ("pass", "flaky", None, "flaky"),
        ("drift", "flaky", None, "flaky"),
        ("flaky", "flaky", None, "flaky"),
        ("pass", "crash", "known race", "flaky"),
        ("pass", "load_fail", None, "missing"),  # no target verdict tonight
        ("pass", "device_error", None, "missing"),
        ("load_fail", "drift", None, "new_failure"),  # the file said it could not be tested
        ("load_fail", "pass", None, "unexpected_pass"),
        (None, "pass", None, "new_model"),
        ("pass", None, None, "missing"),
    ],
)
def test_classify(expected: str | None, actual: str | None, flaky: str | None, status: str) -> None:
    exp = Expected("m", expected) if expected else None
    assert classify(exp, actual, flaky_reason=flaky)[0] == status


def test_every_outcome_pair_gets_a_status() -> None:
    """Written against outcomes.py's table: a new outcome classifies without touching baseline.py."""
    for e in OUTCOMES:
        for a in OUTCOMES:
            status, _ = classify(Expected("m", e), a)
            assert status in bl.STATUSES
            if a == e:
                assert status in ("pass", "expected_failure", "flaky")
            if e in MATCHED and a not in MATCHED and a != "flaky" and status != "missing":
                assert status == "new_failure", (e, a)


# ----------------------------------------------------------------------------------------------
# The CLI on a hand-made DB
# ----------------------------------------------------------------------------------------------


def _db(path: Path, nights: list[dict[str, tuple]], settings: dict = S, list_name: str = "smoke") -> list[str]:
    """nights: one dict per run, model -> (outcome, op)."""
    ids = []
    with ResultStore(path) as st:
        for n, rows in enumerate(nights):
            rid = st.begin_run(RunInfo(list_name, "sim", settings, run_id=f"{settings.get('precision', 'x')}-{n}",
                                       started_at=f"2026-01-0{n + 1}T00:00:00Z"))
            for model, (outcome, op) in rows.items():
                msg = f"Could not run '{op}' with arguments from the 'sim' backend" if op else ""
                st.record(ResultRow(run_id=rid, model_id=model, target="sim", settings=settings, outcome=outcome,
                                    unsupported_op=op, error_message=msg))
            st.finish_run(rid)
            ids.append(rid)
    return ids


GOOD = {"tiny/a": ("pass", ""), "tiny/b": ("pass", ""), "tiny/c": ("unsupported_op", "aten::sort"),
        "tiny/d": ("drift", "")}


def test_cli_update_then_check_round_trip_and_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "n.db"
    _db(db, [GOOD])
    exp_dir = tmp_path / "expected"
    exp_dir.mkdir()
    assert cli_main(["baseline", "update", "--db", str(db), "--out-dir", str(exp_dir)]) == 0
    (path,) = exp_dir.iterdir()
    assert path.name == "smoke--sim--ops=young-precision=default.csv"
    assert cli_main(["baseline", "check", "--db", str(db), "--expected", str(path)]) == 0
    out = capsys.readouterr().out
    assert "new_failure=0  unexpected_pass=0" in out and "RESULT: OK" in out
    assert cli_main(["baseline", "check", "--db", str(db), "--expected-dir", str(exp_dir), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["checks"][0]["counts"]["pass"] == 2 and data["checks"][0]["counts"]["expected_failure"] == 2

    # Bad input: exit 2 with one line on stderr.
    other = tmp_path / "other.db"
    _db(other, [GOOD], settings={"ops": "full", "precision": "highest"})
    assert cli_main(["baseline", "check", "--db", str(other), "--expected", str(path)]) == 2
    assert "has no run of list smoke, target sim" in capsys.readouterr().err
    assert cli_main(["baseline", "check", "--db", str(other), "--expected", str(path), "--run", "highest-0"]) == 2
    err = capsys.readouterr().err
    assert "but" in err and "use the expected file named smoke--sim--ops=full-precision=highest.csv" in err
    assert cli_main(["baseline", "check", "--db", str(other), "--expected-dir", str(exp_dir)]) == 2
    assert "does not exist; create it with `portharness baseline update`" in capsys.readouterr().err
    assert cli_main(["baseline", "check", "--db", str(tmp_path / "nope.db"), "--expected", str(path)]) == 2
    capsys.readouterr()


def test_cli_check_regression_and_unexpected_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "n.db"
    worse = {**GOOD, "tiny/a": ("unsupported_op", "aten::gelu"), "tiny/b": ("unsupported_op", "aten::gelu")}
    fixed = {**GOOD, "tiny/c": ("pass", ""), "tiny/e": ("pass", "")}
    ids = _db(db, [GOOD, worse, fixed])
    exp = tmp_path / "e.csv"
    assert cli_main(["baseline", "update", "--db", str(db), "--run", ids[0], "--out", str(exp)]) == 0
    assert cli_main(["baseline", "check", "--db", str(db), "--expected", str(exp), "--run", ids[1]]) == 1
    out = capsys.readouterr().out
    assert "NEW FAILURES by group (1):" in out and "2 x unsupported_op · aten::gelu · Could not run <q>" in out
    assert "tiny/a  pass -> unsupported_op" in out and "RESULT: FAIL: 2 new failure(s)" in out
    # latest run: tiny/c fixed -> exit 1 "unexpected pass" until the file is updated; tiny/e is new (not gating)
    assert cli_main(["baseline", "check", "--db", str(db), "--expected", str(exp)]) == 1
    out = capsys.readouterr().out
    assert "UNEXPECTED PASS (1)" in out and "tiny/c  unsupported_op -> pass  [fixed]" in out
    assert "new model (1)" in out
    assert cli_main(["baseline", "update", "--db", str(db), "--out", str(exp)]) == 0
    assert cli_main(["baseline", "check", "--db", str(db), "--expected", str(exp)]) == 0
    # a flaky list with a reason keeps a known-flaky model out of the gate
    flaky = tmp_path / "flaky.txt"
    flaky.write_text("tiny/[ab]  # shares a racy kernel\n")
    assert cli_main(["baseline", "update", "--db", str(db), "--run", ids[0], "--out", str(exp)]) == 0
    capsys.readouterr()
    assert cli_main(["baseline", "check", "--db", str(db), "--expected", str(exp), "--run", ids[1],
                     "--flaky", str(flaky), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["checks"][0]
    assert data["counts"]["flaky"] == 2 and data["models"][0]["note"] == "on the flaky list: shares a racy kernel"


def test_update_refuses_to_guess_between_configurations(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "n.db"
    _db(db, [GOOD])
    with ResultStore(db) as st:  # a second configuration in the same (merged) DB
        rid = st.begin_run(RunInfo("smoke", "sim", {"ops": "full", "precision": "highest"}, run_id="hi"))
        st.record(ResultRow(run_id=rid, model_id="tiny/a", target="sim", settings={"ops": "full", "precision": "highest"},
                            outcome="pass"))
        st.finish_run(rid)
    assert cli_main(["baseline", "update", "--db", str(db), "--out", str(tmp_path / "x.csv")]) == 2
    assert "holds runs of 2 configurations" in capsys.readouterr().err
    named = tmp_path / "smoke--sim--ops=full-precision=highest.csv"
    assert cli_main(["baseline", "update", "--db", str(db), "--out", str(named)]) == 0
    assert list(bl.read_expected(named).rows) == ["tiny/a"]
    assert cli_main(["baseline", "update", "--db", str(db), "--out-dir", str(tmp_path)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert cli_main(["baseline", "check", "--db", str(db), "--expected-dir", str(tmp_path)]) == 0


# ----------------------------------------------------------------------------------------------
# Real runs on sim
# ----------------------------------------------------------------------------------------------


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    full["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True,
                          timeout=600, env=full)


def _profile(path: Path, without: str = "") -> Path:
    """sim's `young` op profile, minus every overload of ``without``."""
    lines = YOUNG.read_text().splitlines()
    path.write_text("\n".join(ln for ln in lines if not (without and ln.startswith(f"{without}."))) + "\n")
    return path


@pytest.fixture(scope="module")
def two_nights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | str]:
    """One DB, two runs of one configuration (the same profile file path): with and without aten::gelu.

    Built once per session even under xdist (workers share the session's temp root), like the browser
    test's report."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    with open(root / "baseline-real.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = root / "baseline-real" / "done.json"
        if not done.exists():
            (root / "baseline-real").mkdir(exist_ok=True)
            done.write_text(json.dumps({k: str(v) for k, v in _two_nights(root / "baseline-real").items()}))
    built = json.loads(done.read_text())
    return {**built, "db": Path(built["db"]), "list": Path(built["list"]), "profile": Path(built["profile"]),
            "dir": Path(built["dir"])}


def _two_nights(tmp: Path) -> dict[str, Path | str]:
    lst = tmp / "pair.csv"
    lst.write_text(LIST_HEADER + list_rows([("bert", "base"), ("gpt2", "base")]))
    prof, db = tmp / "profile.txt", tmp / "nights.db"
    # --no-op-check: the flaky test's NaN faults must reach the outputs (see there); one configuration for all
    common = ["run", "--list", str(lst), "--db", str(db), "--precision", "highest", "--ops", str(prof),
              "--no-op-check", "--jobs", "2", "--quiet", "--no-localize"]
    ids = {}
    for night, without in (("good", ""), ("broken", "aten::gelu")):
        _profile(prof, without)
        proc = cli(*common, "--json")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        ids[night] = json.loads(proc.stdout[proc.stdout.index("{"):])["run_id"]
    _profile(prof)  # restored, for the flaky test
    return {"db": db, "list": lst, "profile": prof, "dir": tmp, **ids}


@pytest.mark.long
def test_real_round_trip_planted_regression_and_fix(two_nights: dict) -> None:
    db, tmp = str(two_nights["db"]), two_nights["dir"]
    exp = tmp / "expected.csv"
    # night 1 -> baseline -> check: 0 changes
    assert cli("baseline", "update", "--db", db, "--run", two_nights["good"], "--out", str(exp)).returncode == 0
    assert exp.read_text().endswith("tiny/bert/base,pass,\ntiny/gpt2/base,pass,\n")
    ok = cli("baseline", "check", "--db", db, "--expected", str(exp), "--run", two_nights["good"])
    assert ok.returncode == 0 and "new_failure=0  unexpected_pass=0  flaky=0  missing=0  new_model=0" in ok.stdout
    # aten::gelu removed from the profile: bert fails, the check names the group, exit 1
    bad = cli("baseline", "check", "--db", db, "--expected", str(exp), "--run", two_nights["broken"])
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "1 x unsupported_op · aten::gelu · Could not run <q> with arguments from the <q> backend" in bad.stdout
    assert "tiny/bert/base  pass -> unsupported_op" in bad.stdout
    # the broken night as baseline, the good night checked: a fixed model is an unexpected pass until updated
    assert cli("baseline", "update", "--db", db, "--run", two_nights["broken"], "--out", str(exp)).returncode == 0
    assert "tiny/bert/base,unsupported_op,aten::gelu" in exp.read_text()
    fixed = cli("baseline", "check", "--db", db, "--expected", str(exp), "--run", two_nights["good"], "--json")
    assert fixed.returncode == 1
    (check,) = json.loads(fixed.stdout)["checks"]
    assert check["counts"]["unexpected_pass"] == 1 and check["models"][0]["model"] == "tiny/bert/base"
    assert check["models"][0]["note"] == "fixed"
    assert cli("baseline", "update", "--db", db, "--run", two_nights["good"], "--out", str(exp)).returncode == 0
    assert cli("baseline", "check", "--db", db, "--expected", str(exp), "--run", two_nights["good"]).returncode == 0


@pytest.mark.long
def test_real_flaky_rerun_with_a_probabilistic_sim_fault(two_nights: dict, tmp_path: Path) -> None:
    """NaN faults with a small per-launch probability on both devices: gpt2's outputs turn non-finite in
    about half its forwards, so its attempts disagree; --rerun-flaky samples it 6 more times and the
    samples really flip, so it is labelled flaky and the baseline check does not gate on it.

    Without the kernel-conformance pass (--no-op-check, also in the baseline's runs): that pass runs the
    model once more and judges a kernel hit by a NaN as drift on its own, with finite outputs, which the
    runner does not retry; here a NaN reaches the outputs as non-finite, which it does."""
    db = tmp_path / "flaky.db"
    shutil.copy(two_nights["db"], db)  # the same configuration (same profile path) as the baseline's runs
    exp = tmp_path / "expected.csv"
    assert cli("baseline", "update", "--db", str(db), "--run", two_nights["good"], "--out", str(exp)).returncode == 0
    run = cli("run", "--list", str(two_nights["list"]), "--db", str(db), "--precision", "highest", "--ops",
              str(two_nights["profile"]), "--no-op-check", "--jobs", "1", "--retries", "3", "--quarantine-after", "100",
              "--rerun-flaky", "6", "--no-localize", "--quiet",
              env={"PORTHARNESS_SIM_FAULTS": "sim:0=nan:0.0075@seed=2;sim:1=nan:0.0075@seed=2"})
    assert run.returncode == 0, run.stdout + run.stderr
    with ResultStore(db, create=False) as st:
        rows = {r["model_id"]: r for r in st.results(st.latest_run()).to_dict("records")}
    flaky = [r for r in rows.values() if r["outcome"] == "flaky"]
    assert flaky, ("no model was labelled flaky: the seeded fault pattern no longer makes gpt2's attempts "
                   f"disagree; try another @seed. Rows: {[(m, r['outcome'], r['attempts']) for m, r in rows.items()]}")
    assert "re-ran" in run.stdout and f"flaky {len(flaky)}" in run.stdout
    for r in flaky:
        reruns = [a for a in r["attempts"] if a.get("rerun")]
        first = [a for a in r["attempts"] if not a.get("rerun")]
        assert len({a["outcome"] for a in first}) > 1  # its attempts disagreed, so it was sampled
        assert len(reruns) >= 6 and {a["outcome"] for a in reruns} & set(MATCHED)  # all attempts kept
        outcomes = {a["outcome"] for a in [first[-1], *reruns]}
        assert outcomes & set(MATCHED) and outcomes - set(MATCHED)  # it really flips
    check = cli("baseline", "check", "--db", str(db), "--expected", str(exp), "--json")
    (res,) = json.loads(check.stdout)["checks"]
    statuses = {v["model"]: v for v in res["models"]}
    for r in flaky:
        assert statuses[r["model_id"]]["status"] == "flaky"
        assert statuses[r["model_id"]]["note"] == "its outcome flipped between attempts"
    assert check.returncode == (1 if res["counts"]["new_failure"] else 0)
