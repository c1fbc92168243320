"""Night-to-night diff of two runs: what regressed, what got fixed, what merely changed.

The nightly CI gates on :func:`main_diff`'s exit code, so the classification is deliberately
conservative about what counts as a *target regression*:

* a model whose reference (CPU) run or loading failed on either side says nothing about the target
  backend, and neither does a device error (the model is re-run); such changes are reported under
  ``ref_changes``, never as regressions;
* a model whose head outcome is ``flaky``, or whose id matches the known-flaky allowlist (like
  PyTorch's dynamo CI flaky list), is reported but does not fail the gate;
* drift growth gates only when the model was already drifting and its rmse ratio grew by more
  than ``drift_factor``; growth among passing models is informational (``drift_warnings``);
* a model measured with ``--perf`` in both runs is a *perf regression* when it got slower by the
  threshold beyond both runs' own noise (`harness.analysis.perfgate`); perf regressions gate like the
  numeric ones, in a section of their own, except for models on the perf allowlist.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from harness import files
from harness.analysis.fingerprint import group_key, is_failure, key_label
from harness.analysis.matrix import column_records, with_config
from harness.analysis.perfgate import PerfGate, format_gate, gate
from harness.outcomes import NOT_THE_MODELS, severity
from harness.results.dbfile import StoreError
from harness.results.store import ResultStore
from harness.results.variations import default_run
from harness.speed import DEFAULT_THRESHOLD

DEFAULT_DRIFT_FACTOR = 2.0


@dataclass
class Change:
    """One (model, config) whose outcome or drift differs between base and head."""

    model_id: str
    config: str
    base_outcome: str | None
    head_outcome: str | None
    base_rmse_ratio: float | None = None
    head_rmse_ratio: float | None = None
    direction: str = ""  # worse / better / same
    detail: str = ""  # head error type/op/message, for the summary line
    group: str = ""  # the head row's failure fingerprint (harness.analysis.fingerprint), if it failed


@dataclass
class DiffResult:
    """Classified differences between a base and a head run."""

    base_run: str
    head_run: str
    drift_factor: float = DEFAULT_DRIFT_FACTOR
    new_failures: list[Change] = field(default_factory=list)
    fixes: list[Change] = field(default_factory=list)
    outcome_changes: list[Change] = field(default_factory=list)
    drift_grew: list[Change] = field(default_factory=list)
    drift_warnings: list[Change] = field(default_factory=list)
    ref_changes: list[Change] = field(default_factory=list)
    flaky: list[Change] = field(default_factory=list)
    allowlisted: list[Change] = field(default_factory=list)
    added: list[Change] = field(default_factory=list)
    removed: list[Change] = field(default_factory=list)
    unchanged: int = 0
    perf: PerfGate = field(default_factory=PerfGate)  # models timed (--perf) in both runs

    @property
    def regressions(self) -> list[Change]:
        """The outcome and numeric regressions: new failures, worse target outcomes, drift growth (allowlist
        excluded). Perf regressions are `perf.regressions`; `failed` is either."""
        worse = [c for c in self.outcome_changes if c.direction == "worse"]
        return [*self.new_failures, *worse, *self.drift_grew]

    @property
    def failed(self) -> bool:
        """Whether the gate fails: a regression, a perf regression, or a kernel regression."""
        return bool(self.regressions or self.perf.regressions or self.perf.kernels or self.perf.settings)

    def regression_groups(self) -> list[tuple[str, list[Change]]]:
        """Regressions grouped by the head row's failure fingerprint, biggest group first: 157 models
        newly failing on one missing op read as one line."""
        groups: dict[str, list[Change]] = {}
        for c in self.regressions:
            groups.setdefault(c.group or f"{c.head_outcome or '-'} (drift grew)", []).append(c)
        return sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (``--json`` and the report's diff page)."""
        out = dataclasses.asdict(self)
        out["regressions"] = [dataclasses.asdict(c) for c in self.regressions]
        out["n_regressions"] = len(self.regressions)
        out["n_perf_regressions"] = len(self.perf.regressions)
        out["n_kernel_regressions"] = len(self.perf.kernels)
        out["n_setting_regressions"] = len(self.perf.settings)
        out["n_perf_inconclusive"] = len(self.perf.inconclusive)
        out["perf"] = self.perf.to_dict()
        out["regression_groups"] = [
            {"group": g, "count": len(items), "models": sorted({c.model_id for c in items})}
            for g, items in self.regression_groups()
        ]
        return _finite(out)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _ratio(value: Any) -> float | None:
    if value is None:
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def load_allowlist(path: str | os.PathLike | None) -> list[str]:
    """Known-flaky model id patterns: one per line, ``#`` comments, fnmatch wildcards allowed."""
    if path is None:
        return []
    patterns = []
    for line in files.read_text(path, "--flaky-allowlist").splitlines():
        entry = line.split("#", 1)[0].strip()
        if entry:
            patterns.append(entry)
    return patterns


