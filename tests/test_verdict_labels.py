"""Every per-output label is judged by the row's contract (issue 37, item 1): `check`'s output lines, the
report's per-output tables and the decoding chart say within fp32 / within declared / beyond from one
function, and never contradict the row's outcome. Pure functions: no model runs here."""

from __future__ import annotations

import torch

from harness.console import verdict_lines
from harness.outcomes import BEYOND, JUDGEMENTS, WITHIN_DECLARED, WITHIN_FP32, outcome_of, output_judgement
from harness.report.decoding import decoding_view
from harness.report.views import row_view
from harness.run.compare import Tolerance, compare_outputs
from harness.verdict import StepEvidence, step


def _outputs() -> tuple[dict, dict, dict, dict]:
    """fp32 reference, fp64 oracle, declared-precision expected reference, and targets at three error levels."""
    g = torch.Generator().manual_seed(0)
    oracle = torch.randn(4000, generator=g, dtype=torch.float64)
    noise = {s: (oracle + s * torch.randn(4000, generator=g, dtype=torch.float64)).float() for s in (1e-3, 1e-2)}
    expected = (oracle + 1e-3 * torch.randn(4000, generator=g, dtype=torch.float64)).float()
    return oracle.float(), oracle, expected, {"exact": oracle.float(), "within": noise[1e-3], "beyond": noise[1e-2]}


def test_row_outcome_and_labels_come_from_the_same_judgement() -> None:
    ref, oracle, expected, targets = _outputs()
    names = {"a": "exact", "b": "within", "c": "beyond"}
    for picked, outcome in ((("a",), "pass"), (("a", "b"), "pass_declared"), (("a", "b", "c"), "drift")):
        v = compare_outputs({k: ref for k in picked}, {k: targets[names[k]] for k in picked},
                            {k: oracle for k in picked}, Tolerance(), {k: expected for k in picked})
        stored = {c.name: c.to_dict() for c in v.checks}
        found = step(StepEvidence(tuple(c.judgement for c in v.checks)))
        assert found.outcome == outcome == outcome_of(output_judgement(m) for m in stored.values())
        assert [output_judgement(stored[k]) for k in picked] == [WITHIN_FP32, WITHIN_DECLARED, BEYOND][: len(picked)]
        assert [c.judgement for c in v.checks] == [output_judgement(m) for m in stored.values()]


def test_older_rows_without_ok_declared_are_judged_by_their_declared_ratio() -> None:
    assert output_judgement({"ok": False, "declared_ratio": 0.4}) == WITHIN_DECLARED
    assert output_judgement({"ok": False, "declared_ratio": 3.0}) == BEYOND
    assert output_judgement({"ok": False}) == BEYOND
    assert output_judgement({"value": 1.0}) == "" and output_judgement(0.5) == ""


def _pass_declared_row(mode: str = "inference") -> dict:
    ref, oracle, expected, targets = _outputs()
    names = [f"logits/step{k}" for k in range(3)] if mode == "generate" else ["last_hidden_state", "pooler_output"]
    v = compare_outputs({n: ref for n in names}, {n: targets["within" if i else "exact"] for i, n in enumerate(names)},
                        {n: oracle for n in names}, Tolerance(), {n: expected for n in names})
    row = {"model_id": "tiny/bert/base", "outcome": step(StepEvidence(tuple(c.judgement for c in v.checks))).outcome,
           "config": "sim", "contract": "bf16-matmul",
           "metrics": {c.name: c.to_dict() for c in v.checks}, **v.summary()}
    if mode == "generate":
        row.update(new_tokens=3, first_drift_step=None, tokens_matched=3, ref_tokens=[[1, 2, 3]], target_tokens=[[1, 2, 3]])
    return row


def test_check_prints_no_failure_on_a_pass_declared_row() -> None:
    row = _pass_declared_row()
    assert row["outcome"] == "pass_declared" and row["rmse_ratio"] > 1
    text = "\n".join(verdict_lines(row))
    assert "FAIL" not in text and BEYOND + " " not in text.split("outputs", 1)[1].split("\n", 1)[1]
    assert "within declared pooler_output" in " ".join(text.split())
    assert "declared ratio" in text and "fp32 ratio" in text  # the declared ratio beside the fp32 one


def test_report_badges_never_contradict_the_row() -> None:
    for mode in ("inference", "generate"):
        row = _pass_declared_row(mode)
        view = row_view(row)
        judged = [o["judgement"] for o in view["outputs"]]
        assert set(judged) <= {WITHIN_FP32, WITHIN_DECLARED} and WITHIN_DECLARED in judged
        assert all(j in JUDGEMENTS for j in judged) and not any(o["beyond"] for o in view["outputs"])
    dec = decoding_view(_pass_declared_row("generate"))
    assert dec is not None and ' bad"' not in str(dec["svg"])  # fp32 ratios above 1 within declared: no red points
