"""The kernel worklist: each op variation's result joined with the models that use it.

A backend team lives op by op; portharness judges models. The join connects the two directions:

- an unsupported, crashing or hanging variation lists the models it **blocks**: the model rows of the same
  target and settings that stopped there (``unsupported_op`` naming the same op; a crash or timeout of a
  model that calls it), among the models whose harvest calls the variation;
- a drifting variation lists the model drifts it **explains**: drift rows whose first diverging op is this
  op, on these inputs where the row names them (else any drifting variation of the op the model calls);
- per op (the op to implement or fix: the missing op the target named, else the variation's own), the
  ranking: models blocked, drifts explained, and what the harvest predicts, the models that would run
  (**unblocks**: every failing variation a model calls is this op's) and the models that call a failing
  variation of it at all (**needs**). ``implement aten::sort.stable (1 variation) -> +4 models``.

Without a model run of the same configuration the row-based columns are empty and the predicted ones
rank. Pure functions over frames and mappings, plus `load` (the DB's runs, found by
`harness.results.variations`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from harness.analysis.matrix import column_records, split_ops
from harness.results import variations as rv
from harness.results.dbfile import StoreError
from harness.results.store import ResultStore

BLOCKING = frozenset({"unsupported_op", "crash", "timeout", "oom"})  # the variation did not run to a result
DRIFTING = frozenset({"drift"})
MODEL_BLOCKED = frozenset({"crash", "timeout", "oom"})  # model outcomes a crashing variation may explain
OP_COLUMNS = ("model_id", "outcome", "unsupported_op", "error_message", "repro_path", "arch")
MODEL_COLUMNS = ("model_id", "outcome", "unsupported_op", "first_drift_op", "first_drift_op_inputs")
VARIATION_COLUMNS = ["variation_id", "op", "fix", "inputs", "source", "outcome", "models", "calls", "blocks",
                     "explains", "error", "repro_path"]
RANKING_COLUMNS = ["op", "variations", "failing", "outcomes", "blocks", "explains", "unblocks", "needs", "models",
                   "suggestion", "example_models"]


def _text(v: Any) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)


@dataclass
class Worklist:
    """One configuration's op run, joined; `variations` and `ranking` are frames (columns above)."""

    variations: pd.DataFrame
    ranking: pd.DataFrame
    op_run: str | None = None
    model_run: str | None = None
    config: str = ""
    counts: dict[str, int] = field(default_factory=dict)  # outcome -> variations
    uncovered: dict[str, list[str]] = field(default_factory=dict)  # missing op no variation holds -> models

    @property
    def empty(self) -> bool:
        return self.variations.empty

    def top(self, n: int = 5) -> pd.DataFrame:
        """What to fix first: ops with anything to fix, best first."""
        r = self.ranking
        if r.empty:
            return r
        return r[r["failing"] > 0].head(n)


