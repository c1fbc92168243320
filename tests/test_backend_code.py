"""Whose code a frame is (issue 32.1): the rule of `harness.backends.owner`, as tables, no processes.

A Python backend may register a device module made at run time (no ``__file__``); its code is still
known by the modules given with --backend, its torch.backends entry point, the device module's functions
and the file that registered its PrivateUse1 kernels. Then a connection error its client raises is the
device's in every phase, and a dispatcher error it relays is the target's missing op.
"""

from __future__ import annotations

import os
import types

import pytest

from harness.backends import adapter_for, owner
from harness.backends.owner import BackendCode, device_module_names, package_of, registrar_files
from harness.run.attribution import classify_exception


@pytest.mark.parametrize("name, package", [
    ("npu_toy", "npu_toy"),
    ("npu_toy.remote", "npu_toy"),  # a module stands for its top-level package
    ("torch_npu.npu.utils", "torch_npu"),
    ("torch.toy", None),  # a synthetic module registered under torch's name: torch's frames are everywhere
    ("torch.utils.backend_registration", None),  # torch's dummy device module
    ("socket", None), ("_socket", None), ("importlib.metadata", None),  # the standard library's
    ("harness.sim.device", "harness.sim"),  # the one backend portharness ships
    ("harness.run.pipeline", None), ("harness", None),  # portharness itself
    ("builtins", None), ("__main__", None), ("", None), (None, None),
])
def test_a_module_name_stands_for_its_package(name: str | None, package: str | None) -> None:
    assert package_of(name) == package


def _fn(module: str, filename: str, body: str = "def f(*a, **k):\n    return None\n") -> types.FunctionType:
    """A function whose code claims to be `module`, in `filename` (as a backend's would)."""
    scope: dict = {"__name__": module}
    exec(compile(body, filename, "exec"), scope)
    return scope["f"]


class _Instance:  # a device module that is an instance of a class (npu_toy's plain shape)
    pass


_Instance.__module__ = "npu_toy"


def test_the_device_module_is_known_by_its_file_its_functions_or_its_class() -> None:
    synthetic = types.ModuleType("torch.toy")  # made at run time: no __file__
    synthetic.manual_seed_all = _fn("npu_toy", "/site/npu_toy/__init__.py")
    synthetic.device_count = lambda: 1
    synthetic.device_count.__module__ = "npu_toy._driver"
    synthetic.is_available = staticmethod(_fn("npu_toy", "/site/npu_toy/__init__.py"))
    assert {package_of(n) for n in device_module_names(synthetic)} == {None, "npu_toy"}
    real = types.ModuleType("harness.sim.device")
    real.__file__ = "/repo/harness/sim/device.py"
    real.helper = _fn("numpy", "/site/numpy/x.py")  # an imported name in a real module says nothing
    assert device_module_names(real) == ["harness.sim.device"]
    assert device_module_names(_Instance()) == ["npu_toy"]
    from torch.utils.backend_registration import _DummyBackendModule

    assert [package_of(n) for n in device_module_names(_DummyBackendModule())] == [None]


def test_the_file_that_registered_the_privateuse1_kernels() -> None:
    table = ("Undefined: registered at /__w/pytorch/aten/src/ATen/Register.cpp:1 [default backend kernel]\n"
             "PrivateUse1: registered at /site/npu_toy/__init__.py:275 [kernel]\n")
    assert registrar_files([table]) == ["/site/npu_toy/__init__.py"]
    assert registrar_files(["PrivateUse1: registered at /build/npu/csrc/ops.cpp:12 [kernel]"]) == []  # C++
    assert registrar_files(["PrivateUse1: registered at <stdin>:4 [kernel]"]) == []
    assert registrar_files(["CPU: registered at /x/y.py:1 [kernel]"]) == []


