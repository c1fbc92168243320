"""Run one placement scenario: its processes, their phases in order, one deadline, nothing left behind.

The processes (`harness.bench.placejob`) are forked from a fork server that imported torch and
transformers but no backend (`harness.fleet.pool.context`), so each applies its own environment before
its backend loads. Every process first runs *alone* while the others wait (each in turn; in ``rl`` the
trainer while the generator only collects the weights it hands, then the generator), then all run
*together*. A process that is refused or fails ends the scenario's phases: the rest are stopped.

The scenario has one deadline: past it, whoever has not answered is named (role, pid, what it was
doing) and every process is killed. Processes also die with their fork server (`die_with_parent`), so a
supervisor killed with -9 leaves none running.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from harness.fleet.pool import PRELOAD, context

EXIT_WAIT_S = 5.0


@dataclass
class Plan:
    """A scenario's processes and what each does, stage by stage."""

    scenario: str
    roles: dict[str, dict[str, Any]]  # role -> its spec (`placejob.Role`)
    stages: list[dict[str, str]]  # each: role -> command ("alone", "collect"), run at once; then "together"
    link: tuple[str, str] | None = None  # (sender, receiver): the trainer hands the generator its weights


@dataclass
class Raw:
    """What the processes said, as they said it."""

    hello: dict[str, dict] = field(default_factory=dict)  # role -> its ready message
    replies: dict[str, dict[str, dict]] = field(default_factory=dict)  # role -> command -> reply
    stopped: dict[str, dict] = field(default_factory=dict)  # role -> its refused / failed message
    pids: dict[str, int] = field(default_factory=dict)
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    timed_out: list[str] = field(default_factory=list)  # "generator (pid 123, in its together phase)"
    wall_s: float = 0.0


class _Scenario:
    def __init__(self, plan: Plan, timeout_s: float) -> None:
        from harness.bench.placejob import role_main

        ctx = context([*PRELOAD, "harness.bench.placejob"])
        self.plan, self.raw = plan, Raw()
        self.deadline = time.monotonic() + timeout_s
        self.doing: dict[str, str] = {}  # role -> what it was last asked to do
        self.waiting: set[str] = set()  # roles asked something that have not answered yet
        peers: dict[str, Any] = {}
        if plan.link is not None:
            recv, send = ctx.Pipe(duplex=False)
            peers = {plan.link[0]: send, plan.link[1]: recv}
        self.conns, self.procs = {}, {}
        for role, spec in plan.roles.items():
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=role_main, args=(child, spec, peers.get(role)), daemon=True,
                               name=f"portharness-placement-{role}")
            proc.start()
            child.close()
            self.conns[role], self.procs[role] = parent, proc
            self.raw.pids[role] = proc.pid
            self.doing[role] = "starting"
        for conn in peers.values():
            conn.close()  # the processes hold their ends

    def _await(self, roles: list[str], what: str) -> bool:
        """Wait for one message from each of `roles`; False when one refused or failed, or time ran out."""
        pending = set(roles)
        while pending:
            left = self.deadline - time.monotonic()
            if left <= 0:  # every process still owing an answer, and what the OS says it is doing
                self.raw.timed_out = [f"{r} (pid {self.raw.pids[r]}, {self.doing[r]}, {_state(self.raw.pids[r])})"
                                      for r in self.plan.roles if r in self.waiting | pending]
                return False
            by_handle = {self.conns[r]: r for r in pending} | {self.procs[r].sentinel: r for r in pending}
            for h in wait(list(by_handle), timeout=min(left, 1.0)):
                role = by_handle[h]
                if role not in pending:
                    continue
                try:
                    if not self.conns[role].poll():
                        raise EOFError
                    msg = self.conns[role].recv()
                except (EOFError, OSError):
                    self.procs[role].join(1)
                    msg = {"ev": "failed", "phase": what, "error": f"the process exited (code "
                           f"{self.procs[role].exitcode}) while {self.doing[role]}"}
                pending.discard(role)
                self.waiting.discard(role)
                if msg.get("ev") in ("refused", "failed"):
                    self.raw.stopped[role] = msg
                    return False
                if what == "ready":
                    self.raw.hello[role] = msg
                else:
                    self.raw.replies.setdefault(role, {})[what] = msg
        return True

    def _command(self, cmds: dict[str, str]) -> bool:
        for role, cmd in cmds.items():
            self.doing[role] = f"in its {cmd} phase" if cmd != "collect" else "collecting the trainer's weights"
            self.waiting.add(role)
            self.conns[role].send(cmd)
        ok = True
        for cmd in dict.fromkeys(cmds.values()):
            ok = self._await([r for r, c in cmds.items() if c == cmd], cmd) and ok
            if not ok:
                break
        return ok

    def run(self) -> Raw:
        t0 = time.monotonic()
        try:
            ok = self._await(list(self.plan.roles), "ready")
            for stage in self.plan.stages:
                ok = ok and self._command(stage)
            if ok:
                self._command(dict.fromkeys(self.plan.roles, "together"))
        finally:
            self._stop()
            self.raw.wall_s = time.monotonic() - t0
        return self.raw

    def _stop(self) -> None:
        for conn in self.conns.values():
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        end = time.monotonic() + (0.5 if self.raw.timed_out else EXIT_WAIT_S)
        for proc in self.procs.values():
            proc.join(max(0.0, end - time.monotonic()))
        for proc in self.procs.values():
            if proc.exitcode is None:
                proc.kill()
                proc.join(EXIT_WAIT_S)
        for role, proc in self.procs.items():
            self.raw.exit_codes[role] = proc.exitcode
            self.conns[role].close()


_STATES = {"R": "running", "S": "waiting", "D": "waiting on the kernel", "T": "stopped", "t": "stopped by a tracer",
           "Z": "exited"}


def _state(pid: int) -> str:
    """What the OS says process `pid` is doing (a stopped process and one waiting on it look alike otherwise)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            code = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "state unknown"
    return _STATES.get(code, f"state {code}")


def run_plan(plan: Plan, timeout_s: float) -> Raw:
    """Run `plan` under one deadline of `timeout_s` seconds; always returns, every process gone."""
    return _Scenario(plan, timeout_s).run()
