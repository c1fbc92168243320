"""The pool of `pool.py` on a Ray cluster: one long-lived actor per device, the same events.

`RayPool` has `Pool`'s interface (spawn, retire, poll, close; workers with key, ready, busy, job,
phase), so `runner._Run` and `policy` are one implementation for both executors. Each device of each
node is a *slot*, named `<node>/<device>` (`gpu-host-3/cuda:5`, `10.0.0.7/sim:1`): strikes and
quarantine are per node and device. An actor asks Ray for its device as a resource (`GPU` for cuda,
a custom `sim` resource for sim: `Adapter.ray_resource`) on its slot's node, loads the backend once
and runs models through the worker's own code (`rayactor.py`).

Events: ready, result, died (the actor process died under a model: the signal and phase come from
its node, `rayactor.autopsy`), timeout and startup (deadlines as `Pool`'s, read from the actor's node
with `rayactor.peek` once a job has run as long as its shortest budget: the actor is killed and the
runner replaces it),
`lost` (the actor's node left the cluster) and `interrupted` (Ray could not reach the actor; it is
ended). Neither of the last two says anything about the model: the runner re-runs it elsewhere (and
takes a lost node's devices out of the fleet).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from harness import files
from harness.backends import adapter_for, device_type
from harness.fleet.budgets import Budgets, JobClock
from harness.fleet.pool import Event, ExecutorError

RAY_MISSING = "--executor ray needs Ray on this machine and on every node: pip install 'portharness[ray]'"
CONNECT_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 5.0  # one Ray call to what answers at --ray-address
PEEK_TIMEOUT_S = 30.0
AUTOPSY_TIMEOUT_S = 60.0
# faulthandler's words for the fatal signals it reports
_FATAL = {"Segmentation fault": signal.SIGSEGV, "Aborted": signal.SIGABRT, "Bus error": signal.SIGBUS,
          "Floating-point exception": signal.SIGFPE, "Floating point exception": signal.SIGFPE,
          "Illegal instruction": signal.SIGILL}


def ray_module() -> Any:
    """Ray, or a ValueError saying how to get it."""
    try:
        import ray
    except ImportError as e:
        raise ValueError(f"{RAY_MISSING} ({e})") from None
    return ray


@dataclass(frozen=True)
class Slot:
    """One device of one node."""

    key: str  # the fleet's name for it: "<node>/<device>"
    node_id: str
    host: str  # the node's name in rows: its host name (plus its node id where hosts run several)
    device: str  # the device as the node's backend names it (Ray-assigned ones: by Ray's chip id)
    resource: str  # the Ray resource it is
    assigned: bool  # Ray picks the chip (its own accelerator resources); the actor then sees `<type>:0`
    threads: int  # torch threads for its actor: the node's CPUs shared among its devices


_slots: dict[str, Slot] = {}  # the cluster's slots as last seen (`devices`)
_stdout: Any = None  # the CLI's stdout while Ray is connected (its notices go to stderr meanwhile)


def _reachable(address: str) -> None:
    """A bounded check that something listens at `address` (HOST:PORT or ray://HOST:PORT): Ray itself
    waits minutes for an address that never answers."""
    parts = urlsplit(address if "://" in address else f"//{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if not host or not port:
        raise ValueError(f"--ray-address {address!r}: expected auto, HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ValueError(f"--ray-address {address}: nothing answers there ({e.strerror or e}); start the cluster "
                         "(`ray start --head` on its head node) or fix the address") from None
    why = _not_ray(address, host, port)
    if why:
        raise ValueError(f"--ray-address {address}: something answers there, but it is not a Ray cluster ({why}); "
                         "give the head's GCS address (HOST:6379, what `ray start --head` prints) or its Ray Client "
                         "server (ray://HOST:10001)")


# One call Ray's own server answers at once: the GCS's GetClusterId (HOST:PORT), the Ray Client server's PING
# (ray://). Made in a child process: gRPC and Ray log natively to the stderr of the process that calls them.
_PROBE = r"""
import sys
import grpc
target, client, seconds = sys.argv[1], sys.argv[2] == "client", float(sys.argv[3])
if client:
    from ray.core.generated import ray_client_pb2 as pb, ray_client_pb2_grpc as rpc
    call = rpc.RayletDriverStub(grpc.insecure_channel(target)).ClusterInfo
    request = pb.ClusterInfoRequest(type=pb.ClusterInfoType.PING)
else:
    from ray.core.generated import gcs_service_pb2 as pb, gcs_service_pb2_grpc as rpc
    call = rpc.NodeInfoGcsServiceStub(grpc.insecure_channel(target)).GetClusterId
    request = pb.GetClusterIdRequest()
try:
    call(request, timeout=seconds)
except grpc.RpcError as e:
    print(e.code().name, (e.details() or "").strip().splitlines()[0][:200] if e.details() else "")
else:
    print("OK")
"""
_RAY_ANSWERS = ("OK", "UNAUTHENTICATED", "PERMISSION_DENIED")  # Ray's server knew the call


def _not_ray(address: str, host: str, port: int) -> str:
    """Why what answers at `address` is not Ray's GCS or Ray Client server ("" if it is), within
    PROBE_TIMEOUT_S: Ray's own connect retries for minutes, printing its native warnings."""
    client = address.startswith("ray://")
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE, f"{host}:{port}", "client" if client else "gcs",
                            str(PROBE_TIMEOUT_S)], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S + 25,
                           env={**os.environ, "GRPC_VERBOSITY": "NONE", "RAY_USAGE_STATS_ENABLED": "0"})
    except subprocess.TimeoutExpired:
        return f"no answer to a Ray call within {PROBE_TIMEOUT_S:g}s"
    words = r.stdout.strip().split(" ", 1)
    code, detail = (words + [""])[:2] if words and words[0] else ("", "")
    if r.returncode != 0 or not code:
        last = (r.stderr.strip().splitlines() or ["the probe failed"])[-1]
        return f"the probe could not ask it: {last[:200]}"
    if code in _RAY_ANSWERS:
        return ""
    if code == "DEADLINE_EXCEEDED":
        return f"no answer to a Ray call within {PROBE_TIMEOUT_S:g}s"
    if code == "UNIMPLEMENTED":
        return "a gRPC server without Ray's " + ("Ray Client service" if client else "GCS service")
    if "http1" in detail:
        return "it speaks HTTP/1 (a web server or an HTTP proxy), not gRPC"
    if "Failed parsing HTTP/2" in detail or "Socket closed" in detail or "Connection reset" in detail:
        return "it does not answer in gRPC (HTTP/2): another service, or a proxy to one"
    return f"a Ray call got {code}" + (f": {detail[:150]}" if detail else "")


