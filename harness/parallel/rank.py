"""One rank of a model's parallel step: ``python -m harness.parallel.rank JOB_DIR`` with ``RANK`` and ``WORLD_SIZE``.

The worker (`launch.py`) wrote the job: ``job.json`` (the model's list entry and class, the run's settings, the
seed, the plan's recorded decisions, the spec, the devices, the c10d backend, the collective timeout),
``model/`` (the model as the reference side has it, `save_pretrained`) and ``inputs.pt``. The rank binds to its
device, joins the group by the job's file store, builds the mesh, loads the model (tensor parallel: with the
family's plan), rebuilds the mode's step from its recorded decisions (`Mode.rebuild`: the same labels, the same
teacher-forced tokens), wraps it (`wrap.py`) and runs the step twice (a warm-up, then the step kept) under the
run's settings. Every rank writes its outputs whole on the CPU (``rank{R}.out.pt``: DTensors gathered,
DDP's names unwrapped); where it fails, its row fields as attribution reads the error (``rank{R}.error.json``).
``rank{R}.status`` says the phase it is in (``rendezvous``, ``load``, ``step``, ``done``), so a rank that hangs
is named with where it hung.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from harness.parallel.spec import ParallelSpec, parse

# the attribution's stage: everything a rank does is on the target (its load is the model onto its device)
STAGES = {"setup": "target", "rendezvous": "target", "load": "target", "step": "target", "localize": "target"}


def load_model(job: dict[str, Any], spec: ParallelSpec, mesh: Any, device: Any) -> Any:
    """The job's model on this rank's device: tensor parallel by the family's own plan where the spec says."""
    module, _, name = job["model_class"].partition(":")
    cls = getattr(importlib.import_module(module), name)
    path = Path(job["dir"]) / "model"
    if spec.tp:
        if mesh.ndim == 1:
            kw: dict[str, Any] = {"tp_plan": "auto", "device_mesh": mesh}
        else:  # 2-D: transformers applies both dimensions itself (FSDP2 shards, or replicas for ddp)
            from transformers import DistributedConfig

            dp = {"fsdp_size": spec.size("fsdp")} if "fsdp" in spec.kinds else {"dp_replicate_size": spec.size("ddp")}
            kw = {"distributed_config": DistributedConfig(tp_size=spec.size("tp"), **dp)}
        return cls.from_pretrained(path, use_kernels=False, **kw)
    return cls.from_pretrained(path, use_kernels=False).to(device)  # the kernels hub knows no out-of-tree device


def _modules(model: Any, wrapped: Any, inputs: dict[str, Any], path: Path) -> None:
    """Every submodule's outputs in one forward of the wrapped model, whole (a DTensor gathered; a local shard
    stays one: the worker compares only what has the reference's shape), saved for the worker's localization."""
    from dataclasses import asdict

    import torch
    from torch.distributed.tensor import DTensor

    from harness.backends.contracts import autocast_region
    from harness.run.localize import capture

    with autocast_region(next(iter(model.parameters())).device):  # (under --amp: as the step's forward)
        records = capture(model, lambda: wrapped(**inputs),
                          whole=lambda t: t.full_tensor() if isinstance(t, DTensor) else t)
    torch.save([asdict(r) for r in records], path)


