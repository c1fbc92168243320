"""Tests for the compatibility matrix, pass rates, op-coverage ranking and export."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pandas as pd
import pytest

from harness.analysis.matrix import (
    export,
    matrix,
    op_coverage,
    outcome_counts,
    pass_rates,
    settings_label,
    split_ops,
)
from harness.cli import main as cli_main
from harness.results.rows import ResultRow, RunInfo
from harness.results.store import ResultStore

YOUNG = {"precision": "default", "ops": "young"}
MATURE = {"precision": "default", "ops": "mature"}


@pytest.fixture()
def db(tmp_path: Path) -> Path:
    path = tmp_path / "m.db"
    with ResultStore(path) as st:
        r1 = st.begin_run(RunInfo("smoke", "sim", YOUNG, run_id="r1", started_at="2026-01-01T00:00:00Z"))
        rows = [
            ("org/bert", "BertModel", "fill-mask", "text", "pass", ""),
            ("org/gpt2", "GPT2LMHeadModel", "text-generation", "text", "unsupported_op", "aten::_fused_sdp"),
            (
                "org/vit",
                "ViTModel",
                "image-classification",
                "vision",
                "unsupported_op",
                "aten::upsample_bicubic2d",
            ),
            (
                "org/deit",
                "ViTModel",
                "image-classification",
                "vision",
                "unsupported_op",
                "aten::upsample_bicubic2d",
            ),
            (
                "org/clip",
                "CLIPModel",
                "zero-shot",
                "multimodal",
                "unsupported_op",
                "aten::upsample_bicubic2d, aten::erfinv",
            ),
            ("org/t5", "T5Model", "", "text", "drift", ""),
            ("org/bad", "", "", "", "load_fail", ""),
        ]
        for model, arch, task, modality, outcome, op in rows:
            st.record(
                ResultRow(
                    run_id=r1,
                    model_id=model,
                    target="sim",
                    settings=YOUNG,
                    outcome=outcome,
                    arch=arch,
                    task=task,
                    modality=modality,
                    unsupported_op=op,
                )
            )
        st.finish_run(r1)
        r2 = st.begin_run(RunInfo("smoke", "sim", MATURE, run_id="r2", started_at="2026-01-01T01:00:00Z"))
        st.record(ResultRow(run_id=r2, model_id="org/bert", target="sim", settings=MATURE, outcome="pass", arch="BertModel"))
        st.record(ResultRow(run_id=r2, model_id="org/gpt2", target="sim", settings=MATURE, outcome="pass", arch="GPT2LMHeadModel"))
        st.finish_run(r2)
    return path


def _all(db: Path) -> pd.DataFrame:
    with ResultStore(db, create=False) as st:
        return st.results()


def test_settings_label() -> None:
    assert settings_label("sim", YOUNG) == "sim ops=young precision=default"
    assert settings_label("cuda", {}) == "cuda"


def test_matrix_pivot(db: Path) -> None:
    mat = matrix(_all(db))
    assert list(mat.columns) == ["sim ops=mature precision=default", "sim ops=young precision=default"]
    assert mat.loc["org/gpt2", "sim ops=young precision=default"] == "unsupported_op"
    assert mat.loc["org/gpt2", "sim ops=mature precision=default"] == "pass"
    assert mat.loc["org/vit", "sim ops=mature precision=default"] == ""
    assert len(mat) == 7
    assert matrix(_all(db).iloc[0:0]).empty


def test_matrix_latest_run_wins(db: Path) -> None:
    with ResultStore(db) as st:
        r3 = st.begin_run(RunInfo("smoke", "sim", YOUNG, run_id="r3", started_at="2026-01-02T00:00:00Z"))
        st.record(ResultRow(run_id=r3, model_id="org/t5", target="sim", settings=YOUNG, outcome="pass"))
    mat = matrix(_all(db))
    assert mat.loc["org/t5", "sim ops=young precision=default"] == "pass"


def test_pass_rates(db: Path) -> None:
    with ResultStore(db, create=False) as st:
        df = st.results("r1")
    counts = outcome_counts(df)
    assert counts["unsupported_op"] == 4 and counts["pass"] == 1 and sum(counts.values()) == 7
    by_mod = pass_rates(df, "modality").set_index("modality")
    assert by_mod.loc["text", "n"] == 3 and by_mod.loc["text", "pass"] == 1
    assert by_mod.loc["text", "pass_pct"] == pytest.approx(100 / 3, abs=0.1)
    assert by_mod.loc["(unknown)", "load_fail"] == 1
    assert pd.isna(by_mod.loc["(unknown)", "ran_pct"])  # only a load failure: no target verdict
    assert list(by_mod.columns[:4]) == ["n", "ran_pct", "matched_pct", "pass_pct"]  # the headline first
    by_task = pass_rates(df, "task")
    assert "(unknown)" in set(by_task.task)
    with pytest.raises(ValueError, match="by must be"):
        pass_rates(df, "colour")
    both = pass_rates(_all(db), "arch")
    assert "config" in both.columns


def test_pass_rates_headline_an_all_pass_declared_arch_as_fine() -> None:
    """An architecture that is all pass_declared ran and matched everything: 100% / 100%, not a 0% pass rate."""
    df = pd.DataFrame({"model_id": ["a", "b", "c"], "config": "sim", "arch": ["bert", "bert", "gpt2"],
                       "outcome": ["pass_declared", "pass_declared", "unsupported_op"]})
    rates = pass_rates(df, "arch").set_index("arch")
    assert rates.loc["bert", ["ran_pct", "matched_pct", "pass_pct"]].tolist() == [100.0, 100.0, 0.0]
    assert rates.loc["gpt2", "ran_pct"] == 0 and pd.isna(rates.loc["gpt2", "matched_pct"])


def test_op_coverage_ranking(db: Path, tmp_path: Path) -> None:
    with ResultStore(db, create=False) as st:
        df = st.results("r1")
    cov = op_coverage(df)
    top = cov.iloc[0]
    assert top.op == "aten::upsample_bicubic2d"
    assert top.models_unblocked == 2 and top.models_listing == 3
    assert top.suggestion == "implement aten::upsample_bicubic2d -> +2 models"
    erfinv = cov.set_index("op").loc["aten::erfinv"]
    assert erfinv.models_unblocked == 0 and erfinv.models_listing == 1
    csv = tmp_path / "opinfo.csv"
    pd.DataFrame(
        {
            "op": ["upsample_bicubic2d", "erfinv", "add"],
            "passed": [10, 3, 50],
            "skipped": [1, 0, 0],
            "failed": [4, 2, 0],
        }
    ).to_csv(csv, index=False)
    joined = op_coverage(df, str(csv)).set_index("op")
    assert joined.loc["aten::upsample_bicubic2d", "opinfo_failed"] == 4
    assert joined.loc["aten::erfinv", "opinfo_passed"] == 3
    assert pd.isna(joined.loc["aten::_fused_sdp", "opinfo_passed"])
    bad = tmp_path / "bad.csv"
    bad.write_text("name,ok\nadd,1\n")
    with pytest.raises(ValueError, match="lacks column"):
        op_coverage(df, bad)


def test_split_ops() -> None:
    assert split_ops("aten::a, aten::b;aten::a") == ["aten::a", "aten::b"]
    assert split_ops("") == [] and split_ops(None) == [] and split_ops(float("nan")) == []


def test_export(db: Path, tmp_path: Path) -> None:
    df = _all(db)
    mat = matrix(df)
    csv = export(mat, tmp_path / "m.csv")
    back = pd.read_csv(csv, keep_default_na=False)
    assert list(back.columns)[0] == "model_id" and len(back) == 7
    js = export(df, tmp_path / "m.json")
    data = json.loads(js.read_text())
    assert data[0]["settings"] in (YOUNG, MATURE)
    with pytest.raises(ValueError, match="unknown extension"):
        export(mat, tmp_path / "m.xlsx")
    if importlib.util.find_spec("pyarrow") is None:
        with pytest.raises(ValueError, match="pyarrow"):
            export(mat, tmp_path / "m.parquet")
    else:
        assert pd.read_parquet(export(mat, tmp_path / "m.parquet")).shape[0] == 7


def test_main_matrix(db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mat.csv"
    rc = cli_main(["matrix", "--db", str(db), "--run", "r1", "--by", "arch", "--out", str(out), "--ops"])
    text = capsys.readouterr().out
    assert rc == 0 and out.exists()
    assert (
        "run r1" in text and "implement aten::upsample_bicubic2d -> +2 models" in text and "ViTModel" in text
    )
    rc = cli_main(["matrix", "--db", str(db), "--run", "nope"])
    assert rc == 2 and "unknown run id 'nope'" in capsys.readouterr().err
    rc = cli_main(["matrix", "--db", str(tmp_path / "missing.db")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "missing.db").exists()