def connect(address: str | None, target: str) -> None:
    """Join the Ray cluster at `address` (auto: the one `ray start` made on this host), or start a Ray
    instance of this host alone (None) offering its devices of `target`'s type. ValueError if not."""
    global _stdout
    ray = ray_module()
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING, "namespace": "portharness"}
    if address is not None and address != "auto":
        _reachable(address)
    # Ray prints its nodes' notices (a worker died, ...) on the driver's stdout: the CLI's, which --json
    # keeps for JSON alone. They go to stderr while connected; `disconnect` gives stdout back.
    _stdout, sys.stdout = sys.stdout, sys.stderr
    try:
        if address is None:
            adapter = adapter_for(target)
            resources = {} if adapter.ray_assigns else {adapter.ray_resource: adapter.device_count()}
            # "local": a new instance, never a cluster that happens to run on this host
            ray.init(address="local", include_dashboard=False, resources=resources, **quiet)
        else:
            ray.init(address=address, **quiet)
    except (ConnectionError, RuntimeError, ValueError, TimeoutError) as e:
        sys.stdout, _stdout = _stdout, None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--ray-address {address}: cannot join a Ray cluster there ({first[:300]}); start one "
                         "with `ray start --head` (then --ray-address auto on that host) or fix the address") from None


def disconnect() -> None:
    """Leave the cluster (stopping the Ray instance `connect` started, if it did)."""
    global _stdout
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    if _stdout is not None:
        sys.stdout, _stdout = _stdout, None


def _index(target: str) -> int | None:
    _, _, idx = target.partition(":")
    if not idx:
        return None
    if not idx.isdigit():
        raise ValueError(f"--target {target!r}: expected a device type, or type:index (sim, sim:1, cuda:0)")
    return int(idx)


