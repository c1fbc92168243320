"""Failure fingerprints: normalised error lines, group keys, groups in the diff (no processes)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from harness.analysis.diff import diff_runs, format_summary
from harness.analysis.fingerprint import (
    format_groups,
    group_failures,
    group_key,
    group_rows,
    key_id,
    normalise,
)
from harness.cli import main as cli_main
from harness.outcomes import MATCHED, OUTCOMES
from harness.results.rows import ResultRow, RunInfo
from harness.results.store import ResultStore

MISSING = ("Could not run '{op}' with arguments from the 'sim' backend. This could be because the operator "
           "doesn't exist for this backend. '{op}' is not in the sim op profile 'young'.")


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("Could not run 'aten::sort' with arguments from the 'sim' backend", "Could not run <q> with arguments from the <q> backend"),
        ("the operator doesn't exist", "the operator doesn't exist"),  # an apostrophe is not a quote
        ("no result after 300s on sim:0; worker killed", "no result after 300s on sim:<n>; worker killed"),
        ("output 'logits' out of tolerance: rmse ratio 5.28, max abs 0.0031", "output <q> out of tolerance: rmse ratio <n>, max abs <n>"),
        ("mat1 and mat2 shapes cannot be multiplied (16x32 and 64x10)", "mat1 and mat2 shapes cannot be multiplied (<shape> and <shape>)"),
        ("expected torch.Size([1, 8, 32]) got [2, 8]", "expected <shape> got <shape>"),
        ("segfault at 0x7f3a2b00 in /usr/lib/libsim.so.1", "segfault at <addr> in <path>"),
        ("File \"/tmp/pytest-3/x/modeling.py\", line 42", "File <q>, line <n>"),
        ("bad value 1e-05 and -3.5e+10 in conv2d fp16", "bad value <n> and <n> in conv2d fp16"),  # names keep digits
        ("run 20260101T020000Z-ab12cd id deadbeef12", "run 20260101T020000Z-ab12cd id <hex>"),
        ("  spaced   out  ", "spaced out"),
    ],
)
def test_normalise(line: str, expected: str) -> None:
    assert normalise(line) == expected


def _row(model: str, outcome: str, *, op: str = "", module: str = "", msg: str = "", config: str = "c") -> dict:
    return {"model_id": model, "outcome": outcome, "unsupported_op": op, "first_drift_module_type": module,
            "error_message": msg, "error_type": "", "config": config}


def test_157_models_missing_one_op_are_one_group() -> None:
    rows = [_row(f"m{i:03d}", "unsupported_op", op="aten::sort", msg=MISSING.format(op="aten::sort")) for i in range(157)]
    rows += [_row("x", "unsupported_op", op="aten::cumsum", msg=MISSING.format(op="aten::cumsum"))]
    rows += [_row(f"d{i}", "drift", module="Linear", msg=f"output 'logits' out of tolerance: rmse ratio {i}.5, max abs 0.1")
             for i in range(3)]
    rows += [_row(f"p{i}", o) for i, o in enumerate(sorted(MATCHED))]  # matched rows are never grouped
    groups = group_rows(rows)
    assert [(g.outcome, g.what, g.count) for g in groups] == [
        ("unsupported_op", "aten::sort", 157), ("drift", "Linear", 3), ("unsupported_op", "aten::cumsum", 1)]
    assert groups[0].models == sorted(f"m{i:03d}" for i in range(157)) and groups[0].configs == ["c"]
    assert groups[0].label.startswith("unsupported_op · aten::sort · Could not run <q>")
    assert groups[0].id == key_id(groups[0].key) and len(groups[0].id) == 10
    text = format_groups(groups)
    assert "161 failing result(s) in 3 group(s)" in text and "157 x unsupported_op · aten::sort" in text
    assert json.loads(json.dumps([g.to_dict() for g in groups]))[0]["count"] == 157


def test_the_message_splits_groups_and_the_error_type_stands_in_for_no_message() -> None:
    a = group_key(_row("a", "crash", msg="worker process on sim:0 died: SIGSEGV\nmore"))
    b = group_key(_row("b", "crash", msg="worker process on sim:1 died: SIGSEGV"))
    c = group_key(_row("c", "crash", msg="worker process on sim:1 died: SIGABRT"))
    assert a == b != c
    assert group_key({"model_id": "t", "outcome": "timeout", "error_type": "Timeout"}) == ("timeout", "", "Timeout")


def test_reference_side_groups_are_flagged() -> None:
    (g,) = group_rows([_row("a", "load_fail", msg="cannot build")])
    assert g.reference_side and "not the target's" in format_groups([g])


def test_group_failures_on_a_frame_reads_every_outcome_generically() -> None:
    df = pd.DataFrame([_row(f"m-{o}", o, msg="boom") for o in OUTCOMES])
    groups = group_failures(df)
    assert {g.outcome for g in groups} == set(OUTCOMES) - set(MATCHED)
    assert group_failures(df.iloc[0:0]) == []


def test_diff_reports_regressions_by_group(capsys: pytest.CaptureFixture[str]) -> None:
    base = pd.DataFrame([{**_row(f"m{i}", "pass"), "target": "sim", "settings": {}} for i in range(6)])
    head = pd.DataFrame([{**_row(f"m{i}", "unsupported_op", op="aten::sort", msg=MISSING.format(op="aten::sort")),
                          "target": "sim", "settings": {}} for i in range(5)]
                        + [{**_row("m5", "crash", msg="boom"), "target": "sim", "settings": {}}])
    res = diff_runs(base.drop(columns="config"), head.drop(columns="config"))
    groups = res.regression_groups()
    assert [(g.split(" · ")[:2], len(items)) for g, items in groups] == [
        (["unsupported_op", "aten::sort"], 5), (["crash", "boom"], 1)]
    text = format_summary(res)
    assert "REGRESSIONS by group (2):" in text and "5 x unsupported_op · aten::sort" in text
    data = res.to_dict()
    assert data["regression_groups"][0]["count"] == 5 and data["regressions"][0]["group"].startswith("unsupported_op")


def test_groups_command(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "g.db"
    s = {"ops": "young"}
    with ResultStore(db) as st:
        rid = st.begin_run(RunInfo("smoke", "sim", s, run_id="r1", started_at="2026-01-01T00:00:00Z"))
        for i in range(4):
            st.record(ResultRow(run_id=rid, model_id=f"tiny/m{i}", target="sim", settings=s, outcome="unsupported_op",
                                unsupported_op="aten::sort", error_message=MISSING.format(op="aten::sort")))
        st.record(ResultRow(run_id=rid, model_id="tiny/ok", target="sim", settings=s, outcome="pass"))
        st.finish_run(rid)
    assert cli_main(["groups", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "4 failing result(s) in 1 group(s)" in out and "4 x unsupported_op · aten::sort" in out
    assert cli_main(["groups", "--db", str(db), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["run_id"] == "r1" and data["groups"][0]["count"] == 4
    assert cli_main(["groups", "--db", str(tmp_path / "none.db")]) == 2
