"""Generate the tiny-zoo list: every (architecture, head) transformers registers that runs on the CPU.

Every candidate is built at toy size (`harness.models.tiny`), fed by its input recipe (trying the
alternatives when the default one fails) and run twice on the CPU in a pool worker (a candidate may
segfault, hang or allocate gigabytes); those whose reference forward works and is deterministic go
into ``model_lists/tiny-zoo.csv`` with the recipe that worked. The checks are the pipeline's own
reference stage: a kept candidate is one the runner can compare.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch

from harness import files
from harness.fleet.budgets import Budgets
from harness.fleet.pool import Pool, context, serve
from harness.models.configs import find_attr
from harness.models.heads import candidates
from harness.models.inputs import default_recipe, make_inputs
from harness.models.model_list import ModelEntry, write_model_list
from harness.models.outputs import output_tensors
from harness.models.tiny import build_tiny, count_params, tiny_config
from harness.run.compare import identical

MAX_PARAMS = 5_000_000

# Recipes to try when the default one fails, keyed by main input name (or by the default recipe).
# The one that works is written into the list entry's ``inputs`` so later runs don't search.
_ALT_RECIPES = {
    "input_values": ("audio", "audio-3d", "audio-spec"),
    "input_features": ("features-bft", "features-btf"),
    "pixel_values": ("image", "text+image", "video"),
    "input_ids": ("text", "text+image"),
    "vlm": ("text",),
}


def _modality(config: Any, recipe: str) -> str:
    has_vision = any(
        getattr(config, k, None) is not None for k in ("vision_config", "visual", "image_config")
    )
    has_audio = getattr(config, "audio_config", None) is not None
    if (has_vision or has_audio) and recipe in ("text", "text+image") or recipe in ("text+image", "vlm"):
        return "multimodal"
    return {
        "text": "text",
        "image": "vision",
        "video": "vision",
        "audio": "audio",
        "audio-3d": "audio",
        "features-bft": "audio",
        "features-btf": "audio",
        "audio-spec": "audio",
        "patches": "vision",
        "time-series": "time-series",
    }[recipe]


def _tags(config: Any, recipe: str, modality: str, forward_s: float) -> list[str]:
    tags = []
    if getattr(config, "is_encoder_decoder", False):
        tags.append("encoder-decoder")
    experts = find_attr(config, "num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
    if isinstance(experts, int) and experts > 1:
        tags.append("moe")
    if find_attr(config, "state_size", "mamba_d_state", "ssm_state_size") is not None:
        tags.append("ssm")
    if modality == "multimodal" and recipe == "text":
        tags.append("text-only")
    if forward_s > 0.5:
        tags.append("slow")
    return tags


def check_candidate(model_type: str, task: str, max_params: int = MAX_PARAMS) -> dict[str, Any]:
    """Build, feed and run one (model_type, task) on CPU; a dict describing what happened.

    ``status`` is ``ok`` or the failing stage (``config``, ``build``, ``too-big``, ``inputs``,
    ``forward``, ``nonfinite``, ``nondeterministic``, ``no-output``).
    """
    out: dict[str, Any] = {"arch": model_type, "task": task}
    try:
        config = tiny_config(model_type, task)
    except Exception as e:  # noqa: BLE001 - any failure just excludes the candidate
        return {**out, "status": "config", "error": f"{type(e).__name__}: {e}"[:300]}
    try:
        n_params = count_params(task, config)
    except Exception as e:  # noqa: BLE001
        return {**out, "status": "build", "error": f"{type(e).__name__}: {e}"[:300]}
    out["params"] = n_params
    if n_params > max_params:
        return {**out, "status": "too-big", "error": f"{n_params} parameters > {max_params}"}
    try:
        model = build_tiny(model_type, task, seed=0)
    except Exception as e:  # noqa: BLE001
        return {**out, "status": "build", "error": f"{type(e).__name__}: {e}"[:300]}
    main = getattr(model, "main_input_name", "input_ids")
    first = default_recipe(model, model.config)
    alternatives = _ALT_RECIPES.get(first, ()) + _ALT_RECIPES.get(main, ())
    recipes = list(dict.fromkeys([first, *alternatives]))
    attempts: list[tuple[str, str]] = []  # (stage, error) of recipes that did not work
    for recipe in recipes:
        entry = ModelEntry(
            id=f"tiny/{model_type}/{task}",
            source="tiny",
            arch=model_type,
            task=task,
            inputs={} if recipe == first else {"recipe": recipe},
        )
        try:
            inputs = make_inputs(model, model.config, entry, seed=0)
        except Exception as e:  # noqa: BLE001
            attempts.append(("inputs", f"{recipe}: {type(e).__name__}: {e}"[:300]))
            continue
        try:
            with torch.no_grad():
                res1 = output_tensors(model(**inputs))
                t0 = time.perf_counter()
                res2 = output_tensors(model(**inputs))
                forward_s = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001
            attempts.append(("forward", f"{recipe}: {type(e).__name__}: {e}"[:300]))
            continue
        floats = {k: v for k, v in res1.items() if v.is_floating_point()}
        if not floats:
            attempts.append(("no-output", f"{recipe}: no floating-point outputs"))
            continue
        if any(not torch.isfinite(v).all() and torch.isnan(v).any() for v in floats.values()):
            return {**out, "status": "nonfinite", "error": f"{recipe}: NaN in CPU outputs"}
        if not identical(res1, res2):
            return {**out, "status": "nondeterministic", "error": f"{recipe}: two CPU forwards differ"}
        modality = _modality(model.config, recipe)
        return {
            **out,
            "status": "ok",
            "recipe": recipe,
            "default_recipe": recipe == first,
            "modality": modality,
            "forward_s": round(forward_s, 4),
            "tags": _tags(model.config, recipe, modality, forward_s),
            "outputs": sorted(res1)[:8],
            "attempts": attempts,
        }
    status, error = attempts[0] if attempts else ("inputs", "no input recipe applies")
    return {**out, "status": status, "error": error, "attempts": attempts}



def _serve_candidates(conn: Any, check: Callable[[str, str], dict[str, Any]] | None) -> None:
    """Pool worker: answer (model_type, task) jobs with `check`'s dict (default `check_candidate`)."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    check = check or check_candidate

    def handle(item: tuple[str, str], _phase: Callable[[str], None]) -> dict[str, Any]:
        mt, task = item
        try:
            return check(mt, task)
        except BaseException as e:  # noqa: BLE001 - report, never die silently
            return {"arch": mt, "task": task, "status": "crash", "error": f"{type(e).__name__}: {e}"[:300]}

    serve(conn, handle)


