"""What a model prints while it runs (Python warnings, native code writing to fd 2) goes to its row, not
into the supervisor's terminal and progress bar; a worker that dies under a model leaves its fatal-signal
report in the crash row (issue 37, item 4)."""

from __future__ import annotations

import os
import sys

from harness.fleet.capture import JobOutput, log_path

# The rows' side (a run's noisy model keeps what it printed; a segfault's report lands in its crash row) is
# asserted in tests/test_runner.py::test_crash_and_memory_runaway_cost_only_their_rows, on a run it makes
# anyway.


def test_a_jobs_output_never_reaches_the_terminal(capfd) -> None:
    """Python's streams, file descriptors 1 and 2 (native code), both: into the job's file, none out."""
    out = JobOutput()
    try:
        with out:
            print("python stdout")
            print("python stderr", file=sys.stderr)
            os.write(1, b"native fd 1\n")
            os.write(2, b"native fd 2 (USDT: profiler_start)\n")
        print("after the job")
        text = out.text()
        seen = capfd.readouterr()
        for line in ("python stdout", "python stderr", "native fd 1", "native fd 2 (USDT: profiler_start)"):
            assert line in text and line not in seen.out + seen.err
        assert "after the job" in seen.out and "after the job" not in text
        with out:  # the next job starts empty
            print("second job")
        assert out.text() == "second job\n"
    finally:
        os.close(out.fd)
        log_path(os.getpid()).unlink()


def test_job_output_keeps_the_tail() -> None:
    """A model that prints megabytes keeps the last lines (where the fatal report is), and says how much
    went before."""
    out = JobOutput()
    try:
        with out:
            for i in range(20000):
                print(f"line {i}")
        text = out.text(keep=1000)
        assert text.startswith("[... ") and "bytes before]" in text.splitlines()[0]
        assert text.rstrip().endswith("line 19999") and len(text) < 1100
    finally:
        os.close(out.fd)
        log_path(os.getpid()).unlink()