def main(argv: list[str] | None = None) -> int:
    job_dir = Path((argv if argv is not None else sys.argv[1:])[0])
    job = json.loads((job_dir / "job.json").read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device_name = job["devices"][rank]
    phase = ["setup"]

    def say(name: str) -> None:
        phase[0] = name
        (job_dir / f"rank{rank}.status").write_text(name)

    adapter = None
    try:
        say("setup")
        import torch
        import torch.distributed as dist

        from harness.backends import adapter_for, load_backends

        load_backends(job["backends"])
        adapter = adapter_for(device_name)
        adapter.load()
        torch.set_num_threads(1)  # one process per chip: on a host of few cores, ranks would fight over threads
        device = torch.device(device_name)
        if device.type != "cpu":
            torch.accelerator.set_device_index(device.index or 0)
        spec = parse(job["spec"])
        say("rendezvous")
        store = dist.FileStore(str(job_dir / "store"), world)
        dist.init_process_group(job["dist_backend"], store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=float(job["timeout_s"])))
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, spec.mesh_shape, mesh_dim_names=spec.mesh_names)
        say("load")
        from harness.backends.contracts import amp
        from harness.models.load import LoadedModel
        from harness.models.model_list import ModelEntry
        from harness.parallel.wrap import unwrap_names, wrap
        from harness.run.compiled import CompileWatch, Configuration, compile_model
        from harness.run.modes import mode_for
        from harness.run.target import to_device

        t0 = time.perf_counter()
        model = load_model(job, spec, mesh, device)
        info: dict[str, Any] = {"load_s": round(time.perf_counter() - t0, 3)}
        entry = ModelEntry(**job["entry"])
        inputs = torch.load(job_dir / "inputs.pt", weights_only=False)  # written by this job's worker
        mode = mode_for(job["settings"])
        plan = mode.rebuild(model, LoadedModel(model, model.config, entry, 0.0), entry, inputs, job["seed"],
                            job["fields"])
        frozen = set(job["frozen"])
        for n, p in model.named_parameters():
            p.requires_grad_(n not in frozen)
        wrapped = wrap(model, spec, mesh, training=mode.name == "train", device=device)
        params = list(model.parameters())
        info["sharded_params"] = f"{sum(hasattr(p, 'placements') for p in params)} of {len(params)}"  # DTensors
        cfg = Configuration(**job["cfg"])  # compiled or eager, autocast: the worker's variant's (harness.run.target)
        watch = CompileWatch() if cfg.compiled else contextlib.nullcontext()
        say("step")
        with adapter.apply(job["settings"]), amp(cfg.amp_dtype), watch:
            adapter.seed(job["seed"])
            on_device = to_device(plan.inputs, device)
            if cfg.compiled:
                compile_model(wrapped, cfg)  # FSDP2's and TP's hooks and collectives traced with the model
            plan.step(wrapped, on_device)  # first-call costs (compiled: the compile), as the pipeline's warm-up
            if isinstance(watch, CompileWatch):
                info["compiled"] = dict(watch.freeze())  # JSON for the worker
            t0 = time.perf_counter()
            out = plan.step(wrapped, on_device)
            adapter.synchronize(device_name)
            info["step_s"] = round(time.perf_counter() - t0, 4)
            if job.get("collectives"):  # what each collective setting costs this step (timing.py)
                say("timing")
                from harness.comms.planner import for_group
                from harness.parallel.timing import rounds

                planners = [p for p in {for_group(mesh.get_group(d)) for d in range(mesh.ndim)} if p is not None]
                for p in planners:
                    p.check = False  # time the settings, not a mismatch check no production backend makes
                info["collectives"] = rounds(lambda: plan.step(wrapped, on_device), job["collectives"],
                                             adapter.collective_setting, lambda: adapter.synchronize(device_name),
                                             planners)
            if job.get("localize"):  # module by module, as the CPU reference's forward records them
                say("localize")
                _modules(model, wrapped, on_device, job_dir / f"rank{rank}.modules.pt")
        torch.save(unwrap_names(out), job_dir / f"rank{rank}.out.pt")
        (job_dir / f"rank{rank}.info.json").write_text(json.dumps(info))
        say("done")
        dist.destroy_process_group()
        return 0
    except BaseException as e:  # the rank's failure as a row's fields: the worker names the rank
        from harness.run.attribution import classify_exception

        fields = classify_exception(e, adapter, stage=STAGES.get(phase[0], "target"))
        (job_dir / f"rank{rank}.error.json").write_text(json.dumps(dict(fields), default=str))
        return 1


if __name__ == "__main__":
    sys.exit(main())
