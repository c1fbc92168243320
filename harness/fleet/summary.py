"""What a run of a list reports when it ends (`harness.fleet.runner.run_models`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunSummary:
    run_id: str
    db_path: str
    total: int
    resumed_skipped: int
    counts: dict[str, int]
    wall_s: float
    quarantined: list[str]
    faults_seen: int
    spares_used: list[str] = field(default_factory=list)
    unfinished: int = 0
    resumed_run: str | None = None  # the unfinished run this one continued
    with_fallback: dict[str, int] = field(default_factory=dict)  # outcome -> rows that used CPU fallback
    reruns: dict[str, int] = field(default_factory=dict)  # --rerun-flaky: models re-run, found flaky, stable
    run_counts: dict[str, int] = field(default_factory=dict)  # outcome -> rows of the whole run (resumes too)
    never_worked: str = ""  # why the target never ran a model, when it did not
    workers_started: int = 0  # worker processes (Ray: actors) started, replacements included
    confirmed: dict[str, int] = field(default_factory=dict)  # confirmation at full precision -> rows of the run

    @property
    def rows_written(self) -> int:
        return sum(self.counts.values())