def devices(target: str, address: str | None) -> list[str]:
    """The slots the cluster offers for `target` (every node's devices of its type; `sim:1`: device 1 of
    each node), as fleet keys. ValueError when no node offers one."""
    connect(address, target)
    import ray

    adapter = adapter_for(target)
    kind, resource, want = device_type(target), adapter.ray_resource, _index(target)
    nodes = sorted((n for n in ray.nodes() if n.get("Alive")),
                   key=lambda n: (n.get("NodeManagerHostname", ""), n["NodeID"]))
    names = [n.get("NodeManagerHostname") or n.get("NodeManagerAddress", "") for n in nodes]
    found: dict[str, Slot] = {}
    for node, name in zip(nodes, names, strict=True):
        label = name if names.count(name) == 1 else f"{name}-{node['NodeID'][:6]}"
        count = int(node["Resources"].get(resource, 0))
        threads = max(1, int(node["Resources"].get("CPU", 1)) // max(1, count))
        for i in range(count):
            if want is not None and i != want:
                continue
            slot = Slot(key=f"{label}/{kind}:{i}", node_id=node["NodeID"], host=label, device=f"{kind}:{i}",
                        resource=resource, assigned=adapter.ray_assigns, threads=threads)
            found[slot.key] = slot
    if not found:
        where = "the local Ray instance" if address is None else f"the Ray cluster at {address}"
        offered = sorted({r for n in nodes for r in n["Resources"]
                          if not r.startswith(("node:", "memory", "object_store"))})
        declare = ("(Ray counts them itself on hosts that have them)" if adapter.ray_assigns else
                   f"(declare it on each host: ray start ... --resources '{{\"{resource}\": N}}')")
        raise ValueError(f"--target {target}: no node of {where} offers the '{resource}' resource {declare}; "
                         f"its nodes offer: {', '.join(offered) or 'nothing'}")
    _slots.clear()
    _slots.update(found)
    return list(found)


class RayWorker:
    """One actor serving one slot; the runner sees it as it sees a local worker."""

    noun = "actor"

    def __init__(self, actor_cls: Any, slot: Slot, args: tuple, first_check_s: float) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.slot = slot
        self.key = slot.key
        self.host = slot.host
        self.device = slot.device
        opts: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0,
                                "scheduling_strategy": NodeAffinitySchedulingStrategy(slot.node_id, soft=False)}
        if slot.resource == "GPU":
            opts["num_gpus"] = 1
        else:
            opts["resources"] = {slot.resource: 1}
        local = f"{device_type(slot.device)}:0" if slot.assigned else slot.device
        self.actor = actor_cls.options(**opts).remote(local, slot.host, slot.threads, *args)
        self.first_check_s = first_check_s  # the shortest budget a job can have
        self.hello: Any = self.actor.hello.remote()
        self.born = time.monotonic()
        self.ready = False
        self.job: Any = None
        self.clock = JobClock()  # as a local worker's, as last read from its node
        self.check_at = 0.0  # when the driver next reads the job's budget from its node
        self.done = 0
        self.killed_for: str | None = None
        self.pid = 0
        self.run_ref: Any = None
        self.signal: int | None = None
        self.cause = ""  # what Ray or the node said about its death
        self.fatal = ""  # the fatal-signal report it left

    @property
    def busy(self) -> bool:
        return self.job is not None

    def send(self, job: Any, payload: Any) -> None:
        self.job = job
        self.clock = JobClock.start(time.monotonic())
        self.check_at = self.clock.started + self.first_check_s
        self.run_ref = self.actor.run.remote(payload)

    def kill(self, reason: str) -> None:
        import ray

        self.killed_for = reason
        self.signal = signal.SIGKILL  # `ray.kill` ends the process at once, as a local worker is killed
        ray.kill(self.actor, no_restart=True)

    def stop(self) -> None:
        """Let it clean up after itself, then end it."""
        import ray

        if self.ready and not self.killed_for:
            try:
                ray.get(self.actor.bye.remote(), timeout=5)
            except Exception:  # dead or stuck: it is killed all the same
                pass
        self.kill(self.killed_for or "stop")

    def death(self) -> tuple[int | None, int | None]:
        """(exit code, signal) of a dead actor, as far as its node told (the exit code it never does)."""
        return None, self.signal


