"""The op-level side of a result DB: which runs are of models, of op variations or harvests, and the
harvest (each model's variations) kept beside the rows.

Three kinds of run share the `runs` and `results` tables, told apart by their list name:

- a model run (``smoke``): one row per model;
- an op run (``ops:smoke``): one row per op variation, its id in ``model_id``
  (``aten::addmm.default#3fa2c0d1e9``), its settings the target's plus ``variations`` (``models``:
  harvested from the list's models; ``opinfo``: PyTorch's OpInfo samples of the ops they use). Being a run
  like any other, it resumes, shards, merges, diffs and gates against an expected file unchanged;
- a harvest run (``harvest:smoke``): one row per model (``pass``: harvested, else why not), made by
  ``portharness ops harvest``; its settings are the harvest identity.

The harvest itself lives in two tables (`schema.VARIATIONS`, `schema.OP_USES`): each variation's signature
once per run that found it, and per model the variations its reference step called. A model run with
``--harvest`` fills them too. Views of models (matrix, groups, report) default to the latest model run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pandas as pd

from harness.results.codec import canonical_json, decode_json, encode
from harness.results.dbfile import StoreError
from harness.results.rows import OpUseRow, VariationRow, utc_now
from harness.results.schema import OP_USES, RESULTS, VARIATIONS
from harness.results.store import ResultStore

OPS_PREFIX = "ops:"
HARVEST_PREFIX = "harvest:"
SOURCES = ("models", "opinfo")
# the settings that change which ops a model's reference step calls (the rest act on the target only)
HARVEST_KEYS = ("mode", "dtype", "attn", "seed", "new_tokens", "cache")


def run_kind(list_name: str) -> str:
    """``models``, ``ops`` or ``harvest``, from a run's list name."""
    if str(list_name).startswith(OPS_PREFIX):
        return "ops"
    if str(list_name).startswith(HARVEST_PREFIX):
        return "harvest"
    return "models"


def ops_list(list_name: str) -> str:
    return f"{OPS_PREFIX}{list_name}"


def harvest_list(list_name: str) -> str:
    return f"{HARVEST_PREFIX}{list_name}"


