"""portharness against a second, real out-of-tree PrivateUse1 backend (`npu_toy`, pip-installed into a
venv next to portharness with its own torch.backends entry point), and target validation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LIST_HEADER, list_rows, rows_done

from harness.backends.errors import MISSING_OP
from harness.results.store import ResultStore

STANDARD = [p.regex for p in MISSING_OP]


def run_cli(python: Path, *args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PORTHARNESS_", "TOY_"))}
    return subprocess.run([str(python), "-m", "harness.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**base, **(env or {})})


def test_import_torch_works_with_both_installed(toy_python: Path) -> None:
    code = "import torch, harness, harness.cli; print(torch._C._get_privateuse1_backend_name(), torch.toy.device_count())"
    r = subprocess.run([str(toy_python), "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["toy", "1"]  # autoloaded by its entry point; sim did not claim PrivateUse1


@pytest.mark.long
def test_check_names_the_missing_op(toy_python: Path, tmp_path: Path) -> None:
    for extra in (["--backend", "npu_toy"], []):  # explicit module, or the entry point alone
        r = run_cli(toy_python, "check", "tiny/bert/base", "--target", "toy", "--json", *extra)
        assert r.returncode == 1, r.stderr[-2000:]
        row = json.loads(r.stdout)
        assert row["outcome"] == "unsupported_op", row["error_message"]
        assert row["unsupported_op"].startswith("aten::") and row["unsupported_op"] in row["error_message"]
        assert row["device"] == "toy:0"


@pytest.mark.long
def test_smoke_run_classifies_every_standard_message(toy_python: Path, tmp_path: Path) -> None:
    db = tmp_path / "toy.db"
    r = run_cli(toy_python, "run", "--list", "smoke", "--target", "toy", "--backend", "npu_toy", "--db", str(db),
                "--jobs", "2", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    with ResultStore(db, create=False) as st:
        rows = st.results().to_dict("records")
    assert len(rows) == 60
    kinds = {"dispatcher": 0, "overrideable": 0}
    for row in rows:
        msg = row["error_message"] or ""
        if row["outcome"] == "unsupported_op":
            assert row["unsupported_op"] and row["unsupported_op"].split("::")[-1].split(".")[0] in msg, row
            kinds["overrideable" if "overrideable" in row["unsupported_op"] else "dispatcher"] += 1
        else:  # anything else must not be a standard missing-op message left unparsed
            assert not any(p.search(msg) for p in STANDARD), (row["model_id"], row["outcome"], msg[:300])
    assert kinds["dispatcher"] and kinds["overrideable"], kinds


def test_python_and_dtype_gaps_are_named(toy_python: Path) -> None:
    code = """
import torch
from harness.backends import adapter_for
a = adapter_for("toy")
x = torch.arange(6.0).to("toy")
for f in (lambda: x.sort(stable=True), lambda: torch.zeros(3, dtype=torch.long).to("toy").index_add(0, torch.tensor([0]).to("toy"), torch.ones(1, dtype=torch.long).to("toy"))):
    try:
        f()
    except Exception as e:
        m = a.parse_missing_op(e)
        print(m.op, m.dtype or "-")
"""
    r = subprocess.run([str(toy_python), "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[:2] == ["aten::sort.stable -", "aten::index_add int64"]


@pytest.mark.long
def test_device_death_mid_run_is_a_device_error_then_quarantine_then_resume(toy_python: Path, tmp_path: Path) -> None:
    # long enough that the death lands mid-run even when this test's own polling is starved of CPU
    pairs = [("bert", "base"), ("gpt2", "base"), ("llama", "base"), ("t5", "base"), ("vit", "base"),
             ("opt", "base"), ("mistral", "base"), ("qwen2", "base"), ("bert", "masked-lm"), ("gpt2", "causal-lm"),
             ("llama", "causal-lm"), ("opt", "causal-lm"), ("mistral", "causal-lm"), ("qwen2", "causal-lm"),
             ("bert", "seq-cls"), ("gpt2", "seq-cls")]
    lst = tmp_path / "l.csv"
    lst.write_text(LIST_HEADER + list_rows(pairs))
    db, dead = tmp_path / "r.db", tmp_path / "toy-dead"
    args = ["run", "--list", str(lst), "--target", "toy", "--backend", "npu_toy", "--db", str(db), "--jobs", "1",
            "--quiet", "--quarantine-after", "2"]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PORTHARNESS_", "TOY_"))}
    proc = subprocess.Popen([str(toy_python), "-m", "harness.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**base, "TOY_DEAD_FILE": str(dead)})
    rows_done(db, 2, 300, running=proc)
    dead.touch()  # the device dies mid-run
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]
    assert "quarantining toy:0" in err and "unfinished: rerun with --resume" in err
    with ResultStore(db, create=False) as st:
        rows = {r["model_id"]: r for r in st.results().to_dict("records")}
    lost = [r for r in rows.values() if r["outcome"] == "device_error"]
    assert len(lost) == 2 and all(r["device_fault"] for r in lost), [(r["model_id"], r["outcome"]) for r in rows.values()]
    assert "toy device lost" in lost[0]["error_message"]
    assert not [r for r in rows.values() if r["outcome"] == "load_fail"]
    assert len(rows) < len(pairs)  # the rest wait, unrecorded, for the resume

    dead.unlink()  # device back: the resume runs the device-error and pending models, nothing else
    r = run_cli(toy_python, *args, "--resume", env={"TOY_DEAD_FILE": str(dead)})
    assert r.returncode == 0, r.stderr[-3000:]
    with ResultStore(db, create=False) as st:
        after = st.results().to_dict("records")
    assert len(after) == len(pairs) and {x["run_id"] for x in after} == {next(iter(rows.values()))["run_id"]}
    assert not [x for x in after if x["outcome"] == "device_error"]


@pytest.mark.parametrize(
    ("target", "message"),
    [("foo", "torch knows no device 'foo'"), ("meta", "meta device holds no data"),
     ("sim:7", "device index 7 out of range"), ("", "--target is empty"), ("cuda", "no cuda device")],
)
@pytest.mark.long
def test_bad_targets_exit_2_before_any_row(tmp_path: Path, target: str, message: str) -> None:
    db = tmp_path / "r.db"
    lst = tmp_path / "l.csv"
    lst.write_text(LIST_HEADER + list_rows([("bert", "base")]))
    r = run_cli(Path(sys.executable), "run", "--list", str(lst), "--target", target, "--db", str(db))
    assert r.returncode == 2, r.stderr[-2000:]
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not db.exists()
    r = run_cli(Path(sys.executable), "check", "tiny/bert/base", "--target", target)
    assert r.returncode == 2 and message in r.stderr


@pytest.mark.long
def test_sim_only_options_and_bad_backend_modules_are_refused(tmp_path: Path) -> None:
    for opts, message in ((["--ops", "full"], "--ops is not an option of the cpu backend"),
                          (["--fault", "sim:0=nan:1.0"], "--fault is not an option of the cpu backend"),
                          (["--fallback", "cpu"], "--fallback is not an option of the cpu backend"),
                          (["--backend", "no_such_backend_mod"], "--backend no_such_backend_mod: cannot import it")):
        r = run_cli(Path(sys.executable), "check", "tiny/bert/base", "--target", "cpu", *opts)
        assert r.returncode == 2 and message in r.stderr, (opts, r.stderr[-1000:])
    r = run_cli(Path(sys.executable), "check", "tiny/bert/base", "--target", "cpu",
                env={"PORTHARNESS_BACKENDS": "json,no_such_backend_mod"})
    assert r.returncode == 2 and "no_such_backend_mod" in r.stderr
