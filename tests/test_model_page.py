"""A model page leads somewhere (issue 37, item 6): the command that reproduces its row, its failure group,
the op's coverage row, what its worker printed, decoded tokens; no empty sections. Hand-made rows, one
small build: a second or two."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.cli.options import check_command
from harness.files import safe_name
from harness.report.build import build_report
from harness.results.rows import ResultRow, RunInfo
from harness.results.store import ResultStore
from harness.run.generate import token_text, tokenizer_for

SETTINGS = {"precision": "default", "ops": "young"}
MISSING = ("Could not run 'aten::sort.stable' with arguments from the 'sim' backend. This could be because the "
           "operator doesn't exist for this backend, or was omitted during the selective/custom build process.")


def _row(model: str, outcome: str, **kw) -> ResultRow:
    return ResultRow(run_id="r1", model_id=model, target="sim", settings=kw.pop("settings", SETTINGS), outcome=outcome,
                     arch=model.split("/")[1], task="causal-lm", modality="text", **kw)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model-page")
    metrics = {"logits": {"ok": False, "ok_declared": True, "rmse_ratio": 5.34, "declared_ratio": 0.457,
                          "cosine": 0.99999, "shape": [2, 16], "dtype": "float32"}}
    with ResultStore(out / "r.db") as st:
        st.begin_run(RunInfo("l", "sim", SETTINGS, run_id="r1", started_at="2026-01-01T00:00:00Z"))
        for m in ("tiny/deepseek_v3/causal-lm", "tiny/mixtral/causal-lm", "tiny/jamba/causal-lm"):
            st.record(_row(m, "unsupported_op", unsupported_op="aten::sort.stable", error_type="NotImplementedError",
                           error_message=MISSING))
        st.record(_row("tiny/bert/masked-lm", "pass_declared", metrics=metrics, rmse_ratio=5.34, declared_ratio=0.457,
                       contract="bf16-matmul", worker_output="UserWarning: something noisy\n"))
        st.record(_row("org/gpt", "drift", error_message="rmse ratio 65.05722897265998, declared ratio 3.0",
                       settings={**SETTINGS, "mode": "generate"}, new_tokens=2, ref_tokens=[[5, 6]],
                       target_tokens=[[5, 7]], first_divergent_step=1, tokens_matched=1,
                       token_text={"5": " hello", "6": " world", "7": "\n"}))
        st.finish_run("r1")
    build_report(out / "r.db", out / "site", command=check_command)
    return out / "site"


def _page(site: Path, model: str) -> str:
    return (site / "models" / f"{safe_name(model)}.html").read_text()


def test_a_failing_page_leads_to_its_command_group_and_op(site: Path) -> None:
    page = _page(site, "tiny/mixtral/causal-lm")
    assert "portharness check tiny/mixtral/causal-lm --target sim --ops young" in page
    href = re.search(r'<a class="group" href="\.\./index\.html#(group-[0-9a-f]+)">3 results: unsupported_op', page)
    assert href and f'id="{href.group(1)}"' in (site / "index.html").read_text()
    cov = re.search(r'<a class="coverage" href="\.\./ops\.html#([^"]+)">2 other models need <code>aten::sort.stable', page)
    assert cov and f'id="{cov.group(1)}"' in (site / "ops.html").read_text()
    assert "Per-output error metrics" not in page  # nothing was compared: no empty section


def test_a_pass_declared_page_judges_its_outputs_and_keeps_what_the_worker_printed(site: Path) -> None:
    page = _page(site, "tiny/bert/masked-lm")
    assert 'data-judgement="within declared"' in page and 'data-judgement="beyond"' not in page
    assert "UserWarning: something noisy" in page and 'class="worker-output"' in page
    assert 'class="group"' not in page  # matched rows belong to no failure group


def test_decoded_tokens_and_rounded_messages(site: Path) -> None:
    page = _page(site, "org/gpt")
    assert "rmse ratio 65.1, declared ratio 3.0" in page and "65.0572" not in page
    assert '<td title="6">·world</td>' in page and '<td title="7" class="diverged">⏎</td>' in page
    assert "model&#39;s tokenizer decodes" in page or "model's tokenizer decodes" in page


def test_a_checkpoints_tokenizer_gives_the_tokens_text(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from harness.models.model_list import ModelEntry

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path)
    local = tokenizer_for(ModelEntry(id=str(tmp_path), source="local", path=str(tmp_path)))
    assert token_text(local, [[1, 2]], [[2, 0]]) == {"0": "[UNK]", "1": "hello", "2": "world"}
    assert tokenizer_for(ModelEntry(id="tiny/gpt2/causal-lm", source="tiny")) is None  # tiny builds have none


def test_a_page_the_speed_gate_flagged_says_so() -> None:
    import pandas as pd

    from harness.analysis.diff import DiffResult
    from harness.analysis.perfgate import PerfChange, PerfGate
    from harness.report.links import row_links

    slow = PerfChange(model_id="tiny/bert/base", config="sim", quantity="ratio", base=1.0, head=1.6, slowdown=1.6,
                      lo=1.5, hi=1.7, detail="1.60x slower [1.50-1.70]; aten::_softmax self time 4.1x")
    res = DiffResult(base_run="night-1", head_run="night-2", perf=PerfGate(regressions=[slow]))
    links = row_links([], pd.DataFrame(), res)
    row = {"model_id": "tiny/bert/base", "config": "sim", "target": "sim", "settings": {}, "outcome": "pass"}
    assert links(row)["perf_flag"] == "perf regression vs night-1: 1.60x slower [1.50-1.70]; aten::_softmax self time 4.1x"
    assert links({**row, "model_id": "tiny/gpt2/causal-lm"})["perf_flag"] == ""