def join(op_rows: pd.DataFrame, specs: Mapping[str, Mapping[str, Any]], uses: Mapping[str, Mapping[str, int]],
         model_rows: pd.DataFrame | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(variations, ranking): each variation's result with the models it blocks and explains, and the ops
    ranked by them. `specs`: variation id -> {"op", "source", and "inputs" or the "spec" to describe}."""
    users: dict[str, dict[str, int]] = {}
    for model, used in uses.items():
        for vid, calls in used.items():
            users.setdefault(vid, {})[model] = int(calls)
    rows = column_records(op_rows, OP_COLUMNS) if not op_rows.empty else []
    models = {r["model_id"]: r for r in column_records(model_rows, MODEL_COLUMNS)
              } if model_rows is not None and not model_rows.empty else {}
    var: dict[str, dict[str, Any]] = {}
    for r in rows:
        vid = r["model_id"]
        meta = specs.get(vid, {})
        op = rv.display(_text(meta.get("op")) or vid.split("#", 1)[0])
        outcome = _text(r["outcome"])
        missing = split_ops(r.get("unsupported_op"))
        fix = missing[0] if outcome == "unsupported_op" and missing else op
        inputs = meta["inputs"] if "inputs" in meta else rv.describe(meta["spec"]) if "spec" in meta else []
        var[vid] = {"variation_id": vid, "op": op, "fix": fix, "inputs": list(inputs),
                    "source": _text(meta.get("source")) or ("opinfo" if "#opinfo:" in vid else "models"),
                    "outcome": outcome, "users": users.get(vid, {}),
                    "error": _text(r.get("error_message")).split("\n", 1)[0][:300],
                    "repro_path": _text(r.get("repro_path"))}
    _blocks(var, models)
    _explains(var, models, uses)
    table = pd.DataFrame([{**{k: v for k, v in x.items() if k != "users"}, "models": len(x["users"]),
                           "calls": sum(x["users"].values()), "blocks": sorted(x["blocks"]),
                           "explains": sorted(x["explains"])} for x in var.values()], columns=VARIATION_COLUMNS)
    if not table.empty:
        rank = {o: i for i, o in enumerate(("unsupported_op", "crash", "timeout", "oom", "drift"))}
        table = table.assign(_r=table["outcome"].map(lambda o: rank.get(o, 9))).sort_values(
            ["_r", "fix", "variation_id"], kind="stable").drop(columns="_r").reset_index(drop=True)
    return table, _ranking(var, uses)


def _blocks(var: dict[str, dict[str, Any]], models: Mapping[str, Mapping[str, Any]]) -> None:
    for v in var.values():
        v["blocks"] = set()
        v["explains"] = set()
        if v["outcome"] not in BLOCKING:
            continue
        for m in v["users"]:
            row = models.get(m)
            if row is None:
                continue
            o = _text(row.get("outcome"))
            if (o == "unsupported_op" and v["fix"] in split_ops(row.get("unsupported_op"))) or (
                    o in MODEL_BLOCKED and v["outcome"] in MODEL_BLOCKED):
                v["blocks"].add(m)


def _explains(var: dict[str, dict[str, Any]], models: Mapping[str, Mapping[str, Any]],
              uses: Mapping[str, Mapping[str, int]]) -> None:
    for m, row in models.items():
        if _text(row.get("outcome")) != "drift" or not _text(row.get("first_drift_op")):
            continue
        op = rv.display(_text(row["first_drift_op"]))
        candidates = [vid for vid in uses.get(m, {}) if vid in var and var[vid]["outcome"] in DRIFTING
                      and var[vid]["op"] == op]
        named = list(row.get("first_drift_op_inputs") or [])
        exact = [vid for vid in candidates if named and rv.inputs_key(var[vid]["inputs"]) == named]
        for vid in exact or candidates:
            var[vid]["explains"].add(m)


def _ranking(var: dict[str, dict[str, Any]], uses: Mapping[str, Mapping[str, int]]) -> pd.DataFrame:
    by_fix: dict[str, list[dict[str, Any]]] = {}
    for v in var.values():
        by_fix.setdefault(v["fix"], []).append(v)
    # what each model still needs, per the harvest: the ops of the failing variations it calls, those that
    # stop it (a missing kernel, a crash) apart from those that make it drift
    stops: dict[str, set[str]] = {}
    drifts: dict[str, set[str]] = {}
    for m, used in uses.items():
        for vid in used:
            v = var.get(vid)
            if v is not None and v["outcome"] in BLOCKING:
                stops.setdefault(m, set()).add(v["fix"])
            elif v is not None and v["outcome"] in DRIFTING:
                drifts.setdefault(m, set()).add(v["fix"])
    records = []
    for fix, vs in by_fix.items():
        failing = [v for v in vs if v["outcome"] in BLOCKING | DRIFTING]
        users = set().union(*(v["users"] for v in vs))
        needing = set().union(*(v["users"] for v in failing)) if failing else set()
        blocks = set().union(*(v["blocks"] for v in vs))
        explains = set().union(*(v["explains"] for v in vs))
        blocking = any(v["outcome"] in BLOCKING for v in failing)
        # implemented: the models it alone stops would run; fixed: the models it alone makes drift would match
        unblocks = ({m for m in needing if stops.get(m) == {fix}} if blocking else
                    {m for m in needing if drifts.get(m) == {fix} and not stops.get(m)})
        outcomes: dict[str, int] = {}
        for v in vs:
            outcomes[v["outcome"]] = outcomes.get(v["outcome"], 0) + 1
        missing = any(v["outcome"] == "unsupported_op" for v in failing)
        verb, gain = ("implement" if missing else "fix", f"+{len(unblocks)} model{'s' if len(unblocks) != 1 else ''} "
                      "run" + (f" ({len(blocks)} blocked now)" if blocks else "")) if blocking else (
                      "fix", f"explains {len(explains)} model drift{'s' if len(explains) != 1 else ''}"
                      + (f", +{len(unblocks)} matched" if unblocks else ""))
        records.append({
            "op": fix, "variations": len(vs), "failing": len(failing),
            "outcomes": ", ".join(f"{o} {n}" for o, n in sorted(outcomes.items(), key=lambda x: (-x[1], x[0]))),
            "blocks": len(blocks), "explains": len(explains), "unblocks": len(unblocks), "needs": len(needing),
            "models": len(users),
            "suggestion": (f"{verb} {fix} ({len(failing)} variation{'s' if len(failing) != 1 else ''}) -> {gain}"
                           if failing else ""),
            "example_models": ", ".join(sorted(blocks | explains or needing)[:3]),
        })
    out = pd.DataFrame(records, columns=RANKING_COLUMNS)
    if out.empty:
        return out
    out["_rows"] = out["blocks"] + out["explains"]  # the models whose rows it accounts for, now
    todo = out[out["failing"] > 0].sort_values(["_rows", "unblocks", "needs", "op"],
                                               ascending=[False, False, False, True], kind="stable")
    done = out[out["failing"] == 0].sort_values(["models", "op"], ascending=[False, True], kind="stable")
    return pd.concat([todo, done]).drop(columns="_rows").reset_index(drop=True)


def uncovered(variations: pd.DataFrame, model_rows: pd.DataFrame | None,
              uses: Mapping[str, Mapping[str, int]] | None = None) -> dict[str, list[str]]:
    """Missing ops that model rows name and no failing variation accounts for: op -> models. The harvest
    sees the CPU's op calls; a composite op that takes a device-specific path (an LSTM: ``mkldnn_rnn_layer``
    on the CPU, a fused cell on an accelerator) calls kernels on the target that no variation holds. With
    `uses`, only models every variation of which this op run ran (not one cut short by ``--only``)."""
    if model_rows is None or model_rows.empty:
        return {}
    ran = set(variations["variation_id"]) if not variations.empty else set()
    covered = set(variations.loc[variations["outcome"].isin(sorted(BLOCKING)), "fix"]) if not variations.empty else set()
    out: dict[str, list[str]] = {}
    for r in column_records(model_rows[model_rows["outcome"] == "unsupported_op"], ("model_id", "unsupported_op")):
        if uses is not None and (not uses.get(r["model_id"]) or not set(uses[r["model_id"]]) <= ran):
            continue
        for op in split_ops(r["unsupported_op"]):
            if op not in covered:
                out.setdefault(op, []).append(r["model_id"])
    return {op: sorted(ms) for op, ms in sorted(out.items(), key=lambda x: (-len(x[1]), x[0]))}


# -- from a DB ---------------------------------------------------------------------------------------------


def runs_for(store: ResultStore, run_id: str | None = None, source: str = "models") -> tuple[str | None, str | None]:
    """(op run, model run) of one configuration: `run_id` may name either (default: the latest model run,
    else the latest op run)."""
    runs = store.runs()
    rid = run_id or rv.default_run(store)
    if rid is None:
        return None, None
    row = runs[runs.run_id == rid]
    if row.empty:
        raise StoreError(f"{store.path}: unknown run id {rid!r}")
    run = row.iloc[0]
    if rv.run_kind(run.list_name) == "ops":
        settings = rv.model_settings(run.settings)
        base = str(run.list_name)[len(rv.OPS_PREFIX):]
        model = (rv.latest(store, "models", target=run.target, settings=settings, list_name=base)
                 or rv.latest(store, "models", target=run.target, settings=settings))
        return rid, model
    if rv.run_kind(run.list_name) == "harvest":
        return rv.latest(store, "ops"), None
    return rv.op_run_for(store, rid, source), rid


def load(db: str | os.PathLike, run_id: str | None = None, source: str = "models") -> Worklist:
    """The worklist of `run_id`'s configuration (see `runs_for`); empty when it has no op run."""
    from harness.analysis.matrix import settings_label

    with ResultStore(db, read_only=True) as store:
        op_run, model_run = runs_for(store, run_id, source)
        if op_run is None:
            return Worklist(pd.DataFrame(columns=VARIATION_COLUMNS), pd.DataFrame(columns=RANKING_COLUMNS),
                            None, model_run)
        op_rows = rv.run_rows(store, op_run, OP_COLUMNS)
        model_rows = rv.run_rows(store, model_run, MODEL_COLUMNS) if model_run else None
        run = store.runs().set_index("run_id").loc[op_run]
        ids = set(op_rows["model_id"])
        wanted = set(model_rows["model_id"]) if model_rows is not None and not model_rows.empty else None
        every = rv.harvested(store, wanted, run.settings)
        uses = {m: {v: c for v, c in used.items() if v in ids} for m, used in every.items()}
        uses = {m: u for m, u in uses.items() if u}
        specs = rv.variation_meta(store, ids)
    variations, ranking = join(op_rows, specs, uses, model_rows)
    counts = op_rows["outcome"].value_counts().to_dict() if not op_rows.empty else {}
    return Worklist(variations, ranking, op_run, model_run, settings_label(run.target, run.settings),
                    {str(k): int(v) for k, v in counts.items()}, uncovered(variations, model_rows, every))


