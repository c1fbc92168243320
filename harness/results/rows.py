"""The row contract between the worker, the runner and the store: typed, in one place.

A worker measures one attempt of one model on one device and returns a `Measurement`. The runner
decides the final outcome over all attempts (retries, flaky, quarantine) and turns the last
measurement into a `ResultRow` by adding the run-level fields. Every field the runner decides on is
a field here, so it is stored, resumed and merged like the rest: nothing travels as an untyped dict.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import importlib.metadata
import math
import re
import secrets
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True)
class Attempt:
    """One try of a model on one device, as the runner saw it."""

    device: str
    outcome: str  # an outcome, or "interrupted" (its device was quarantined mid-run)
    error_type: str = ""
    exit_code: int | None = None
    signal: int | None = None
    duration_s: float | None = None
    device_fault: bool = False
    phase: str = ""  # where a worker death or timeout struck (PHASES; "" for a result the worker sent)


@dataclass(kw_only=True)
class Measurement:
    """What one attempt measured: the worker's answer for one model on one device."""

    model_id: str
    outcome: str
    device: str = ""
    host: str = ""  # the machine whose device it ran on (a Ray run spans hosts; the runs table has the driver's)
    unsupported_op: str = ""
    unsupported_dtype: str = ""  # when the backend's message names one ("supports float32 only, got Long")
    error_type: str = ""
    error_message: str = ""
    traceback: str = ""
    first_drift_module: str = ""
    first_drift_module_type: str = ""
    first_drift_op: str = ""  # the first ATen op whose own result is beyond the declared precision
    first_drift_op_module: str = ""  # ... the module it ran in
    first_drift_op_inputs: list = field(default_factory=list)  # ... its tensor inputs, "float32[2, 16, 64]"
    first_drift_op_ratio: float | None = None
    ops_checked: int | None = None  # ops the kernel-conformance check judged (None: not run)
    # train mode (settings mode=train): the loss used, and the gradients' summary
    loss_kind: str = ""  # "model" (the head's loss on seeded labels) or "reduction (why)"
    grad_worst_ratio: float | None = None  # worst rmse ratio over the parameters' gradients
    first_drift_param: str = ""  # first parameter (module order) whose gradient is beyond the bound, else
    # the parameter the drifting kernel takes (or the nearest one of its module); error_message says which
    grad_norm_ratio: float | None = None  # ||all gradients|| on the target / on the reference
    loss_delta: float | None = None  # target loss - reference loss
    missing_grads: list = field(default_factory=list)  # parameters with a reference gradient, none on target
    # generate mode (settings mode=generate): per-step logits under teacher forcing, free-running tokens
    new_tokens: int | None = None  # tokens decoded (the steps judged)
    first_drift_step: int | None = None  # first step whose logits are beyond the bound (>= 1: the cache path);
    # where every step's logits are inside it but a kernel is not, the step that kernel ran in
    ref_tokens: list = field(default_factory=list)  # the reference's greedy tokens, one list per batch row
    target_tokens: list = field(default_factory=list)  # the target's own (free-running) greedy tokens
    token_text: dict = field(default_factory=dict)  # token id (str) -> its text, from the checkpoint's tokenizer
    tokens_matched: int | None = None  # steps at which every row's free-running token matched, before the first
    first_divergent_step: int | None = None  # ... that did not (None: all N matched)
    divergence_margin: float | None = None  # the reference's top-2 logit margin there
    divergence_envelope: float | None = None  # ... what the declared precision may move it by
    divergence: str = ""  # "near-tie" (margin within the envelope) or "bug"; "" when nothing diverged
    ops_sampled_out: int | None = None  # op calls the sampled check left unjudged (None: every call judged)
    repro_path: str = ""  # standalone repro script of the first diverging op
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    min_cosine: float | None = None
    rmse_ratio: float | None = None  # worst output's error / the fp32 envelope (> 1: outside it)
    declared_ratio: float | None = None  # ... / the declared-precision envelope (> 1: drift)
    contract: str = ""  # the numerics contract the target declared (fp32, bf16-matmul, ...)
    # the confirmation of a pass within the declared precision at the device's highest (harness.run.variants):
    confirm: str = ""  # confirmed, unconfirmed (could not: confirm_note says why), hidden drift; "" not asked
    confirm_note: str = ""  # what the confirmation found, or why there was none
    parallel: dict = field(default_factory=dict)  # --parallel: the spec, the mesh, each rank's device, phase, gap
    collectives: dict = field(default_factory=dict)  # --parallel --perf: each collective setting's step and ratio
    earlier_outcome: str = ""  # a worker that died or hung in a later phase: what the step was before (pass_declared)
    metrics: dict = field(default_factory=dict)
    nonfinite: bool = False  # the target produced NaN/inf where the reference did not
    device_fault: bool = False  # the backend adapter blamed the device, not the model
    device_unreachable: bool = False  # ... its client could not reach it at all (connection refused)
    fallback_ops: dict = field(default_factory=dict)  # op -> calls that ran on the CPU instead of the target
    native_ops: list = field(default_factory=list)  # ops the target ran itself (when its backend reports them)
    op_census: bool = False  # whether the backend reported fallback/native ops at all
    exit_code: int | None = None
    signal: int | None = None
    load_time_s: float | None = None
    ref_time_s: float | None = None
    expected_time_s: float | None = None  # the contract-emulating CPU reference
    target_time_s: float | None = None
    wall_time_s: float | None = None
    peak_rss_mb: float | None = None
    phases: dict = field(default_factory=dict)  # phase (PHASES) -> {"s": seconds, "peak_rss_mb": MB}
    oracle: str = ""  # which fp64 rule judged it: fp64-copy, fp64-streamed, none (why)
    # --perf (harness.run.perf): the step timed after the verdict; medians here, the summaries
    # (harness.speed.summarize), the op profile and any failure in `perf`
    perf_target_s: float | None = None  # the target's step, synchronized
    perf_ref_s: float | None = None  # the same step on the CPU reference
    perf_ratio: float | None = None  # target / reference, median over interleaved rounds (what gates)
    perf_speedup: float | None = None  # eager / compiled on the target (with --compile)
    perf_rounds: int | None = None  # timed rounds (every step once per round)
    perf_peak_mem_mb: float | None = None  # the device's peak allocated memory while timed (where it reports one)
    perf: dict = field(default_factory=dict)
    ref_cache: str = ""  # the reference side: "cached", "stored", "computed (why not stored)"; "" without a cache
    ref_key: str = ""  # its reference-cache key
    worker_output: str = ""  # what the worker printed (stdout and stderr, native code's too) while it ran the
    # model, the tail (harness.fleet.capture): warnings and a fatal signal's report, kept off the terminal
    # run --harvest / ops harvest (harness.ops.harvest): the op variations the reference step called,
    # {"uses": {variation id: calls}, "specs": {variation id: signature}}; the runner moves them into the
    # `op_uses` and `variations` tables (`OpUseRow`, `VariationRow`), so a stored row holds none
    harvest: dict = field(default_factory=dict)

    # --compile (harness.run.compiled): what compiling made and cost, apart from the run's seconds
    compile_stage: str = ""  # compile_fail: Dynamo trace, AOT/functionalization, Inductor graph passes or backend
    # codegen; also an unsupported_op the backend refused while the compiler ran it
    compile_node: str = ""  # ... the op or graph node the compiler's error names
    graph_count: int | None = None  # graphs Dynamo compiled
    graph_breaks: int | None = None
    graph_break_reasons: list = field(default_factory=list)  # the first three, one line each
    recompiles: int | None = None
    compile_s: float | None = None  # the compiler's wall time (Dynamo, AOTAutograd, the backend)
    compile_cache: str = ""  # cold (every graph compiled), warm (the FX graph cache served all), mixed; rebuilt
    # (the run's cache failed it: compiled again in a fresh one, the damaged entries dropped)
    eager_outcome: str = ""  # a compiled row that did not pass: the same step, eager, on the same device
    amp_step_skipped: str = ""  # --amp fp16 train: the loss scaler skipped the step on "both" sides, the "target
    # only" (drift), or the "reference only" (its gradients overflowed: the loss is what is judged)


