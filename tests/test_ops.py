"""The kernel worklist (issue 38): harvest, one variation on the target, the join; then the whole path through
the real fleet on sim and on the rude test backend. Real tiny models, real sim, real worker processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import LIST_HEADER, list_rows

from harness.analysis.fingerprint import group_failures
from harness.analysis.matrix import with_config
from harness.analysis.worklist import join, load, uncovered
from harness.fleet.runner import RunConfig, run_models
from harness.models.model_list import load_model_list
from harness.ops import jobs
from harness.ops.harvest import Harvest
from harness.ops.signature import regenerate, resolve
from harness.ops.variation import run_variation
from harness.results import variations as rv
from harness.results.store import ResultStore
from harness.run.context import Task

YOUNG = {"precision": "default", "ops": "young"}
EXACT = {"precision": "highest", "ops": "full"}


class Tiny(torch.nn.Module):
    """Embedding ids, a linear and a layer norm, GELU, a bool mask, a sort (young sim lacks it), a gather."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 16)
        self.lin = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.lin(self.emb(ids)))
        h = torch.nn.functional.gelu(h).masked_fill(~mask[..., None], 0.0)
        v, i = torch.sort(h, dim=-1)
        return torch.gather(h, -1, i) + v.transpose(0, 1).transpose(0, 1)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 10, (2, 8), generator=g), torch.rand(2, 8, generator=g) > 0.3


def _harvest() -> dict:
    model, (ids, mask) = Tiny(), _inputs()
    with torch.no_grad(), Harvest() as h:
        model(ids, mask)
        model(ids, mask)  # the same signatures again: counted, not new
    return h.result()


def test_a_variation_is_its_signature_and_regenerates_valid_inputs() -> None:
    got = _harvest()
    assert got == _harvest()  # ids and observations are deterministic
    ops = {spec["op"] for spec in got["specs"].values()}
    assert {"aten::embedding.default", "aten::native_layer_norm.default", "aten::gelu.default", "aten::sort.default",
            "aten::gather.default", "aten::masked_fill.Scalar"} <= ops, ops
    assert all(n % 2 == 0 for n in got["uses"].values())  # two forwards: every call twice
    json.dumps(got)  # plain data: it travels over a pipe and into SQLite
    for vid, spec in got["specs"].items():
        args, kwargs = regenerate(spec, seed=0)
        for a, t in zip(args, spec["args"], strict=True):  # the signature's tensors, as they were
            if isinstance(t, dict) and "t" in t:
                assert (str(a.dtype), list(a.shape), list(a.stride())) == (
                    f"torch.{t['t']['dtype']}", t["t"]["shape"], t["t"]["stride"]), vid
        resolve(spec["op"])(*args, **kwargs)  # valid for the CPU: indices in range, a real mask
    gather = next(s for s in got["specs"].values() if s["op"] == "aten::gather.default")
    index = regenerate(gather, seed=3)[0][2]
    assert index.dtype == torch.int64 and 0 <= int(index.min()) and int(index.max()) < 16


def test_one_variation_on_sim_is_judged_as_the_op_check_judges_it(tmp_path: Path) -> None:
    """Young sim: sort is missing (unsupported, named as the model rows name it), the matmul passes within
    its declared bf16 precision; a planted GELU bug drifts that variation alone, with a repro and the inputs
    the op check names for the same model; at full precision nothing drifts."""
    import harness.sim  # noqa: F401  (the sim device in this process)
    from harness.run.opcheck import OpCheck

    specs = _harvest()["specs"]

    def outcomes(settings: dict) -> dict[str, object]:
        out = {}
        for vid, spec in specs.items():
            m = run_variation(Task(entry={"id": vid}, target="sim:0", settings=settings, kind="variation",
                                   variation=spec, repro_dir=str(tmp_path / "repro")))
            out[spec["op"]] = out.get(spec["op"], []) + [m]
        return out

    young = outcomes(YOUNG)
    assert [(m.outcome, m.unsupported_op) for m in young["aten::sort.default"]] == [("unsupported_op", "aten::sort.stable")]
    assert {m.outcome for m in young["aten::addmm.default"]} == {"pass_declared"}
    assert not [op for op, ms in young.items() for m in ms if m.outcome == "drift"]

    bug = outcomes({**YOUNG, "numerics": "gelu-mixup"})
    drifts = {op: m for op, ms in bug.items() for m in ms if m.outcome == "drift"}
    assert set(drifts) == {"aten::gelu.default"}, {op: m.error_message for op, m in drifts.items()}
    gelu = drifts["aten::gelu.default"]
    assert gelu.first_drift_op == "aten::gelu" and Path(gelu.repro_path).is_file()
    assert "Op variation " in Path(gelu.repro_path).read_text()  # found alone, not in a model
    model, (ids, mask) = Tiny(), _inputs()
    check = OpCheck("sim", __import__("harness.backends.contracts", fromlist=["contract"]).contract("bf16-matmul"))
    with torch.no_grad(), harness.sim.numerics_bugs("gelu-mixup"), harness.sim.op_profile("full"), check:
        model.to("sim:0")(ids.to("sim:0"), mask.to("sim:0"))
    assert check.failure is not None and (check.failure.op, check.failure.inputs) == (gelu.first_drift_op,
                                                                                     gelu.first_drift_op_inputs)

    exact = outcomes(EXACT)
    assert {m.outcome for ms in exact.values() for m in ms} <= {"pass", "skipped"}, {
        op: [m.error_message for m in ms] for op, ms in exact.items()}


