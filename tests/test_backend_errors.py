"""Message patterns: every standard way a backend reports a missing op or a sick device."""

from __future__ import annotations

import pytest

from harness.backends import adapter_for
from harness.backends.errors import MISSING_OP, MissingOp, is_device_fault_message, parse_missing_op

EXPECTED = {
    "dispatcher": MissingOp("aten::relu"),
    "relayed-dispatcher": MissingOp("aten::histc"),
    "cannot-run": MissingOp("aten::as_strided_"),
    "overrideable": MissingOp("aten::convolution_overrideable"),
    "python-backend": MissingOp("aten::sort"),
    "python-backend-prefix": MissingOp("aten::_fft_r2c"),
    "dtype-only": MissingOp("aten::index_add", "Long"),
    "dtype-not-implemented": MissingOp("aten::baddbmm", "Int"),
    "bare-op-dtype": MissingOp("aten::mul", "Int"),
    "bare-op": MissingOp("aten::add"),
    "not-aten-op": MissingOp("prims::device_put"),
    "flex-attention": MissingOp("flex_attention"),
    "c10d": MissingOp("c10d::reduce_scatter_tensor"),
}


@pytest.mark.parametrize("pattern", MISSING_OP, ids=lambda p: p.name)
def test_every_pattern_parses_its_example(pattern) -> None:
    assert pattern.regex.search(pattern.example), pattern.name
    assert parse_missing_op(pattern.example, "toy", relayed=pattern.relayed) == EXPECTED[pattern.name]


def test_op_names_are_normalised_and_the_dtype_kept() -> None:
    assert parse_missing_op("NotImplementedError: op aten.add.Tensor is not implemented", "toy").op == "aten::add.Tensor"
    assert parse_missing_op("The operator 'aten::_linalg_eigh' is not currently implemented for the MPS device",
                            "mps") == MissingOp("aten::_linalg_eigh")
    assert parse_missing_op('"addmm_impl_cpu_" not implemented for \'Half\'', "toy") == MissingOp("aten::addmm", "Half")


def test_a_dtype_is_kept_when_an_op_name_comes_first() -> None:
    """Issue 32.4: the op the backend names, the dtype its kernel's message names."""
    msg = 'NotImplementedError: aten::histc: "histogram_cpu" not implemented for \'Int\''
    assert parse_missing_op(msg, "toy") == MissingOp("aten::histc", "Int")
    assert parse_missing_op('"histogram_cpu" not implemented for \'Int\'', "toy") == MissingOp("aten::histogram", "Int")
    assert parse_missing_op("aten::histc is not implemented on toy", "toy") == MissingOp("aten::histc")


def test_a_relayed_dispatcher_error_is_the_targets_gap_only_when_the_backend_raised_it() -> None:
    cpu = "Could not run 'aten::histc' with arguments from the 'CPU' backend. This could be because"
    assert parse_missing_op(cpu, "toy") is None
    assert parse_missing_op(cpu, "toy", relayed=True) == MissingOp("aten::histc")
    # the adapter decides from the traceback: raised in the backend's own package, or not
    assert adapter_for("cpu").parse_missing_op(NotImplementedError(cpu.replace("CPU", "CUDA"))) is None


def test_device_faults_are_read_from_the_whole_chain_and_from_connection_errors() -> None:
    a = adapter_for("toy")
    try:
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except OSError as e:
            raise ValueError("tiny/x: could not load (ConnectionRefusedError)") from e
    except ValueError as wrapped:
        assert isinstance(a.blames_device(wrapped, "target"), ConnectionRefusedError)
        # while loading, only the backend's own client counts: a model's download failing is not the device's
        assert a.blames_device(wrapped, "load") is None
    lost = RuntimeError("wrapper")
    lost.__context__ = RuntimeError("toy device lost: the device stopped responding")
    assert a.blames_device(lost, "load") is lost.__context__
    assert a.blames_device(TimeoutError("timed out"), "target") is not None
    assert a.blames_device(KeyError("x"), "target") is None


def test_the_table_and_the_expectations_agree() -> None:
    assert {p.name for p in MISSING_OP} == set(EXPECTED)


def test_a_gap_of_another_backend_is_not_the_targets() -> None:
    cpu = "Could not run 'aten::foo' with arguments from the 'CPU' backend. This could be because the operator"
    assert parse_missing_op(cpu, "toy") is None
    assert parse_missing_op(cpu, "cpu") == MissingOp("aten::foo")
    autograd = "Could not run 'aten::bar.out' with arguments from the 'AutogradPrivateUse1' backend"
    assert parse_missing_op(autograd, "privateuse1") == MissingOp("aten::bar.out")
    assert parse_missing_op("Could not run 'aten::x' with arguments from the 'SparseCUDA' backend", "cuda").op == "aten::x"


def test_unknown_messages_stay_unknown() -> None:
    for msg in ("shape mismatch: [2, 3] vs [3, 2]", "index 7 is out of bounds for dimension 0 with size 4",
                "expected scalar type Float but found Half", ""):
        assert parse_missing_op(msg, "toy") is None


def test_the_adapter_parses_only_exceptions_that_can_mean_a_gap() -> None:
    a = adapter_for("toy")
    msg = "Could not run 'aten::relu' with arguments from the 'toy' backend."
    assert a.parse_missing_op(NotImplementedError(msg)) == MissingOp("aten::relu")
    assert a.parse_missing_op(KeyError(msg)) is None


@pytest.mark.parametrize(
    "msg",
    ["toy device lost", "RuntimeError: device is lost (driver reset)", "CUDA error: an illegal memory access was encountered",
     "NCCL error in: ProcessGroupNCCL.cpp:1, unhandled system error", "NRT error: execution failed",
     "the device server gone away", "uncorrectable ECC error encountered"],
)
def test_device_fault_messages(msg: str) -> None:
    assert is_device_fault_message(msg)
    assert adapter_for("toy").is_device_fault(RuntimeError(msg))


@pytest.mark.parametrize("msg", ["shape mismatch", "device-side assert triggered", "Expected all tensors to be on the same device"])
def test_model_errors_are_not_device_faults(msg: str) -> None:
    assert not is_device_fault_message(msg)
