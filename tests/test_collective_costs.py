"""What collective settings cost each sharded model (issue 44): the per-model summary, the night-to-night gate and
the report's views from plain data; end to end, one model's FSDP2 step on sim under fused and skinny."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import LIST_HEADER, list_rows

from harness.analysis.perfgate import format_gate, gate
from harness.parallel.timing import fastest, summary
from harness.report.collectives import model_settings_view


def _timed(fused: list[float], skinny: list[float]) -> dict:
    return {"fused": {"times_s": fused, "messages": 6, "collective_s": [t * 0.3 for t in fused]},
            "skinny": {"times_s": skinny, "messages": 105, "collective_s": [t * 0.6 for t in skinny]}}


def test_a_setting_is_its_ratio_to_the_baseline_round_by_round() -> None:
    fused = [0.100, 0.104, 0.098, 0.101, 0.150, 0.099, 0.102]  # round 5 slowed for both settings alike
    skinny = [0.200, 0.206, 0.197, 0.203, 0.300, 0.199, 0.205]
    s = summary(_timed(fused, skinny), ["fused", "skinny"])
    ratio = s["settings"]["skinny"]["ratio"]
    assert s["baseline"] == "fused" and "ratio" not in s["settings"]["fused"] and s["rounds"] == 7
    assert ratio["median"] == pytest.approx(2.0, rel=0.02) and ratio["lo"] > 1.9 and ratio["hi"] < 2.1
    assert s["settings"]["skinny"]["messages"] == 105 and s["settings"]["skinny"]["share"] == pytest.approx(0.6, rel=0.05)
    assert fastest(s) == ("fused", pytest.approx(1.0))


def _row(model: str, ratio: float, spread: float = 0.03, load: float = 0.5) -> dict:
    return {"model_id": model, "config": "c", "parallel": {"spec": "fsdp:2"},
            "collectives": {"baseline": "fused", "host": {"load_per_core": load}, "rounds": 7, "settings": {
                "fused": {"step": {"median": 0.1, "lo": 0.098, "hi": 0.102}, "messages": 6},
                "skinny": {"step": {"median": 0.1 * ratio, "lo": 0.1 * ratio * (1 - spread), "hi": 0.1 * ratio * (1 + spread)},
                           "ratio": {"median": ratio, "lo": ratio * (1 - spread), "hi": ratio * (1 + spread)},
                           "messages": 105, "share": 0.5}}}}


GATE = [  # (base ratio, head ratio, head spread, host load per core) -> where the change lands
    (1.5, 1.5, 0.03, 0.5, ""),  # the same cost: nothing
    (1.5, 2.4, 0.03, 0.5, "settings"),  # skinny costs 1.6x more than last night, beyond noise: a regression
    (1.5, 2.4, 0.03, 6.0, "settings"),  # even on a busy host (the widened interval still clears 1)
    (1.5, 1.95, 0.20, 6.0, "inconclusive"),  # 1.3x more, rounds spread 20%: the busy host could hide that much
    (1.5, 1.1, 0.03, 0.5, ""),  # cheaper: not gating
]


@pytest.mark.parametrize("base,head,spread,load,where", GATE)
def test_a_setting_that_got_dearer_is_gated_like_a_step(base: float, head: float, spread: float, load: float,
                                                        where: str) -> None:
    res = gate([("m", "c", _row("m", base), _row("m", head, spread, load))])
    got = {"settings": res.settings, "inconclusive": res.inconclusive}
    assert [k for k, v in got.items() if v] == ([where] if where else [])
    if where == "settings":
        assert "COLLECTIVE SETTINGS COSTING MORE" in "\n".join(format_gate(res))
        assert res.settings[0].quantity == "setting:skinny" and "skinny / fused" in res.settings[0].detail


def test_the_report_shows_each_setting_per_model_and_architecture_and_which_is_fastest() -> None:
    df = pd.DataFrame([_row("tiny/llama/causal-lm", 1.8), _row("tiny/llama/base", 2.2), _row("tiny/qwen2/base", 0.9)])
    view = model_settings_view(df, {"tiny/llama/base": "models/x.html"})
    assert len(view["rows"]) == 6 and view["svg"]
    assert {(a["arch"], a["setting"], a["models"]) for a in view["archs"]} == {("llama", "skinny", 2), ("qwen2", "skinny", 1)}
    assert view["fastest"][0]["setting"] == "fused" and view["fastest"][0]["models"] == 2
    assert [w["setting"] for w in view["fastest"]] == ["fused", "skinny"]


@pytest.mark.long
def test_one_models_fsdp2_step_costs_more_skinny_on_sim(tmp_path: Path) -> None:
    lst = tmp_path / "l.csv"
    lst.write_text(LIST_HEADER + list_rows([("llama", "causal-lm")]))
    db = tmp_path / "r.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PORTHARNESS_") or k == "PORTHARNESS_SIM_NAMESPACE"}
    r = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--list", str(lst), "--db", str(db), "--quiet",
                        "--no-ref-cache", "--parallel", "fsdp:2", "--mode", "train", "--precision", "highest", "--ops",
                        "full", "--perf", "--collectives", "fused,skinny:16k"], capture_output=True, text=True,
                       timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    with sqlite3.connect(db) as c:
        outcome, raw = c.execute("SELECT outcome, collectives FROM results").fetchone()
    col = json.loads(raw)
    assert outcome == "pass" and col["baseline"] == "fused" and col["rounds"] >= 5
    skinny = col["settings"]["skinny:16k"]
    assert skinny["messages"] > col["settings"]["fused"]["messages"]  # the setting shaped FSDP2's traffic
    assert skinny["ratio"]["median"] > 1 and 0 < skinny["share"] <= 1
