"""Tests for the night-to-night diff and its CI exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from harness.analysis.diff import diff_runs, format_summary, load_allowlist
from harness.cli import main as cli_main
from harness.results.rows import ResultRow, RunInfo
from harness.results.store import ResultStore

S = {"ops": "young"}


def _frame(rows: list[tuple]) -> pd.DataFrame:
    """rows: (model, outcome[, rmse_ratio])"""
    recs = []
    for r in rows:
        recs.append(
            {
                "model_id": r[0],
                "target": "sim",
                "settings": S,
                "outcome": r[1],
                "rmse_ratio": r[2] if len(r) > 2 else None,
                "error_type": "",
                "error_message": "",
                "unsupported_op": "",
            }
        )
    return pd.DataFrame(recs)


BASE = [
    ("a", "pass", 0.1),
    ("b", "pass"),
    ("c", "crash"),
    ("d", "drift", 2.0),
    ("e", "drift", 2.0),
    ("f", "drift"),
    ("g", "pass"),
    ("h", "ref_fail"),
    ("i", "pass"),
    ("j", "pass"),
    ("k", "timeout"),
    ("gone", "pass"),
    ("p", "pass", 0.01),
]
HEAD = [
    ("a", "pass", 0.1),  # unchanged
    ("b", "crash"),  # new failure
    ("c", "pass"),  # fix
    ("d", "drift", 9.0),  # drift grew 4.5x -> regression
    ("e", "drift", 3.0),  # grew 1.5x -> fine
    ("f", "crash"),  # worse among failures -> regression
    ("g", "load_fail"),  # not a target regression
    ("h", "pass"),  # ref fixed: ref change
    ("i", "flaky"),  # flaky, not counted
    ("j", "timeout"),  # allowlisted below
    ("k", "oom"),  # lateral change
    ("new", "unsupported_op"),
    ("p", "pass", 0.5),  # grew 50x but still passing -> warning only
]


def test_classification() -> None:
    res = diff_runs(_frame(BASE), _frame(HEAD), base_run="r1", head_run="r2", flaky_allowlist=["j*"])
    ids = lambda items: [c.model_id for c in items]  # noqa: E731
    assert ids(res.new_failures) == ["b"]
    assert ids(res.fixes) == ["c"]
    assert ids(res.drift_grew) == ["d"]
    assert ids(res.ref_changes) == ["g", "h"]
    assert ids(res.flaky) == ["i"]
    assert ids(res.allowlisted) == ["j"]
    assert ids(res.added) == ["new"] and ids(res.removed) == ["gone"]
    assert ids(res.drift_warnings) == ["p"]
    changes = {c.model_id: c.direction for c in res.outcome_changes}
    assert changes == {"f": "worse", "k": "same"}
    assert sorted(ids(res.regressions)) == ["b", "d", "f"]
    assert res.unchanged == 2  # a, e
    text = format_summary(res)
    assert "NEW FAILURES (1)" in text and "3 regression(s)" in text and "rmse_ratio 2 -> 9" in text
    data = res.to_dict()
    assert data["n_regressions"] == 3 and json.dumps(data)


def test_drift_factor_and_no_regressions() -> None:
    res = diff_runs(_frame([("e", "drift", 2.0)]), _frame([("e", "drift", 3.0)]), drift_factor=1.2)
    assert [c.model_id for c in res.drift_grew] == ["e"]
    same = diff_runs(_frame(BASE), _frame(BASE))
    assert not same.regressions and same.unchanged == len(BASE)
    with pytest.raises(ValueError):
        diff_runs(_frame(BASE), _frame(BASE), drift_factor=0.5)


def test_allowlist_file(tmp_path: Path) -> None:
    f = tmp_path / "flaky.txt"
    f.write_text("# known flaky\norg/model-a  # nondeterministic sampler\n\norg/whisper-*\n")
    assert load_allowlist(f) == ["org/model-a", "org/whisper-*"]
    with pytest.raises(FileNotFoundError):
        load_allowlist(tmp_path / "nope.txt")


def _db(path: Path, nights: list[list[tuple]]) -> list[str]:
    ids = []
    with ResultStore(path) as st:
        for n, rows in enumerate(nights):
            rid = st.begin_run(
                RunInfo("tiny-zoo", "sim", S, run_id=f"night{n}", started_at=f"2026-01-0{n + 1}T00:00:00Z")
            )
            for r in rows:
                st.record(ResultRow(run_id=rid, model_id=r[0], target="sim", settings=S, outcome=r[1], rmse_ratio=r[2] if len(r) > 2 else None))
            st.finish_run(rid)
            ids.append(rid)
    return ids


def _diff(**kw) -> int:
    """`portharness diff` through the real CLI; keyword names are the option names."""
    argv = ["diff"]
    for k, v in kw.items():
        if v is True:
            argv.append(f"--{k.replace('_', '-')}")
        elif v is not None:
            argv += [f"--{k.replace('_', '-')}", str(v)]
    return cli_main(argv)


def test_main_diff_same_db(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "n.db"
    _db(db, [BASE, HEAD, HEAD])
    # Default: latest two comparable runs (night1 -> night2: identical) -> 0
    assert _diff(db=str(db)) == 0
    assert "base=night1 head=night2" in capsys.readouterr().out
    assert _diff(db=str(db), base="night0", head="night1") == 1
    assert "NEW FAILURES" in capsys.readouterr().out
    assert _diff(db=str(db), base="night0", head="night1", json=True) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["n_regressions"] == 4 and data["base_run"] == "night0"  # j not allowlisted here
    assert _diff(db=str(db), base="nope") == 2
    assert "unknown run id 'nope'" in capsys.readouterr().err


def test_main_diff_two_dbs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prev, cur = tmp_path / "prev.db", tmp_path / "merged.db"
    _db(prev, [BASE])
    _db(cur, [HEAD])
    assert _diff(base_db=str(prev), head_db=str(cur)) == 1
    assert _diff(base_db=str(prev), head_db=str(prev)) == 2  # one run only: nothing to compare
    capsys.readouterr()
    assert _diff(base_db=str(tmp_path / "missing.db"), head_db=str(cur)) == 2
    assert "missing.db does not exist" in capsys.readouterr().err
    assert not (tmp_path / "missing.db").exists()
    single = tmp_path / "single.db"
    _db(single, [BASE])
    assert _diff(db=str(single)) == 2
    assert "no earlier run comparable" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# scripts/nightly_local.sh: the same steps as the nightly workflow, run here
# ----------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "nightly_local.sh"

# Stands in for `portharness run` (which needs models) and delegates every other subcommand to the
# real CLI, so the script's plumbing (shards -> merge -> report -> diff -> exit code) is tested fast.
_FAKE_CLI = """
import sys
args = sys.argv[1:]
if args and args[0] == "run":
    from harness.results.rows import ResultRow, RunInfo
    from harness.results.store import ResultStore
    opt = dict(zip(args[1::2], args[2::2]))
    i, n = (int(x) for x in opt["--shard"].split("/"))
    broken = sys.argv[0].endswith("broken.py")
    with ResultStore(opt["--db"]) as st:
        rid = st.begin_run(RunInfo(opt["--list"], opt["--target"], {"ops": "young"}, shard=opt["--shard"]))
        for m in range(i - 1, 6, n):
            outcome = "crash" if broken and m == 0 else "pass"
            st.record(ResultRow(run_id=rid, model_id=f"tiny/m{m}", target=opt["--target"], settings={"ops": "young"}, outcome=outcome, arch="Bert"))
        st.finish_run(rid)
    sys.exit(1 if sys.argv[0].endswith("dies.py") and i == 2 else 0)  # dies.py: shard 2 fails after its rows