def harvest_identity(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a harvest depends on: a train step calls backward kernels, a decoder's generate the cache's."""
    return {k: settings[k] for k in HARVEST_KEYS if k in settings}


def op_settings(settings: Mapping[str, Any], source: str = "models") -> dict[str, Any]:
    """An op run's settings: the target's, and where its variations come from."""
    return {**settings, "variations": source}


def model_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The model run's settings an op run was made for."""
    return {k: v for k, v in settings.items() if k != "variations"}


# -- a signature, read (harness.ops.signature writes them) -----------------------------------------------


def display(op: str) -> str:
    """``aten::addmm`` for the default overload (how backends and model rows name it), else as given."""
    return op.removesuffix(".default")


def describe(spec: dict[str, Any]) -> list[str]:
    """``float32[2, 16, 64]`` per tensor argument, in order (as the op check names a kernel's inputs), with
    ``/strided`` where a tensor is not contiguous (an OpInfo sample's, as it was described when made)."""
    if "inputs" in spec:
        return list(spec["inputs"])
    out = []

    def walk(x: Any) -> None:
        if isinstance(x, dict) and "t" in x:
            t = x["t"]
            contiguous = t["stride"] == _contiguous(t["shape"])
            out.append(f"{t['dtype']}{t['shape']}" + ("" if contiguous else f"/strided{t['stride']}"))
        elif isinstance(x, dict) and "list" in x:
            for v in x["list"]:
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(spec.get("args", []))
    walk(list(spec.get("kwargs", {}).values()))
    return out


def inputs_key(described: list[str]) -> list[str]:
    """`describe`'s list without the stride notes: what a model row's ``first_drift_op_inputs`` holds."""
    return [d.split("/", 1)[0] for d in described]


def _contiguous(shape: list[int]) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return out[::-1]


# -- runs ----------------------------------------------------------------------------------------------------


def latest(store: ResultStore, kind: str | tuple[str, ...] = "models", *, target: str | None = None,
           settings: Mapping[str, Any] | None = None, list_name: str | None = None) -> str | None:
    """The newest run with results of `kind` (one, or any of several; and of this target, settings, list)."""
    runs = store.runs()
    if runs.empty:
        return None
    kinds = (kind,) if isinstance(kind, str) else kind
    keep = (runs.n_results > 0) & runs.list_name.map(run_kind).isin(kinds)
    if target is not None:
        keep &= runs.target == target
    if settings is not None:
        keep &= runs.settings_json == canonical_json(dict(settings))
    if list_name is not None:
        keep &= runs.list_name == list_name
    found = runs[keep]
    return None if found.empty else str(found.iloc[0].run_id)  # runs() is newest first


def default_run(store: ResultStore, kinds: tuple[str, ...] = ("models",)) -> str | None:
    """The run a reader shows when none is named: the latest of these kinds (views of models: a model run;
    the diff: a model or an op run), else the latest model or op run; never a harvest, whose rows say what
    the CPU's step called, not how a target ran."""
    return latest(store, kinds) or latest(store, ("models", "ops"))


def shown_run(store: ResultStore, run_id: str | None, what: str = "model results") -> str | None:
    """The run a view of results shows: `run_id`, else `default_run`. StoreError when it is a harvest (a
    DB holding nothing else included): its rows are no target's results."""
    rid = run_id or default_run(store)
    runs = store.runs()
    if rid is None:
        harvests = runs[(runs.n_results > 0) & runs.list_name.map(run_kind).eq("harvest")] if not runs.empty else runs
        if not harvests.empty:
            raise StoreError(f"{store.path} holds only the harvest of {harvests.iloc[0].list_name[len(HARVEST_PREFIX):]} "
                             f"(the op calls of its models on the CPU), no {what}: `portharness ops` runs its variations "
                             "on a target, `portharness run` its models")
        return None
    row = runs[runs.run_id == rid]
    if not row.empty and run_kind(row.iloc[0].list_name) == "harvest":
        raise StoreError(f"run {rid} is a harvest (the op calls of {row.iloc[0].list_name[len(HARVEST_PREFIX):]}'s "
                         f"models on the CPU), no {what}: name a model or op run")
    return rid


def op_run_for(store: ResultStore, model_run: str, source: str = "models") -> str | None:
    """The latest op run of `model_run`'s target and settings (its own list's first, any list's else)."""
    runs = store.runs()
    row = runs[runs.run_id == model_run]
    if row.empty:
        return None
    run = row.iloc[0]
    settings = op_settings(run.settings, source) if isinstance(run.settings, dict) else None
    if settings is None:
        return None
    return (latest(store, "ops", target=run.target, settings=settings, list_name=ops_list(run.list_name))
            or latest(store, "ops", target=run.target, settings=settings))


# -- the harvest ---------------------------------------------------------------------------------------------


def record_harvest(store: ResultStore, run_id: str, model_id: str, settings: Mapping[str, Any],
                   harvest: Mapping[str, Any], seen: dict[str, dict[str, Any]] | None = None,
                   merge: Callable[[list[Any], list[Any]], list[Any]] | None = None) -> None:
    """One model's harvest (``{"uses": {id: calls}, "specs": {id: signature}}``): its uses, and each
    variation's signature under this run (one transaction: a kill leaves the model harvested or not).
    `seen`: the signatures this run wrote so far, whose observations `merge` (signature's ``gens``
    lists) widens with this model's; a signature that gained nothing is not written again."""
    uses = {str(k): int(v) for k, v in (harvest.get("uses") or {}).items()}
    now = utc_now()
    row = OpUseRow(run_id=run_id, model_id=model_id, harvest=canonical_json(harvest_identity(settings)), uses=uses,
                   n_variations=len(uses), calls=sum(uses.values()), finished_at=now)
    write: dict[str, dict[str, Any]] = {}
    for vid, spec in (harvest.get("specs") or {}).items():
        before = seen.get(vid) if seen is not None else None
        if before is not None and merge is not None:
            spec = {**before, "gens": merge(before.get("gens", []), spec.get("gens", []))}
        if spec != before:
            write[vid] = spec
            if seen is not None:
                seen[vid] = spec
    with store.transaction():
        store.put_raw_rows(VARIATIONS.name, [encode(VariationRow(run_id=run_id, variation_id=vid, op=_op(spec),
                                                                  spec=spec, inputs=describe(spec), finished_at=now),
                                                     VARIATIONS.types) for vid, spec in write.items()])
        store.put_raw_rows(OP_USES.name, [encode(row, OP_USES.types)])


def record_variations(store: ResultStore, run_id: str, specs: Mapping[str, dict[str, Any]], source: str) -> None:
    """Signatures a run made itself (OpInfo samples), so its views can describe them."""
    now = utc_now()
    rows = [encode(VariationRow(run_id=run_id, variation_id=vid, op=_op(spec), spec=dict(spec), source=source,
                                inputs=describe(spec), finished_at=now), VARIATIONS.types) for vid, spec in specs.items()]
    with store.transaction():
        store.put_raw_rows(VARIATIONS.name, rows)


def _op(spec: Mapping[str, Any]) -> str:
    return str(spec.get("display") or str(spec.get("op", "")).removesuffix(".default"))


def harvested(store: ResultStore, model_ids: Iterable[str] | None, settings: Mapping[str, Any]
              ) -> dict[str, dict[str, int]]:
    """Each model's latest harvest under `settings`' identity: model -> {variation id: calls} (models
    never harvested so are absent)."""
    identity = canonical_json(harvest_identity(settings))
    wanted = None if model_ids is None else set(model_ids)
    out: dict[str, tuple[str, dict[str, int]]] = {}
    for r in store.raw_rows(OP_USES.name):
        if r["harvest"] != identity or (wanted is not None and r["model_id"] not in wanted):
            continue
        when = r.get("finished_at") or ""
        if r["model_id"] not in out or when >= out[r["model_id"]][0]:
            uses = decode_json(r["uses"], f"table {OP_USES.name}, row model_id {r['model_id']!r}, column uses", dict)
            out[r["model_id"]] = (when, {str(k): v for k, v in (uses or {}).items()})
    return {m: uses for m, (_, uses) in out.items()}


def harvest_failures(store: ResultStore, list_name: str, ids: Iterable[str]) -> dict[str, str]:
    """Model -> the outcome of its latest harvest row in `list_name`'s harvest runs, for those of `ids` that
    have one (models a harvest could not load or run: what an op run's banner names)."""
    wanted = set(ids)
    if not wanted:
        return {}
    rows = store._query("SELECT r.model_id, r.outcome FROM results r JOIN runs u ON r.run_id = u.run_id "
                        "WHERE u.list_name=? ORDER BY r.finished_at", (list_name,))
    return {r["model_id"]: str(r["outcome"]) for r in rows if r["model_id"] in wanted}


def specs(store: ResultStore, ids: Iterable[str] | None = None) -> dict[str, dict[str, Any]]:
    """Variation id -> {"op", "spec", "source"}, the latest recorded (every variation when `ids` is None)."""
    return {vid: {"op": r["op"], "spec": _spec(vid, r["spec"]), "source": r["source"]}
            for vid, r in _latest(store.raw_rows(VARIATIONS.name), ids).items()}


def _spec(vid: str, text: Any) -> dict[str, Any]:
    """A variation's stored signature: a JSON object (a null, a list or damaged text is a damaged DB)."""
    where = f"table {VARIATIONS.name}, row variation_id {vid!r}, column spec"
    spec = decode_json(text, where, dict)
    if not isinstance(spec, dict):
        raise StoreError(f"{where}: holds no signature (null); the DB was damaged or written by another program: "
                         "harvest again into a fresh DB (ops harvest)")
    return spec


def _latest(rows: Iterable[dict[str, Any]], ids: Iterable[str] | None) -> dict[str, dict[str, Any]]:
    """Variation id -> its latest recorded row (by finished_at), of those in `ids` (None: all)."""
    wanted = None if ids is None else set(ids)
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for r in rows:
        vid = r["variation_id"]
        if wanted is not None and vid not in wanted:
            continue
        when = r.get("finished_at") or ""
        if vid not in out or when >= out[vid][0]:
            out[vid] = (when, r)
    return {vid: r for vid, (_, r) in out.items()}


# -- lean reads for the worklist: the columns it joins on, not whole rows ------------------------------------
# (a night's op run is tens of thousands of rows; `ResultStore.results` decodes every column of each)


def run_rows(store: ResultStore, run_id: str, columns: Iterable[str]) -> pd.DataFrame:
    """`columns` of `run_id`'s result rows (list and dict columns decoded; a column the DB lacks is empty)."""
    have = store._result_columns()
    cols = [c for c in columns if c in have]
    rows = store._query(f"SELECT {', '.join(cols)} FROM results WHERE run_id=? ORDER BY model_id", (run_id,))
    df = pd.DataFrame(rows, columns=cols)
    for c in columns:
        if c not in df.columns:
            df[c] = pd.Series([None] * len(df), dtype=object)
        elif RESULTS.types.get(c) in (dict, list):
            df[c] = df[c].map(lambda v, c=c: decode_json(v, f"table {RESULTS.name}, column {c}", RESULTS.types[c]))
    return df


def variation_meta(store: ResultStore, ids: Iterable[str] | None = None) -> dict[str, dict[str, Any]]:
    """Variation id -> {"op", "source", "inputs"}, the latest recorded, without parsing signatures (`specs`
    for those)."""
    if not store._has_table(VARIATIONS.name):
        return {}
    have = {r["name"] for r in store._query(f"SELECT name FROM pragma_table_info('{VARIATIONS.name}')")}
    inputs = "inputs" if "inputs" in have else "NULL AS inputs"
    # a row written before `inputs` existed: described from its signature
    spec = "CASE WHEN inputs IS NULL THEN spec END AS spec" if "inputs" in have else "spec"
    rows = store._query(f"SELECT variation_id, op, source, {inputs}, {spec}, finished_at FROM {VARIATIONS.name}")
    return {vid: {"op": r["op"], "source": r["source"],
                  "inputs": (decode_json(r["inputs"], f"table {VARIATIONS.name}, row variation_id {vid!r}, column inputs",
                                         list) if r["inputs"] is not None else describe(_spec(vid, r["spec"])))}
            for vid, r in _latest(rows, ids).items()}
