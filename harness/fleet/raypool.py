"""The pool of `pool.py` on a Ray cluster: one long-lived actor per device, the same events.

`RayPool` has `Pool`'s interface (spawn, retire, poll, close; workers with key, ready, busy, job,
phase), so `runner._Run` and `policy` are one implementation for both executors. Each device of each
node is a *slot*, named `<node>/<device>` (`gpu-host-3/cuda:5`, `10.0.0.7/sim:1`): strikes and
quarantine are per node and device. An actor asks Ray for its device as a resource (`GPU` for cuda,
a custom `sim` resource for sim: `Adapter.ray_resource`) on its slot's node, loads the backend once
and runs models through the worker's own code (`rayactor.py`). A --parallel group's slot is a placement
group of one bundle per device on one node; its actor sits in the first bundle holding no device, and each
run's ranks are actors of their own, one per bundle (`rayranks.py`).

Events: ready, result, died (the actor process died under a model: the signal and phase come from
its node, `rayactor.autopsy`), timeout and startup (deadlines as `Pool`'s, read from the actor's node
with `rayactor.peek` once a job has run as long as its shortest budget: the actor is killed and the
runner replaces it),
`lost` (the actor's node left the cluster) and `interrupted` (Ray could not reach the actor; it is
ended). Neither of the last two says anything about the model: the runner re-runs it elsewhere (and
takes a lost node's devices out of the fleet). Joining the cluster and its slots: `raycluster.py`.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from typing import Any

from harness import files
from harness.backends import device_type
from harness.fleet.budgets import Budgets, JobClock
from harness.fleet.pool import Event, ExecutorError
from harness.fleet.raycluster import SLOTS, Slot, slot
from harness.fleet.rayranks import fatal_signal

PEEK_TIMEOUT_S = 30.0
AUTOPSY_TIMEOUT_S = 60.0


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
        group: dict[str, Any] = {}
        self.group: Any = None  # a --parallel group's placement group: one bundle per device (`rayranks`)
        if slot.count > 1:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            from harness.fleet.rayranks import placement

            self.group = placement(slot.resource, slot.count, slot.node_id)
            # the worker sits in bundle 0 holding no device: each rank's actor holds its own
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=0, placement_group_capture_child_tasks=False)
            group = {"group": self.group, "resource": slot.resource}
        elif slot.resource == "GPU":
            opts["num_gpus"] = 1
        else:
            opts["resources"] = {slot.resource: 1}
        local = f"{device_type(slot.device)}:0" if slot.assigned else slot.device
        self.actor = actor_cls.options(**opts).remote(local, slot.host, slot.threads, *args, **group)
        self.first_check_s = first_check_s  # the shortest budget a job can have
        self.hello: Any = self.actor.hello.remote()
        self.born = time.monotonic()
        self.ready = False
        self.job: Any = None
        self.clock = JobClock()  # as a local worker's, as last read from its node
        self.found: dict[str, Any] | None = None  # what the job had established, as last read from its node
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
        self.found = None
        self.check_at = self.clock.started + self.first_check_s
        self.run_ref = self.actor.run.remote(payload)

    def kill(self, reason: str) -> None:
        import ray

        self.killed_for = reason
        self.signal = signal.SIGKILL  # `ray.kill` ends the process at once, as a local worker is killed
        ray.kill(self.actor, no_restart=True)
        if self.group is not None:  # its devices back to the node, and any rank actor still there ended
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
            self.group = None

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
        return slot(key)

    def node_devices(self, w: RayWorker) -> list[str]:
        """Every slot of `w`'s node."""
        return [k for k, s in SLOTS.items() if s.node_id == w.slot.node_id]

    def spawn(self, key: str) -> RayWorker:
        held = self.holders.pop(key, None)
        if held is not None:  # a spare coming in: the actor pinning its chip becomes its worker
            self.workers.append(held)
            return held
        self.started += 1
        w = RayWorker(self.actor_cls, slot(key), self.args, first_check_s=self.budgets.shortest)
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
            if actual != w.key and actual in SLOTS:
                wanted = w.key
                w.key, w.slot, w.device = actual, SLOTS[actual], SLOTS[actual].device
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
        phase, window_age, spent, found = got
        w.clock.phase, w.clock.spent = phase, spent
        w.found = found
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
            w.signal = fatal_signal(w.fatal)
        return Event("died", w)

    def _autopsy(self, w: RayWorker) -> str:
        """What dead actor `w` left on its node: the phase its job was in becomes `w.phase`; returns its
        fatal-signal report. Raises when the node cannot answer."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        phase, fatal, found = self.ray.get(self.autopsy.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(w.slot.node_id, soft=False)).remote(w.pid),
            timeout=AUTOPSY_TIMEOUT_S)
        if w.busy and phase:
            w.clock.phase = phase
        if w.busy and found is not None:
            w.found = found
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
