"""A run's configuration: which target and settings, how defensively, and the ranges the runner relies on
(checked before any work: a value outside them would hang the run or mislabel every model)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.fleet.budgets import Budgets
from harness.fleet.executor import executor_for
from harness.run.perf import HARD_CAP


@dataclass
class RunConfig:
    """How to run a list: which target, with which backend settings, and how defensively."""

    target: str = "sim"
    settings: dict[str, Any] = field(default_factory=lambda: {"precision": "default", "ops": "young"})
    jobs: int = 1  # workers; 0 with the ray executor: one actor per device of the cluster
    timeout_s: float = 300.0  # per model, from the end of its loading
    load_timeout_s: float = 900.0  # loading's own budget
    compile_timeout_s: float = 600.0  # the compiler's own budget (--compile), each time it runs
    retries: int = 1  # extra attempts per model for suspicious failures
    spare: int = 0  # devices held back as hot spares
    quarantine_after: int = 2  # strikes before a device is quarantined
    mem_cap_mb: int | None = 8192  # address space a worker may add after start-up
    seed: int = 0
    localize: bool = True
    startup_timeout_s: float = 300.0  # a worker that is not ready by then fails the run with a clear error
    devices: list[str] | None = None  # default: every device of the target's type
    backends: list[str] = field(default_factory=list)  # modules that register the target's backend
    repro_dir: str | None = None  # first-diverging-op repros (default: "<db>-repro/" next to the DB)
    ref_cache: str | None = None  # reference cache directory shared by runs, shards and hosts (None: none)
    compile_cache: str | None = None  # --compile: caches (default: "<db>-compile-cache/" next to the DB)
    progress: bool = True
    fork_workers: bool = False  # workers fork from this process instead of a forkserver (one `check`)
    rerun_flaky: int = 0  # after the run, sample models whose attempts disagreed this many more times
    executor: str = "local"  # local: worker processes on this host; ray: one actor per device of a Ray cluster
    ray_address: str | None = None  # auto, HOST:PORT, ray://HOST:PORT; None: a Ray instance of this host alone
    perf: bool = False  # time each model's step after its verdict (harness.run.perf); not part of the run's identity
    perf_budget_s: float = 1.0  # seconds of timed rounds per model (harness.run.context.DEFAULT_BUDGET_S)
    harvest: bool = False  # record each model's op calls as variations (run --harvest); not part of the run's identity
    collectives: list[str] = field(default_factory=list)  # --parallel --perf: collective settings timed per model

    @property
    def budgets(self) -> Budgets:
        return Budgets(self.timeout_s, self.load_timeout_s, self.compile_timeout_s)

    def validate(self) -> None:
        """Ranges the runner relies on (it would hang or mislabel every model otherwise)."""
        executor = executor_for(self.executor)  # ValueError naming the choices
        checks = [
            (self.ray_address is None or executor.address_option, f"--ray-address {self.ray_address}: needs --executor ray"),
            (self.jobs >= 1 or (self.jobs == 0 and executor.all_devices_by_default),
             f"--jobs {self.jobs}: need at least 1 worker"),
            (self.timeout_s > 0, f"--timeout {self.timeout_s}: must be > 0 seconds"),
            (self.load_timeout_s > 0, f"--load-timeout {self.load_timeout_s}: must be > 0 seconds"),
            (self.compile_timeout_s > 0, f"--compile-timeout {self.compile_timeout_s}: must be > 0 seconds"),
            (self.retries >= 0, f"--retries {self.retries}: must be >= 0"),
            (self.spare >= 0, f"--spare {self.spare}: must be >= 0"),
            (self.quarantine_after >= 1, f"--quarantine-after {self.quarantine_after}: must be >= 1"),
            (self.mem_cap_mb is None or self.mem_cap_mb >= 0, f"--mem-cap-mb {self.mem_cap_mb}: must be >= 0 (0: no cap)"),
            (self.startup_timeout_s > 0, f"startup timeout {self.startup_timeout_s}: must be > 0"),
            (self.rerun_flaky >= 0, f"--rerun-flaky {self.rerun_flaky}: must be >= 0"),
            (0 <= self.seed < 2**32, f"--seed {self.seed}: must be from 0 to 2**32 - 1 (the random generators' range)"),
            (0 < self.perf_budget_s <= 600, f"--perf-budget {self.perf_budget_s}: must be > 0 and at most 600 seconds"),
            (not self.perf or self.perf_budget_s * HARD_CAP < self.timeout_s,
             f"--perf-budget {self.perf_budget_s}: a slow model may take {HARD_CAP:g}x that, past --timeout "
             f"{self.timeout_s:g}; raise --timeout or lower the budget"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def compile_cache_root(config: RunConfig, db: str | os.PathLike) -> str:
    """Where --compile keeps its caches: --compile-cache, else ``<db>-compile-cache/`` beside the DB."""
    p = Path(db)
    return config.compile_cache or str(p.with_name(p.stem + "-compile-cache"))


def check_compile_cache(config: RunConfig, db: str | os.PathLike) -> None:
    """OutputError (one line, before the banner) unless a compiled run can keep its caches where it would:
    a file there or above it, or storage that refuses writes, made every model its own crash."""
    if "compile" in config.settings:
        from harness.files import check_writable, probe_writable

        root = compile_cache_root(config, db)
        check_writable(root, create_parents=True, directory=True)
        probe_writable(root)