def test_names_and_files_become_packages_and_directories(tmp_path) -> None:
    pkg, single, loose = tmp_path / "npu_toy", tmp_path / "onefile.py", tmp_path / "loose" / "reg.py"
    modules = {"npu_toy": types.SimpleNamespace(__path__=[str(pkg)], __file__=str(pkg / "__init__.py")),
               "npu_toy.remote": types.SimpleNamespace(__file__=str(pkg / "remote.py")),
               "onefile": types.SimpleNamespace(__file__=str(single)),
               "torch": types.SimpleNamespace(__path__=["/site/torch"])}
    code = BackendCode.from_names(["npu_toy.remote", "torch.toy", "socket"], [str(single), str(loose)], modules)
    assert code.packages == {"npu_toy", "onefile"}
    root = os.path.realpath(pkg) + os.sep
    assert set(code.roots) == {root, os.path.realpath(single), os.path.realpath(loose)}


_CODE = BackendCode(frozenset({"npu_toy"}), ("/site/npu_toy/", "/site/onefile.py"))


@pytest.mark.parametrize("module, filename, owned", [
    ("npu_toy", "/site/npu_toy/__init__.py", True),
    ("npu_toy.remote", "/anywhere/else.py", True),  # by its module's name
    (None, "/site/npu_toy/remote.py", True),  # by its file (code run without a module name)
    ("onefile", "/site/onefile.py", True),
    ("onefile_other", "/site/onefile_other.py", False),  # a single-file root is one file, not a prefix
    ("torch.random", "/site/torch/random.py", False),
    ("transformers.modeling_utils", "/site/transformers/modeling_utils.py", False),
    ("socket", "/usr/lib/python3.11/socket.py", False),
    ("npu_toy_extra", "/site/npu_toy_extra/x.py", False),  # another package whose name starts the same
    (None, "<string>", False),
])
def test_which_frames_are_the_backends(module: str | None, filename: str, owned: bool) -> None:
    assert _CODE.owns(module, filename) is owned


def _raise_in(module: str, filename: str, exc: BaseException) -> None:
    _fn(module, filename, "def f(exc):\n    raise exc\n")(exc)


def _raised(exc: BaseException, module: str, filename: str, wrap: bool) -> BaseException:
    """`exc` raised in (module, filename); `wrap`: then wrapped by a loader (`raise ValueError(...) from e`)."""
    try:
        try:
            _raise_in(module, filename, exc)
        except Exception as e:
            if not wrap:
                return e
            raise ValueError(f"could not load ({type(e).__name__}: {e})") from e
    except ValueError as outer:
        return outer
    raise AssertionError


def _unreached() -> BaseException:
    """The toy client's words after its reconnect window: ConnectionError from the refusal."""
    try:
        _raise_in("npu_toy.remote", "/site/npu_toy/remote.py", ConnectionRefusedError(111, "Connection refused"))
    except ConnectionRefusedError as refused:
        gone = ConnectionError("toy client: could not reach the server again at 127.0.0.1:1 within 60 s")
        gone.__cause__ = refused
        return _raised(gone, "npu_toy.remote", "/site/npu_toy/remote.py", wrap=True)
    raise AssertionError


BACKEND, MODEL = ("npu_toy", "/site/npu_toy/__init__.py"), ("transformers.hub", "/site/transformers/hub.py")
RELAYED = "Could not run 'aten::_thnn_fused_lstm_cell' with arguments from the 'CPU' backend. This could be"

# (where it was raised, the exception, phase) -> outcome, unsupported op, device unreachable
CLASSIFIED = [
    ("seeding while a model is built, no server", BACKEND, ConnectionRefusedError(111, "refused"), "load",
     ("device_error", "", True)),
    ("the model's own download refused", MODEL, ConnectionRefusedError(111, "refused"), "load", ("load_fail", "", False)),
    ("seeding in the reference phase, server died", BACKEND, ConnectionResetError(104, "reset"), "reference",
     ("device_error", "", False)),
    ("a move to the device, server hung", BACKEND, TimeoutError("timed out"), "load", ("device_error", "", False)),
    ("the target phase: any connection error", MODEL, BrokenPipeError(32, "broken pipe"), "target",
     ("device_error", "", False)),
    ("a dispatcher error the backend's executor relays", BACKEND, RuntimeError(RELAYED), "target",
     ("unsupported_op", "aten::_thnn_fused_lstm_cell", False)),
    ("the same message raised by the CPU itself", MODEL, RuntimeError(RELAYED), "target", ("crash", "", False)),
]


