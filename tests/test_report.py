"""Tests for the static HTML report: content, HTML-injection safety, file names, speed, CLI errors."""

from __future__ import annotations

import json
import re
import time
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from itertools import pairwise
from pathlib import Path

import pandas as pd
import pytest

from harness.cli import main as cli_main
from harness.files import safe_name
from harness.report.build import build_report
from harness.report.svg import svg_bars, svg_histogram
from harness.results.rows import CollectiveRow, ResultRow, RunInfo
from harness.results.store import ResultStore

S = {"ops": "young"}
EVIL = "<script>alert('pwned')</script><img src=x onerror=alert(2)>"


class _Scan(HTMLParser):
    """Collects script tags (with attributes and text) and every element's tag name."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[dict] = []
        self.tags: list[str] = []
        self._in_script: dict | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.tags.append(tag)
        if tag == "script":
            self._in_script = {"attrs": dict(attrs), "text": ""}
            self.scripts.append(self._in_script)

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = None

    def handle_data(self, data: str) -> None:
        if self._in_script is not None:
            self._in_script["text"] += data


def _scan(path: Path) -> _Scan:
    p = _Scan()
    p.feed(path.read_text(encoding="utf-8"))
    return p


def _evil_db(path: Path) -> None:
    with ResultStore(path) as st:
        r1 = st.begin_run(RunInfo("smoke", "sim", S, run_id="r1", started_at="2026-01-01T00:00:00Z"))
        st.record(ResultRow(run_id=r1, model_id="org/<b>evil</b>", target="sim", settings=S, outcome="pass", rmse_ratio=0.1))
        st.record(ResultRow(run_id=r1, model_id="../../etc/passwd", target="sim", settings=S, outcome="pass"))
        st.finish_run(r1)
        r2 = st.begin_run(RunInfo("smoke", "sim", S, run_id="r2", started_at="2026-01-02T00:00:00Z"))
        st.record(
            ResultRow(
                run_id=r2,
                model_id="org/<b>evil</b>",
                target="sim",
                settings=S,
                outcome="crash",
                arch=EVIL,
                error_type="RuntimeError",
                error_message=EVIL,
                traceback="Traceback:\n" + EVIL,
                unsupported_op=EVIL,
                first_drift_module=EVIL,
                metrics={EVIL: {"rmse_target": 1.0, "shape": [1], "dtype": EVIL, "ok": False}},
                attempts=[{"device": EVIL, "outcome": "crash", "exit_code": -11, "signal": 11}],
            )
        )
        st.record(ResultRow(run_id=r2, model_id="../../etc/passwd", target="sim", settings=S, outcome="unsupported_op", unsupported_op="aten::x"))
        st.finish_run(r2)


def test_no_html_injection(tmp_path: Path) -> None:
    db, out = tmp_path / "e.db", tmp_path / "site"
    _evil_db(db)
    index = build_report(db, out)
    assert index == out / "index.html"
    pages = list(out.glob("*.html")) + list((out / "models").glob("*.html"))
    assert {p.name for p in out.glob("*.html")} == {
        "index.html",
        "matrix.html",
        "ops.html",
        "drift.html",
        "collectives.html",
        "diff.html",
    }
    for page in pages:
        text = page.read_text(encoding="utf-8")
        assert "<script>alert" not in text and "<img src=x" not in text and "<b>evil" not in text, page
        scan = _scan(page)
        assert "img" not in scan.tags and "b" not in scan.tags, page
        for s in scan.scripts:  # only external scripts and inert JSON data: nothing inline executes
            assert "src" in s["attrs"] or s["attrs"].get("type") == "application/json", (page, s)
    model_pages = sorted((out / "models").glob("*.html"))
    assert len(model_pages) == 2
    evil_page = out / "models" / f"{safe_name('org/<b>evil</b>')}.html"
    text = evil_page.read_text(encoding="utf-8")
    assert "&lt;script&gt;alert(&#39;pwned&#39;)&lt;/script&gt;" in text
    assert "org/&lt;b&gt;evil&lt;/b&gt;" in text
    data = json.loads(
        next(s["text"] for s in _scan(out / "matrix.html").scripts if s["attrs"].get("id") == "matrix-data")
    )
    assert {r["model"] for r in data["rows"]} == {"org/<b>evil</b>", "../../etc/passwd"}
    assert all(r["href"].startswith("models/") and ".." not in r["href"] for r in data["rows"])


def test_safe_name() -> None:
    names = {safe_name(m) for m in ("a/b", "a_b", "a b", "A/B")}
    assert len(names) == 4
    for m in ("../../etc/passwd", "org/model", "x" * 500, "...", "con", "名前/モデル"):
        n = safe_name(m)
        assert re.fullmatch(r"[A-Za-z0-9._-]+", n) and not n.startswith(".") and len(n) <= 100
        assert "/" not in n and ".." not in n.split("-")[0][:2]


def test_pages_content(tmp_path: Path, write_synthetic_db) -> None:
    db, out = tmp_path / "s.db", tmp_path / "site"
    write_synthetic_db(db, 60, runs=2, seed=3)
    csv = tmp_path / "opinfo.csv"
    pd.DataFrame(
        {"op": ["erfinv", "_fft_r2c"], "passed": [7, 1], "skipped": [0, 2], "failed": [3, 9]}
    ).to_csv(csv, index=False)
    build_report(db, out, opinfo_csv=csv)
    index = (out / "index.html").read_text()
    assert "night-01" in index and "matched % by arch" in index and "2.13" in index and "0.1.0" in index
    assert "regressions vs night-00" in index
    ops = (out / "ops.html").read_text()
    assert "implement aten::" in ops and "OpInfo passed" in ops
    assert "<svg" in (out / "drift.html").read_text()
    coll = (out / "collectives.html").read_text()
    assert "all_reduce" in coll and "<svg" in coll
    assert "night-00" in (out / "diff.html").read_text()
    with ResultStore(db, create=False) as st:
        some = st.results("night-01").iloc[5]
    page = (out / "models" / f"{safe_name(some.model_id)}.html").read_text()
    assert "night-00" in page and "night-01" in page  # history across runs
    assert "last_hidden_state" in page and "Attempts" in page
    assert (out / "assets" / "matrix.js").is_file() and (out / "assets" / "style.css").is_file()
    for html_file in out.rglob("*.html"):
        text = html_file.read_text()
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text


def test_single_run_no_collectives_no_diff(tmp_path: Path, write_synthetic_db) -> None:
    db, out = tmp_path / "one.db", tmp_path / "site"
    write_synthetic_db(db, 5, runs=1, collectives=False)
    build_report(db, out)
    assert "no collective benchmarks recorded" in (out / "collectives.html").read_text()
    assert not (out / "diff.html").exists()
    assert "diff.html" not in (out / "index.html").read_text()
    # A base from another DB brings the diff page back.
    other = tmp_path / "prev.db"
    write_synthetic_db(other, 5, runs=1, seed=9, collectives=False)
    build_report(db, out, base_db=other)
    assert "prev.db" in (out / "diff.html").read_text()


def test_rebuild_removes_stale_model_pages(tmp_path: Path, write_synthetic_db) -> None:
    db, out = tmp_path / "a.db", tmp_path / "site"
    write_synthetic_db(db, 8, runs=1, collectives=False)
    build_report(db, out)
    stale = out / "models" / "stale-00000000.html"
    stale.write_text("old")
    build_report(db, out)
    assert not stale.exists() and len(list((out / "models").glob("*.html"))) == 8


def test_svg_helpers_edge_cases() -> None:
    assert "no finite" in svg_histogram([])
    assert "<rect" in svg_histogram([1e-9, 1e9, 1.0, 0.5])
    assert "<svg" in svg_histogram([1.0])
    assert "no ratios" in svg_bars([{"label": "x", "value": None}])
    assert "&lt;b&gt;" in svg_bars([{"label": "<b>", "value": 2.0, "lo": 1.5, "hi": 2.5}])


def _tick_labels(svg: str) -> tuple[list[tuple[float, str]], ET.Element]:
    root = ET.fromstring(str(svg))
    texts = root.iter("{http://www.w3.org/2000/svg}text")
    ticks = sorted((float(t.get("x")), t.text) for t in texts if re.fullmatch(r"1e-?\d+", t.text or ""))
    return ticks, root


@pytest.mark.parametrize(
    "lo, hi, bins",
    [(-6, 4, 0.25), (-6, 4, 0.05), (-300, 3, 0.25), (-1, 300, 0.25), (-30, 30, 0.1)],
)
def test_histogram_tick_labels_never_overlap(lo: int, hi: int, bins: float) -> None:
    values = [10.0**lo, 10.0**hi] + [10 ** (lo + (hi - lo) * k / 97) for k in range(98)]
    ticks, root = _tick_labels(svg_histogram(values, bin_width=bins))
    assert 2 <= len(ticks) <= 10, ticks
    assert "1e0" in {t for _, t in ticks}  # the bound always has its label
    for (x1, t1), (x2, t2) in pairwise(ticks):
        # 11px labels: at most ~6.5px a character, so centres this far apart leave a gap between them
        assert x2 - x1 >= 6.5 * (len(t1) + len(t2)) / 2 + 4, (t1, x1, t2, x2)
    width = float(root.get("width"))
    assert all(x + 3.5 * len(t) <= width for x, t in ticks), ticks  # none clipped at the right edge
    bound = next(t for t in root.iter("{http://www.w3.org/2000/svg}text") if t.text == "bound (ratio 1)")
    x = float(bound.get("x"))
    if bound.get("text-anchor") == "end":
        assert x - 7 * len(bound.text) >= 0
    else:
        assert x + 7 * len(bound.text) <= width


def test_histogram_ticks_unchanged_for_narrow_range() -> None:
    """Up to ten decades every one is labelled, as before the stride was introduced."""
    ticks, _ = _tick_labels(svg_histogram([1e-5, 0.3, 2.0, 40.0]))
    assert [t for _, t in ticks] == [f"1e{d}" for d in range(-5, 2)]


def test_build_time_1000_rows(tmp_path: Path, write_synthetic_db) -> None:
    db, out = tmp_path / "big.db", tmp_path / "site"
    write_synthetic_db(db, 1000, runs=2)
    t0 = time.perf_counter()
    build_report(db, out)
    elapsed = time.perf_counter() - t0
    print(f"\nreport build, 1000 models x 2 runs: {elapsed:.2f}s")
    assert len(list((out / "models").glob("*.html"))) == 1000
    assert elapsed < 30


def _report(db: str, out: str, *extra: str) -> int:
    return cli_main(["report", "--db", db, "--out", out, *extra])


def test_main_report_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], write_synthetic_db) -> None:
    db = tmp_path / "a.db"
    write_synthetic_db(db, 4, runs=1, collectives=False)
    out = tmp_path / "site"
    assert _report(str(db), str(out)) == 0
    assert "report written to" in capsys.readouterr().out
    assert _report(str(tmp_path / "missing.db"), str(out)) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "missing.db").exists()
    assert _report(str(db), str(out), "--run", "nope") == 2
    assert "unknown run id 'nope'" in capsys.readouterr().err
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    assert _report(str(db), str(foreign)) == 2
    assert "not a portharness report" in capsys.readouterr().err
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    empty = tmp_path / "empty.db"
    ResultStore(empty).close()
    assert _report(str(empty), str(tmp_path / "s2")) == 2
    assert "no runs" in capsys.readouterr().err
    corrupt = tmp_path / "corrupt.db"
    corrupt.write_bytes(b"\x00garbage" * 100)
    assert _report(str(corrupt), str(tmp_path / "s3")) == 2
    assert corrupt.read_bytes() == b"\x00garbage" * 100


def test_collectives_run_separate_from_model_run(tmp_path: Path, write_synthetic_db) -> None:
    """`portharness collectives --db` records its own run; the report still shows the model run."""
    db, out = tmp_path / "c.db", tmp_path / "site"
    write_synthetic_db(db, 6, runs=1, collectives=False)
    with ResultStore(db) as st:
        bench = st.begin_run(
            RunInfo("collectives", "sim", {"kind": "collective"}, started_at="2030-01-01T00:00:00Z")
        )
        st.record_collective(
            CollectiveRow(
                bench,
                "sim",
                "sim",
                2,
                "all_reduce",
                4096,
                "skinny",
                {},
                "fused",
                1e-3,
                9e-4,
                1.1e-3,
                5,
                1.4,
                1.3,
                1.5,
            )
        )
        assert st.latest_run() == bench and st.latest_run(has_results=True) == "night-00"
    build_report(db, out)
    assert "night-00" in (out / "index.html").read_text()
    coll = (out / "collectives.html").read_text()
    assert "all_reduce" in coll and bench in coll
    assert len(list((out / "models").glob("*.html"))) == 6


# ----------------------------------------------------------------------------------------------
# Nightly: failure groups, the trend page, a night of several configurations
# ----------------------------------------------------------------------------------------------


def three_night_history(db: Path, path: Path) -> Path:
    """A history file with three nights of two configurations from a 3-run synthetic DB: the second
    configuration is the first one shifted (the rendering, not the numbers, is under test)."""
    from harness.analysis.trend import append_history, summarize

    with ResultStore(db, create=False) as st:
        entries = [summarize(run, st.results(run["run_id"])) for run in st.runs().to_dict("records")[::-1]]
    other = [{**e, "config": "sim ops=full precision=highest", "settings": {"ops": "full", "precision": "highest"},
              "ran_pct": min(100.0, e["ran_pct"] + 5), "groups": e["groups"][1:]} for e in entries]
    append_history(path, entries + other)
    return path


def test_trend_page_groups_and_diff_groups(tmp_path: Path, write_synthetic_db) -> None:
    db, out = tmp_path / "n.db", tmp_path / "site"
    write_synthetic_db(db, 60, runs=3, seed=3, collectives=False)
    hist = three_night_history(db, tmp_path / "history.jsonl")
    build_report(db, out, history=hist)
    page = (out / "trend.html").read_text()
    assert _scan(out / "trend.html").tags.count("svg") == 2
    for cls in ("pass", "ran", "matched"):
        assert page.count(f'class="point {cls}"') == 6  # three nights x two configurations
    assert "2026-01-03" in page and "night-02" in page and 'class="appeared"' in page
    assert '<a href="trend.html"' in (out / "index.html").read_text()  # in the nav of every page
    index = (out / "index.html").read_text()
    assert 'id="failure-groups"' in index and "Failure groups" in index
    assert "<script>alert" not in index  # group messages are text
    diff = (out / "diff.html").read_text()
    assert "Regressions by failure group" in diff
    with pytest.raises(FileNotFoundError, match="history file"):
        build_report(db, tmp_path / "s2", history=tmp_path / "none.jsonl")
    assert not (tmp_path / "s2").exists()  # checked before anything is written
    # without a history there is no trend page and no nav entry
    build_report(db, tmp_path / "s3")
    assert not (tmp_path / "s3" / "trend.html").exists() and "trend.html" not in (tmp_path / "s3" / "index.html").read_text()


def test_night_report_shows_every_configuration(tmp_path: Path) -> None:
    db, out = tmp_path / "merged.db", tmp_path / "site"
    high = {"ops": "full", "precision": "highest"}
    with ResultStore(db) as st:
        for n, settings in enumerate((S, high)):
            rid = st.begin_run(RunInfo("smoke", "sim", settings, run_id=f"r{n}", started_at=f"2026-01-01T0{n}:00:00Z"))
            for m in ("tiny/a", "tiny/b"):
                st.record(ResultRow(run_id=rid, model_id=m, target="sim", settings=settings,
                                    outcome="pass" if n else "drift"))
            st.finish_run(rid)
    assert cli_main(["report", "--db", str(db), "--out", str(out), "--night"]) == 0
    data = json.loads(re.search(r'id="matrix-data">(.*?)</script>', (out / "matrix.html").read_text(), re.S).group(1))
    assert data["configs"] == ["sim ops=full precision=highest", "sim ops=young"]
    assert [r["outcomes"] for r in data["rows"]] == [["pass", "drift"], ["pass", "drift"]]
    model = (out / "models" / f"{safe_name('tiny/a')}.html").read_text()
    assert "sim ops=full precision=highest" in model and "sim ops=young" in model
    build_report(db, out)  # without --night: the latest run only, and models/ is rebuilt whole
    data = json.loads(re.search(r'id="matrix-data">(.*?)</script>', (out / "matrix.html").read_text(), re.S).group(1))
    assert data["configs"] == ["sim ops=full precision=highest"]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".models")) == []


def test_model_pages_written_by_forked_workers_match_a_serial_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write_synthetic_db
) -> None:
    import harness.report.build as build

    assert build.page_workers(10) == 1  # a small site: no fork
    db = tmp_path / "p.db"
    write_synthetic_db(db, 30, runs=2, collectives=False)
    monkeypatch.setattr(build, "page_workers", lambda n: 1)
    build_report(db, tmp_path / "serial")
    monkeypatch.setattr(build, "page_workers", lambda n: 3)
    build_report(db, tmp_path / "forked")

    def pages(site: Path) -> dict[str, str]:  # the footer's build time differs, nothing else may
        return {p.name: re.sub(r"generated \S+", "", p.read_text()) for p in (site / "models").glob("*.html")}

    serial, forked = pages(tmp_path / "serial"), pages(tmp_path / "forked")
    assert len(serial) == 30 and serial == forked

    def broken(r):  # a page that cannot be rendered, in whichever process gets it
        raise ValueError(f"cannot render {r['model_id']}")

    monkeypatch.setattr(build, "row_view", broken)
    with pytest.raises((RuntimeError, ValueError)):
        build_report(db, tmp_path / "forked")
