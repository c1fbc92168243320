"""The runs of a night: a merged nightly DB holds the latest run of each configuration (one per setting).

Everything that gates or summarises a night (the baseline check and update, the history, the report's
and the diff's ``--night``) picks its runs here, so they agree on which runs a night is: the latest run
with results of each (list, target, settings).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pandas as pd

from harness import files
from harness.analysis.baseline import (
    CheckResult,
    Config,
    ExpectedFile,
    check,
    count_line,
    expected_rows,
    list_key,
    read_expected,
    read_flaky,
    write_expected,
)
from harness.analysis.perfbase import perf_path, perf_rows, read_perf, write_perf
from harness.analysis.perfgate import disturbance
from harness.results.dbfile import StoreError
from harness.results.store import ResultStore
from harness.results.variations import run_kind


def run_config(run: dict[str, Any]) -> Config:
    """The configuration of a row of ``ResultStore.runs()``."""
    return Config(list_key(run["list_name"]), str(run["target"]), str(run["settings_json"]))


def night_runs(store: ResultStore, kinds: tuple[str, ...] = ("models", "ops")) -> list[dict[str, Any]]:
    """The latest run with results per configuration, oldest first; each row of ``store.runs()`` gains
    its ``config``. `kinds`: model runs and op runs (`harness.results.variations`: an op run gates like a
    model run; a harvest run is no night's result)."""
    runs = store.runs()
    out: dict[Config, dict[str, Any]] = {}
    runs = runs[(runs.n_results > 0) & runs.list_name.map(run_kind).isin(kinds)] if not runs.empty else runs
    for run in runs.to_dict("records"):  # newest first: keep the first seen
        out.setdefault(run_config(run), {**run, "config": run_config(run)})
    return sorted(out.values(), key=lambda r: (r["started_at"], r["run_id"]))


def _night(db: str | os.PathLike) -> list[dict[str, Any]]:
    with ResultStore(db, read_only=True) as store:
        runs = night_runs(store)
    if not runs:
        raise StoreError(f"{db} contains no model results")
    return runs


def pick_run(db: str | os.PathLike, *, run_id: str | None = None, config: Config | None = None,
             file_name: str | None = None) -> dict[str, Any]:
    """One run: ``run_id``; else the latest run of ``config``; else the DB's only configuration; else the
    one whose conventional file name is ``file_name``. ValueError naming the choices otherwise."""
    if run_id is not None:
        with ResultStore(db, read_only=True) as store:
            store.results(run_id)  # StoreError naming recent runs when it is not there
            runs = store.runs()
        run = runs[runs.run_id == run_id].iloc[0].to_dict()
        return {**run, "config": run_config(run)}
    nights = _night(db)
    if config is not None:
        match = [r for r in nights if r["config"] == config]
        if not match:
            have = "; ".join(r["config"].describe() for r in nights)
            raise ValueError(f"{db} has no run of {config.describe()} (it has: {have})")
        return match[-1]
    if len(nights) == 1:
        return nights[0]
    named = [r for r in nights if file_name is not None and r["config"].file_name == file_name]
    if len(named) == 1:
        return named[0]
    names = ", ".join(r["config"].file_name for r in nights)
    raise ValueError(f"{db} holds runs of {len(nights)} configurations; pass --run, or --out/--expected-dir "
                     f"with the conventional names ({names})")


def runs_to_update(db: str | os.PathLike, *, run_id: str | None = None,
                   out: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """`baseline update`: with ``out`` (one file) one run, else ``run_id`` or every configuration's."""
    if out is not None:
        return [pick_run(db, run_id=run_id, file_name=Path(out).name)]
    return [pick_run(db, run_id=run_id)] if run_id is not None else _night(db)


def runs_to_check(db: str | os.PathLike, *, run_id: str | None = None, expected: str | os.PathLike | None = None,
                  expected_dir: str | os.PathLike | None = None) -> list[tuple[ExpectedFile, dict[str, Any]]]:
    """`baseline check`: (expected file, run) pairs. One file: its configuration's latest run (or
    ``run_id``, which must match it: `check` says so). A directory: every configuration of the night
    (or ``run_id``) against the conventionally named file there (FileNotFoundError when missing)."""
    if expected is not None:
        exp = read_expected(expected)
        return [(exp, pick_run(db, run_id=run_id, config=None if run_id else exp.config))]
    if expected_dir is None or not Path(expected_dir).is_dir():
        raise FileNotFoundError(f"--expected-dir {expected_dir} is not a directory")
    runs = [pick_run(db, run_id=run_id)] if run_id is not None else _night(db)
    return [(read_expected(Path(expected_dir) / r["config"].file_name), r) for r in runs]


def load_run(db: str | os.PathLike, run_id: str) -> pd.DataFrame:
    """One run's results."""
    with ResultStore(db, read_only=True) as store:
        return store.results(run_id)


def update_baselines(db: str | os.PathLike, *, run_id: str | None = None, out: str | os.PathLike | None = None,
                     out_dir: str | os.PathLike | None = None) -> list[str]:
    """`baseline update`: write the expected file(s) (``out``, or one per configuration in ``out_dir``);
    returns one line per file written."""
    if out_dir is not None and not Path(out_dir).is_dir():
        raise FileNotFoundError(f"--out-dir {out_dir} is not a directory")
    lines = []
    runs = [(run, Path(out) if out is not None else Path(out_dir or ".") / run["config"].file_name)
            for run in runs_to_update(db, run_id=run_id, out=out)]
    for _, dest in runs:  # every file refused before one is written
        if dest.parent.is_dir():
            files.check_writable(dest)
    for run, dest in runs:
        df = load_run(db, run["run_id"])
        rows = expected_rows(df)
        command = f"portharness baseline update --db <merged.db> --out {dest}"
        write_expected(dest, run["config"], rows, command=command)
        lines.append(f"wrote {dest}: {len(rows)} models from run {run['run_id']} ({count_line(rows)})")
        perfs = perf_rows(df)
        if perfs:  # a run measured with --perf also sets the expected speed
            write_perf(perf_path(dest), run["config"], perfs, command=command)
            lines.append(f"wrote {perf_path(dest)}: the speed of {len(perfs)} models timed with --perf")
            disturbed = sorted(m for m, perf in perfs.items() if disturbance(perf))
            if disturbed:  # the file keeps no host signs: a busy night's numbers would pass for a quiet one's
                lines.append(f"  {len(disturbed)} of them timed on a disturbed host ({', '.join(disturbed[:3])}"
                             f"{', ...' if len(disturbed) > 3 else ''}): update the perf baseline from a quieter run")
    return lines


def check_baselines(db: str | os.PathLike, *, run_id: str | None = None, expected: str | os.PathLike | None = None,
                    expected_dir: str | os.PathLike | None = None, flaky: str | os.PathLike | None = None,
                    perf_threshold: float = 1.2, perf_allowlist: dict[str, str] | None = None) -> list[CheckResult]:
    """`baseline check`: every (expected file, run) pair of :func:`runs_to_check`, checked; with the perf
    baseline beside an expected file (`harness.analysis.perfbase`), its speed too."""
    known = read_flaky(flaky) if flaky is not None else {}
    pairs = runs_to_check(db, run_id=run_id, expected=expected, expected_dir=expected_dir)
    perfs = [_perf_baseline(exp) for exp, _ in pairs]  # every file read (and refused) before a run is loaded
    return [check(exp, load_run(db, run["run_id"]), run_config=run["config"], run_id=run["run_id"], flaky=known,
                  perf=perf, perf_threshold=perf_threshold, perf_allowlist=perf_allowlist)
            for (exp, run), perf in zip(pairs, perfs, strict=True)]


def _perf_baseline(exp: ExpectedFile) -> tuple[str, dict[str, dict[str, Any]]] | None:
    """The perf baseline beside ``exp`` (None when there is none); ValueError when it names another configuration."""
    path = perf_path(exp.path)
    if not path.is_file():
        return None
    config, perfs = read_perf(path)
    if config != exp.config:
        raise ValueError(f"{path} is for {config.describe()}, but {exp.path} is for {exp.config.describe()}; "
                         "regenerate it with `portharness baseline update`")
    return str(path), perfs
