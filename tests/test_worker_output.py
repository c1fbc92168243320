"""What a model prints while it runs (Python warnings, native code writing to fd 2) goes to its row, not
into the supervisor's terminal and progress bar; a worker that dies under a model leaves its fatal-signal
report in the crash row (issue 37, item 4)."""

from __future__ import annotations

import signal
from pathlib import Path

from conftest import LIST_HEADER

from harness.fleet.capture import log_path
from harness.fleet.runner import RunConfig, run_models
from harness.models.model_list import load_model_list
from harness.results.store import ResultStore


def test_worker_output_goes_to_the_row_not_the_terminal(tmp_path: Path, patho, capfd) -> None:
    lst = tmp_path / "l.csv"
    lst.write_text(LIST_HEADER + patho.rows(dict(patho(b) for b in ("noisy", "crash"))))
    db = tmp_path / "r.db"
    capfd.readouterr()
    # forked from this process, like `check`: its fds are the ones capfd watches
    summary = run_models(load_model_list(str(lst)), RunConfig(settings={"precision": "highest", "ops": "full"},
                         jobs=1, retries=0, timeout_s=120, progress=False, fork_workers=True), db, list_name="noisy")
    out, err = capfd.readouterr()
    with ResultStore(db) as store:
        got = {r["model_id"]: r for r in store.results(summary.run_id).to_dict("records")}
    noisy = got["patho/noisy"]
    assert noisy["outcome"] == "pass"
    for line in ("noisy: a line on stdout", "noisy: a UserWarning on sys.stderr", "noisy: USDT-like line from native code"):
        assert line in noisy["worker_output"]
        assert line not in out + err
    crash = got["patho/crash"]
    assert crash["outcome"] == "crash" and crash["signal"] == signal.SIGSEGV, crash
    assert crash["traceback"].startswith("Fatal Python error: Segmentation fault")  # its faulthandler, read back
    assert "Segmentation fault" not in out + err
    assert "noisy" not in crash["worker_output"]  # each job's output is its own


def test_job_output_keeps_the_tail(tmp_path: Path) -> None:
    """A model that prints megabytes keeps the last lines (where the fatal report is), and says how much
    went before."""
    from harness.fleet.capture import JobOutput

    out = JobOutput()
    try:
        with out:
            for i in range(20000):
                print(f"line {i}")
        text = out.text(keep=1000)
        assert text.startswith("[... ") and "bytes before]" in text.splitlines()[0]
        assert text.rstrip().endswith("line 19999") and len(text) < 1100
    finally:
        import os

        os.close(out.fd)
        log_path(os.getpid()).unlink()