def test_the_join_blocks_explains_and_ranks() -> None:
    """Two missing ops and a drifting kernel: each failing variation lists the model rows it accounts for,
    the ranking puts the op accounting for most rows first, and a missing op no variation holds is named."""
    op_rows = pd.DataFrame([
        {"model_id": "aten::sort.default#a", "outcome": "unsupported_op", "unsupported_op": "aten::sort.stable"},
        {"model_id": "aten::gelu.default#b", "outcome": "drift", "unsupported_op": ""},
        {"model_id": "aten::gelu.default#c", "outcome": "pass", "unsupported_op": ""},
        {"model_id": "aten::erf.default#d", "outcome": "unsupported_op", "unsupported_op": "aten::erf"},
        {"model_id": "aten::mm.default#e", "outcome": "pass_declared", "unsupported_op": ""},
    ])
    specs = {"aten::gelu.default#b": {"op": "aten::gelu", "spec": {"args": [
        {"t": {"dtype": "float32", "shape": [2, 8], "stride": [8, 1], "offset": 0}}], "kwargs": {}}}}
    uses = {"m1": {"aten::sort.default#a": 1, "aten::mm.default#e": 2}, "m2": {"aten::sort.default#a": 1},
            "m3": {"aten::gelu.default#b": 1, "aten::gelu.default#c": 1}, "m4": {"aten::gelu.default#b": 1},
            "m5": {"aten::erf.default#d": 1, "aten::sort.default#a": 1}}
    models = pd.DataFrame([
        {"model_id": "m1", "outcome": "unsupported_op", "unsupported_op": "aten::sort.stable"},
        {"model_id": "m2", "outcome": "unsupported_op", "unsupported_op": "aten::sort.stable"},
        {"model_id": "m3", "outcome": "drift", "first_drift_op": "aten::gelu", "first_drift_op_inputs": ["float32[2, 8]"]},
        {"model_id": "m4", "outcome": "drift", "first_drift_op": "aten::gelu", "first_drift_op_inputs": ["float32[4, 4]"]},
        {"model_id": "m5", "outcome": "unsupported_op", "unsupported_op": "aten::erf"},
        {"model_id": "m6", "outcome": "unsupported_op", "unsupported_op": "aten::_thnn_fused_lstm_cell"},
    ])
    table, ranking = join(op_rows, specs, uses, models)
    by = table.set_index("variation_id")
    assert by.loc["aten::sort.default#a", "fix"] == "aten::sort.stable"
    assert by.loc["aten::sort.default#a", "blocks"] == ["m1", "m2"]  # m5 stopped at erf first
    assert by.loc["aten::gelu.default#b", "explains"] == ["m3", "m4"]  # m4 names other inputs: the op's one drift
    top = ranking.set_index("op")
    assert list(ranking["op"][:3]) == ["aten::sort.stable", "aten::gelu", "aten::erf"]  # ties: more models need it
    assert (top.loc["aten::sort.stable", "blocks"], top.loc["aten::sort.stable", "unblocks"]) == (2, 2)
    assert (top.loc["aten::erf", "unblocks"], top.loc["aten::gelu", "explains"]) == (0, 2)  # m5 needs sort too
    assert uncovered(table, models) == {"aten::_thnn_fused_lstm_cell": ["m6"]}