def compile_summary(row: Mapping[str, Any]) -> str:
    """``1 graph, 0 breaks, 0 recompiles, compile 12.3 s (cold); eager: pass_declared`` ("" if not compiled)."""
    def given(v: Any) -> bool:
        return v is not None and not (isinstance(v, float) and math.isnan(v)) and v != ""

    if not any(given(row.get(k)) for k in ("graph_count", "compile_s", "compile_stage")):
        return ""
    parts = []
    if given(row.get("compile_stage")):
        parts.append(f"failed in {row['compile_stage']}" + (f" at {row['compile_node']}" if row.get("compile_node") else ""))
    for key, word in (("graph_count", "graph"), ("graph_breaks", "break"), ("recompiles", "recompile")):
        n = row.get(key)
        if given(n):
            parts.append(f"{int(n)} {word}{'' if int(n) == 1 else 's'}")
    secs = row.get("compile_s")
    if given(secs):
        parts.append(f"compile {secs:.1f} s" + (f" ({row['compile_cache']})" if given(row.get("compile_cache")) else ""))
    if given(row.get("eager_outcome")):
        parts.append(f"eager on the same device: {row['eager_outcome']}")
    return ", ".join(parts)


_LONG_FLOAT = re.compile(r"(?<![\w.])-?\d+\.\d{5,}(?:[eE][-+]?\d+)?(?![\w.])")