from harness.cli import build_parser  # the real CLI wiring, minus main()'s eager torch import
from harness.results.dbfile import StoreError
ns = build_parser().parse_args(args)
try:
    sys.exit(ns.func(ns))
except (ValueError, FileNotFoundError, StoreError) as e:  # main()'s exit policy: bad input is one line, exit 2
    print(f"portharness {ns.command}: error: {e}", file=sys.stderr)
    sys.exit(2)
"""


def _run_script(
    tmp_path: Path, fake: str, out: Path, shards: int = 2, **env: str
) -> subprocess.CompletedProcess:
    cli = tmp_path / fake
    cli.write_text(_FAKE_CLI)
    full_env = {**os.environ, "OUT": str(out), "PORTHARNESS": f"{sys.executable} {cli}",
                "EXPECTED_DIR": str(tmp_path / "expected"), "HISTORY": str(tmp_path / "history.jsonl"), **env}
    full_env["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    return subprocess.run(
        ["bash", str(SCRIPT), "tiny-zoo", str(shards)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.long
def test_nightly_local_pipeline(tmp_path: Path) -> None:
    night1, night2 = tmp_path / "n1", tmp_path / "n2"
    first = _run_script(tmp_path, "good.py", night1, shards=3, PARALLEL="1", UPDATE_BASELINE="1")
    assert first.returncode == 0, first.stderr
    assert (night1 / "site" / "index.html").is_file() and "diff skipped" in first.stderr
    assert (tmp_path / "expected" / "tiny-zoo--sim--ops=young.csv").is_file() and "RESULT: OK" in first.stdout
    summary = (night1 / "summary.md").read_text()
    assert "| `sim ops=young` | **100.0** | **100.0** |" in summary and "- `tiny-zoo--sim--ops=young.csv`: OK: 0 new failure(s)" in summary
    with ResultStore(night1 / "merged.db", create=False) as st:
        runs = st.runs()
        assert len(runs) == 1 and runs.iloc[0].shard == "1/1"  # three shards became one night
        assert len(st.results()) == 6
    same = _run_script(tmp_path, "good.py", night2, PREV_DB=str(night1 / "merged.db"))  # 2 shards, not 3
    assert same.returncode == 0, same.stdout + same.stderr
    assert "no regressions" in same.stdout and (night2 / "site" / "diff.html").is_file()
    worse = _run_script(tmp_path, "broken.py", tmp_path / "n3", PREV_DB=str(night1 / "merged.db"))
    assert worse.returncode == 1, worse.stdout + worse.stderr
    assert "NEW FAILURES" in worse.stdout and "tiny/m0" in worse.stdout
    assert "RESULT: FAIL: 1 new failure(s)" in (tmp_path / "n3" / "baseline.txt").read_text()
    assert "`: FAIL: 1 new failure(s)" in (tmp_path / "n3" / "summary.md").read_text()
    assert len((tmp_path / "history.jsonl").read_text().splitlines()) == 3  # one line per night
    assert (tmp_path / "n3" / "diff.txt").read_text() == worse.stdout[worse.stdout.index("diff base=") :]
    missing = _run_script(tmp_path, "good.py", tmp_path / "n4", PREV_DB=str(tmp_path / "nope.db"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    died = _run_script(tmp_path, "dies.py", tmp_path / "n6", PARALLEL="1")
    assert died.returncode == 1 and "shard 2 failed (exit 1)" in died.stderr
    assert (tmp_path / "n6" / "site" / "index.html").is_file()  # the night is still merged and reported
    (tmp_path / "empty").mkdir()
    no_file = _run_script(tmp_path, "good.py", tmp_path / "n5", EXPECTED_DIR=str(tmp_path / "empty"))
    assert no_file.returncode == 2 and "create it with `portharness baseline update`" in no_file.stdout
    assert "**Baseline: bad input**" in (tmp_path / "n5" / "summary.md").read_text()


def _three_nights(tmp_path: Path, list_name: str, shards: int, limit: str = "",
                  parallel: bool = True) -> dict[str, subprocess.CompletedProcess]:
    """scripts/nightly_local.sh with the real runner over three simulated nights of two settings on one
    op profile file: night 1 writes the expected files, night 2 runs with aten::gelu removed from the
    profile (a regression), night 3 with it back (fixed). The first setting is timed (--perf, as the nightly
    times one configuration); PERF_REGRESSION=100 keeps the speed gate out of these verdicts (its rules
    are tested on rows built for them, in test_perf.py: no verdict here may hang on a clock)."""
    young = (REPO / "harness" / "sim" / "profiles" / "young.txt").read_text()
    profile = tmp_path / "profile.txt"
    settings = f"--ops {profile} --precision default --perf --perf-budget 0.3\n--ops {profile} --precision highest"
    env = {**os.environ, "JOBS": "1" if parallel else "2", "PARALLEL": "1" if parallel else "0", "HF_HUB_OFFLINE": "1",
           "SETTINGS": settings, "PERF_REGRESSION": "100",
           "EXPECTED_DIR": str(tmp_path / "expected"), "HISTORY": str(tmp_path / "history.jsonl"), "LIMIT": limit}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env.pop("PORTHARNESS", None)
    nights: dict[str, subprocess.CompletedProcess] = {}
    prev = ""
    for n, name in enumerate(("first", "broken", "fixed"), 1):
        lines = young.splitlines()
        if name == "broken":
            lines = [ln for ln in lines if not ln.startswith("aten::gelu.")]
        profile.write_text("\n".join(lines) + "\n")
        night_env = {**env, "OUT": str(tmp_path / f"n{n}"), "NIGHT_DATE": f"2026-01-0{n}", "PREV_DB": prev,
                     "UPDATE_BASELINE": "1" if n == 1 else "0"}
        nights[name] = subprocess.run(["bash", str(SCRIPT), list_name, str(shards)], env=night_env,
                                      capture_output=True, text=True, timeout=1800)
        prev = str(tmp_path / f"n{n}" / "merged.db")
    return nights


def _check_three_nights(tmp_path: Path, nights: dict[str, subprocess.CompletedProcess], n_models: int) -> None:
    first, broken, fixed = nights["first"], nights["broken"], nights["fixed"]
    assert first.returncode == 0, first.stdout + first.stderr
    assert first.stdout.count("RESULT: OK: 0 new failure(s), 0 unexpected pass(es)") == 2  # both settings
    expected = sorted((tmp_path / "expected").glob("smoke--sim--ops=*.csv"))
    outcomes = [p.name for p in expected if not p.name.endswith(".perf.csv")]
    timed = [n for n in outcomes if "precision=default" in n]  # the --perf setting: its speed baseline beside
    assert len(outcomes) == 2 and len(timed) == 1
    assert [p.name for p in expected if p.name.endswith(".perf.csv")] == [timed[0].replace(".csv", ".perf.csv")]
    assert broken.returncode == 1, broken.stdout + broken.stderr
    baseline = (tmp_path / "n2" / "baseline.txt").read_text()
    assert "NEW FAILURES by group (1):" in baseline and "unsupported_op · aten::gelu · Could not run <q>" in baseline
    assert "tiny/audio-spectrogram-transformer/audio-cls" in baseline
    assert "REGRESSIONS by group" in broken.stdout and "aten::gelu" in broken.stdout  # the diff vs night 1
    assert (tmp_path / "n2" / "summary.md").read_text().count("`: FAIL: ") == 2
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert fixed.stdout.count("RESULT: OK") == 2 and "fixes=" in fixed.stdout
    with ResultStore(tmp_path / "n3" / "merged.db", create=False) as st:
        runs = st.runs()
        assert len(runs) == 2 and set(runs.shard) == {"1/1"} and set(runs.n_results) == {n_models}
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert len(history) == 6  # three nights x two settings
    nights_seen = [(e["date"], e["config"][-9:], e["counts"]) for e in history]
    trend = (tmp_path / "n3" / "site" / "trend.html").read_text()
    assert trend.count("<svg class=\"trend\"") == 3  # each setting's outcomes, and the timed one's speed
    for cls, key in (("pass", "pass_pct"), ("ran", "ran_pct"), ("matched", "matched_pct")):
        # A point per night that has a value: matched % has none on a night where nothing ran (both models
        # lost to other causes on a loaded machine), and then the chart must leave that night out.
        valued = sum(e[key] is not None for e in history)
        assert trend.count(f'class="point {cls}"') == valued, nights_seen
        assert valued >= (6 if cls != "matched" else 5), nights_seen  # the broken night's matched % may be empty
    assert trend.count('<div class="speed-trend">') == 1 and trend.count('class="point ratio"') == 3  # the timed one
    assert "speed: " in fixed.stdout and "model(s) compared" in fixed.stdout  # the diff compared the timed models
    assert "2026-01-02" in trend and "aten::gelu" in trend  # the group that appeared, and went away
    matrix = (tmp_path / "n3" / "site" / "matrix.html").read_text()
    assert matrix.count("precision=highest") >= 1 and matrix.count("precision=default") >= 1  # one site, both


@pytest.mark.long
def test_nightly_local_three_nights_real_runner(tmp_path: Path) -> None:
    """The whole night here, with the real runner on the first two smoke models per setting."""
    nights = _three_nights(tmp_path, "smoke", shards=1, limit="2")
    _check_three_nights(tmp_path, nights, n_models=2)


@pytest.mark.slow
def test_nightly_local_three_nights_smoke(tmp_path: Path) -> None:
    """The same three nights on the whole smoke list (60 models per setting, two shards one after another)."""
    nights = _three_nights(tmp_path, "smoke", shards=2, parallel=False)
    _check_three_nights(tmp_path, nights, n_models=60)


@pytest.mark.long
def test_nightly_local_split_like_the_workflow(tmp_path: Path) -> None:
    """The workflow's way: one shard job per (setting, shard) with STEPS=shards into its own directory,
    the DBs gathered in one, then STEPS=night there."""
    gathered = tmp_path / "gathered"
    gathered.mkdir()
    for settings in ("--precision default", "--precision highest --ops full"):
        for i in (1, 2):
            job = tmp_path / f"job-{settings[-4:]}-{i}"
            done = _run_script(tmp_path, "good.py", job, SETTINGS=settings, SHARD_ONLY=str(i), STEPS="shards")
            assert done.returncode == 0, done.stderr
            (db,) = job.glob("shard-*.db")
            assert db.name.startswith("shard---precision_") and db.name.endswith(f"-{i}.db")
            assert not (job / "merged.db").exists()
            db.rename(gathered / db.name)
    assert len(list(gathered.glob("shard-*.db"))) == 4  # unique names per (setting, shard)
    night = _run_script(tmp_path, "good.py", gathered, STEPS="night", UPDATE_BASELINE="1")
    assert night.returncode == 0, night.stdout + night.stderr
    assert (gathered / "site" / "index.html").is_file() and (gathered / "summary.md").is_file()
    bad = _run_script(tmp_path, "good.py", tmp_path / "x", STEPS="nope")
    assert bad.returncode == 2 and "STEPS must be" in bad.stderr
    bad = _run_script(tmp_path, "good.py", tmp_path / "x", SHARD_ONLY="3")
    assert bad.returncode == 2 and "SHARD_ONLY" in bad.stderr
