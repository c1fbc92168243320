"""The verdict, decided in one place (issue 46): `harness.verdict`'s rules as tables of plain data, no model
and no process; then, end to end, a worker that dies at full precision keeps the declared run's verdict."""

from __future__ import annotations

import dataclasses
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LIST_HEADER, list_rows

from harness import verdict
from harness.outcomes import BEYOND, OUTCOMES, WITHIN_DECLARED, WITHIN_FP32
from harness.phases import DEVICE_PHASES, PHASES, REFERENCE_PHASES, TABLE
from harness.results.rows import Measurement
from harness.verdict import DeathEvidence, FailureEvidence, StepEvidence

F, D, B = WITHIN_FP32, WITHIN_DECLARED, BEYOND

STEP = [  # (output judgements, a kernel beyond, missing gradients) -> outcome
    ((F, F), False, (), "pass"),
    ((F, D), False, (), "pass_declared"),
    ((D, D), False, (), "pass_declared"),
    ((F, B), False, (), "drift"),
    ((F, F), True, (), "drift"),  # every output inside, a kernel beyond on its own inputs
    ((D,), True, (), "drift"),
    ((F, F), False, ("lm_head.weight",), "missing_grad"),
    ((B,), True, ("w",), "missing_grad"),  # a missing gradient says more than its drift
    ((), False, (), "pass"),
]


@pytest.mark.parametrize("judgements,kernel,missing,outcome", STEP)
def test_one_run_of_the_step(judgements: tuple, kernel: bool, missing: tuple, outcome: str) -> None:
    found = verdict.step(StepEvidence(judgements, kernel, missing))
    assert found.outcome == outcome
    if missing:
        assert found.fields["missing_grads"] == list(missing) and "got no gradient" in found.message


FAILURE = [  # evidence -> outcome, in the order the rule reads it
    (FailureEvidence("target", device_fault=True, out_of_memory=True, missing_op=True), "device_error"),
    (FailureEvidence("load", device_fault=True), "device_error"),  # seeding a device is part of loading
    (FailureEvidence("target", cap_too_small=True, out_of_memory=True), "load_fail"),
    (FailureEvidence("target", out_of_memory=True, missing_op=True), "oom"),
    (FailureEvidence("load", out_of_memory=True), "oom"),
    (FailureEvidence("load", out_of_memory=True, host_inputs=True), "load_fail"),  # an op variation's inputs
    (FailureEvidence("reference", out_of_memory=True, host_inputs=True), "ref_fail"),
    (FailureEvidence("load", missing_op=True), "load_fail"),
    (FailureEvidence("reference", missing_op=True), "ref_fail"),
    (FailureEvidence("target", missing_op=True, compiling=True), "unsupported_op"),  # refused while compiling
    (FailureEvidence("target", compiling=True), "compile_fail"),
    (FailureEvidence("confirm"), "crash"),
    (FailureEvidence("target"), "crash"),
]


@pytest.mark.parametrize("evidence,outcome", FAILURE)
def test_an_exception(evidence: FailureEvidence, outcome: str) -> None:
    assert verdict.failure(evidence) == outcome


DEATH = [  # (phase, killed for, signal) -> outcome
    ("reference", "timeout", signal.SIGKILL, "ref_timeout"),
    ("oracle", "timeout", signal.SIGKILL, "ref_timeout"),
    ("load", "timeout", signal.SIGKILL, "ref_timeout"),
    ("harvest", "timeout", signal.SIGKILL, "ref_timeout"),
    ("target", "timeout", signal.SIGKILL, "timeout"),
    ("confirm", "timeout", signal.SIGKILL, "timeout"),
    ("perf", "timeout", signal.SIGKILL, "timeout"),
    ("", "timeout", signal.SIGKILL, "timeout"),  # no phase heard: not known to be the reference's
    ("target", None, signal.SIGKILL, "oom"),
    ("target", None, signal.SIGSEGV, "crash"),
    ("confirm", None, signal.SIGABRT, "crash"),
    ("reference", None, None, "crash"),
]


@pytest.mark.parametrize("phase,killed_for,sig,outcome", DEATH)
def test_a_workers_death(phase: str, killed_for: str | None, sig: int | None, outcome: str) -> None:
    assert verdict.death(DeathEvidence(phase, killed_for, sig)) == outcome


EARLIER = {"outcome": "pass_declared", "contract": "bf16-matmul", "rmse_ratio": 3.2, "declared_ratio": 0.4,
           "metrics": {"logits": {"ok": False, "ok_declared": True}}, "error_message": "", "phases": {"target": {}}}
AFTER_DEATH = [  # (outcome, phase, earlier) -> (earlier_outcome kept, confirm)
    ("crash", "confirm", EARLIER, "pass_declared", "unconfirmed"),
    ("timeout", "confirm", EARLIER, "pass_declared", "unconfirmed"),
    ("crash", "perf", {**EARLIER, "outcome": "pass"}, "pass", None),
    ("crash", "eager", {**EARLIER, "outcome": "compile_fail"}, "compile_fail", None),
    ("ref_timeout", "oracle", EARLIER, None, None),  # a reference phase: nothing established is the row's
    ("crash", "target", None, None, None),  # nothing established yet
]