@pytest.fixture
def toy_code(monkeypatch) -> None:
    monkeypatch.setitem(owner._known, "npu", BackendCode.from_names(["npu_toy"], [], {}))


@pytest.mark.parametrize("case", CLASSIFIED, ids=[c[0] for c in CLASSIFIED])
def test_connection_errors_and_relayed_gaps_by_whose_code_raised_them(case, toy_code) -> None:
    _name, (module, filename), exc, stage, (outcome, op, unreachable) = case
    raised = _raised(exc, module, filename, wrap=stage != "target")  # loaders wrap what they catch
    fields = classify_exception(raised, adapter_for("npu"), stage)
    assert (fields["outcome"], fields.get("unsupported_op", ""), fields.get("device_unreachable", False)) == (
        outcome, op, unreachable)


def test_a_client_that_gave_up_reconnecting_is_an_unreachable_device(toy_code) -> None:
    fields = classify_exception(_unreached(), adapter_for("npu"), "load")
    assert fields["outcome"] == "device_error" and fields["device_unreachable"]
    assert fields["error_type"] == "ConnectionError" and "in the load phase" in fields["error_message"]


def test_the_toy_backend_is_found_in_both_shapes(toy_python, tmp_path) -> None:
    """The real thing: npu_toy imported through its entry point, as an instance (plain) and as a module
    made at run time (TOY_SYNTHETIC_MODULE): the same package either way, by each source alone."""
    import subprocess

    probe = ("import torch, json; from harness.backends import owner; from harness.backends.owner import *\n"
             "m = torch.get_device_module('toy'); c = BackendCode.of('toy')\n"
             "tables = [torch._C._dispatch_dump_table('aten::empty_strided')]\n"
             "print(json.dumps([type(m).__name__, getattr(m, '__file__', None), sorted(c.packages),\n"
             "  sorted({package_of(n) for n in device_module_names(m)} - {None}),\n"
             "  sorted({package_of(n) for n in BackendCode.from_names([], registrar_files(tables)).packages})]))")
    for synthetic in ("0", "1"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOY_")}
        out = subprocess.run([str(toy_python), "-c", probe], capture_output=True, text=True, timeout=300,
                             env={**env, "TOY_SYNTHETIC_MODULE": synthetic}, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        import json

        kind, file, packages, by_module, by_registrar = json.loads(out.stdout.splitlines()[-1])
        assert (kind, file) == (("module", None) if synthetic == "1" else ("_DeviceModule", None))
        assert packages == by_module == by_registrar == ["npu_toy"], (synthetic, out.stdout)


# -- while compiling (issue 32.4): which party refused or raised what ---------------------------------

REFUSED = "prims::device_put.default is not an aten op: the npu backend runs aten ops only"
PASSES_FILE = ("torch._inductor.fx_passes.joint_graph", "/site/torch/_inductor/fx_passes/joint_graph.py")
AOT_FILE = ("torch._functorch.aot_autograd", "/site/torch/_functorch/aot_autograd.py")


def _compile_error(caller: tuple[str, str] | None, raiser: tuple[str, str], exc: BaseException) -> BaseException:
    """What Dynamo raises when a compiler stage (`caller`'s file) runs code (`raiser`'s) that raises `exc`."""
    import torch

    run = _fn(*raiser, "def f(exc):\n    raise exc\n")
    stage = _fn(*caller, "def f(run, exc):\n    run(exc)\n") if caller else None

    def backend(gm: torch.fx.GraphModule, inputs: list) -> object:
        stage(run, exc)
        return gm.forward

    if stage is None:  # no compiler stage: the backend's own package holds the compiler Dynamo calls
        scope = {"__name__": raiser[0], "exc": exc}
        exec(compile("def backend(gm, inputs):\n    raise exc\n", raiser[1], "exec"), scope)
        backend = scope["backend"]

    torch._dynamo.reset()
    try:
        torch.compile(lambda x: x.sin() + 1, backend=backend)(torch.randn(3))
    except Exception as e:
        return e
    raise AssertionError("compiled without an error")


COMPILING = [
    ("Inductor's graph passes run a node on the device, whose code raises", PASSES_FILE, BACKEND,
     AttributeError("'UntypedStorage' object has no attribute '_npu'"),
     ("compile_fail", "", "Inductor graph passes", "raised in the npu backend's own code")),
    ("the same error raised by the graph pass itself: the compiler's", PASSES_FILE, PASSES_FILE,
     AttributeError("no attribute"), ("compile_fail", "", "Inductor graph passes", None)),
    ("a tensor-subclass backend refuses an op AOT traced", AOT_FILE, BACKEND, NotImplementedError(REFUSED),
     ("unsupported_op", "prims::device_put", "AOT/functionalization",
      "the npu backend refused prims::device_put while the compiler ran it (AOT/functionalization)")),
    ("a vendor's compiler in the backend's own package raises: its codegen, not the device", None, BACKEND,
     NotImplementedError("no kernel template for this node"), ("compile_fail", "", "backend codegen", None)),
    ("the same words from torch itself are nobody's missing op", AOT_FILE,
     ("torch._subclasses.fake_tensor", "/site/torch/_subclasses/fake_tensor.py"), NotImplementedError(REFUSED),
     ("compile_fail", "", "AOT/functionalization", None)),
    ("a missing kernel the device reports while Inductor's passes run it", PASSES_FILE, BACKEND,
     NotImplementedError("Could not run 'aten::_fused_sdp_choice' with arguments from the 'npu' backend"),
     ("unsupported_op", "aten::_fused_sdp_choice", "Inductor graph passes", "the npu backend refused")),
]


@pytest.mark.parametrize("case", COMPILING, ids=[c[0] for c in COMPILING])
def test_what_the_backend_refuses_or_raises_while_compiling(case, toy_code) -> None:
    _name, caller, raiser, exc, (outcome, op, stage, said) = case
    fields = classify_exception(_compile_error(caller, raiser, exc), adapter_for("npu"))
    assert (fields["outcome"], fields.get("unsupported_op", ""), fields["compile_stage"]) == (outcome, op, stage)
    if said is None:
        assert "backend's own code" not in fields["error_message"] and "refused" not in fields["error_message"]
    else:
        assert said in fields["error_message"], fields["error_message"][:300]
    assert "_backend_raised" not in dict(fields)  # (a row field could not be: RowDraft takes Measurement's only)


def test_a_device_fault_that_escapes_the_pipeline_is_still_the_devices(toy_code, monkeypatch) -> None:
    """The worker's last resort (a harness bug) classifies with the target's adapter: a refused connection
    from the backend's client is device_error there too, anything else a crash."""
    from harness.fleet import worker

    raised: list[BaseException] = []

    def run_one(task, on_phase=None):  # noqa: ANN001, ANN202
        on_phase("oracle")
        raise raised[0]

    monkeypatch.setattr(worker, "run_one", run_one)
    payload = {"entry": {"id": "m", "source": "tiny", "arch": "bert", "task": "base"}, "target": "npu:0"}
    raised[:] = [_raised(ConnectionRefusedError(111, "refused"), *BACKEND, wrap=False)]
    m = worker.run_task(payload, "npu:0", host="h")
    assert (m.outcome, m.device_fault, m.device_unreachable) == ("device_error", True, True)
    raised[:] = [KeyError("a harness bug")]
    assert worker.run_task(payload, "npu:0", host="h").outcome == "crash"
