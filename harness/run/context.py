"""What one model's run knows: the task the fleet hands a worker (`Task`), and, once the model is loaded, the
context every later phase reads (`ModelRun`) instead of a dozen parameters each.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.backends import Adapter
from harness.backends.contracts import Contract
from harness.models.inputs import make_inputs
from harness.models.load import LoadedModel, load_model
from harness.models.model_list import ModelEntry
from harness.results.draft import RowDraft
from harness.run.compare import Tolerance
from harness.run.memory import PhaseClock
from harness.run.modes import Mode, Plan

DEFAULT_BUDGET_S = 1.0  # at most this many seconds of timed rounds per model (all steps together), after warm-up


@dataclass
class Task:
    """One model to run on one target device with the given backend settings."""

    entry: dict[str, Any]
    target: str  # device string: "sim:1", "cuda:0", "cpu"
    settings: dict[str, Any] = field(default_factory=dict)  # precision, ops, attn
    seed: int = 0
    localize: bool = True
    repro_dir: str = ""  # where the first diverging op's standalone repro goes ("" = none)
    backends: list[str] = field(default_factory=list)  # modules the repro imports to get the backend
    ref_cache: str = ""  # reference cache directory ("" = none: the reference side is computed)
    perf: bool = False  # time the step after the verdict (harness.run.perf)
    perf_budget_s: float = DEFAULT_BUDGET_S
    compile_cache: str = ""  # --compile: Inductor's cache directory ("" = torch's default)
    quiet_lock: str = ""  # --perf beside other workers: the run's lock file (its worker takes it)
    quiet_wait_s: float = 30.0  # the longest wait for it
    kind: str = "model"  # what the job is: a model's run; "harvest": its reference step, op calls recorded
    # (harness.ops.harvest); "variation": one op variation on the target (harness.ops.variation)
    variation: dict = field(default_factory=dict)  # kind "variation": its signature (entry["id"] is its id)
    harvest: bool = False  # kind "model": also record the reference step's op calls (run --harvest)
    timeout_s: float = 600.0  # the job's --timeout: a parallel step's ranks are stopped before it
    collectives: list[str] = field(default_factory=list)  # --parallel --perf: the settings its step is timed under


class Stop(Exception):
    """The model's row ends here, with these fields (checked as row fields where it is raised)."""

    def __init__(self, fields: Mapping[str, Any]) -> None:
        self.fields = fields if isinstance(fields, RowDraft) else RowDraft(fields)
        super().__init__(self.fields.row.outcome)


@dataclass
class ReferenceSide:
    plan: Plan
    ref: dict[str, torch.Tensor]
    oracle: dict[str, torch.Tensor] | None
    oracle_rule: str  # which rule judges the row (fp64-copy, fp64-streamed, none (...))
    oracle_model: torch.nn.Module | None  # the fp64 copy, for module-level localization
    expected: dict[str, torch.Tensor] | None  # None: the contract is exact, or the model cannot run emulated
    ref_s: float
    cached: bool = False  # from the reference cache: nothing above was computed, the model was not run
    fields: RowDraft = field(default_factory=RowDraft)  # the row's ref_cache and ref_key


def load(entry: ModelEntry, task: Task) -> tuple[LoadedModel, dict[str, Any]]:
    """The model as the task builds it, and its seeded inputs."""
    loaded = load_model(entry, seed=task.seed, attn_implementation=task.settings.get("attn"),
                        dtype=task.settings.get("dtype"))
    return loaded, make_inputs(loaded.model, loaded.config, entry, seed=task.seed)


@dataclass
class ModelRun:
    """One model on its way through the pipeline, after loading."""

    entry: ModelEntry
    task: Task
    mode: Mode
    adapter: Adapter
    clock: PhaseClock
    loaded: LoadedModel
    inputs: dict[str, Any]  # the model's own inputs (the plan's step may add labels)
    declared: Contract  # what the target declares under the run's settings
    tol: Tolerance
    side: ReferenceSide | None = None  # the reference side, once computed or found in the cache
    keep_cpu: bool = False  # the CPU model stays on the CPU (the target gets a copy)
    small: bool = True  # a copy of the model fits beside it (harness.run.oracle.COPY_MAX_PARAMS)
    localizes: bool = False  # a drift is localized to a module (small models, eager, a mode that names modules)
    parallel: Any = None  # --parallel: the ranks' target side (harness.parallel.launch.Parallel, the worker's)
    recorder: Any = None  # run --harvest: a dispatch mode recording the reference step's op calls
    # (harness.ops.harvest.Harvest, handed in by the worker); the reference's first run runs under it

    @property
    def device(self) -> str:
        return self.task.target

    @property
    def settings(self) -> dict[str, Any]:
        return self.task.settings

    @property
    def model(self) -> torch.nn.Module:
        """The model as loaded: on the CPU unless the target took it in place (`keep_cpu` false)."""
        return self.loaded.model

    @property
    def cpu_model(self) -> torch.nn.Module | None:
        """The CPU model, where it was kept."""
        return self.model if self.keep_cpu else None

    def fresh_model(self) -> tuple[torch.nn.Module, bool]:
        """A model for another run on the device, unlike the one a run left there (compiled, perhaps half-way
        through a failure; Dynamo may still hold its parameters, and a backend that moves them by swap_tensors
        refuses to move them again): (model, whether the target must copy it). The kept CPU model is copied;
        a small one that went to the device in place is built again, prepared as its plan prepares it; a real
        checkpoint is not loaded twice: the one on the device runs again, uncompiled."""
        if self.keep_cpu:
            return self.model, True
        if not self.small:
            self.model._compiled_call_impl = None  # what Module.compile set: it runs eagerly again
            return self.model, False
        assert self.side is not None
        loaded, inputs = load(self.entry, self.task)
        self.mode.rebuild(loaded.model, loaded, self.entry, inputs, self.task.seed, self.side.plan.fields)
        return loaded.model, False

    def cpu_models(self) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        """The CPU model and its fp64 copy (where the oracle was one), for localizing a drift: the ones the
        reference side kept, else built again (a reference side from the cache, a model moved in place)."""
        assert self.side is not None
        if not self.side.cached and self.keep_cpu:
            return self.model, self.side.oracle_model
        model, _copy = self.fresh_model()
        return model, copy.deepcopy(model).double() if self.side.oracle_rule == "fp64-copy" else None
