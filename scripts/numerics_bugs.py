"""How well the verdict catches sim's planted numeric bugs: detection and localization rates per bug kind.

For a model list (default: smoke) and sim settings (default: sim's default precision and young op
profile), one clean run gives every model's outcome; then, per bug kind, each model's target forward
is run once in this process with the bug planted to learn whether the bug changed any result beyond
fp32 rounding (sim's `numerics_hits`: an op called only on integers, or on values where the bug is a
no-op, does not exercise it), and one run per kind measures, among the models the bug exercises, the
share that became `drift` and the share of those whose first diverging op is one of the bug's ops --
and checks that every model the bug does not touch has exactly the clean run's outcome and errors.
With ``--mode train`` the probe and the runs are a training step (forward, loss, backward, optimizers),
and a column says how many drift rows name a parameter. With ``--mode generate`` (``--cache dynamic|static``)
they are the teacher-forced decoding along the reference's tokens, and a column says how many drift rows
name the step the bug starts at (``cache-off-by-one``: `CACHE_BUG_STEP`; other kinds: any step). Not a
timed test; run by hand:

    python scripts/numerics_bugs.py [--list smoke] [--precision default] [--ops young] [--mode train] [--jobs 2]
    python scripts/numerics_bugs.py --mode generate [--cache static] --kinds cache-off-by-one
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from harness.fleet.runner import RunConfig, run_models
from harness.models.model_list import load_model_list
from harness.results.store import ResultStore
from harness.sim.numerics import BUGS, CACHE_BUG_STEP


def _ops(kind: str) -> set[str]:
    names = set()
    for func in BUGS[kind]:
        ov = func._overloadname
        names.add(func._schema.name if ov == "default" else f"{func._schema.name}.{ov}")
    return names


def _exercised(entries, settings: dict, kind: str, mode: str) -> set[str]:
    """Models whose target forward (train: training step; generate: teacher-forced decoding) the planted
    bug changes beyond fp32 rounding, run in this process."""
    import copy

    import torch

    import harness.sim as sim
    from harness.backends import adapter_for
    from harness.models.inputs import make_inputs
    from harness.models.load import load_model
    from harness.run.modes import mode_for
    from harness.run.train import prepare, train_step

    adapter, hit = adapter_for("sim"), set()
    train = mode == "train"
    for e in entries:
        try:
            loaded = load_model(e, seed=0)
            inputs = make_inputs(loaded.model, loaded.config, e, seed=0)
            step = None
            if mode == "generate":  # the reference's tokens, decided on the CPU as the pipeline does
                plan = mode_for(settings).plan(loaded.model, loaded, e, inputs, 0)
                step, inputs = plan.step, plan.inputs
            model = copy.deepcopy(prepare(loaded.model) if train else loaded.model).to("sim")
            sim_inputs = {k: v.to("sim") if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
            sim.reset_numerics_hits()
            with adapter.apply({**settings, "numerics": kind}):
                if step is not None:
                    step(model, sim_inputs)
                elif train:
                    train_step(model, sim_inputs, model_loss=False)
                else:
                    with torch.no_grad():
                        model(**sim_inputs)
        except Exception:  # a model the target cannot run at all is not a user of anything
            continue
        finally:
            if sim.numerics_hits():
                hit.add(e.id)
    return hit


def _step(row: dict) -> int | None:
    k = row.get("first_drift_step")
    return int(k) if k is not None and k == k else None  # NaN: no step


def _same(a: object, b: object) -> bool:
    return a == b or (a != a and b != b)  # NaN (no value) equals NaN


def _run(entries, settings: dict, db: Path, list_name: str, jobs: int) -> dict[str, dict]:
    summary = run_models(entries, RunConfig(settings=settings, jobs=jobs, timeout_s=600, progress=False), db,
                         list_name=list_name)
    with ResultStore(db) as store:
        return {r["model_id"]: r for r in store.results(summary.run_id).to_dict("records")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--list", default="smoke")
    p.add_argument("--precision", default="default")
    p.add_argument("--ops", default="young")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--mode", default="inference", choices=["inference", "train", "generate"])
    p.add_argument("--cache", default="dynamic", choices=["dynamic", "static"], help="--mode generate: the KV cache")
    p.add_argument("--kinds", default=None, help="comma-separated (default: every kind; grad-scale in train mode only, "
                   "cache-off-by-one in generate mode only)")
    p.add_argument("--db", default=None, help="keep the runs in this DB (default: a temp file)")
    args = p.parse_args(argv)
    entries = load_model_list(args.list)
    db = Path(args.db) if args.db else Path(tempfile.mkdtemp(prefix="numerics-bugs-")) / "runs.db"
    train, generate = args.mode == "train", args.mode == "generate"
    base_settings = {"precision": args.precision, "ops": args.ops}
    if args.mode != "inference":
        base_settings["mode"] = args.mode
    if generate and args.cache != "dynamic":
        base_settings["cache"] = args.cache
    kinds = args.kinds or ",".join(k for k in BUGS if (train or k != "grad-scale")
                                   and (generate or k != "cache-off-by-one"))  # only decoding meets it
    clean = _run(entries, base_settings, db, args.list, args.jobs)
    print(f"{args.list} on sim {base_settings}: {len(clean)} models -> {db}")
    print(f"{'bug':<17} {'exercised':>9} {'drift':>13} {'localized':>13} {'untouched unchanged':>20}"
          + (f" {'names a param':>13}" if train else "") + (f" {'names the step':>14}" if generate else ""))
    for kind in [k.strip() for k in kinds.split(",") if k.strip()]:
        ops = _ops(kind)
        users = _exercised(entries, base_settings, kind, args.mode)
        bugged = _run(entries, {**base_settings, "numerics": kind}, db, args.list, args.jobs)
        ran_users = [m for m in users if clean[m]["outcome"] in ("pass", "pass_declared", "drift")]
        drift = [m for m in ran_users if bugged[m]["outcome"] == "drift"]
        localized = [m for m in drift if bugged[m].get("first_drift_op") in ops]
        others = [m for m in clean if m not in users]
        same = [m for m in others if bugged[m]["outcome"] == clean[m]["outcome"]
                and _same(bugged[m].get("max_abs_err"), clean[m].get("max_abs_err"))]
        pct = lambda a, b: f"{len(a)}/{len(b)} {100 * len(a) / len(b):5.1f}%" if b else "-"  # noqa: E731
        named = [m for m in drift if bugged[m].get("first_drift_param")]
        want = CACHE_BUG_STEP if kind == "cache-off-by-one" else None
        steps = [m for m in drift if _step(bugged[m]) is not None and _step(bugged[m]) == (want or _step(bugged[m]))]
        print(f"{kind:<17} {len(ran_users):>9} {pct(drift, ran_users):>13} {pct(localized, drift):>13} "
              f"{pct(same, others):>20}" + (f" {pct(named, drift):>13}" if train else "")
              + (f" {pct(steps, drift):>14}" if generate else ""))
        missed = sorted(set(ran_users) - set(drift))
        if missed:
            print(f"  not caught: {', '.join(missed)}")
        wrong = sorted(set(drift) - set(localized))
        if wrong:
            print("  localized elsewhere: " + ", ".join(f"{m} -> {bugged[m].get('first_drift_op') or '-'}" for m in wrong))
    return 0


if __name__ == "__main__":
    sys.exit(main())