def format_worklist(w: Worklist, *, limit: int = 10, examples: int = 3) -> str:
    """The worklist as the terminal shows it: the counts, then what to fix first, one line per op."""
    if w.op_run is None:
        return ("no op run for this configuration yet: `portharness ops --list L --target T --db D` runs every op "
                "variation its models use")
    total = sum(w.counts.values())
    counts = ", ".join(f"{o} {n}" for o, n in sorted(w.counts.items(), key=lambda x: (-x[1], x[0])))
    lines = [f"op run {w.op_run} ({w.config}): {total} variation(s): {counts}"
             + ("" if w.model_run else "; no model run of this configuration: blocks/explains from the harvest only")]
    top = w.top(limit)
    if top.empty:
        lines.append("  nothing to fix: every variation ran within its declared precision")
        return "\n".join(lines)
    lines.append("what to fix first (op, the variations that fail, the models they block or explain):")
    for rec in column_records(top, ("suggestion", "outcomes", "example_models", "needs")):
        lines.append(f"  {rec['suggestion']}   [{rec['outcomes']}; {rec['needs']} model(s) call a failing one]")
        if rec["example_models"]:
            lines.append(f"      e.g. {rec['example_models']}")
    more = int((w.ranking["failing"] > 0).sum()) - len(top)
    if more > 0:
        lines.append(f"  ... and {more} more op(s): portharness matrix --ops, or the report's op pages")
    for op, models in list(w.uncovered.items())[:examples]:
        lines.append(f"  {len(models)} model(s) stop at {op}, which no variation holds (the target takes another "
                     f"path than the CPU's harvest saw): e.g. {', '.join(models[:examples])}")
    return "\n".join(lines)