def _allowed(model_id: str, patterns: list[str]) -> bool:
    return any(model_id == p or fnmatch.fnmatchcase(model_id, p) for p in patterns)


def _detail(row: dict[str, Any] | None) -> str:
    if row is None:
        return ""
    parts = [str(row.get(k) or "") for k in ("unsupported_op", "error_type")]
    msg = str(row.get("error_message") or "").strip().splitlines()
    if msg:
        parts.append(msg[0][:160])
    if row.get("outcome") == "drift" and _ratio(row.get("rmse_ratio")) is not None:
        parts.append(f"rmse_ratio={_ratio(row.get('rmse_ratio')):.3g}")
    return "; ".join(p for p in parts if p)


def _group(row: dict[str, Any] | None) -> str:
    if row is None or not is_failure(str(row.get("outcome") or "")):
        return ""
    return key_label(group_key(row))


_COLUMNS = ("model_id", "config", "outcome", "rmse_ratio", "unsupported_op", "error_type", "error_message",
            "first_drift_module_type", "perf")


def _index(df: pd.DataFrame) -> dict[tuple[str, str], dict[str, Any]]:
    """(model, config) -> row; with several runs in ``df`` the latest run's row wins.

    Only the columns the diff reads are kept: a night's frame carries metrics and tracebacks that
    would make this the slowest step of the report."""
    df = with_config(df)
    if df.empty:
        return {}
    if "run_started_at" in df.columns:
        df = df.sort_values("run_started_at", kind="stable")
    return {(r["model_id"], r["config"]): r for r in column_records(df, _COLUMNS)}


def diff_runs(
    base_df: pd.DataFrame,
    head_df: pd.DataFrame,
    *,
    base_run: str = "",
    head_run: str = "",
    drift_factor: float = DEFAULT_DRIFT_FACTOR,
    flaky_allowlist: list[str] | None = None,
    perf_threshold: float = DEFAULT_THRESHOLD,
    perf_allowlist: dict[str, str] | None = None,
) -> DiffResult:
    """Classify every (model, target+settings) between two result frames; see the module docstring."""
    if drift_factor <= 1.0:
        raise ValueError(f"drift_factor must be > 1, got {drift_factor}")
    patterns = list(flaky_allowlist or [])
    base, head = _index(base_df), _index(head_df)
    base, head = _one_to_one(base, head)
    res = DiffResult(base_run=base_run, head_run=head_run, drift_factor=drift_factor)
    res.perf = gate([(k[0], k[1], base[k], head[k]) for k in sorted(base.keys() & head.keys())],
                    threshold=perf_threshold, allowlist=perf_allowlist)
    for key in sorted(base.keys() | head.keys()):
        b, h = base.get(key), head.get(key)
        bo = None if b is None else str(b["outcome"])
        ho = None if h is None else str(h["outcome"])
        ch = Change(
            model_id=key[0],
            config=key[1],
            base_outcome=bo,
            head_outcome=ho,
            base_rmse_ratio=None if b is None else _ratio(b.get("rmse_ratio")),
            head_rmse_ratio=None if h is None else _ratio(h.get("rmse_ratio")),
            detail=_detail(h if h is not None else b),
            group=_group(h),
        )
        if b is None:
            res.added.append(ch)
            if ho == "flaky":
                res.flaky.append(ch)
            continue
        if h is None:
            res.removed.append(ch)
            continue
        assert bo is not None and ho is not None
        sb, sh = severity(bo), severity(ho)
        ch.direction = "worse" if sh > sb else "better" if sh < sb else "same"
        allowed = _allowed(key[0], patterns)
        if ho == "flaky":
            res.flaky.append(ch)
        if bo == ho:
            grew = (
                ch.base_rmse_ratio is not None
                and ch.head_rmse_ratio is not None
                and ch.base_rmse_ratio > 0
                and ch.head_rmse_ratio > ch.base_rmse_ratio * drift_factor
            )
            if grew and ho == "drift":
                ch.direction = "worse"
                (res.allowlisted if allowed else res.drift_grew).append(ch)
            elif grew:
                res.drift_warnings.append(ch)
            else:
                res.unchanged += 1
            continue
        if bo in NOT_THE_MODELS or ho in NOT_THE_MODELS:
            res.ref_changes.append(ch)
        elif ho == "flaky":
            pass  # reported under flaky; flakiness is not a regression
        elif bo in ("pass", "flaky") and ch.direction == "worse":
            (res.allowlisted if allowed else res.new_failures).append(ch)
        elif ho == "pass":
            res.fixes.append(ch)
        elif ch.direction == "worse" and allowed:
            res.allowlisted.append(ch)
        else:
            res.outcome_changes.append(ch)
    return res


