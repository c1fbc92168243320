"""The fault matrix: every scenario x collective setting on one target and world size.

This is the API behind ``portharness collectives --faults``: `run_matrix` runs, per setting, a
healthy baseline (``none``: false straggler flags, the steps/s the others' throughput loss is
measured against), every requested scenario, and, when a scenario recovered onto a spare, a healthy
run that re-forms its group at the same step (the reference whose final parameters the recovered
run must match bit for bit). `to_rows` / `record` store the results (list ``collective-faults``),
`as_json` is the ``--json`` payload and `format_table` the terminal table.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from harness.bench.faultresult import ScenarioResult, set_loss
from harness.bench.faultrun import run_scenarios
from harness.bench.faults import FaultConfig

LIST_NAME = "collective-faults"


@dataclass
class FaultMatrix:
    """The results of one matrix run (the baselines among them), plus the restart references."""

    config: FaultConfig
    results: list[ScenarioResult]
    references: list[ScenarioResult]
    wall_s: float


def _jobs(cfg: FaultConfig, restart: bool) -> list[tuple[str, str, int | None]]:
    jobs: list[tuple[str, str, int | None]] = []
    for setting in cfg.settings:
        jobs.append(("none", setting, None))
        jobs += [(s.name, setting, None) for s in cfg.specs() if s.kind != "none"]
        if restart:  # a recovery restarts at the step the fault hit (the state is the step before's)
            jobs.append(("none", setting, cfg.fault_step))
    return jobs


def run_matrix(cfg: FaultConfig, *, keep: str | None = None) -> FaultMatrix:
    """Validate ``cfg`` and run every scenario under every setting; always returns (deadlines inside)."""
    cfg.validate()
    t0 = time.time()
    restart = cfg.spare > 0 and any(s.recoverable for s in cfg.specs())
    jobs = _jobs(cfg, restart)
    out = run_scenarios(cfg, jobs, keep=keep)
    results, refs = [], []
    for (_, _, restart_step), res in zip(jobs, out, strict=True):
        (refs if restart_step is not None else results).append(res)
    # A recovery that restarted elsewhere than expected gets its own reference.
    missing = sorted(
        {(r.setting, r.restart_step) for r in results if r.recovered and r.restart_step is not None}
        - {(r.setting, r.restart_step) for r in refs}
    )
    if missing:
        refs += run_scenarios(cfg, [("none", setting, step) for setting, step in missing])
    for res in results:
        base = next((b for b in results if b.scenario == "none" and b.setting == res.setting), None)
        if res.scenario == "none":
            res.throughput_loss = None  # it is the baseline
        elif base is not None and base.steps_per_s:
            set_loss(res, base.steps_per_s)
        if res.recovered:
            ref = next((r for r in refs if r.setting == res.setting and r.restart_step == res.restart_step), None)
            if ref is not None and ref.params_digest and res.params_digest:
                res.params_match = ref.params_digest == res.params_digest
                res.reference_digest = ref.params_digest
    return FaultMatrix(cfg, results, refs, time.time() - t0)


def problems(matrix: FaultMatrix) -> list[str]:
    """What the CLI's exit code gates on: a bad rank not caught or not named, a healthy run flagged."""
    out = []
    for r in matrix.results:
        where = f"{r.scenario} ({r.backend}, {r.setting}, world {r.world_size})"
        if r.scenario == "none":
            if r.detected or r.false_flags:
                out.append(f"{where}: a healthy run was flagged ({r.detected_by or 'straggler'})")
        elif not r.detected:
            out.append(f"{where}: not detected" + (" (timed out)" if r.timed_out else ""))
        elif r.detect_s is not None and r.detect_s > r.timeout_s:
            out.append(f"{where}: detected after {r.detect_s:.1f} s, past the {r.timeout_s:g} s timeout")
        elif not r.rank_named:
            out.append(f"{where}: the bad rank was not named")
    return out


def _tri(v: bool | None) -> int | None:
    return None if v is None else int(bool(v))


def to_rows(matrix: FaultMatrix, run_id: str) -> list:
    """`CollectiveFaultRow`s for `ResultStore.record_collective_fault`."""
    from harness.comms.settings import parse_setting
    from harness.results.rows import CollectiveFaultRow

    cfg = matrix.config
    rows = []
    for r in matrix.results:
        settings = {
            **parse_setting(r.setting).as_dict(),
            "kind": "collective-fault",
            "collective_timeout_s": cfg.collective_timeout_s,
            "stall_s": cfg.stall_s,
            "straggler_excess": cfg.excess,
            "injection": "sim device faults" if cfg.target == "sim" else "harness, at the collective",
            "slowdown": r.slowdown,
            "steps_per_s": r.steps_per_s,
            "baseline_steps_per_s": r.baseline_steps_per_s,
            "reference_digest": r.reference_digest,
            "params_digest": r.params_digest,
            "flag_step": r.flag_step,
            "exit_codes": r.exit_codes,
        }
        rows.append(
            CollectiveFaultRow(
                run_id=run_id, target=r.target, backend=r.backend, world_size=r.world_size, setting=r.setting,
                scenario=r.scenario, settings=settings, fault_rank=r.fault_rank, fault_step=r.fault_step,
                steps=r.steps, spare=r.spare, timeout_s=r.timeout_s, detected=r.detected,
                detected_by=r.detected_by, detect_s=r.detect_s, rank_named=r.rank_named, named_rank=r.named_rank,
                named_by=r.named_by, backend_error=r.backend_error, backend_error_s=r.backend_error_s,
                clean_exit=r.clean_exit, nan_caught=_tri(r.nan_caught), flagged=_tri(r.flagged),
                false_flags=r.false_flags, throughput_loss=r.throughput_loss, recovered=_tri(r.recovered),
                restart_step=r.restart_step, steps_lost=r.steps_lost, resume_s=r.resume_s,
                params_match=_tri(r.params_match), completed_steps=r.completed_steps, timed_out=r.timed_out,
                wall_s=r.wall_s, detail=r.detail, error=r.error,
            )
        )
    return rows