@pytest.mark.parametrize("outcome,phase,earlier,kept,confirm", AFTER_DEATH)
def test_a_death_keeps_what_earlier_phases_established(outcome: str, phase: str, earlier: dict | None,
                                                        kept: str | None, confirm: str | None) -> None:
    row = verdict.after_death(outcome, "worker died: SIGSEGV", phase, earlier)
    assert row["outcome"] == outcome  # the death is the row's outcome: device evidence
    assert row.get("earlier_outcome") == kept
    assert row.get("confirm") == confirm
    if kept:
        assert f"before it, the step was {kept}" in row["error_message"] and row["rmse_ratio"] == 3.2


def test_what_a_death_keeps_and_where_a_drift_starts_are_named_by_row_fields() -> None:
    """KEPT and LOCATION are read from the row by name: a name that is no Measurement field is never kept (KEPT
    said "graphs" for graph_count, so a compiled row's graph count was lost to a later death)."""
    names = {f.name for f in dataclasses.fields(Measurement)}
    assert set(verdict.KEPT) - names == set()
    assert set(verdict.LOCATION) - names == set()


def test_phases_are_one_table_and_every_list_of_them_derives_from_it() -> None:
    assert set(PHASES) | {"compile"} == {p.name for p in TABLE}
    assert REFERENCE_PHASES == {"load", "ref_cache", "reference", "oracle", "expected", "ref_store", "harvest"}
    assert {"target", "localize", "confirm", "eager", "recompile", "perf"} == DEVICE_PHASES
    assert not REFERENCE_PHASES & DEVICE_PHASES and "compare" not in DEVICE_PHASES | REFERENCE_PHASES
    from harness.fleet.policy import evidence
    from harness.results.rows import Measurement

    for phase in DEVICE_PHASES:  # a death in any of them is device evidence
        assert evidence(Measurement(model_id="m", outcome="crash"), phase) == "death"
    for phase in REFERENCE_PHASES | {"compare", "compile"}:
        assert evidence(Measurement(model_id="m", outcome="timeout"), phase) == "none"


def test_every_outcome_the_rules_give_is_in_the_vocabulary() -> None:
    given = {verdict.step(StepEvidence(j, k, m)).outcome for j, k, m, _ in STEP}
    given |= {verdict.failure(e) for e, _ in FAILURE} | {verdict.death(DeathEvidence(*d[:3])) for d in DEATH}
    given |= {verdict.reference(applies=False), verdict.reference(deterministic=False), verdict.harvested()}
    assert given <= set(OUTCOMES)


def test_no_module_but_the_verdict_writes_an_outcome_literal() -> None:
    """`"outcome": "drift"`-style assignments live in harness/verdict.py alone (the fleet's retry policy
    labels attempts, `flaky`; the outcome table itself names them)."""
    import re

    root = Path(__file__).resolve().parents[1] / "harness"
    names = "|".join(OUTCOMES)
    pattern = re.compile(r"""(["']outcome["']\s*:\s*|outcome\s*=\s*)["'](""" + names + r""")["']""")
    found = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py")
             if p.name not in ("verdict.py", "outcomes.py", "policy.py")
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found


@pytest.mark.long
@pytest.mark.parametrize("how", ["segv", "hang"])
def test_a_kernel_that_fails_only_at_full_precision_keeps_the_declared_verdict(tmp_path: Path, how: str) -> None:
    """A kernel planted from outside the harness (tests/planted_bugs.py) crashes or hangs only at sim's highest
    precision: the row is the death in phase confirm, on the device, and says the step passed at the declared
    precision before it."""
    lst = tmp_path / "l.csv"
    lst.write_text(LIST_HEADER + list_rows([("bert", "base")]))
    db = tmp_path / "r.db"
    env = {"PYTHONPATH": str(Path(__file__).parent), "PLANTED_BUG": f"at_highest:{how}"}
    import os

    r = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--list", str(lst), "--db", str(db), "--backend",
                        "planted_bugs", "--retries", "0", "--jobs", "1", "--timeout", "15", "--no-ref-cache", "--quiet"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert r.returncode == 0, r.stderr[-3000:]
    with sqlite3.connect(db) as c:
        c.row_factory = sqlite3.Row
        row = dict(c.execute("SELECT * FROM results").fetchone())
    assert row["outcome"] == ("crash" if how == "segv" else "timeout"), row["error_message"]
    assert row["earlier_outcome"] == "pass_declared" and row["confirm"] == "unconfirmed"
    assert "before it, the step was pass_declared under the bf16-matmul contract" in row["error_message"]
    assert '"phase": "confirm"' in row["attempts"] or '"phase":"confirm"' in row["attempts"]
    assert '"confirm"' in row["phases"] and '"target"' in row["phases"] and row["metrics"] not in (None, "", "{}")
