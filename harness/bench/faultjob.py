"""The rank side of a fault scenario: a DDP training job that can lose a rank and carry on.

Each process (a rank, or a hot spare that has already imported torch and built the model) runs
`proc_main`. The supervisor (`harness.bench.faultrun`) drives it through a control file: generation
g says which process is which rank and where the group meets (a fresh FileStore per generation, so a
re-formed group never shares a rendezvous with the broken one). In a generation a rank trains tiny
GPT-2 steps under DDP, with a comm hook that (1) lets the `Injector` act before the gradient
all_reduce, (2) reports the rank's arrival there (its compute time: what the straggler rule and the
stall detector read), (3) checks its own bucket is finite before sending it, and (4) hands back a
future the supervisor can fail ("abort"), so a peer stuck in a collective the backend will not time
out for seconds is released at once, as torchft's managed process group does.

After each backward the ranks all_reduce one flag per rank (non-finite gradients here?): every rank
learns who sent NaN and all skip the optimizer step together, so the NaN never reaches the weights.

When a step fails (a backend error, or an abort), the rank keeps its state as of the last completed
step (the failed step never reached the optimizer), reports it and waits. If the supervisor forms a
new generation with a spare in the bad rank's place, a healthy source rank broadcasts parameters,
optimizer state and step to all (the torchft pattern: recover from a live peer, no checkpoint), every
member rebuilds model, optimizer and DDP on the new group, and training resumes where it stopped.
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import io
import os
import sys
import threading
import time
from typing import Any

from harness.bench.config import TARGETS
from harness.bench.faults import FaultConfig, Injector, parse_scenario
from harness.bench.watchdog import EventLog, read_json, write_json

# Tiny GPT-2: a few ms of compute per step on a CPU core (20 steps are well under a second), gradients
# in one DDP bucket. No dropout: nothing random in a step, so runs can be compared bit for bit.
MODEL_CONFIG = {
    "vocab_size": 256,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 2,
    "n_positions": 32,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
BATCH = (4, 32)  # sequences x tokens per rank and step
LR = 0.05
MOMENTUM = 0.9
POLL_S = 0.02
HEARTBEAT_S = 0.25


def root_cause(exc: BaseException) -> str:
    """The backend's own words: future callbacks wrap an error in "Got the following error when running
    the callback: ..." and a Python stack ("At: ..."), once per chained future."""
    text = f"{type(exc).__name__}: {exc}"
    wrapper = "Got the following error when running the callback: "
    while wrapper in text:
        text = text.split(wrapper, 1)[1]
    return text.split("\n\nAt:\n", 1)[0].strip()[:1000]


def control_path(workdir: str) -> str:
    return os.path.join(workdir, "control.json")


def heartbeat_path(workdir: str, label: str) -> str:
    return os.path.join(workdir, f"hb-{label}.json")


def _value(fut):
    return fut.value()


class _Comms:
    """All-reduces whose futures the supervisor can fail (abort) while the backend is still stuck."""

    def __init__(self) -> None:
        self.pg = None
        self._lock = threading.Lock()
        self._pending: list = []
        self._inflight: dict[int, int] = {}  # id(group) -> messages its backend has not answered yet
        self.aborted = ""

    def reset(self, pg) -> None:
        with self._lock:
            self.pg, self._pending, self.aborted = pg, [], ""
            self._inflight.setdefault(id(pg), 0)

    def abort(self, reason: str) -> None:
        with self._lock:
            if self.aborted:
                return
            self.aborted = reason
            for fut in self._pending:
                if not fut.done():
                    fut.set_exception(RuntimeError(reason))
            self._pending = []

    def allreduce(self, t, *, unwrap: bool = False):
        """Start an all_reduce of ``t``; the returned future yields ``t`` (``unwrap``) or ``[t]``."""
        import torch
        import torch.distributed as dist

        out: torch.futures.Future = torch.futures.Future()
        key = id(self.pg)
        with self._lock:
            if self.aborted:
                out.set_exception(RuntimeError(self.aborted))
                return out.then(_value)
            self._pending = [f for f in self._pending if not f.done()] + [out]
            self._inflight[key] += 1
        work = dist.all_reduce(t, group=self.pg, async_op=True).get_future()

        def _done(f) -> None:
            try:
                value, err = f.value(), None
            except Exception as exc:  # the backend's own error (peer gone, timeout)
                value, err = None, exc
            with self._lock:
                self._inflight[key] -= 1
                if out.done():
                    return  # aborted first; the backend's late answer is dropped
                if err is not None:
                    out.set_exception(err)
                else:
                    out.set_result(value[0] if unwrap else value)

        work.add_done_callback(_done)
        # A Python-side set_exception is a result the Python wrapper re-raises; C++ callers (DDP's reducer)
        # would see the exception object as the value. Chaining makes it a real error for both.
        return out.then(_value)

    def retire(self, pg, within_s: float) -> None:
        """Free an abandoned group once its backend has answered every message (an error, a timeout).

        Not at once: destroying a gloo group blocks until its in-flight messages end. Not never: after a
        peer died, the abandoned group's gloo event loop spins on the dead connection, a core's worth of
        CPU stolen from the ranks that carry on. So a reaper thread waits (at most ``within_s``: the
        backend's timeout ends every message) and drops the last reference there, off the training path.
        """
        key = id(pg)
        holder = [pg]
        del pg

        def reap() -> None:
            deadline = time.time() + within_s
            while time.time() < deadline:
                with self._lock:
                    if self._inflight.get(key, 0) <= 0:
                        break
                time.sleep(0.05)
            else:
                return  # still stuck past its own timeout: leave it be (the process exits without destructors)
            holder.clear()
            gc.collect()

        threading.Thread(target=reap, daemon=True, name="portharness-reaper").start()


