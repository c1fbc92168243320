"""A pass within the declared precision is confirmed at the device's highest precision (harness.run.variants):
a bug the declared rounding hid becomes a drift, named from the full-precision run; a clean device stays
``pass_declared`` (confirmed); a device that cannot be confirmed says so.

The bugs are planted from outside the harness (tests/planted_bugs.py, loaded as a backend module in the
workers), never through sim's own switches."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import planted_bugs
import pytest

from harness.models.model_list import find_entry
from harness.run.pipeline import Task, run_one
from harness.verdict import CONFIRMED, HIDDEN, UNCONFIRMED
from harness.verdict import confirmed as confirm_fields
from harness.verdict import located as locate_fields

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


# -- the merge rule, as a table ------------------------------------------------------------------------

FIRST = {"outcome": "pass_declared", "rmse_ratio": 3.7, "declared_ratio": 0.75, "contract": "bf16-matmul",
         "tokens_matched": 8, "error_message": ""}


@pytest.mark.parametrize(("confirm", "outcome", "mark", "now_its"), [
    ({"outcome": "pass", "rmse_ratio": 0.01, "contract": "fp32"}, "pass_declared", CONFIRMED, False),
    ({"outcome": "drift", "rmse_ratio": 2.0, "first_drift_module": "encoder.ln", "contract": "fp32",
      "error_message": "output 'x' out of tolerance"}, "drift", HIDDEN, True),
    ({"outcome": "crash", "error_type": "RuntimeError", "error_message": "boom"}, "pass_declared", UNCONFIRMED, False),
    ({"outcome": "device_error", "device_fault": True, "error_message": "device lost"}, "device_error", "", True),
])
def test_what_a_confirmation_run_makes_of_the_row(confirm: dict, outcome: str, mark: str, now_its: bool) -> None:
    row = dict(FIRST)
    assert confirm_fields(row, confirm, "bf16-matmul") is now_its
    assert row["outcome"] == outcome
    assert row.get("confirm", "") == mark
    if mark == HIDDEN:
        assert row["first_drift_module"] == "encoder.ln" and row["contract"] == "fp32"
        assert row["tokens_matched"] == 8  # what only the first run measured stays
        assert row["error_message"].startswith("the declared bf16-matmul precision hid a drift")
        assert "rmse ratio 3.7, declared ratio 0.75" in row["confirm_note"]


DRIFT = {"outcome": "drift", "rmse_ratio": 40.0, "first_drift_step": 6, "first_drift_op": "aten::bmm",
         "error_message": "step 6 beyond the declared precision"}


@pytest.mark.parametrize(("located", "step", "op", "note"), [
    ({"outcome": "drift", "first_drift_step": 3, "first_drift_op": "aten::index_copy_", "rmse_ratio": 9.0}, 3,
     "aten::index_copy_", "located at the device's highest precision: step 3 (at bf16-matmul: 6); op aten::index_copy_"),
    ({"outcome": "drift", "first_drift_step": 6, "first_drift_op": "aten::bmm"}, 6, "aten::bmm",
     "located at the device's highest precision, where it starts at the same place"),
    ({"outcome": "pass", "first_drift_step": None}, 6, "aten::bmm", "at the device's highest precision the step passes"),
    ({"outcome": "crash", "error_message": "boom"}, 6, "aten::bmm", "at the device's highest precision the step crash"),
])
def test_where_a_drift_at_the_declared_precision_starts(located: dict, step: int, op: str, note: str) -> None:
    """The drift's verdict and measures stay the declared run's; where it starts is the full-precision run's."""
    row = dict(DRIFT)
    locate_fields(row, located, "bf16-matmul")
    assert (row["outcome"], row["rmse_ratio"], row["first_drift_step"], row["first_drift_op"]) == ("drift", 40.0, step, op)
    assert row["confirm_note"].startswith(note) and "confirm" not in row
    assert ("first seen at: step 3" in row["error_message"]) is (step == 3)


# -- one model, in this process (the bugs planted and taken out again) ------------------------------------


def one(model: str, bug: str = "", **settings: object) -> dict:
    """The row of `model` on sim:1 with `bug` planted (tests/planted_bugs.py) while it runs."""
    import harness.sim  # noqa: F401  (the sim device in this process)

    undo = planted_bugs.plant(bug) if bug else None
    try:
        entry = find_entry(model)
        return asdict(run_one(Task(entry=asdict(entry), target="sim:1", settings={"ops": "young", **settings})))
    finally:
        if undo is not None:
            undo()


def test_a_clean_device_is_confirmed_and_confirm_off_skips_it() -> None:
    row = one("tiny/bert/base")
    assert row["outcome"] == "pass_declared" and row["confirm"] == CONFIRMED
    assert "confirm" in row["phases"]
    off = one("tiny/bert/base", confirm="off")
    assert off["outcome"] == "pass_declared" and off["confirm"] == "" and "confirm" not in off["phases"]