def round_floats(text: str) -> str:
    """A message's long floats as people read them, three significant digits ("rmse ratio 65.1", not
    65.05722897265998; rows written before messages rounded their numbers)."""
    return _LONG_FLOAT.sub(lambda m: f"{float(m.group()):.3g}", text)


def step_output(k: int) -> str:
    """The `metrics` name of decoding step k's logits (generate mode)."""
    return f"logits/step{k}"


def output_step(name: str) -> int | None:
    """The decoding step a `metrics` name is for (None: not a step's logits)."""
    head, _, k = name.rpartition("/step")
    return int(k) if head == "logits" and k.isdigit() else None


@dataclass(kw_only=True)
class ResultRow(Measurement):
    """The classified outcome of one model on one target with one settings dict (a `results` row)."""

    run_id: str
    target: str
    settings: dict
    arch: str = ""
    task: str = ""
    modality: str = ""
    attempts: list = field(default_factory=list)  # Attempt dicts, oldest first
    torch_version: str = ""
    transformers_version: str = ""
    harness_version: str = ""
    finished_at: str = ""

    @classmethod
    def from_measurement(cls, m: Measurement, **run_fields: Any) -> ResultRow:
        """`m` plus the run-level fields (run_id, target, settings, outcome override, attempts...)."""
        values = {f.name: getattr(m, f.name) for f in dataclasses.fields(Measurement)}
        values.update(run_fields)
        return cls(**values)


@dataclass
class RunInfo:
    """One invocation of the runner over a model list for one target and settings (a `runs` row)."""

    list_name: str
    target: str
    settings: dict
    shard: str = "1/1"
    argv: str = ""
    run_id: str = ""
    started_at: str = ""
    torch_version: str = ""
    transformers_version: str = ""
    harness_version: str = ""
    host: str = ""


@dataclass
class VariationRow:
    """One op variation (an overload with one input signature, `harness.ops.signature`), as the run that found
    it recorded it (a `variations` row): what a worker regenerates its inputs from."""

    run_id: str
    variation_id: str  # aten::addmm.default#3fa2c0d1e9
    op: str  # the op as backends and model rows name it: aten::addmm, aten::sort.stable
    spec: dict  # the signature and what was seen of the values; OpInfo's: the sample's name, dtype and index
    source: str = "models"  # models: harvested from a list's models; opinfo: one of PyTorch's OpInfo samples
    inputs: list = field(default_factory=list)  # "float32[2, 16, 64]" per tensor argument (views read this, not spec)
    finished_at: str = ""


@dataclass
class OpUseRow:
    """The variations one model's reference step called and how often (an `op_uses` row): the harvest of
    one model under the settings that shape its step (`harvest`: mode, dtype, attention, seed ...)."""

    run_id: str
    model_id: str
    harvest: str  # canonical JSON of those settings (harness.results.variations.harvest_identity)
    uses: dict  # variation id -> calls
    n_variations: int = 0
    calls: int = 0
    finished_at: str = ""


@dataclass
class PlannedRow:
    """One job a run was started to finish (a `run_plan` row). A run is finished when every planned job has
    its row, so a resume that runs fewer of them (a narrower --limit or --only) can never close it."""

    run_id: str
    model_id: str  # a model id, or a variation id in an op run
    planned_at: str = ""