class RayPool:
    """Actors for the cluster's slots; `poll` turns their lives into `pool.Event`s."""

    per_device = 1  # Ray hands a device to one actor at a time

    def __init__(self, *, mem_cap_mb: int | None, env: dict[str, str], backends: list[str], budgets: Budgets,
                 startup_timeout_s: float | None = None, usable: Callable[[str], bool] = lambda key: True) -> None:
        import ray

        from harness.fleet.rayactor import DeviceActor, autopsy, peek

        self.ray = ray
        self.actor_cls = ray.remote(DeviceActor)
        self.autopsy = ray.remote(num_cpus=0, max_retries=0)(autopsy)
        self.peek = ray.remote(num_cpus=0, max_retries=0)(peek)
        self.args = (mem_cap_mb, env, backends)
        self.budgets = budgets
        self.startup_timeout_s = startup_timeout_s
        self.usable = usable
        self.workers: list[RayWorker] = []
        self.holders: dict[str, RayWorker] = {}  # Ray-assigned chips no worker may use (quarantined, spares)
        self.started = 0  # actors started, replacements included

    def slot(self, key: str) -> Slot:
        return _slots[key]

    def node_devices(self, w: RayWorker) -> list[str]:
        """Every slot of `w`'s node."""
        return [k for k, s in _slots.items() if s.node_id == w.slot.node_id]

    def spawn(self, key: str) -> RayWorker:
        held = self.holders.pop(key, None)
        if held is not None:  # a spare coming in: the actor pinning its chip becomes its worker
            self.workers.append(held)
            return held
        self.started += 1
        w = RayWorker(self.actor_cls, _slots[key], self.args, first_check_s=self.budgets.shortest)
        self.workers.append(w)
        return w

    def retire(self, w: RayWorker) -> None:
        """Forget a worker; its actor is ended (a retired worker never comes back)."""
        if w in self.workers:
            self.workers.remove(w)
        if w.killed_for is None:
            w.kill("retired")

    # -- events ------------------------------------------------------------------------------

    def _deadline(self, w: RayWorker) -> float:
        return self.budgets.deadline(w.clock)

    def poll(self, max_wait: float = 1.0) -> list[Event]:
        """Wait up to `max_wait` s (less if a deadline is nearer); every event that happened meanwhile."""
        now = time.monotonic()
        waits = [max_wait, *(w.check_at - now for w in self.workers if w.busy)]
        refs: dict[Any, tuple[RayWorker | None, str]] = {}
        for w in self.workers:
            for kind, ref in (("hello", w.hello), ("run", w.run_ref)):
                if ref is not None:
                    refs[ref] = (w, kind)
        timeout = max(0.0, min(waits))
        ready: list[Any] = []
        try:
            if refs:
                ready, _ = self.ray.wait(list(refs), num_returns=1, timeout=timeout)
                if ready:
                    ready, _ = self.ray.wait(list(refs), num_returns=len(refs), timeout=0)
            else:
                time.sleep(timeout)
        except self.ray.exceptions.RaySystemError as e:
            raise ExecutorError(f"lost the Ray cluster ({str(e).splitlines()[0][:200]}); the finished rows are "
                                "saved: rerun with --resume once it is back") from None
        events: list[Event] = []
        for ref in sorted(ready, key=lambda r: refs[r][1] != "hello"):
            w, kind = refs[ref]
            if w in self.workers:
                events.extend(getattr(self, f"_on_{kind}")(w, ref))
        events.extend(self._deadlines())
        return events

    def _on_hello(self, w: RayWorker, ref: Any) -> list[Event]:
        w.hello = None
        try:
            info = self.ray.get(ref)
        except self.ray.exceptions.RayError as e:
            return [self._dead(w, e)]
        w.pid = info["pid"]
        chips = info["accelerators"].get(w.slot.resource, [])
        if w.slot.assigned and chips:  # Ray picked the chip: the worker is that chip's
            actual = f"{w.host}/{device_type(w.slot.device)}:{chips[0]}"
            if actual != w.key and actual in _slots:
                wanted = w.key
                w.key, w.slot, w.device = actual, _slots[actual], _slots[actual].device
                if not self.usable(actual):  # a chip out of service (quarantined, a spare): pin it, ask again
                    w.ready = True
                    self.workers.remove(w)
                    self.holders[actual] = w
                    self.spawn(wanted)
                    return []
        w.ready = True
        return [Event("ready", w, info)]

    def _peek(self, w: RayWorker) -> bool:
        """Read `w`'s job's phase and time budget from its node (`rayactor.peek`); False if it cannot, or if
        the job has ended there (its result is on its way)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        try:
            got = self.ray.get(self.peek.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                w.slot.node_id, soft=False)).remote(w.pid), timeout=PEEK_TIMEOUT_S)
        except Exception:  # the node or the actor is going: its death or loss is the next event
            return False
        if got is None or not w.busy:
            return False
        phase, window_age, spent = got
        w.clock.phase, w.clock.spent = phase, spent
        w.clock.phase_started = time.monotonic() - window_age
        return True

    def _catch_up(self, w: RayWorker) -> None:
        """The phase `w`'s job is in, for judging its end."""
        if w.busy and w.pid:
            self._peek(w)

    def _on_run(self, w: RayWorker, ref: Any) -> list[Event]:
        w.run_ref = None
        try:
            m, repro = self.ray.get(ref)
        except self.ray.exceptions.RayActorError as e:
            return [self._dead(w, e)]
        except self.ray.exceptions.RayError as e:  # the reply itself failed (it could not be unpickled, ...)
            self._catch_up(w)
            w.kill("harness")
            w.cause = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
            return [Event("died", w)]
        m.device = w.device  # a Ray-assigned chip is `<type>:0` to its actor
        for path, data in repro.items():
            if not os.path.exists(path):  # the driver keeps a node's repro (same file on a shared disk)
                files.write_bytes(path, data)
        w.done += 1
        return [Event("result", w, m)]

    def _node_alive(self, w: RayWorker) -> bool:
        try:
            return any(n["NodeID"] == w.slot.node_id and n.get("Alive") for n in self.ray.nodes())
        except Exception:
            return False

    def _dead(self, w: RayWorker, err: Exception) -> Event:
        """The event for an actor Ray reports dead: its node gone, its constructor failed, or the
        process died (the signal and the phase read back from its node)."""
        text = str(err)
        w.cause = _ray_reason(text)
        if w.killed_for:
            return Event("died", w)
        if "node has died" in text or not self._node_alive(w):
            return Event("lost", w)
        if isinstance(err, self.ray.exceptions.ActorUnavailableError):  # unreachable, not known dead: end it
            w.kill("unavailable")
            return Event("interrupted", w)
        if getattr(err, "actor_init_failed", False):
            return Event("died", w)
        if re.search(r"low on memory|memory monitor|OutOfMemory|OUT_OF_MEMORY", text):
            w.signal = signal.SIGKILL
            w.cause = "killed by Ray's memory monitor (the node ran low on memory)"
            return Event("died", w)
        if w.pid:
            try:
                w.fatal = self._autopsy(w)
            except Exception:  # the node went while we asked
                return Event("lost", w) if not self._node_alive(w) else Event("died", w)
            w.signal = next((s for words, s in _FATAL.items() if f"Fatal Python error: {words}" in w.fatal), None)
        return Event("died", w)

    def _autopsy(self, w: RayWorker) -> str:
        """What dead actor `w` left on its node: the phase its job was in becomes `w.phase`; returns its
        fatal-signal report. Raises when the node cannot answer."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        phase, fatal = self.ray.get(self.autopsy.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(w.slot.node_id, soft=False)).remote(w.pid),
            timeout=AUTOPSY_TIMEOUT_S)
        if w.busy and phase:
            w.clock.phase = phase
        return fatal

    def _deadlines(self) -> list[Event]:
        events = []
        for w in list(self.workers):
            now = time.monotonic()
            if w.busy and now > w.check_at:
                if not w.pid or not self._peek(w):
                    w.check_at = now + 1.0
                    continue
                now = time.monotonic()
                if now > self._deadline(w):
                    w.kill("timeout")
                    events.append(Event("timeout", w))
                else:
                    w.check_at = self.budgets.next_check(w.clock, now)
            elif not w.ready and self.startup_timeout_s and now - w.born > self.startup_timeout_s:
                w.kill("startup")
                events.append(Event("startup", w))
        return events

    def close(self) -> None:
        for w in [*self.workers, *self.holders.values()]:
            w.stop()
        self.workers.clear()
        self.holders.clear()


def _ray_reason(text: str) -> str:
    """The line of Ray's actor-death message that says why."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    why = next((ln for ln in lines if ln.startswith(("The actor is dead", "The actor died because"))), "")
    if not why:
        why = lines[-1] if lines else ""
    return why.split(" Some common causes")[0][:300]