def run_candidates(
    items: list[tuple[str, str]],
    jobs: int = 2,
    timeout_s: float = 120.0,
    max_rss_mb: float = 6000.0,
    tasks_per_child: int = 40,
    progress: bool = True,
    check: Callable[[str, str], dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Check candidates in pool workers; a crash, hang or memory blow-up fails only that one.

    `check` (default `check_candidate`) must be an importable top-level function. Workers are
    recycled after `tasks_per_child` candidates to bound leaked memory."""
    pool = Pool(context(), _serve_candidates, lambda _key: (check,), budgets=Budgets(timeout_s), max_rss_mb=max_rss_mb)
    pending = list(items)
    results: list[dict[str, Any]] = []
    failures = {"died": ("crash", "worker died (exit code {code})"), "timeout": ("timeout", f"no result after {timeout_s:.0f}s"),
                "memory": ("memory", f"worker RSS above {max_rss_mb:.0f} MB")}
    t_start = time.monotonic()

    def feed(w: Any) -> None:
        if pending:
            item = pending.pop(0)
            w.send(item, item)

    try:
        for _ in range(max(1, min(jobs, len(pending)))):
            feed(pool.spawn("cpu"))
        while any(w.busy for w in pool.workers):
            for ev in pool.poll(0.5):
                w = ev.worker
                if ev.kind == "ready" or (ev.kind == "died" and not w.busy):
                    continue
                item = w.job
                w.job = None
                if ev.kind == "result":
                    res = ev.payload
                else:
                    status, msg = failures[ev.kind]
                    res = {"arch": item[0], "task": item[1], "status": status, "error": msg.format(code=w.death()[0])}
                results.append(res)
                if progress:
                    print(f"[{len(results)}/{len(items)} {time.monotonic() - t_start:6.0f}s] {res['status']:>16} "
                          f"{res['arch']}/{res['task']}", file=sys.stderr, flush=True)
                if ev.kind != "result" or w.done >= tasks_per_child:
                    w.stop()
                    pool.retire(w)
                    w = pool.spawn("cpu")
                feed(w)
    finally:
        pool.close()
    return results


def result_to_entry(res: dict[str, Any]) -> ModelEntry:
    """A ModelEntry for one kept candidate."""
    inputs = {} if res.get("default_recipe", True) else {"recipe": res["recipe"]}
    return ModelEntry(
        id=f"tiny/{res['arch']}/{res['task']}",
        source="tiny",
        arch=res["arch"],
        task=res["task"],
        modality=res["modality"],
        inputs=inputs,
        tags=tuple(res.get("tags", ())),
    )


def generate(
    out_path: str | os.PathLike[str],
    *,
    jobs: int = 2,
    limit: int | None = None,
    only: Iterable[str] | None = None,
    timeout_s: float = 120.0,
    report_path: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Check every candidate and write the kept ones to ``out_path``; returns the counts."""
    items = candidates()
    if only:
        wanted = set(only)
        items = [c for c in items if c[0] in wanted or f"{c[0]}/{c[1]}" in wanted]
    if limit:
        items = items[:limit]
    t0 = time.monotonic()
    results = run_candidates(items, jobs=jobs, timeout_s=timeout_s)
    wall = time.monotonic() - t0
    results.sort(key=lambda r: f"tiny/{r['arch']}/{r['task']}")  # = sorted by id
    kept = [r for r in results if r["status"] == "ok"]
    entries = [result_to_entry(r) for r in kept]
    import transformers

    failed = Counter(r["status"] for r in results if r["status"] != "ok")
    counts = {
        "candidates": len(items),
        "kept": len(kept),
        "failed": dict(sorted(failed.items())),
        "architectures": len({r["arch"] for r in kept}),
        "wall_s": round(wall, 1),
        "transformers": transformers.__version__,
    }
    header = (
        f"tiny-zoo: generated by `portharness zoo` from transformers {transformers.__version__}.\n"
        f"Every row built from a shrunk default config and ran a CPU forward; regenerate, don't edit.\n"
        f"{counts['kept']} of {counts['candidates']} candidates kept, {counts['architectures']} architectures."
    )
    write_model_list(entries, out_path, header)
    if report_path:
        files.write_text(report_path, json.dumps({"counts": counts, "results": results}, indent=1, sort_keys=True))
    return counts