@dataclass
class CollectiveRow:
    """Timing of one collective op at one size and setting, relative to a baseline setting."""

    run_id: str
    target: str
    backend: str
    world_size: int
    op: str
    size_bytes: int
    setting: str
    settings: dict
    baseline_setting: str
    median_s: float
    p10_s: float
    p90_s: float
    repeats: int
    ratio: float | None
    ratio_p10: float | None
    ratio_p90: float | None
    finished_at: str = ""


@dataclass
class CollectiveFaultRow:
    """One fault scenario (one bad rank) on one backend, collective setting and world size.

    Times are seconds from the fault's injection. ``nan_caught``, ``flagged``, ``recovered`` and
    ``params_match`` are 1/0, or None where the scenario does not ask the question (a bool column
    would store "not applicable" as 0).
    """

    run_id: str
    target: str
    backend: str
    world_size: int
    setting: str
    scenario: str
    settings: dict
    fault_rank: int
    fault_step: int
    steps: int
    spare: int
    timeout_s: float
    detected: bool
    detected_by: str
    detect_s: float | None
    rank_named: bool
    named_rank: int | None
    named_by: str
    backend_error: bool
    backend_error_s: float | None
    clean_exit: bool
    nan_caught: int | None
    flagged: int | None
    false_flags: int
    throughput_loss: float | None
    recovered: int | None
    restart_step: int | None
    steps_lost: int | None
    resume_s: float | None
    params_match: int | None
    completed_steps: int
    timed_out: bool
    wall_s: float
    detail: str = ""
    error: str = ""
    finished_at: str = ""


@dataclass
class PlacementRow:
    """One placement scenario (per-chip, host, shared:K, rl) on one backend (`harness.bench.placement`).

    ``slowdown`` is the worst process's ratio of per-step medians together against alone, with its 95%
    interval; ``identical`` and ``latest_weights`` are 1/0, or None where the scenario did not ask (a refused
    one, or latest_weights outside rl); ``per_process`` has each process's own numbers."""

    run_id: str
    target: str
    backend: str
    scenario: str
    mode: str  # how the backend's devices take processes: exclusive, shared, unknown
    settings: dict
    result: str  # allowed, refused, timeout, failed (a placement's, not a model's outcome)
    processes: int
    devices: list
    refusal: str = ""
    refused_role: str = ""
    holder: int | None = None
    holder_role: str = ""
    refusal_s: float | None = None
    slowdown: float | None = None
    slowdown_lo: float | None = None
    slowdown_hi: float | None = None
    identical: int | None = None
    latest_weights: int | None = None
    visibility: str = ""
    peak_mb: float | None = None
    handoff_ms: float | None = None
    wall_s: float = 0.0
    per_process: list = field(default_factory=list)
    detail: str = ""
    error: str = ""
    finished_at: str = ""


# ----------------------------------------------------------------------------------------------
# Column types, from the real annotations (not their text)
# ----------------------------------------------------------------------------------------------

SQL_TYPES = {bool: "INTEGER", int: "INTEGER", float: "REAL", str: "TEXT", dict: "TEXT", list: "TEXT"}


def _base_type(hint: Any) -> type:
    """`float | None` -> float, `dict[str, int]` -> dict, `str` -> str."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return typing.get_origin(hint) or hint


@functools.cache
def column_types(cls: type) -> dict[str, type]:
    """Field name -> Python base type (bool/int/float/str/dict/list) for a row dataclass."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        base = _base_type(hints[f.name])
        if base not in SQL_TYPES:
            raise TypeError(f"{cls.__name__}.{f.name}: unsupported column type {hints[f.name]!r}")
        out[f.name] = base
    return out


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


# ----------------------------------------------------------------------------------------------
# Stamps
# ----------------------------------------------------------------------------------------------


def utc_now() -> str:
    """ISO-8601 UTC timestamp with seconds, sortable as text."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def new_run_id() -> str:
    """UTC timestamp plus a short random suffix: sortable by time and unique across shards."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{secrets.token_hex(3)}"


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


@functools.lru_cache(maxsize=1)
def versions() -> dict[str, str]:
    """Versions without importing torch/transformers (importing torch costs seconds per process)."""
    from harness import __version__

    return {
        "torch_version": _dist_version("torch"),
        "transformers_version": _dist_version("transformers"),
        "harness_version": __version__,
    }
