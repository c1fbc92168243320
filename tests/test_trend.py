"""Nightly history: one JSON line per night per configuration, the trend it draws, its chart."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness.analysis.trend import append_history, format_history, read_history, series, summarize_db
from harness.cli import main as cli_main
from harness.report.svg import svg_lines
from harness.results.rows import ResultRow, RunInfo
from harness.results.store import ResultStore

DEFAULT = {"ops": "young", "precision": "default"}
HIGHEST = {"ops": "full", "precision": "highest"}
SORT = "Could not run 'aten::sort' with arguments from the 'sim' backend"


def _night(path: Path, n: int, broken: bool) -> None:
    """One merged night: two configurations, four models; a 'broken' night loses aten::sort on two."""
    with ResultStore(path) as st:
        for settings in (DEFAULT, HIGHEST):
            rid = st.begin_run(RunInfo("smoke", "sim", settings, run_id=f"n{n}-{settings['precision']}",
                                       started_at=f"2026-01-0{n}T02:00:00Z"))
            for i, outcome in enumerate(("pass", "pass", "drift", "load_fail")):
                op = "aten::sort" if broken and i < 2 else ""
                st.record(ResultRow(run_id=rid, model_id=f"tiny/m{i}", target="sim", settings=settings,
                                    outcome="unsupported_op" if op else outcome, unsupported_op=op,
                                    error_message=SORT if op else "", first_drift_module_type="Linear"))
            st.finish_run(rid)


def test_three_nights_append_and_draw(tmp_path: Path) -> None:
    hist = tmp_path / "history.jsonl"
    for n, broken in ((1, False), (2, True), (3, False)):
        db = tmp_path / f"night{n}.db"
        _night(db, n, broken)
        entries = summarize_db(db)
        assert [e["config"] for e in entries] == ["sim ops=young precision=default", "sim ops=full precision=highest"]
        append_history(hist, entries)
    append_history(hist, summarize_db(tmp_path / "night3.db"))  # a re-run job does not count a night twice
    lines = read_history(hist)
    assert len(lines) == 6 and len(hist.read_text().splitlines()) == 6
    first = lines[0]
    assert first["date"] == "2026-01-01" and first["counts"] == {"load_fail": 1, "drift": 1, "pass": 2}
    assert first["pass_pct"] == 50.0 and first["ran_pct"] == 100.0 and first["matched_pct"] == 66.67
    by = series(lines)
    assert list(by) == ["sim ops=full precision=highest", "sim ops=young precision=default"]
    nights = by["sim ops=young precision=default"]
    assert [n.entry["run_id"] for n in nights] == ["n1-default", "n2-default", "n3-default"]
    assert nights[0].appeared == [] and nights[1].appeared[0][1] == 2
    assert nights[1].appeared[0][0].startswith("unsupported_op · aten::sort")
    assert nights[2].disappeared == nights[1].appeared and nights[2].appeared == []
    assert nights[1].entry["ran_pct"] == 33.33 and nights[1].entry["matched_pct"] == 0.0
    text = format_history(lines)
    assert "+ 2 x unsupported_op · aten::sort" in text and "- 2 x unsupported_op · aten::sort" in text


def test_history_errors(tmp_path: Path) -> None:
    assert read_history(tmp_path / "none.jsonl") == []  # the first night
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"run_id": "a", "config": "c", "counts": {}}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON line"):
        read_history(bad)
    bad.write_text('{"x": 1}\n')
    with pytest.raises(ValueError, match="not a portharness history line"):
        read_history(bad)
    with pytest.raises(FileNotFoundError):
        append_history(tmp_path / "no-dir" / "h.jsonl", [])


def test_trend_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hist = tmp_path / "h.jsonl"
    _night(tmp_path / "n.db", 1, False)
    assert cli_main(["trend", "append", "--db", str(tmp_path / "n.db"), "--history", str(hist), "--date", "2026-02-01"]) == 0
    out = capsys.readouterr().out
    assert "2026-02-01 sim ops=young precision=default: ran 100.0%, matched 66.67%" in out and "2 line(s)" in out
    assert cli_main(["trend", "show", "--history", str(hist), "--json"]) == 0
    assert {e["date"] for e in json.loads(capsys.readouterr().out)} == {"2026-02-01"}
    assert cli_main(["trend", "show", "--history", str(tmp_path / "none.jsonl")]) == 2
    assert cli_main(["trend", "append", "--db", str(tmp_path / "none.db"), "--history", str(hist)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_svg_lines_draws_every_point_and_breaks_at_gaps() -> None:
    svg = str(svg_lines(["d1", "d2", "d3"], [("pass %", "pass", [10.0, None, 30.0]), ("ran %", "ran", [50, 60, 70])]))
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    points = root.findall(f"{ns}circle")
    assert sorted(p.get("class") for p in points) == ["point pass"] * 2 + ["point ran"] * 3
    lines = [p for p in root.findall(f"{ns}polyline")]
    assert [p.get("class") for p in lines] == ["line ran"]  # pass % has no two adjacent points
    assert "d2: 60.0%" in svg and "<text" in svg
    one = str(svg_lines(["only"], [("ran %", "ran", [42.0])]))
    assert one.count("<circle") == 1
    assert "no points" in str(svg_lines([], []))
    assert "&lt;b&gt;" in str(svg_lines(["<b>"], [("x", "ran", [1.0])]))  # labels are escaped