def test_run_harvest_records_the_same_variations_with_a_cached_reference_side(tmp_path: Path) -> None:
    """`run --harvest` records during the reference's determinism run; a model whose reference side comes from
    the cache runs one more step for it: the same variations, and the verdict is the one without harvesting."""
    import harness.sim  # noqa: F401
    from harness.models.model_list import find_entry
    from harness.run.pipeline import run_one

    def one(recorder: type | None) -> object:
        return run_one(Task(entry=asdict(find_entry("tiny/bert/base")), target="sim:0", settings=EXACT,
                            ref_cache=str(tmp_path / "cache"), localize=False), recorder=recorder)

    computed, cached, plain = one(Harvest), one(Harvest), one(None)
    assert (computed.ref_cache.split(" ")[0], cached.ref_cache) == ("stored", "cached")
    assert computed.harvest["uses"] and computed.harvest["uses"] == cached.harvest["uses"]
    assert computed.outcome == cached.outcome == plain.outcome and not plain.harvest


def _variations(db: Path, entries: list, settings: dict) -> dict[str, dict]:
    with ResultStore(db, read_only=True) as store:
        uses = rv.harvested(store, [e.id for e in entries], settings)
        return {vid: m["spec"] for vid, m in rv.specs(store, jobs.used(uses)).items()}


def _op_run(db: Path, entries: list, settings: dict, list_name: str) -> str:
    specs = _variations(db, entries, settings)
    config = RunConfig(settings=rv.op_settings(settings), jobs=2, retries=0, timeout_s=120, progress=False,
                       fork_workers=True)
    return run_models([jobs.entry(v, s) for v, s in specs.items()], config, db, list_name=rv.ops_list(list_name),
                      kind="variation", variations=specs).run_id


def test_variations_through_the_fleet_agree_with_groups_and_explain_a_planted_bug(tmp_path: Path) -> None:
    """Two tiny models on young sim with a planted GELU bug, through the real pool: `run --harvest`, then each
    variation one job of an op run. The ranking's missing op and its model count are `groups`'; GELU's
    variations alone drift, and they explain the model's drift. (Full precision: the test above, and the
    slow test of the smoke list.)"""
    lst = tmp_path / "l.csv"
    lst.write_text(LIST_HEADER + list_rows([("bert", "masked-lm"), ("mixtral", "causal-lm")]))
    entries, db = load_model_list(str(lst)), tmp_path / "r.db"
    settings = {**YOUNG, "numerics": "gelu-mixup", "confirm": "off"}  # the op check names the kernel: enough
    run_models(entries, RunConfig(settings=settings, jobs=2, retries=0, timeout_s=300, progress=False,
                                  fork_workers=True, harvest=True, localize=False), db, list_name="pair")
    _op_run(db, entries, settings, "pair")
    work = load(db)
    assert work.op_run is not None and work.model_run is not None
    with ResultStore(db, read_only=True) as store:
        rows = with_config(store.results(work.model_run))
    groups = {g.what: g.count for g in group_failures(rows) if g.outcome == "unsupported_op"}
    assert groups == {"aten::sort.stable": 1}, groups
    assert {op: int(work.ranking.set_index("op").loc[op, "blocks"]) for op in groups} == groups
    drifting = set(work.variations.loc[work.variations["outcome"] == "drift", "op"])
    drift_rows = set(rows.loc[rows["outcome"] == "drift", "model_id"])
    assert drifting == {"aten::gelu"} and drift_rows == {"tiny/bert/masked-lm"}
    assert set().union(*map(set, work.variations["explains"])) == drift_rows
    assert list(work.top(2)["op"]) in (["aten::sort.stable", "aten::gelu"], ["aten::gelu", "aten::sort.stable"])
    from harness.report import build_report
    from harness.report.worklist import op_href

    index = build_report(db, tmp_path / "site").read_text()
    assert 'id="what-to-fix-first"' in index and op_href("aten::gelu") in index
    gelu = (tmp_path / "site" / op_href("aten::gelu")).read_text()
    assert "tiny/bert/masked-lm" in gelu and "../repro/" in gelu  # the drift it explains, its repro