@pytest.mark.long
def test_a_kv_cache_bug_is_named_at_the_step_it_starts_at_default_precision_too() -> None:
    bug = "kv_cache:3e-2:3"
    assert one("tiny/gpt2/causal-lm", bug, mode="generate", confirm="off")["outcome"] == "pass_declared"
    highest = one("tiny/gpt2/causal-lm", bug, mode="generate", precision="highest")
    row = one("tiny/gpt2/causal-lm", bug, mode="generate")
    assert highest["first_drift_step"] == row["first_drift_step"] == 3
    assert row["outcome"] == "drift" and row["confirm"] == HIDDEN
    assert row["tokens_matched"] is not None  # free-running decoding judged as before, from the first run


@pytest.mark.long
def test_a_drift_the_declared_precision_shows_late_is_located_at_full_precision() -> None:
    """A bug big enough to drift at default precision too: rounding there hides its first steps, so the row
    names the step the full-precision run finds (the step the bug starts at)."""
    bug = "kv_cache:1e-1:3"
    alone = one("tiny/gpt2/causal-lm", bug, mode="generate", confirm="off")
    row = one("tiny/gpt2/causal-lm", bug, mode="generate")
    assert alone["outcome"] == row["outcome"] == "drift" and alone["first_drift_step"] > 3
    assert row["first_drift_step"] == 3 and row["confirm_note"].startswith("located at the device's highest precision")
    assert row["rmse_ratio"] == alone["rmse_ratio"]  # the verdict's measures are the declared run's


def test_autocast_cannot_be_confirmed_and_says_so() -> None:
    row = one("tiny/bert/base", amp="bf16")
    assert row["outcome"] == "pass_declared" and row["confirm"] == UNCONFIRMED
    assert "autocast" in row["confirm_note"]


# -- through the real CLI: the bug in the workers as a backend module --------------------------------------


@pytest.mark.long
def test_a_normalization_bug_the_declared_precision_hides_is_a_drift_named_at_full_precision(tmp_path: Path) -> None:
    lst = tmp_path / "l.csv"
    lst.write_text("id,source,arch,task,modality\ntiny/bert/base,tiny,bert,base,text\n")
    env = {**{k: v for k, v in os.environ.items() if (not k.startswith("PORTHARNESS_") or k == "PORTHARNESS_SIM_NAMESPACE")},
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)]), "PLANTED_BUG": "layer_norm:2e-4"}
    rows = {}
    for name, extra in (("hidden", ["--confirm", "off"]), ("highest", ["--precision", "highest"]), ("confirmed", [])):
        db = tmp_path / f"{name}.db"
        r = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--list", str(lst), "--target", "sim",
                            "--backend", "planted_bugs", "--db", str(db), "--jobs", "1", "--quiet", *extra],
                           capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        with sqlite3.connect(db) as c:
            c.row_factory = sqlite3.Row
            rows[name] = dict(c.execute("SELECT * FROM results").fetchone())
    assert rows["hidden"]["outcome"] == "pass_declared"  # inside the bf16 envelope: what the confirmation is for
    assert rows["highest"]["outcome"] == rows["confirmed"]["outcome"] == "drift"
    assert rows["confirmed"]["confirm"] == HIDDEN and "hid a drift" in rows["confirmed"]["error_message"]
    assert rows["confirmed"]["first_drift_module"] == rows["highest"]["first_drift_module"] == "embeddings.LayerNorm"
    # visible where a nightly reads it: matrix, the expected file, the report's first screen
    cli = [sys.executable, "-m", "harness.cli"]
    mat = subprocess.run([*cli, "matrix", "--db", str(tmp_path / "confirmed.db")], capture_output=True, text=True,
                         timeout=300, env=env)
    assert "0 pass_declared confirmed, 0 unconfirmed (the declared precision may hide a bug there), 1 drift(s) the " \
           "declared precision hid" in mat.stdout, mat.stdout + mat.stderr
    subprocess.run([*cli, "baseline", "update", "--db", str(tmp_path / "confirmed.db"), "--out", str(tmp_path / "e.csv")],
                   check=True, capture_output=True, timeout=300, env=env)
    assert "tiny/bert/base,drift,LayerNorm (hidden drift)" in (tmp_path / "e.csv").read_text()
    subprocess.run([*cli, "report", "--db", str(tmp_path / "hidden.db"), "--out", str(tmp_path / "site")],
                   check=True, capture_output=True, timeout=300, env=env)
    assert 'id="confirmed"' not in (tmp_path / "site" / "index.html").read_text()  # --confirm off: nothing to say
    subprocess.run([*cli, "report", "--db", str(tmp_path / "confirmed.db"), "--out", str(tmp_path / "site")],
                   check=True, capture_output=True, timeout=300, env=env)
    assert "1 drift(s) the declared precision hid" in (tmp_path / "site" / "index.html").read_text()