def _one_to_one(base: dict[tuple[str, str], Any], head: dict[tuple[str, str], Any]
                ) -> tuple[dict[tuple[str, str], Any], dict[tuple[str, str], Any]]:
    """Two runs of one configuration each, but different ones (named on purpose: --base RUN --head RUN, e.g.
    without and with a setting) are compared model by model, under the label ``base config -> head config``."""
    b_cfg, h_cfg = {k[1] for k in base}, {k[1] for k in head}
    if len(b_cfg) != 1 or len(h_cfg) != 1 or b_cfg == h_cfg:
        return base, head
    label = f"{b_cfg.pop()} -> {h_cfg.pop()}"
    return {(k[0], label): v for k, v in base.items()}, {(k[0], label): v for k, v in head.items()}


# ----------------------------------------------------------------------------------------------
# Choosing runs
# ----------------------------------------------------------------------------------------------


def previous_comparable(store: ResultStore, head_run: str) -> str | None:
    """The latest run started before ``head_run`` with the same list, target and settings."""
    runs = store.runs()
    if runs.empty or head_run not in set(runs.run_id):
        return None
    head = runs[runs.run_id == head_run].iloc[0]
    same = runs[
        (runs.list_name == head.list_name)
        & (runs.target == head.target)
        & (runs.settings_json == head.settings_json)
        & (runs.run_id != head_run)
        & (runs.started_at <= head.started_at)
        & (runs.n_results > 0)
    ]
    return None if same.empty else str(same.iloc[0].run_id)  # runs() is newest first


def resolve_runs(
    *,
    db: str | None = None,
    base: str | None = None,
    head: str | None = None,
    base_db: str | None = None,
    head_db: str | None = None,
    night: bool = False,
) -> tuple[tuple[str, pd.DataFrame], tuple[str, pd.DataFrame]]:
    """Load (run id, results) for base and head from one DB (latest two comparable) or two DBs.

    With ``night`` and two DBs, each side is the latest run of every configuration in its DB (merged
    nightly DBs holding several settings); changes are matched per (model, configuration)."""
    head_path = head_db or db
    base_path = base_db or head_path
    if head_path is None:
        raise StoreError("diff needs --db, or --base-db and --head-db")
    for p in {head_path, base_path}:
        if not Path(p).exists():
            raise StoreError(f"{p} does not exist")
    if night and base is None and head is None and Path(base_path).resolve() != Path(head_path).resolve():
        return _night(base_path), _night(head_path)
    with ResultStore(head_path, read_only=True) as hs:
        head_id = head or default_run(hs, ("models", "ops"))
        if head_id is None:
            raise StoreError(f"{head_path} contains no model results")
        head_df = hs.results(head_id)
        head_run = _identity(hs, head_id)
        if Path(base_path).resolve() == Path(head_path).resolve():
            base_id = base or previous_comparable(hs, head_id)
            if base_id is None:
                raise StoreError(
                    f"{head_path} has no earlier run comparable to {head_id} (same list, target, settings); "
                    "pass --base RUN or --base-db PATH"
                )
            _require_comparable((base_path, base_id, _identity(hs, base_id)), (head_path, head_id, head_run),
                                named=bool(base and head))
            return (base_id, hs.results(base_id)), (head_id, head_df)
    with ResultStore(base_path, read_only=True) as bs:
        base_id = base or default_run(bs, ("models", "ops"))
        if base_id is None:
            raise StoreError(f"{base_path} contains no model results")
        _require_comparable((base_path, base_id, _identity(bs, base_id)), (head_path, head_id, head_run),
                            named=bool(base and head))
        return (base_id, bs.results(base_id)), (head_id, head_df)


def _require_comparable(base: tuple[str, str, tuple[str, str, str]], head: tuple[str, str, tuple[str, str, str]],
                        *, named: bool) -> None:
    """One rule for one DB and two: runs of different lists, targets or settings are compared only when
    both are named (--base RUN --head RUN); a run picked by default must match the other."""
    (base_path, base_id, base_run), (head_path, head_id, head_run) = base, head
    if named or base_run == head_run:
        return
    # Different lists or settings make every row "added"/"removed" and hide real regressions.
    what = [k for k, a, b in zip(("list", "target", "settings"), base_run, head_run, strict=True) if a != b]
    where = (f"runs {base_id} and {head_id} of {head_path}" if base_path == head_path
             else f"runs {base_path} ({base_id}) and {head_path} ({head_id})")
    raise StoreError(
        f"the {where} are not comparable: different {', '.join(what)} "
        f"({'; '.join(f'{a} vs {b}' for a, b in zip(base_run, head_run, strict=True) if a != b)}). "
        "Name the runs with --base RUN --head RUN to compare them anyway"
    )


