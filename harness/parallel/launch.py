"""The worker's side of a model's parallel step: write the job, start one process per device, supervise them.

`Parallel` is handed to the pipeline by the worker (`harness.run.pipeline.run_one(parallel=...)`), as the
harvest's recorder is: the pipeline computes the reference side as for one device, then asks it for the target
side of each variant it runs (the step as the settings name it, its confirmation at full precision). It
saves the model and the inputs once per model, writes each run's job, starts the ranks (`rank.py`) on the
group's devices with the run's environment, and waits:

- every rank done: their outputs, the rank furthest from the CPU reference's kept as the target's (replicated
  data: every rank's outputs should be one device's; a rank whose own outputs differ is named, the drift
  being before the collectives on that rank; ranks that agree with each other and drift together drift in
  the reduced result);
- a rank failed: the first to fail is the row's failure (its error as attribution read it on the rank: an
  op the device lacks is ``unsupported_op``, a device fault ``device_error``; a rank killed by a signal is a
  ``crash``), named with its rank, device and phase; the other ranks are stopped, never left waiting;
- a rank hangs: its peers fail at the collective timeout, or the job's deadline passes: the ranks still
  running are named with the phase they were in, and every rank is stopped (``timeout``).

How a rank's process starts is the executor's (`Starter`): `start_local`, a fresh interpreter, a child of the
worker killed with it should the worker die (the kernel's parent-death signal); on the local pool, a fork of the
worker's own server that has imported torch and transformers (`harness.fleet.rankfork`: a fork, not a 5 s
import); on Ray, an actor of its own in the group's placement group, one bundle per device
(`harness.fleet.rayranks`). The supervision above is the same for all three.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from itertools import zip_longest
from pathlib import Path
from typing import Any, Protocol

import torch

from harness import verdict
from harness.parallel.spec import ParallelSpec, members, parse
from harness.parallel.wrap import tp_plan
from harness.results.draft import RowDraft
from harness.run.context import Stop

POLL_S = 0.05
GRACE_S = 5.0  # after the first rank fails: the others' own errors (a peer died) arrive, then they are stopped


def _die_with_parent() -> None:  # in the rank, before exec: SIGKILL when the worker goes (kill -9 included)
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)


class RankProcess(Protocol):
    """A started rank as the worker supervises it: `subprocess.Popen`'s part of it (a signal's death is a
    negative `returncode`). Optional: `where` it runs (merged into the row's per-rank record) and `why` it died
    where its returncode cannot say."""

    returncode: int | None

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int | None: ...


# (job directory, rank, the rank's environment variables) -> its started process
Starter = Callable[[Path, int, dict[str, str]], RankProcess]


def start_local(job_dir: Path, rank: int, env: dict[str, str]) -> subprocess.Popen:
    """A rank as the worker's child, logging to its job directory, killed should the worker die."""
    with open(job_dir / f"rank{rank}.log", "w") as log:  # the child holds its own copy
        return subprocess.Popen([sys.executable, "-m", "harness.parallel.rank", str(job_dir)],
                                env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_parent)


class Parallel:
    """One model's parallel target side, on the group `devices` (one rank each), started by `start`."""

    def __init__(self, spec: str, devices: list[str], *, backends: list[str], dist_backend: str,
                 deadline_s: float, env: dict[str, str] | None = None, collectives: list[str] | None = None,
                 start: Starter = start_local) -> None:
        self.spec: ParallelSpec = parse(spec)
        self.devices = list(devices)
        if len(self.devices) != self.spec.world:
            raise ValueError(f"--parallel {spec}: {self.spec.world} ranks, {len(self.devices)} device(s) given")
        self.backends, self.dist_backend, self.deadline_s = list(backends), dist_backend, deadline_s
        self.env = dict(env or {})
        self.start = start
        self.procs: list[RankProcess] = []
        self.dir = Path(tempfile.mkdtemp(prefix="portharness-parallel-"))
        self.saved = False
        self.runs = 0
        self.ranks: list[dict[str, Any]] = []  # the last run's per-rank record (the row's `parallel`)
        self.note = ""
        self.culprit: dict[str, Any] = {}  # the last run's rank at fault, for the fleet's policy (see `_blame`)
        self.collectives = list(collectives or [])  # --perf: the settings the first run times (timing.py)
        self.timed: dict[str, Any] = {}  # their summary: the row's `collectives`
        self.compiled: dict[str, Any] = {}  # --compile: rank 0's graphs, breaks and compile time (CompileWatch's)
        self.modules: list[list[Any]] = []  # localize: each rank's modules' outputs (harness.run.localize's)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def skip(self, config: Any) -> str:
        """Why this spec does not apply to a model ("" : it does): tensor parallel needs the family's plan."""
        if self.spec.tp and not tp_plan(config):
            return (f"--parallel {self.spec}: {type(config).__name__} declares no tensor-parallel plan "
                    "(base_model_tp_plan): nothing to shard by")
        return ""

    def fields(self) -> dict[str, Any]:
        """The row's `parallel`: the spec, the mesh, each rank's device, phase and times."""
        ranks = [{**r, **getattr(p, "where", {})} for r, p in zip_longest(self.ranks, self.procs)]
        return {"spec": str(self.spec), "mesh": dict(zip(self.spec.mesh_names, self.spec.mesh_shape, strict=True)),
                "ranks": ranks, **({"note": self.note} if self.note else {}),
                **({"culprit": self.culprit} if self.culprit else {})}

    # -- one run of the step ------------------------------------------------------------------------

    def run(self, *, model: torch.nn.Module, entry: dict[str, Any], inputs: dict[str, Any], settings: dict[str, Any],
            seed: int, fields: dict[str, Any], reference: dict[str, torch.Tensor],
            cfg: dict[str, Any] | None = None, localize: bool = False) -> dict[str, torch.Tensor]:
        """The step on every rank; the outputs judged (see the module docstring). A rank that fails or hangs stops
        the row (`Stop`) with its fields, the rank named. `cfg`: how the ranks run it (`harness.run.compiled`'s
        Configuration as a dict: compiled or eager, autocast; None: eager). `localize`: every rank also records its
        modules' outputs (`modules`: per rank, as `harness.run.localize.capture` gives them)."""
        if not self.saved:
            from harness.run.train import as_loaded

            with as_loaded(model):  # the checkpoint rebuilds the reference's modules; the rank's mode prepares it
                model.save_pretrained(self.dir / "model")
            torch.save(inputs, self.dir / "inputs.pt")
            self.saved = True
        self.runs += 1
        job_dir = self.dir / f"run{self.runs}"
        job_dir.mkdir()
        (job_dir / "model").symlink_to(self.dir / "model")
        shutil.copy(self.dir / "inputs.pt", job_dir / "inputs.pt")
        cls = type(model)
        job = {"dir": str(job_dir), "entry": entry, "model_class": f"{cls.__module__}:{cls.__qualname__}",
               "settings": settings, "cfg": cfg or {}, "seed": seed, "fields": fields, "spec": str(self.spec), "devices": self.devices,
               "dist_backend": self.dist_backend, "backends": self.backends,
               # a collective's timeout; compiled, ranks compile at their own pace (one may hit the shared cache)
               "timeout_s": max(5.0, self.deadline_s / 3 if (cfg or {}).get("backend") else min(120.0, self.deadline_s / 3)),
               # which parameters train, as the reference has them (from_pretrained does not keep every flag)
               "frozen": [n for n, p in model.named_parameters() if not p.requires_grad],
               "collectives": self.collectives if self.runs == 1 else [],  # the judged settings' step only
               "localize": localize}
        (job_dir / "job.json").write_text(json.dumps(job, default=str))
        try:
            self._wait(job_dir, self._start(job_dir))
        finally:  # (a rank that could not start: those started before it are stopped too)
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
            for p in self.procs:
                p.wait(timeout=30)
        outs = [torch.load(job_dir / f"rank{r}.out.pt", weights_only=False) for r in range(len(self.procs))]
        timed = self.ranks[0].pop("collectives", None)
        self.compiled = self.ranks[0].get("compiled", {})  # the row's graph and compile fields: rank 0's
        for r in self.ranks:
            r.pop("collectives", None)
        if timed:
            from harness.parallel.timing import summary

            self.timed = summary(timed, self.collectives)
        judged = self._judged(outs, reference)
        if localize:
            from harness.run.localize import ModuleOutput

            self.modules = [[ModuleOutput(**r) for r in torch.load(job_dir / f"rank{k}.modules.pt", weights_only=False)]
                            for k in range(len(self.procs))]
        return judged

    def _start(self, job_dir: Path) -> list[RankProcess]:
        self.procs = []
        self.culprit, self.note, self.ranks = {}, "", []  # this run's (a row keeps the last run's `fields()`)
        for rank, device in enumerate(self.devices):
            index = device.partition(":")[2] or "0"
            env = {**self.env, "RANK": str(rank), "WORLD_SIZE": str(self.spec.world), "LOCAL_RANK": index,
                   "LOCAL_WORLD_SIZE": str(self.spec.world), "MASTER_ADDR": "127.0.0.1"}
            self.ranks.append({"rank": rank, "device": device})
            self.procs.append(self.start(job_dir, rank, env))
        return self.procs

    def _status(self, job_dir: Path, rank: int) -> str:
        try:
            return (job_dir / f"rank{rank}.status").read_text().strip()
        except OSError:
            return "start"

    def _wait(self, job_dir: Path, procs: list[RankProcess]) -> None:
        t0 = time.monotonic()
        first: int | None = None
        while True:
            codes = [p.poll() for p in procs]
            # a rank says "done" once its outputs are written: its teardown (the process group's, the
            # interpreter's) is not the step's, and a busy host can make it outlast the deadline
            if all(c == 0 or (c is None and self._status(job_dir, r) == "done") for r, c in enumerate(codes)):
                break
            # a rank killed by a signal first: its peers' errors ("connection closed") follow from it
            failed = sorted((r for r, c in enumerate(codes) if c not in (None, 0)), key=lambda r: codes[r] >= 0)
            if failed and first is None:
                first = failed[0]
                failed_at = time.monotonic()
            if first is not None and (all(c is not None for c in codes) or time.monotonic() - failed_at > GRACE_S):
                raise Stop(RowDraft(self._failure(job_dir, procs, first), parallel=self.fields()))
            if time.monotonic() - t0 > self.deadline_s:
                if first is not None:  # the deadline fell in a failure's grace: the failure is the row's
                    raise Stop(RowDraft(self._failure(job_dir, procs, first), parallel=self.fields()))
                hung = [r for r, c in enumerate(codes) if c is None and self._status(job_dir, r) != "done"]
                raise Stop(RowDraft(self._hang(job_dir, hung), parallel=self.fields()))
            time.sleep(POLL_S)
        for r in range(len(procs)):
            self.ranks[r]["phase"] = self._status(job_dir, r)
            try:
                self.ranks[r].update(json.loads((job_dir / f"rank{r}.info.json").read_text()))
            except (OSError, ValueError):
                pass

    def _failure(self, job_dir: Path, procs: list[RankProcess], first: int) -> RowDraft:
        """The row's fields for a group whose rank `first` failed first (a rank still running then hung)."""
        for r in range(len(procs)):
            self.ranks[r]["phase"] = self._status(job_dir, r)
        running = [r for r, p in enumerate(procs) if p.poll() is None]
        err = self._error(job_dir, first)
        if running and _waited(err):  # its peers gave up on a rank that never came: that rank is the culprit
            return self._hang(job_dir, running, because=f"rank {first} gave up waiting: {err.get('error_message', '')[:300]}")
        where = self._rank(first, job_dir)
        code = procs[first].returncode
        if err:
            if err.get("device_fault"):
                self._blame(first, job_dir, "fault")
            return RowDraft(err, error_message=f"{where}: {err.get('error_message', '')}"[:2000])
        sig = -code if code is not None and code < 0 else None
        name = signal.Signals(sig).name if sig else getattr(procs[first], "why", "") or f"exit code {code}"
        outcome = verdict.death(verdict.DeathEvidence(self._status(job_dir, first), None, sig))
        self._blame(first, job_dir, "death")
        return RowDraft(outcome=outcome, error_type="RankDied", signal=sig,
                        error_message=f"{where} died: {name}; the other ranks were stopped",
                        traceback=_tail(job_dir / f"rank{first}.log"))

    def _hang(self, job_dir: Path, hung: list[int], because: str = "") -> RowDraft:
        for r in range(len(self.ranks)):
            self.ranks[r]["phase"] = self._status(job_dir, r)
        names = "; ".join(self._rank(r, job_dir) for r in hung)
        if len(hung) < len(self.ranks):  # the others finished or gave up on it; all hung names no one
            self._blame(hung[0], job_dir, "death")
        return RowDraft(outcome=verdict.death(verdict.DeathEvidence("target", "timeout")), error_type="RankHung",
                        error_message=(f"{names} did not finish ({because or f'no result within {self.deadline_s:.0f}s'});"
                                       " every rank was stopped")[:2000])

    def _blame(self, r: int, job_dir: Path, kind: str) -> None:
        """Rank `r`'s device is the evidence's (`harness.fleet.policy`: a death or a fault there counts against
        that device of the group, not its peers)."""
        self.culprit = {"rank": r, "device": self.devices[r], "phase": self._status(job_dir, r), "kind": kind}

    def _rank(self, r: int, job_dir: Path) -> str:
        return f"rank {r} ({self.devices[r]}, in phase {self._status(job_dir, r)})"

    @staticmethod
    def _error(job_dir: Path, rank: int) -> dict[str, Any]:
        try:
            return json.loads((job_dir / f"rank{rank}.error.json").read_text())
        except (OSError, ValueError):
            return {}

    def _judged(self, outs: list[dict[str, torch.Tensor]], reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The outputs the row is judged by: the rank furthest from the CPU reference, naming any rank whose
        outputs differ from the others' (replicated data: they should agree)."""
        gaps = [_gap(o, reference) for o in outs]
        differ = [r for r in range(1, len(outs)) if not _same(outs[r], outs[0])]
        # where ranks differ, the rank at fault is furthest on what differs (FSDP's gradients are reduced: the
        # same on every rank, however far; the rank's own loss is not), then on everything
        own = [k for k in outs[0] if any(k not in o or not _equal(o[k], outs[0][k]) for o in outs[1:])]
        local = [_gap({k: o[k] for k in own if k in o}, reference) for o in outs]
        worst = max(range(len(outs)), key=lambda r: (local[r], gaps[r]))
        for r, g in enumerate(gaps):
            self.ranks[r]["max_rel_from_reference"] = g
        if differ:
            self.note = (f"ranks' outputs differ ({', '.join(f'rank {r}' for r in [0, *differ])}): the drift is before "
                         f"the collectives, on a rank; judged: rank {worst} ({self.devices[worst]}), the furthest from "
                         f"the CPU reference on what differs ({', '.join(own[:3])}{', ...' if len(own) > 3 else ''})")
        else:
            self.note = "every rank's outputs agree: what is judged is the collectives' reduced result"
        return outs[worst]


def _waited(err: dict[str, Any]) -> bool:
    text = str(err.get("error_message", "")).lower()
    return any(w in text for w in ("timed out", "timeout", "late or hung", "no peer process died"))


def _equal(x: Any, y: Any) -> bool:
    """The same tensor (values that are not tensors are not outputs)."""
    if not (isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor)):
        return True
    return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)


def _gap(out: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """The largest relative difference from the reference over the outputs both hold (a ranking, not a verdict)."""
    worst = 0.0
    for k, r in ref.items():
        t = out.get(k)
        if not isinstance(t, torch.Tensor) or not isinstance(r, torch.Tensor) or t.shape != r.shape:
            continue
        if not (t.is_floating_point() and r.is_floating_point()):
            continue
        d = (t.double() - r.double()).abs().max().item() / max(r.double().abs().max().item(), 1e-12) if r.numel() else 0.0
        worst = max(worst, d if d == d else float("inf"))
    return round(worst, 6)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def for_task(settings: dict[str, Any], target: str, backends: list[str], deadline_s: float,
             env: dict[str, str], collectives: list[str] | None = None, start: Starter = start_local) -> Parallel | None:
    """The strategy for a task whose settings name a parallel spec (None: one device), its ranks started by
    `start` (the executor's)."""
    spec = settings.get("parallel")
    if not spec:
        return None
    from harness.backends import adapter_for

    return Parallel(spec, members(target), backends=backends,
                    dist_backend=settings.get("dist_backend") or adapter_for(target).dist_backend(),
                    deadline_s=deadline_s, env=env, collectives=collectives, start=start)


