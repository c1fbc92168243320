"""A row inside one model's run is a `RowDraft`: Measurement's fields only, each checked where it is produced."""

from __future__ import annotations

import pytest

from harness import verdict
from harness.results.draft import RowDraft, RowFieldError
from harness.results.rows import Measurement
from harness.run.attribution import classify_exception
from harness.run.context import Stop


@pytest.mark.parametrize(("name", "value", "error"), [
    ("outcome", "pass", None),
    ("rmse_ratio", 2, None),  # an int is a float's value
    ("rmse_ratio", None, None),  # float | None
    ("first_drift_op_inputs", ["float32[2]"], None),
    ("nonfinite", True, None),
    ("rmse_ratio", "1.5", "takes float, not str"),
    ("ops_checked", 1.5, "takes int, not float"),
    ("metrics", [], "takes dict, not list"),
    ("error_message", None, "takes str, not None"),
    ("graphs", 1, "'graphs' is not a row field"),  # misspelt graph_count
    ("_target_s", 0.1, "'_target_s' is not a row field"),  # bookkeeping is no row field
])
def test_a_field_is_checked_where_it_is_set(name: str, value: object, error: str | None) -> None:
    for how in (lambda d: d.__setitem__(name, value), lambda d: d.update({name: value}),
                lambda d: RowDraft({name: value})):
        draft = RowDraft()
        if error is None:
            how(draft)
        else:
            with pytest.raises(RowFieldError, match=error):
                how(draft)


def test_reads_are_checked_and_typed_and_only_set_fields_are_the_mapping() -> None:
    draft = RowDraft(outcome="drift", rmse_ratio=3.0)
    assert dict(draft) == {"outcome": "drift", "rmse_ratio": 3.0}
    assert draft.row.outcome == "drift" and draft.row.declared_ratio is None  # unset: Measurement's default
    assert draft.get("declared_ratio", "-") == "-" and "declared_ratio" not in draft
    with pytest.raises(RowFieldError, match="'graphs' is not a row field"):
        draft.get("graphs")
    del draft["rmse_ratio"]
    assert draft.row.rmse_ratio is None and dict(draft) == {"outcome": "drift"}
    draft.update(first_drift_op_inputs=["a"])
    draft.clear()
    assert draft.row.first_drift_op_inputs == [] and not draft


def test_a_merge_sets_only_what_the_producer_set() -> None:
    row = RowDraft(loss_kind="model", ref_cache="cached", outcome="")  # the reference side's
    row.update(Stop({"outcome": "crash", "error_type": "RuntimeError"}).fields)  # the target's failure
    assert dict(row) == {"loss_kind": "model", "ref_cache": "cached", "outcome": "crash", "error_type": "RuntimeError"}


def test_the_finished_row_is_a_measurement_and_the_pipeline_fields_are_its_own() -> None:
    m = RowDraft(outcome="pass", rmse_ratio=0.5).measurement(model_id="m", device="sim:0", wall_time_s=1.0)
    assert m == Measurement(model_id="m", outcome="pass", device="sim:0", rmse_ratio=0.5, wall_time_s=1.0)
    with pytest.raises(TypeError, match="multiple values"):  # a producer may not set what the pipeline measures
        RowDraft(outcome="pass", wall_time_s=2.0).measurement(model_id="m", wall_time_s=1.0)
    with pytest.raises(TypeError, match="outcome"):  # no verdict, no row
        RowDraft().measurement(model_id="m")


def test_producers_hand_over_checked_typed_fields() -> None:
    with pytest.raises(RowFieldError, match="'eror_message' is not a row field"):  # at the raise, not at the end
        raise Stop({"outcome": "crash", "eror_message": "x"})
    fields = classify_exception(RuntimeError("boom"))
    assert isinstance(fields, RowDraft) and fields.row.outcome == "crash" and fields.row.error_message == "boom"
    with pytest.raises(RowFieldError, match="'first_drift_ops' is not a row field"):  # merged into the row: checked
        verdict.confirmed(RowDraft(outcome="pass_declared"), {"outcome": "drift", "first_drift_ops": "x"}, "bf16")