def record(matrix: FaultMatrix, db: str | os.PathLike, argv: str = "") -> str:
    """Write the rows into the DB at ``db`` as one run (list ``collective-faults``); returns the run id."""
    from harness.results.rows import RunInfo
    from harness.results.store import ResultStore

    cfg = matrix.config
    with ResultStore(db) as store:
        run_id = store.begin_run(
            RunInfo(
                list_name=LIST_NAME,
                target=cfg.target,
                settings={
                    "kind": "collective-fault",
                    "backend": cfg.backend,
                    "world_size": cfg.world_size,
                    "settings": cfg.settings,
                    "scenarios": cfg.scenarios,
                    "fault_rank": cfg.fault_rank,
                    "fault_step": cfg.fault_step,
                    "steps": cfg.steps,
                    "spare": cfg.spare,
                    "timeout_s": cfg.timeout_s,
                },
                argv=argv,
            )
        )
        for row in to_rows(matrix, run_id):
            store.record_collective_fault(row)
        store.finish_run(run_id)
    return run_id


def as_json(matrix: FaultMatrix, run_id: str | None) -> dict:
    """The ``--json`` payload: the configuration and every scenario's measurements."""
    cfg = matrix.config
    return {
        "target": cfg.target,
        "backend": cfg.backend,
        "world_size": cfg.world_size,
        "config": cfg.as_dict(),
        "run_id": run_id,
        "wall_s": matrix.wall_s,
        "rows": [r.as_dict() for r in matrix.results],
        "references": [
            {"setting": r.setting, "restart_step": r.restart_step, "params_digest": r.params_digest}
            for r in matrix.references
        ],
    }


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _loss(r: ScenarioResult) -> str:
    if r.scenario == "none":
        return f"base {r.steps_per_s:.0f}/s" if r.steps_per_s else "base"
    return "-" if r.throughput_loss is None else f"{r.throughput_loss:.0%}"


def _yn(v: bool | None) -> str:
    return "-" if v is None else ("yes" if v else "NO")


COLUMNS = ("backend", "world", "setting", "scenario", "detected", "by", "detect s", "named", "clean exit",
           "nan caught", "flagged", "false flags", "tput loss", "recovered", "resume s", "params match")


def table_rows(results: Sequence[ScenarioResult]) -> list[tuple[str, ...]]:
    out = []
    for r in results:
        named = "-" if r.scenario == "none" else (f"rank {r.named_rank}" if r.named_rank is not None else "NO")
        if r.scenario != "none" and r.named_rank is not None and not r.rank_named:
            named += " (WRONG)"
        out.append((
            r.backend, str(r.world_size), r.setting, r.scenario,
            ("yes" if r.detected else "no") if r.scenario == "none" else _yn(r.detected),
            r.detected_by or "-", _s(r.detect_s), named, _yn(r.clean_exit), _yn(r.nan_caught), _yn(r.flagged),
            str(r.false_flags), _loss(r),
            _yn(r.recovered), _s(r.resume_s), _yn(r.params_match),
        ))
    return out


def render_table(rows: Sequence[tuple[str, ...]], head: str = "") -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(COLUMNS)]

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()

    lines = [head] if head else []
    lines += [fmt(COLUMNS), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in rows]
    return "\n".join(lines)


def format_table(matrix: FaultMatrix) -> str:
    """The matrix as a terminal table, with what every column means under it."""
    cfg = matrix.config
    head = (
        f"collective faults: target {cfg.target} ({cfg.backend}), world size {cfg.world_size}, bad rank "
        f"{cfg.fault_rank} from step {cfg.fault_step} of {cfg.steps}, {cfg.spare} spare(s), timeout "
        f"{cfg.timeout_s:g} s (collective {cfg.collective_timeout_s:g} s, stall {cfg.stall_s:g} s); "
        f"{matrix.wall_s:.0f} s"
    )
    notes = [r for r in matrix.results if r.timed_out or (r.error and not r.detected)]
    out = [render_table(table_rows(matrix.results), head)]
    out.append(
        "detect s / resume s: from the injection; by: stall (never arrived), exit, heartbeat, straggler, "
        f"finite_check, backend (a healthy rank's error); tput loss: steps/s after the fault vs the healthy run; "
        f"straggler: > 1 std and > {cfg.excess:.0%} above the peers' mean busy time"
    )
    for r in notes:
        out.append(f"  {r.scenario} ({r.setting}): {'TIMED OUT: ' if r.timed_out else ''}{r.error[:300]}")
    return "\n".join(out)