class _Agent(threading.Thread):
    """Heartbeat + control watcher: beats every 0.25 s, fails pending collectives on an abort."""

    def __init__(self, job: Job) -> None:
        super().__init__(daemon=True, name="portharness-agent")
        self.job = job
        self.parent = os.getppid()

    def run(self) -> None:
        job = self.job
        last_beat = 0.0
        while True:
            now = time.time()
            if os.getppid() != self.parent:  # the supervisor is gone: nobody will ever stop us
                os._exit(3)
            if now - last_beat >= HEARTBEAT_S:
                write_json(heartbeat_path(job.workdir, job.label), {"t": now, **job.log.fields, "step": job.step})
                last_beat = now
            ctl = read_json(control_path(job.workdir))
            if ctl and job.gen in ctl.get("abort", []):
                job.comms.abort(f"aborted by the portharness watchdog: {ctl.get('reason', 'a rank failed')}")
            time.sleep(POLL_S)


class Job:
    """One process's life: set up, then train in every generation it is a member of."""

    def __init__(self, cfg: FaultConfig, scenario: str, label: str, slot: int, workdir: str) -> None:
        self.cfg = cfg
        self.spec = parse_scenario(scenario)
        self.label = label
        self.slot = slot  # process index: picks the GPU on cuda
        self.workdir = workdir
        self.log = EventLog(workdir, label)
        self.comms = _Comms()
        self.gen = -1
        self.rank = -1
        self.step = -1
        self.completed = -1  # last step whose optimizer step ran (or was skipped by the finite check)
        self.state: dict[str, Any] | None = None

    # -- setup ----------------------------------------------------------------------------------

    def setup(self) -> None:
        import torch

        torch.set_num_threads(1)  # several ranks share few cores: no intra-op oversubscription
        import harness.comms.shaped  # noqa: F401  registers shaped_gloo / shaped_nccl
        from harness.comms.settings import parse_setting, set_collective_settings

        if self.cfg.target == "sim":
            import harness.sim
            import harness.sim.distributed  # noqa: F401  registers the "sim" c10d backend

            if not os.environ.get("PORTHARNESS_SIM_OPS"):
                harness.sim.set_op_profile("full")  # DDP needs ops the young profile lacks
            # each process is its own host (sim:0 of its own: sim's devices take one process each)
            from harness.sim.placement import NAMESPACE_ENV

            os.environ[NAMESPACE_ENV] = f"{os.environ.get(NAMESPACE_ENV, '')}:{os.path.basename(self.workdir)}:{self.label}"
            self.device = torch.device("sim", 0)  # autograd runs on sim:0
        elif self.cfg.target == "cuda":
            idx = self.slot % torch.cuda.device_count()
            torch.cuda.set_device(idx)
            self.device = torch.device("cuda", idx)
        else:
            self.device = torch.device("cpu")
        self.setting = parse_setting(self.cfg.settings[0])
        set_collective_settings(self.setting)
        self._build()  # a hot spare is warm: model built, one forward/backward done
        loss = self.model(input_ids=self._batch(0, 0), labels=self._batch(0, 0)).loss
        loss.backward()
        self.model.zero_grad(set_to_none=True)

    def _build(self, state: dict[str, Any] | None = None) -> None:
        import torch
        from transformers import GPT2Config

        from harness.models.tiny import build_from_config

        model = build_from_config("causal-lm", GPT2Config(**MODEL_CONFIG), seed=self.cfg.seed).train().to(self.device)
        model.tie_weights()  # .to("sim") unties lm_head from wte; re-tie (as the collectives benchmark does)
        if state is not None:
            model.load_state_dict(state["model"])
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        if state is not None:
            opt.load_state_dict(state["opt"])
        self.model, self.opt = model, opt

    def _batch(self, rank: int, step: int):
        import torch

        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + rank * 10_007 + step)
        return torch.randint(0, MODEL_CONFIG["vocab_size"], BATCH, generator=g).to(self.device)

    # -- generations ----------------------------------------------------------------------------

    def wait_control(self, last_gen: int) -> dict | None:
        """The next generation this process belongs to, or None when told to stop."""
        while True:
            ctl = read_json(control_path(self.workdir))
            if ctl:
                if ctl["gen"] > last_gen and self.label in ctl["members"]:
                    return ctl
                if ctl.get("stop"):
                    return None
            time.sleep(POLL_S)

    def join(self, ctl: dict) -> None:
        """Meet the generation's group at its own rendezvous, take the source's state, rebuild DDP."""
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        from harness.comms.settings import collective_settings

        if dist.is_initialized():
            old = dist.group.WORLD
            self.ddp = None  # its reducer holds the old group too
            dist.destroy_process_group()
            self.comms.retire(old, self.cfg.collective_timeout_s + 2.0)
            del old
        self.gen, self.rank = ctl["gen"], ctl["members"].index(self.label)
        self.log.fields = {"gen": self.gen, "rank": self.rank}
        world = len(ctl["members"])
        store = dist.FileStore(os.path.join(self.workdir, f"store-g{self.gen}"), world)
        timeout = datetime.timedelta(seconds=self.cfg.collective_timeout_s)
        dist.init_process_group(TARGETS[self.cfg.target][0], store=store, rank=self.rank, world_size=world,
                                timeout=timeout)
        pg = dist.group.WORLD
        self.comms.reset(pg)
        if ctl.get("source") is not None:
            self.state = self._receive_state(ctl["source"])
            self.completed = self.state["step"]
            self._build(self.state)
        self._threads: set[int] = set()
        self._clocks: list[int] = []
        self._watch_thread()
        self.injector = Injector(
            self.spec, bad=self.rank == self.cfg.fault_rank and self.gen == 0, mode=self._mode(),
            fault_step=self.cfg.fault_step, seed=self.cfg.seed,
            on_fire=lambda step: self.log.emit("inject", step=step, scenario=self.spec.name),
        )
        with collective_settings(self.setting):
            self.ddp = DDP(self.model, process_group=pg, bucket_cap_mb=self.setting.bucket_mb)
        self.ddp.register_comm_hook(None, self._hook)
        self.log.emit("joined", start_step=ctl["start_step"], source=ctl.get("source"))

    def _mode(self) -> str:
        return "sim" if self.cfg.target == "sim" else "harness"

    def _receive_state(self, source: int) -> dict[str, Any]:
        """Parameters, optimizer state and step, broadcast as bytes from ``source`` (a healthy peer)."""
        import torch
        import torch.distributed as dist

        payload = b""
        if self.rank == source:
            buf = io.BytesIO()
            torch.save(self.state, buf)
            payload = buf.getvalue()
        n = torch.tensor([len(payload)], dtype=torch.int64).to(self.device)
        dist.broadcast(n, src=source)
        size = int(n.cpu().item())
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(size, dtype=torch.uint8)
        data = data.to(self.device)
        dist.broadcast(data, src=source)
        if self.rank == source:
            return self.state  # type: ignore[return-value]
        return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=True)

    def _snapshot(self) -> None:
        """The state as of the last completed step: the failed step never reached the optimizer."""
        import torch

        def cpu(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return x.detach().cpu().clone()
            if isinstance(x, dict):
                return {k: cpu(v) for k, v in x.items()}
            if isinstance(x, list):
                return [cpu(v) for v in x]
            return x

        self.state = {"model": cpu(self.model.state_dict()), "opt": cpu(self.opt.state_dict()), "step": self.completed}

    # -- training -------------------------------------------------------------------------------

    def _hook(self, _state: object, bucket):
        import torch

        buf = bucket.buffer()
        if self._arrived is None:
            self.injector.at_collective(self.step, buf)
            self._arrived = time.perf_counter()
            self._busy_s = self._busy_clock() - self._c0
            self._watch_thread()
            self.log.emit("arrive", step=self.step, compute_s=self._busy_s, wall_s=self._arrived - self._t0)
        if not bool(torch.isfinite(buf).all()):
            self._nonfinite = True  # checked before sending: this rank's own contribution
        buf.div_(self.ddp.process_group.size())
        return self.comms.allreduce(buf, unwrap=True)

    def train(self, start: int) -> str:
        """Steps ``start`` .. steps-1; 'done', or 'failed' (state kept as of the last completed step)."""
        for step in range(start, self.cfg.steps):
            self.step = step
            if self.spec.kind == "none" and self.gen == 0 and step == self.cfg.restart_step:
                self._snapshot()
                self.log.emit("failed", step=step, completed=self.completed, planned=True, error="planned restart")
                return "failed"
            try:
                self._one_step(step)
            except Exception as exc:
                self._snapshot()
                self.log.emit("failed", step=step, completed=self.completed, aborted=bool(self.comms.aborted),
                              error=root_cause(exc))
                return "failed"
        self.log.emit("done", completed=self.completed)
        return "done"

    def _busy_clock(self) -> float:
        """The clock a rank's compute is timed with: how long its device was busy, not how long it waited.

        On ``cpu`` and ``sim`` the device is the host CPU, shared with the other ranks (and whatever else
        runs there): wall time would charge a rank for being scheduled out, so the straggler rule would
        flag whichever rank the OS happened to preempt. The CPU time of the threads that compute (the
        main thread, and the autograd thread the comm hook runs on) does not; nor does it count a
        backend's own threads. On ``cuda`` each rank owns its GPU: wall time after a synchronize.
        """
        if self.cfg.target == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
            return time.perf_counter()
        if not self._clocks:
            return time.process_time()
        return sum(time.clock_gettime(c) for c in self._clocks)

    def _watch_thread(self) -> None:
        """Count the calling thread's CPU time from the next step on (the hook finds autograd's thread)."""
        ident = threading.get_ident()
        if ident not in self._threads and hasattr(time, "pthread_getcpuclockid"):
            self._threads.add(ident)
            self._clocks = [*self._clocks, time.pthread_getcpuclockid(ident)]

    def _one_step(self, step: int) -> None:
        import torch

        self._t0, self._arrived, self._nonfinite = time.perf_counter(), None, False
        self._c0, self._busy_s = self._busy_clock(), None
        self.injector.step_begin(step)
        try:
            ids = self._batch(self.rank, step)
            self.ddp(input_ids=ids, labels=ids).loss.backward()
        finally:
            self.injector.step_end(step)
        compute = self._busy_s if self._busy_s is not None else self._busy_clock() - self._c0
        world = self.ddp.process_group.size()
        flags = torch.zeros(world)
        flags[self.rank] = 1.0 if self._nonfinite else 0.0
        flags = self.comms.allreduce(flags.to(self.device)).wait()[0].cpu()
        bad = [r for r in range(world) if flags[r] > 0]
        if not bad:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.completed = step
        self.injector.observe(step, compute)
        self.log.emit("step", step=step, compute_s=compute, step_s=time.perf_counter() - self._t0,
                      nonfinite=bad, skipped=bool(bad))

    def final(self) -> None:
        import torch

        digest = hashlib.sha256()
        finite = True
        for k, v in self.model.state_dict().items():
            t = v.detach().cpu().contiguous()
            finite = finite and bool(torch.isfinite(t).all())
            digest.update(k.encode())
            digest.update(t.numpy().tobytes())
        self.log.emit("final", digest=digest.hexdigest(), params_finite=finite, completed=self.completed)


def proc_main(label: str, slot: int, cfg_dict: dict, scenario: str, workdir: str) -> None:
    """One rank or spare process: set up, report ready, then follow the supervisor's generations."""
    from harness.fleet.pool import die_with_parent

    die_with_parent()  # a killed supervisor / CLI leaves nothing behind
    out = os.open(os.path.join(workdir, f"log-{label}.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo listens on 127.0.0.1 only
    cfg = FaultConfig(**cfg_dict)
    # Belt and braces: even if the supervisor is SIGKILLed, no rank outlives its deadline.
    killer = threading.Timer(cfg.startup_s + cfg.deadline_s + 30, os._exit, (124,))
    killer.daemon = True
    killer.start()
    job = Job(cfg, scenario, label, slot, workdir)
    code = 0
    try:
        job.setup()
        _Agent(job).start()
        job.log.emit("ready")
        last = -1
        while (ctl := job.wait_control(last)) is not None:
            job.join(ctl)
            last = job.gen
            if job.train(ctl["start_step"]) == "done":
                break
        job.final() if job.gen >= 0 else job.log.emit("final", unused=True)
    except BaseException as exc:  # noqa: BLE001  a rank must always say why it ended
        import traceback

        job.log.emit("crashed", error=f"{type(exc).__name__}: {exc}"[:2000])
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip destructors: an abandoned group's stuck message must not block or abort the exit