def _identity(store: ResultStore, run_id: str) -> tuple[str, str, str]:
    """(list, target, settings) of a run: what makes two runs comparable."""
    runs = store.runs()
    r = runs[runs.run_id == run_id]
    if r.empty:
        raise StoreError(f"{store.path}: unknown run id {run_id!r}")
    r = r.iloc[0]
    return str(r.list_name), str(r.target), str(r.settings_json)


def _night(path: str | os.PathLike) -> tuple[str, pd.DataFrame]:
    """("run1+run2", their results): the latest run of each configuration in the DB at ``path``."""
    from harness.analysis.nights import night_runs  # nights -> baseline -> fingerprint: imported when needed

    with ResultStore(path, read_only=True) as st:
        ids = [r["run_id"] for r in night_runs(st)]
        if not ids:
            raise StoreError(f"{path} contains no model results")
        return "+".join(ids), pd.concat([st.results(r) for r in ids], ignore_index=True)


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


def _fmt_ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def format_summary(res: DiffResult, *, limit: int = 50) -> str:
    """Human-readable multi-line summary, regressions first."""
    lines = [f"diff base={res.base_run} head={res.head_run}"]
    n_reg = len(res.regressions)
    lines.append(
        f"  regressions={n_reg} fixes={len(res.fixes)} changes={len(res.outcome_changes)} "
        f"drift_grew={len(res.drift_grew)} ref_changes={len(res.ref_changes)} flaky={len(res.flaky)} "
        f"allowlisted={len(res.allowlisted)} added={len(res.added)} removed={len(res.removed)} "
        f"unchanged={res.unchanged}"
    )

    def section(title: str, items: list[Change], ratios: bool = False) -> None:
        if not items:
            return
        lines.append(f"\n{title} ({len(items)}):")
        for c in items[:limit]:
            arrow = f"{c.base_outcome or '-'} -> {c.head_outcome or '-'}"
            if ratios:
                arrow += f" (rmse_ratio {_fmt_ratio(c.base_rmse_ratio)} -> {_fmt_ratio(c.head_rmse_ratio)})"
            extra = f"  [{c.detail}]" if c.detail else ""
            lines.append(f"  {c.model_id}  [{c.config}]  {arrow}{extra}")
        if len(items) > limit:
            lines.append(f"  ... and {len(items) - limit} more")

    groups = res.regression_groups()
    if groups:
        lines.append(f"\nREGRESSIONS by group ({len(groups)}):")
        for g, items in groups[:limit]:
            lines.append(f"  {len(items):>4} x {g}")
            lines.append(f"         {', '.join(c.model_id for c in items[:5])}{' ...' if len(items) > 5 else ''}")
    section("NEW FAILURES", res.new_failures)
    section("WORSE", [c for c in res.outcome_changes if c.direction == "worse"])
    section(f"DRIFT GREW > {res.drift_factor:g}x", res.drift_grew, ratios=True)
    section("fixes", res.fixes)
    section("other outcome changes", [c for c in res.outcome_changes if c.direction != "worse"])
    section("drift grew among passing models (not gating)", res.drift_warnings, ratios=True)
    section("reference/load/device changes (not target regressions)", res.ref_changes)
    section("flaky", res.flaky)
    section("known-flaky allowlist (not counted)", res.allowlisted)
    section("added", res.added)
    section("removed", res.removed)
    lines += format_gate(res.perf, limit=limit)
    n_perf, n_kernel, n_set = len(res.perf.regressions), len(res.perf.kernels), len(res.perf.settings)
    verdict = [f"{n_reg} regression(s)"] if n_reg else []
    verdict += [f"{n_perf} perf regression(s)"] if n_perf else []
    verdict += [f"{n_kernel} kernel regression(s)"] if n_kernel else []
    verdict += [f"{n_set} collective setting(s) costing more"] if n_set else []
    n_open = len(res.perf.inconclusive)
    verdict += [f"{n_open} perf inconclusive (not counted)"] if n_open else []
    lines.append("\nRESULT: " + (", ".join(verdict) if n_reg or n_perf or n_kernel or n_set
                                  else ", ".join(["no regressions", *verdict])))
    return "\n".join(lines)
