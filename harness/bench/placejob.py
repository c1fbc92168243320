"""One process of a placement scenario: a model's steps on its device(s), timed and fingerprinted.

Started by `harness.bench.placerun` from a fork server that imported torch and transformers but no
backend: the process applies its own environment first (the visibility variable that shows it only its
device), then loads the backend, so it sees what a process started that way on that chip would see. It
answers the supervisor's commands over its pipe, one phase at a time:

- ``step`` (per-chip, host, shared:K): a training step of a tiny GPT-2 on each of its devices (a replica
  per device, seeded alike);
- ``trainer`` (rl): a training step, then its weights copied to the host and handed to the generator
  (`torch.save` bytes over a pipe, version and digest attached);
- ``generator`` (rl): the latest weights loaded onto its device, then greedy decoding of a seeded prompt.

A phase starts from the seeded model and optimizer (``alone``: this process by itself on the device;
``together``: with the scenario's others), so two phases of one process must give the same numbers: the
losses, the final parameters, the decoded tokens, each hashed. The device is first used inside a phase,
so a backend that refuses this process refuses it there; the refusal is reported with its words.
"""

from __future__ import annotations

import hashlib
import io
import os
import signal
import struct
import sys
import time
from typing import Any

ROLE_ENV = "PORTHARNESS_PLACEMENT_ROLE"  # this process's role, for a backend module that wants to know
MODEL_CONFIG = {"vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 64, "resid_pdrop": 0.0,
                "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}
BATCH = (4, 32)
PROMPT = (2, 8)
LR = 0.05


def _model(seed: int) -> Any:
    import torch
    from transformers import GPT2Config

    from harness.models.tiny import build_from_config

    model = build_from_config("causal-lm", GPT2Config(**MODEL_CONFIG), seed=seed)
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def _tokens(shape: tuple[int, int], seed: int) -> Any:
    import torch

    return torch.randint(0, MODEL_CONFIG["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


def state_digest(state: dict[str, Any]) -> str:
    """sha256 of a state dict's bytes, key by key (on the host: the same digest wherever the weights are)."""
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class _Clocks:
    """Per-step wall seconds and the adapter's clock (the speed gate's), around a synchronized step."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self.clock = adapter.perf_clock()[1]
        self.wall: list[float] = []
        self.device: list[float] = []

    def time(self, run, devices: list[str]) -> Any:
        w0, c0 = time.perf_counter(), self.clock()
        out = run()
        for d in devices:
            self.adapter.synchronize(d)
        self.wall.append(time.perf_counter() - w0)
        self.device.append(self.clock() - c0)
        return out


class Role:
    def __init__(self, spec: dict[str, Any], peer: Any) -> None:
        from harness.backends import adapter_for

        self.spec, self.peer = spec, peer
        self.kind, self.devices = spec["kind"], list(spec["devices"])
        self.steps, self.warmup, self.seed = int(spec["steps"]), int(spec["warmup"]), int(spec["seed"])
        self.adapter = adapter_for(spec["target"])
        self.versions: list[bytes] = []  # the generator's copy of the trainer's weights, for its alone phase
        self.first_use = 0.0  # when this process first asked its device for something (a refusal's clock)

    def _on_device(self, model: Any, device: str) -> Any:
        if not self.first_use:
            self.first_use = time.perf_counter()
        return model.to(device)

    def hello(self) -> dict[str, Any]:
        import torch

        return {"ev": "ready", "pid": os.getpid(), "sees": self.adapter.device_count(),
                "identity": [self.adapter.device_identity(d) for d in self.devices], "torch": torch.__version__}

    def phase(self, name: str) -> dict[str, Any]:
        for d in self.devices:
            self.adapter.reset_peak_memory(d)
        clocks = _Clocks(self.adapter)
        out = {"step": self._steps, "trainer": self._train, "generator": self._generate}[self.kind](name, clocks)
        peaks = [self.adapter.peak_memory_mb(d) for d in self.devices]
        return {"ev": "done", "phase": name, "wall": clocks.wall, "clock": clocks.device,
                "peak_mb": peaks, "device_used_mb": [self._device_used(d) for d in self.devices], **out}

    def _device_used(self, device: str) -> float | None:
        """What the whole device has in use (every process's), where its module reports free memory."""
        import torch

        info = getattr(torch.get_device_module(self.adapter.kind), "mem_get_info", None) \
            if self.adapter.kind != "cpu" else None
        try:
            free, total = info(torch.device(device)) if callable(info) else (None, None)
        except (RuntimeError, NotImplementedError, AttributeError):
            return None
        return None if free is None else (total - free) / 2**20

    # -- the workloads --------------------------------------------------------------------------

    def _steps(self, name: str, clocks: _Clocks) -> dict[str, Any]:
        devices = self.devices[:1] if name == "alone" and self.spec.get("alone_first_only") else self.devices
        replicas = []
        for d in devices:  # the first use of each device: a refusal is raised here
            model, opt = _model(self.seed)
            replicas.append((self._on_device(model.train(), d), opt, _tokens(BATCH, self.seed).to(d), d))
        losses: dict[str, list[float]] = {d: [] for d in devices}

        def step() -> None:
            for model, opt, ids, d in replicas:
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses[d].append(loss.detach())

        for i in range(self.warmup + self.steps):
            if i < self.warmup:
                step()
            else:
                clocks.time(step, devices)
        numbers = {d: _float_digest([float(v) for v in losses[d]]) + ":" + state_digest(m.state_dict())
                   for m, _, _, d in replicas}
        return {"numbers": numbers, "devices_run": devices}

    def _train(self, name: str, clocks: _Clocks) -> dict[str, Any]:
        import torch

        model, opt = _model(self.seed)
        device = self.devices[0]
        model = self._on_device(model.train(), device)
        losses, handoff, sent = [], [], []

        def hand(version: int) -> None:
            t0 = time.perf_counter()
            state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
            digest = state_digest(state)
            buf = io.BytesIO()
            torch.save(state, buf)
            self.peer.send_bytes(struct.pack("<i", version) + digest.encode() + buf.getvalue())
            handoff.append(time.perf_counter() - t0)
            sent.append(digest)

        def step(s: int) -> None:
            ids = _tokens(BATCH, self.seed + 1 + s).to(device)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            hand(s + 1)  # the weights go to the generator every step: part of the trainer's step

        hand(0)
        for s in range(self.warmup + self.steps):
            if s < self.warmup:
                step(s)
            else:
                clocks.time(lambda s=s: step(s), [device])
        return {"numbers": {device: _float_digest(losses) + ":" + sent[-1]}, "sent": sent,
                "handoff_s": handoff[1 + self.warmup:]}

    def collect(self) -> dict[str, Any]:
        """The generator's side of the trainer's alone phase: every version it hands, kept for later."""
        self.versions = [self.peer.recv_bytes() for _ in range(self.warmup + self.steps + 1)]
        return {"ev": "collected", "versions": len(self.versions)}

    def _generate(self, name: str, clocks: _Clocks) -> dict[str, Any]:
        import torch

        model, _ = _model(self.seed)
        device = self.devices[0]
        model = self._on_device(model.eval(), device)
        prompt = _tokens(PROMPT, self.seed + 10_000).to(device)
        mask = torch.ones_like(prompt)
        tokens, versions, digests, waits, loads = [], [], [], [], []
        stored = iter(self.versions)

        def step() -> None:
            t0 = time.perf_counter()
            raw = next(stored) if name == "alone" else self.peer.recv_bytes()  # together: the trainer's latest
            t1 = time.perf_counter()
            version, sent = struct.unpack("<i", raw[:4])[0], raw[4:20].decode()
            state = torch.load(io.BytesIO(raw[20:]), weights_only=True)
            model.load_state_dict(state)
            # what the device really holds now, read back: the weights it decodes with
            held = state_digest(model.state_dict())
            with torch.no_grad():
                out = model.generate(prompt, attention_mask=mask, max_new_tokens=int(self.spec["new_tokens"]),
                                     do_sample=False, pad_token_id=0)
            tokens.append(out[:, prompt.shape[1]:].cpu().reshape(-1).tolist())
            versions.append(version)
            digests.append([sent, held])
            waits.append(t1 - t0)
            loads.append(time.perf_counter() - t1)

        for s in range(self.warmup + self.steps):
            if s < self.warmup:
                step()
            else:
                clocks.time(step, [device])
        if name != "alone":
            self.peer.recv_bytes()  # the trainer's last version (after its last step): nobody decodes with it
        return {"numbers": {device: hashlib.sha256(repr(tokens).encode()).hexdigest()[:16]}, "versions": versions,
                "digests": digests, "wait_s": waits[self.warmup:], "load_s": loads[self.warmup:],
                "tokens": tokens[-1] if tokens else []}


def _float_digest(values: list[float]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(values)}f", *values)).hexdigest()[:16]


def role_main(conn: Any, spec: dict[str, Any], peer: Any = None) -> None:
    """Entry point of one scenario process (forked from the fork server)."""
    from harness.fleet.pool import die_with_parent

    die_with_parent()  # a supervisor killed with -9 leaves nothing running
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stdout.flush()
    os.dup2(2, 1)  # what a backend prints is not the CLI's --json
    os.environ.clear()  # the supervisor's environment as of this scenario, plus this process's own
    os.environ.update(spec["env"])
    os.environ[ROLE_ENV] = spec["role"]
    try:
        import torch

        from harness.backends import load_backends

        load_backends(spec["backends"], entry_points=True)
        import transformers

        transformers.logging.set_verbosity_error()  # the tiny config's notes, once per process: noise here
        torch.set_num_threads(1)  # as the speed gate times: the step's own work on one core
        role = Role(spec, peer)
        role.adapter.load()
        conn.send(role.hello())
    except BaseException as e:  # noqa: BLE001  reported, then this process is done
        conn.send({"ev": "failed", "phase": "start", "error": f"{type(e).__name__}: {e}"[:2000]})
        return
    while True:
        try:
            cmd = conn.recv()
        except (EOFError, OSError):
            return
        if cmd is None:
            return
        try:
            conn.send(role.collect() if cmd == "collect" else role.phase(cmd))
        except BaseException as e:  # noqa: BLE001
            found = role.adapter.refusal(e)
            after = time.perf_counter() - role.first_use if role.first_use else None
            conn.send({"ev": "refused" if found else "failed", "phase": cmd, "after_s": after,
                       "error": found.message if found else f"{type(e).__name__}: {e}"[:2000],
                       "holder": found.holder if found else None})
            return
