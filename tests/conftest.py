"""Shared test helpers: a synthetic result DB, model-list rows, misbehaving remote-code models.

``write_synthetic_db`` is a plain function so scripts can import it too (put ``tests/`` on
``sys.path``); tests get it through the ``write_synthetic_db`` fixture rather than importing conftest.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.outcomes import OUTCOMES
from harness.results.rows import CollectiveRow, ResultRow, RunInfo
from harness.results.store import ResultStore

# sim's devices belong to one process each (harness/sim/placement.py). Each test is its own simulated host, so
# tests side by side (pytest-xdist) never hold each other's devices, nor does this process, which keeps what
# it used in one test, hold them in the next; environments made at import share this worker's own host.
_SIM_HOST = f"pytest-{os.getpid()}"
os.environ["PORTHARNESS_SIM_NAMESPACE"] = _SIM_HOST
_tests_run = iter(range(1 << 62))


@pytest.fixture(autouse=True)
def _own_sim_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PORTHARNESS_SIM_NAMESPACE", f"{_SIM_HOST}-{next(_tests_run)}")


# Share of each outcome in the synthetic runs, roughly what a real zoo night looks like. The dict order
# is the draw order: changing it changes every seeded DB.
_OUTCOME_WEIGHTS: dict[str, float] = {
    "pass": 0.55,
    "flaky": 0.04,
    "drift": 0.15,
    "unsupported_op": 0.12,
    "crash": 0.05,
    "timeout": 0.02,
    "oom": 0.01,
    "load_fail": 0.03,
    "ref_fail": 0.01,
    "ref_nondeterministic": 0.02,
    "device_error": 0.01,
    "pass_declared": 0.05,
    "missing_grad": 0.005,
    "skipped": 0.005,  # split from missing_grad's share: the draws of every other outcome stay as they were
    "compile_fail": 0.0025,  # likewise
    "ref_timeout": 0.0025,  # split from compile_fail's share, likewise
}
# A new outcome in harness/outcomes.py must get a weight here, or the report tests never see it.
assert set(_OUTCOME_WEIGHTS) == set(OUTCOMES), set(OUTCOMES) ^ set(_OUTCOME_WEIGHTS)


_ARCHS = [
    ("BertModel", "fill-mask", "text"),
    ("ViTModel", "image-classification", "vision"),
    ("GPT2LMHeadModel", "text-generation", "text"),
    ("WhisperModel", "asr", "audio"),
    ("CLIPModel", "zero-shot-image-classification", "multimodal"),
]
_OPS = ["aten::_upsample_bicubic2d_aa", "aten::erfinv", "aten::_fft_r2c", "aten::linalg_eigh"]
_SETTINGS = {"ops": "young", "precision": "default"}


def _fake_row(rng: random.Random, rid: str, i: int) -> ResultRow:
    """Model ``i`` of run ``rid``. Hostile on purpose: ``<script>`` in messages, ``/``, ``<b>`` in ids.

    Keep the order of the ``rng`` calls: every seeded DB (and the tests' expected numbers) depends on it.
    """
    arch, task, modality = _ARCHS[i % len(_ARCHS)]
    outcome = rng.choices(list(_OUTCOME_WEIGHTS), list(_OUTCOME_WEIGHTS.values()))[0]
    ratio = 10 ** rng.gauss(-1.2, 0.6) if outcome in ("pass", "flaky") else None
    if outcome == "drift":
        ratio = 10 ** rng.uniform(0.01, 2.5)
    op = ""
    if outcome == "unsupported_op":
        op = rng.choice(_OPS) if rng.random() < 0.8 else ", ".join(rng.sample(_OPS, 2))
    err = "" if outcome in ("pass", "drift", "flaky") else f"{outcome.title()}Error"
    return ResultRow(
        run_id=rid,
        model_id=f"org-{i % 37}/model {i:04d}" if i % 11 else f"org/<b>model-{i}</b>",
        target="sim",
        settings=_SETTINGS,
        outcome=outcome,
        arch=arch,
        task=task,
        modality=modality,
        unsupported_op=op,
        error_type=err,
        error_message=f"<script>alert({i})</script> failed" if err else "",
        traceback='Traceback (most recent call last):\n  File "x.py"\n' + "<img src=x onerror=alert(1)>"
        if err
        else "",
        first_drift_module="encoder.layer.3.attention" if outcome == "drift" else "",
        first_drift_module_type="BertSelfAttention" if outcome == "drift" else "",
        max_abs_err=rng.random() * 1e-3,
        max_rel_err=rng.random() * 1e-2,
        min_cosine=1 - rng.random() * 1e-5,
        rmse_ratio=ratio,
        metrics={
            "last_hidden_state": {
                "rmse_target": 1e-4,
                "rmse_ref": 1e-5,
                "cosine": 0.99999,
                "max_abs": 1e-3,
                "max_rel": 1e-2,
                "ok": outcome != "drift",
                "shape": [1, 8, 32],
                "dtype": "float32",
            }
        },
        device=f"sim:{i % 2}",
        attempts=[
            {
                "device": f"sim:{i % 2}",
                "outcome": outcome,
                "error_type": err,
                "exit_code": 0,
                "signal": None,
                "duration_s": rng.random() * 5,
            }
        ],
        exit_code=0,
        load_time_s=rng.random(),
        ref_time_s=rng.random(),
        target_time_s=rng.random() * 2,
        wall_time_s=rng.random() * 5,
        peak_rss_mb=500 + rng.random() * 1000,
    )


def _fake_collectives(rng: random.Random, rid: str) -> list[CollectiveRow]:
    """Two ops x two sizes x three settings, each compared with the "default" setting."""
    rows = []
    for op in ("all_reduce", "all_gather"):
        for size in (1 << 10, 1 << 20):
            for setting in ("default", "bucket25mb", "compress-fp16"):
                base = 1.0 if setting == "default" else rng.uniform(0.6, 1.4)
                rows.append(
                    CollectiveRow(
                        run_id=rid,
                        target="sim",
                        backend="gloo",
                        world_size=2,
                        op=op,
                        size_bytes=size,
                        setting=setting,
                        settings={"setting": setting},
                        baseline_setting="default",
                        median_s=1e-3 * base,
                        p10_s=0.9e-3 * base,
                        p90_s=1.2e-3 * base,
                        repeats=20,
                        ratio=base,
                        ratio_p10=base * 0.9,
                        ratio_p90=base * 1.1,
                    )
                )
    return rows


def write_synthetic_db(
    path: str | os.PathLike, n_models: int = 1000, *, runs: int = 2, seed: int = 0, collectives: bool = True
) -> list[str]:
    """Fill a DB with plausible fake results (for report tests/benchmarks, not for conclusions).

    ``runs`` nights (``night-00``, ...) of ``n_models`` models each, optionally with collective
    benchmarks; includes hostile strings on purpose. Returns the run ids.
    """
    rng = random.Random(seed)
    ids = []
    with ResultStore(path) as st:
        for night in range(runs):
            rid = st.begin_run(
                RunInfo(
                    "tiny-zoo",
                    "sim",
                    _SETTINGS,
                    run_id=f"night-{night:02d}",
                    started_at=f"2026-01-{night + 1:02d}T02:00:00Z",
                    argv="portharness run --list tiny-zoo",
                )
            )
            ids.append(rid)
            for i in range(n_models):
                st.record(_fake_row(rng, rid, i))
            if collectives:
                for row in _fake_collectives(rng, rid):
                    st.record_collective(row)
            st.finish_run(rid)
    return ids


@pytest.fixture(name="write_synthetic_db", scope="session")
def _write_synthetic_db_fixture() -> Callable[..., list[str]]:
    """:func:`write_synthetic_db` itself, so test modules need not import conftest."""
    return write_synthetic_db


# ----------------------------------------------------------------------------------------------
# Model lists and misbehaving models for runner tests
# ----------------------------------------------------------------------------------------------

LIST_HEADER = "id,source,arch,task,modality,inputs,tags,revision,trust_remote_code,atol,rtol,path\n"
_MODALITY = {"vit": "vision"}


def list_rows(pairs: list[tuple[str, str]]) -> str:
    """Model-list CSV rows for tiny (arch, head) pairs."""
    return "".join(f"tiny/{a}/{h},tiny,{a},{h},{_MODALITY.get(a, 'text')},,,,,,,\n" for a, h in pairs)


@pytest.fixture(name="patho")
def _patho_fixture(tmp_path):
    """`patho(behaviour)` -> (model id, saved checkpoint dir) of a remote-code model that crashes,
    hangs, allocates without bound (``crash``, ``hang``, ``oom``) or behaves (``none``) on the target."""
    import pathological_models

    def build(behaviour: str):
        return f"patho/{behaviour}", pathological_models.build(tmp_path / "patho-models", behaviour)

    build.rows = pathological_models.list_rows  # type: ignore[attr-defined]
    return build


# ----------------------------------------------------------------------------------------------
# A second, out-of-tree PrivateUse1 backend installed next to portharness
# ----------------------------------------------------------------------------------------------

TOY_SRC = Path(__file__).parent / "toy_backend"


def make_toy_env(root: Path) -> Path:
    """A venv that sees this environment's packages (torch, transformers, portharness) with the `npu-toy`
    package pip-installed into it (its torch.backends entry point included); returns its python."""
    import shutil
    import site
    import subprocess
    import sys
    import venv

    venv.create(root / "venv", with_pip=False, symlinks=True)
    py = root / "venv" / "bin" / "python"
    purelib = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    # addsitedir (not a bare path) so the parent's .pth files (an editable portharness) apply too
    parents = [p for p in [*site.getsitepackages(), site.getusersitepackages()] if Path(p).is_dir()]
    (purelib / "_parent_env.pth").write_text(f"import site; list(map(site.addsitedir, {parents!r}))\n")
    src = root / "npu-toy-src"
    shutil.copytree(TOY_SRC, src)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(purelib), str(src)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    return py


@pytest.fixture(name="toy_python", scope="session")
def _toy_python_fixture(tmp_path_factory) -> Path:
    return make_toy_env(tmp_path_factory.mktemp("toy-env"))


# ----------------------------------------------------------------------------------------------
# Full disks and read-only media: a private mount namespace
# ----------------------------------------------------------------------------------------------

_MOUNT_DRIVER = r'''
import hashlib, json, os, subprocess, sys, time
from pathlib import Path

ENV = {k: v for k, v in os.environ.items() if (not k.startswith("PORTHARNESS_") or k == "PORTHARNESS_SIM_NAMESPACE")}


def cli(*args, env=None, timeout=600):
    r = subprocess.run([sys.executable, "-m", "harness.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, env={**ENV, **(env or {})})
    return {"rc": r.returncode, "out": r.stdout, "err": r.stderr}


def tmpfs(path, size="4m"):
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "none", str(path)], check=True)


def read_only(path):
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)


def fill(path, leave=0):
    """Take every free byte of the file system at `path` but `leave` (a full disk)."""
    fd = os.open(os.path.join(path, ".filler"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    for chunk in (1 << 20, 1 << 16, 1 << 12, 1):
        try:
            while True:
                os.write(fd, b"\0" * chunk)
        except OSError:
            pass
    os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))
    os.close(fd)


def snapshot(path):
    """Every file under `path` (the filler aside) and its digest."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(path).rglob("*")) if p.is_file() and p.name != ".filler"}


def rows(db):
    import sqlite3
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as c:
            return c.execute("SELECT count(*) FROM results").fetchone()[0]
    except sqlite3.Error:
        return 0
'''


def _namespace_command() -> list[str] | None:
    """`unshare` arguments that give a private mount namespace where tmpfs can be mounted, or None."""
    import shutil
    import subprocess
    import tempfile

    if shutil.which("unshare") is None:
        return None
    cmd = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    with tempfile.TemporaryDirectory() as d:
        ok = subprocess.run([*cmd, "mount", "-t", "tmpfs", "-o", "size=64k", "none", d], capture_output=True)
    return cmd if ok.returncode == 0 else None


@pytest.fixture(name="private_mounts", scope="session")
def _private_mounts_fixture() -> Callable[..., Any]:
    """`private_mounts(body)` runs the Python `body` as root of a private mount namespace, with the helpers
    above (`cli`, `tmpfs`, `read_only`, `fill`, `snapshot`, `rows`); its mounts vanish with it. Returns the
    JSON value of the body's last line of output. Skips where no such namespace can be made."""
    import json
    import subprocess
    import sys

    cmd = _namespace_command()
    if cmd is None:
        pytest.skip("needs a private mount namespace with tmpfs (unshare -m as root, or unshare -rm): "
                    "cannot make a full disk or read-only media here")

    def run(body: str, timeout: float = 900) -> Any:
        r = subprocess.run([*cmd, sys.executable, "-c", _MOUNT_DRIVER + body], capture_output=True, text=True,
                           timeout=timeout)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    return run


def rows_done(db: Path, at_least: int, timeout_s: float, running: Any = None) -> int:
    """How many rows a run writing `db` has finished, polled until there are `at_least` (or `timeout_s` passes,
    or the process `running` ends): a test that kills a run mid-way kills it after real progress."""
    import sqlite3
    import time

    deadline, done = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline and done < at_least and (running is None or running.poll() is None):
        time.sleep(0.2)
        if db.exists():
            try:
                with sqlite3.connect(db, timeout=5) as c:
                    done = c.execute("SELECT count(*) FROM results").fetchone()[0]
            except sqlite3.OperationalError:  # the run is creating it
                pass
    return done