def cli(python: Path, *args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PORTHARNESS_", "TOY_", "PATHO_"))}
    return subprocess.run([str(python), "-m", "harness.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**base, **(env or {})})


@pytest.mark.long
def test_a_kernel_that_crashes_or_hangs_the_device_is_that_variations_alone(toy_python: Path, tmp_path: Path) -> None:
    """The rude test backend: layer norm's kernel segfaults the process, addmm's hangs. Those two variations
    are crash and timeout, every other variation passes, and the one device stays in service."""
    import pathological_models

    lst = tmp_path / "l.csv"
    lst.write_text(LIST_HEADER + pathological_models.list_rows({"z/norm": pathological_models.build(tmp_path, "norm")}))
    db = tmp_path / "r.db"
    r = cli(toy_python, "ops", "--list", lst, "--target", "toy", "--db", db, "--jobs", "1", "--timeout", "3",
            "--retries", "0", "--quiet", "--json", env={"TOY_BROKEN_OPS": "native_layer_norm:segv,addmm:hang", "TOY_HANG_S": "60"})
    assert r.returncode == 0 and "quarantining" not in r.stderr, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["summary"]["quarantined"] == [] and out["summary"]["workers_started"] >= 3  # replaced twice
    with ResultStore(db, read_only=True) as store:
        rows = store.results(rv.latest(store, "ops"))
    got = {v.split("#")[0]: (o, a) for v, o, a in zip(rows["model_id"], rows["outcome"], rows["attempts"], strict=True)}
    assert got.pop("aten::native_layer_norm.default")[0] == "crash"
    assert got.pop("aten::addmm.default")[0] == "timeout"
    assert got and {o for o, _ in got.values()} == {"pass"}, got
    assert all(a["device"] == "toy:0" for _, attempts in got.items() for a in attempts[1]), got
    assert {o["op"] for o in out["worklist"]} == {"aten::addmm", "aten::native_layer_norm"}


@pytest.mark.slow
@pytest.mark.parametrize("settings", [[], ["--numerics-bug", "gelu-mixup"], ["--precision", "highest", "--ops", "full"]])
def test_smoke_worklist_through_the_cli(tmp_path: Path, settings: list[str]) -> None:
    """The whole smoke list on sim, as a user runs it: `run --harvest`, then `ops`. Young: the ranking's
    missing ops and counts are `groups`'; gelu-mixup: GELU's variations alone drift and explain every model
    drift; full precision: no variation drifts."""
    db = tmp_path / "s.db"
    common = ["--list", "smoke", "--target", "sim", "--db", db, "--jobs", "2", "--quiet", *settings]
    r = cli(Path(sys.executable), "run", "--harvest", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli(Path(sys.executable), "ops", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    work = load(db)
    with ResultStore(db, read_only=True) as store:
        rows = with_config(store.results(work.model_run))
    groups = {g.what: g.count for g in group_failures(rows) if g.outcome == "unsupported_op"}
    ranked = work.ranking.set_index("op")
    held = {op: n for op, n in groups.items() if op not in work.uncovered}  # an LSTM's device path: named apart
    assert {op: int(ranked.loc[op, "blocks"]) for op in held if op in ranked.index} == held
    assert {op: len(ms) for op, ms in work.uncovered.items()} == {op: n for op, n in groups.items() if op not in held}
    drifting = set(work.variations.loc[work.variations["outcome"] == "drift", "op"])
    drift_rows = set(rows.loc[rows["outcome"] == "drift", "model_id"])
    if "gelu-mixup" in settings:
        assert drifting == {"aten::gelu"} and set().union(*map(set, work.variations["explains"])) == drift_rows
    else:
        assert not drifting
    if settings == []:
        top = max(held.values())
        assert int(work.ranking.iloc[0]["blocks"]) == top and work.ranking.iloc[0]["op"] in {
            op for op, n in held.items() if n == top}


@pytest.mark.slow
def test_opinfo_samples_of_the_ops_the_list_uses(tmp_path: Path) -> None:
    """`--source opinfo`: PyTorch's samples of the harvested ops, in float32 and the dtypes the models use
    (int64 for add), run as variations: a planted GELU bug drifts GELU's samples and nothing else."""
    import harness.sim  # noqa: F401
    from harness.ops.opinfo import variations

    specs = variations({"aten::gelu.default": {"float32"}, "aten::add.Tensor": {"float32", "int64"}}, samples=3)
    assert {s["dtype"] for s in specs.values() if s["op"] == "aten::add.Tensor"} == {"float32", "int64"}
    got = {vid: run_variation(Task(entry={"id": vid}, target="sim:0", settings={**YOUNG, "numerics": "gelu-mixup"},
                                   kind="variation", variation=spec)).outcome for vid, spec in specs.items()}
    assert {v for v, o in got.items() if o == "drift"} == {v for v in got if v.startswith("aten::gelu")}, got
