"""Placement scenarios: which placements of processes on chips a backend allows, and what each costs.

``portharness placement --target DEV`` runs, each in fresh processes (`harness.bench.placerun`):

- ``per-chip``: one process per device, each shown only its own (the backend's visibility variable:
  CUDA_VISIBLE_DEVICES, sim's own, a vendor adapter's), as TorchTPU runs;
- ``host``: one process drives every device (a model replica on each, in turn), as JAX runs per host;
- ``shared:K``: K processes on one device, each taking training steps;
- ``rl``: on one device, a generator process decoding with a tiny causal LM while a trainer process takes
  training steps on the same model and hands the generator its weights every step (one-step pipelined:
  the generator decodes step s with the weights the trainer made at its step s-1, the newest it has
  finished while the generator was decoding).

Each process first runs alone, then with the others; each scenario becomes one row: allowed or refused
(the backend's own words, the holder it names, how long the refusal took), each process's peak device
memory, its slowdown against running alone (the ratio of per-step medians, wall clock, with the 95%
interval `harness.speed.compare` gives the speed gate), whether its numbers (losses, final weights,
decoded tokens, hashed) are identical to running alone, and in ``rl`` whether the generator decoded every
step with the weights the trainer handed it for that step (the digest of what its device holds after
loading, against the digest the trainer sent). A process that hangs past ``--timeout`` makes a timeout
row naming it; it is killed with the rest.
"""

from __future__ import annotations

import os
import re
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from harness.bench.placerun import Plan, Raw, run_plan

LIST_NAME = "placement"
DEFAULT_SCENARIOS = ("per-chip", "host", "shared:2", "rl")
KINDS = ("per-chip", "host", "shared", "rl")
MAX_SHARED = 16
GRAMMAR = "per-chip, host, shared:K (K from 2 to 16), rl, or all"


def parse_scenarios(text: str) -> list[str]:
    """``per-chip,shared:3`` -> ["per-chip", "shared:3"]; ValueError naming a bad one and the grammar."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    if items == ["all"]:
        return list(DEFAULT_SCENARIOS)
    out = []
    for item in items:
        m = re.fullmatch(r"shared(?::(\d+))?", item)
        if m is not None:
            k = int(m[1]) if m[1] else 2
            if not 2 <= k <= MAX_SHARED:
                raise ValueError(f"--scenarios {item}: K processes on one device must be from 2 to {MAX_SHARED} "
                                 "(one process alone shares nothing)")
            item = f"shared:{k}"
        elif item not in KINDS:
            raise ValueError(f"--scenarios {item!r}: unknown scenario; expected {GRAMMAR}")
        if item not in out:
            out.append(item)
    if not out:
        raise ValueError(f"--scenarios {text!r}: no scenario; expected {GRAMMAR}")
    return out


@dataclass
class PlacementConfig:
    target: str = "sim"
    scenarios: list[str] = field(default_factory=lambda: list(DEFAULT_SCENARIOS))
    steps: int = 10  # timed steps per phase
    warmup: int = 2
    new_tokens: int = 8
    timeout_s: float = 300.0  # per scenario, processes' start-up included
    seed: int = 0
    backends: list[str] = field(default_factory=list)

    def validate(self) -> None:
        for name in self.scenarios:
            parse_scenarios(name)
        checks = [(3 <= self.steps <= 1000, f"--steps {self.steps}: from 3 (an interval needs samples) to 1000"),
                  (0 <= self.warmup <= 100, f"--warmup {self.warmup}: from 0 to 100"),
                  (1 <= self.new_tokens <= 32, f"--new-tokens {self.new_tokens}: from 1 to 32 (the model has 64 "
                                               "positions)"),
                  (1 <= self.timeout_s <= 3600, f"--timeout {self.timeout_s:g}: from 1 to 3600 seconds")]
        for ok, why in checks:
            if not ok:
                raise ValueError(why)


@dataclass
class PlacementResult:
    """One scenario's row (`harness.results.rows.PlacementRow` is its stored form)."""

    target: str
    backend: str
    mode: str  # the backend's sharing: exclusive, shared, unknown
    scenario: str
    result: str = "allowed"  # allowed, refused, timeout, failed
    processes: int = 0
    devices: list = field(default_factory=list)
    refusal: str = ""
    refused_role: str = ""
    holder: int | None = None
    holder_role: str = ""
    refusal_s: float | None = None
    slowdown: float | None = None
    slowdown_lo: float | None = None
    slowdown_hi: float | None = None
    identical: bool | None = None
    latest_weights: bool | None = None
    visibility: str = ""
    peak_mb: float | None = None
    handoff_ms: float | None = None
    wall_s: float = 0.0
    per_process: list = field(default_factory=list)
    detail: str = ""
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------------------------
# Plans: which processes, on which devices, doing what
# ----------------------------------------------------------------------------------------------


def _spec(cfg: PlacementConfig, role: str, kind: str, devices: list[str], env: dict[str, str],
          **extra: Any) -> dict[str, Any]:
    return {"role": role, "kind": kind, "target": cfg.target, "devices": devices, "env": {**os.environ, **env},
            "backends": cfg.backends, "steps": cfg.steps, "warmup": cfg.warmup, "seed": cfg.seed,
            "new_tokens": cfg.new_tokens, **extra}


def plan(cfg: PlacementConfig, scenario: str, adapter: Any, every: list[str], one: str) -> Plan:
    """The processes of `scenario`: `every` device of the target's type (per-chip, host), or `one` (shared, rl)."""
    if scenario == "per-chip":
        roles = {}
        for i, dev in enumerate(every):
            env = adapter.visible_env([i])
            roles[f"p{i}"] = _spec(cfg, f"p{i}", "step", [f"{adapter.kind}:0" if env else dev], env)
        return Plan(scenario, roles, [{r: "alone"} for r in roles])
    if scenario == "host":
        return Plan(scenario, {"host": _spec(cfg, "host", "step", every, {}, alone_first_only=True)},
                    [{"host": "alone"}])
    if scenario == "rl":
        roles = {"trainer": _spec(cfg, "trainer", "trainer", [one], {}),
                 "generator": _spec(cfg, "generator", "generator", [one], {})}
        return Plan(scenario, roles, [{"trainer": "alone", "generator": "collect"}, {"generator": "alone"}],
                    link=("trainer", "generator"))
    k = int(scenario.split(":")[1])
    roles = {f"p{i}": _spec(cfg, f"p{i}", "step", [one], {}) for i in range(k)}
    return Plan(scenario, roles, [{r: "alone"} for r in roles])


# ----------------------------------------------------------------------------------------------
# From what the processes said to a row
# ----------------------------------------------------------------------------------------------


def _process(role: str, raw: Raw) -> dict[str, Any]:
    from harness.speed import compare, summarize

    alone, together = raw.replies.get(role, {}).get("alone"), raw.replies.get(role, {}).get("together")
    hello = raw.hello.get(role, {})
    out: dict[str, Any] = {"role": role, "pid": raw.pids.get(role), "sees": hello.get("sees"),
                           "identity": hello.get("identity"), "exit_code": raw.exit_codes.get(role)}
    if together is not None:
        out["devices"] = together.get("devices_run") or list(together.get("numbers", {}))
        out["peak_mb"] = max((p for p in together.get("peak_mb", []) if p is not None), default=None)
        used = [u for u in together.get("device_used_mb", []) if u is not None]
        out["device_used_mb"] = max(used) if used else None
    if alone is not None and together is not None and alone.get("wall") and together.get("wall"):
        base, head = summarize(alone["wall"]), summarize(together["wall"])
        shift = compare(base, head)
        out |= {"alone_ms": base["median"] * 1e3, "together_ms": head["median"] * 1e3}
        if shift is not None:
            out |= {"slowdown": shift.slowdown, "lo": shift.lo, "hi": shift.hi}
        if alone.get("clock") and together.get("clock"):
            c = compare(summarize(alone["clock"]), summarize(together["clock"]))
            out["clock_slowdown"] = c.slowdown if c is not None else None
        first = next(iter(alone["numbers"].values()))  # host: every replica against the one that ran alone
        same = all(v == (alone["numbers"].get(d) or first) for d, v in together["numbers"].items())
        out["identical"] = same
    return out


def _latest_weights(raw: Raw) -> tuple[bool | None, str]:
    gen, tr = raw.replies.get("generator", {}), raw.replies.get("trainer", {})
    if "together" not in gen or "together" not in tr:
        return None, ""
    g, sent = gen["together"], tr["together"]["sent"]
    bad = [s for s, (v, (got, held)) in enumerate(zip(g["versions"], g["digests"], strict=True))
           if v != s or got != sent[s] or held != got]
    alone_bad = [s for s, (got, held) in enumerate(gen.get("alone", {}).get("digests", [])) if got != held]
    if bad or alone_bad:
        s = (bad or alone_bad)[0]
        return False, f"step {s}: decoded with version {g['versions'][s]} (digest {g['digests'][s][1]}), " \
                      f"the trainer handed version {s} (digest {sent[s] if s < len(sent) else '?'})"
    return True, ""


def summarize_scenario(cfg: PlacementConfig, scenario: str, adapter: Any, p: Plan, raw: Raw,
                       expected: list[str]) -> PlacementResult:
    """The row of one scenario from its processes' messages; `expected`: each per-chip process's device
    identity as this process sees it."""
    res = PlacementResult(cfg.target, adapter.kind, adapter.sharing(), scenario, processes=len(p.roles),
                          devices=sorted({d for spec in p.roles.values() for d in spec["devices"]}), wall_s=raw.wall_s)
    res.per_process = [_process(role, raw) for role in p.roles]
    for role, msg in raw.stopped.items():
        if msg["ev"] == "refused" and not res.refusal:
            res.result, res.refusal, res.refused_role = "refused", msg["error"], role
            res.holder, res.refusal_s = msg.get("holder"), msg.get("after_s")
            res.holder_role = next((r for r, pid in raw.pids.items() if pid == res.holder), "")
        elif msg["ev"] == "failed" and not res.error:
            res.result, res.error = "failed", f"{role} ({msg.get('phase')}): {msg['error']}"
    if raw.timed_out:
        res.result = "timeout"
        res.error = f"past the {cfg.timeout_s:g} s deadline: {', '.join(raw.timed_out)} had not answered; killed"
    if res.result == "refused":
        res.detail = (f"{res.refused_role} refused at its first use of the device"
                      + (f" ({res.refusal_s * 1e3:.1f} ms)" if res.refusal_s is not None else "")
                      + (f"; held by {res.holder_role or 'process'} (pid {res.holder})" if res.holder else ""))
    timed = [x for x in res.per_process if x.get("slowdown") is not None]
    if timed:
        worst = max(timed, key=lambda x: x["slowdown"])
        res.slowdown, res.slowdown_lo, res.slowdown_hi = worst["slowdown"], worst["lo"], worst["hi"]
    same = [x["identical"] for x in res.per_process if "identical" in x]
    res.identical = all(same) if same and res.result == "allowed" else None
    peaks = [x["peak_mb"] for x in res.per_process if x.get("peak_mb") is not None]
    res.peak_mb = max(peaks) if peaks else None
    if scenario == "rl":
        res.latest_weights, why = _latest_weights(raw)
        res.detail = "; ".join(filter(None, [res.detail, why]))
        handoff = raw.replies.get("trainer", {}).get("together", {}).get("handoff_s") or []
        res.handoff_ms = statistics.median(handoff) * 1e3 if handoff else None
    if scenario == "per-chip" and raw.hello:
        res.visibility = _visibility(adapter, res.per_process, expected)
    return res


def _visibility(adapter: Any, procs: list[dict[str, Any]], expected: list[str]) -> str:
    if adapter.visibility_variable is None:
        return "not restricted (the backend names no visibility variable)"
    seen = [(x.get("sees"), (x.get("identity") or [None])[0]) for x in procs]
    if all(n == 1 for n, _ in seen) and [i for _, i in seen] == expected:
        return f"each process saw only its own device ({adapter.visibility_variable})"
    return f"NOT restricted by {adapter.visibility_variable}: processes saw {[n for n, _ in seen]} device(s), " \
           f"identities {[i for _, i in seen]} for {expected}"


def problems(results: list[PlacementResult]) -> list[str]:
    """What the CLI's exit code gates on: a process that hung or failed, numbers that moved, stale weights,
    a visibility variable that did not restrict. A refusal is the backend's answer, not a problem."""
    out = []
    for r in results:
        if r.result in ("timeout", "failed"):
            out.append(f"{r.scenario}: {r.result}: {r.error}")
        if r.identical is False:
            out.append(f"{r.scenario}: numbers differ from running alone")
        if r.latest_weights is False:
            out.append(f"{r.scenario}: the generator did not decode with the trainer's latest weights")
        if r.visibility.startswith("NOT"):
            out.append(f"{r.scenario}: {r.visibility}")
    return out


def run_placement(cfg: PlacementConfig, adapter: Any, devices: list[str]) -> list[PlacementResult]:
    """Every scenario of `cfg` on the target (`devices`: what `resolve_target` gave for it)."""
    import torch

    cfg.validate()
    every = adapter.devices(torch.device(cfg.target).type)
    expected = [adapter.device_identity(d) for d in every]
    out = []
    for scenario in cfg.scenarios:
        p = plan(cfg, scenario, adapter, every, devices[0])
        out.append(summarize_scenario(cfg, scenario, adapter, p, run_plan(p, cfg.timeout_s), expected))
    return out


# ----------------------------------------------------------------------------------------------
# Rows, JSON, the terminal table
# ----------------------------------------------------------------------------------------------


def _tri(v: bool | None) -> int | None:
    return None if v is None else int(bool(v))


def to_rows(results: list[PlacementResult], cfg: PlacementConfig, run_id: str) -> list:
    """`PlacementRow`s for `ResultStore.record_placement`."""
    from harness.results.rows import PlacementRow

    settings = {"steps": cfg.steps, "warmup": cfg.warmup, "new_tokens": cfg.new_tokens, "seed": cfg.seed,
                "clock": "wall (per step, synchronized)"}
    rows = []
    for r in results:
        d = r.as_dict()
        d["identical"], d["latest_weights"] = _tri(r.identical), _tri(r.latest_weights)
        rows.append(PlacementRow(run_id=run_id, settings={**settings, "mode": r.mode}, **d))
    return rows


def record(results: list[PlacementResult], cfg: PlacementConfig, db: str | os.PathLike, argv: str = "") -> str:
    """The rows into the DB at `db` as one run (list ``placement``); returns the run id."""
    from harness.results.rows import RunInfo
    from harness.results.store import ResultStore

    mode = results[0].mode if results else ""
    with ResultStore(db) as store:
        run_id = store.begin_run(RunInfo(list_name=LIST_NAME, target=cfg.target, argv=argv, settings={
            "scenarios": cfg.scenarios, "steps": cfg.steps, "warmup": cfg.warmup, "mode": mode}))
        for row in to_rows(results, cfg, run_id):
            store.record_placement(row)
        store.finish_run(run_id)
    return run_id


def as_json(results: list[PlacementResult], cfg: PlacementConfig, run_id: str | None) -> dict[str, Any]:
    return {"target": cfg.target, "run_id": run_id, "config": asdict(cfg), "rows": [r.as_dict() for r in results]}


def _x(v: float | None, lo: float | None = None, hi: float | None = None) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}x" + (f" [{lo:.2f}-{hi:.2f}]" if lo is not None and hi is not None and hi != float("inf") else "")


def _yn(v: bool | None) -> str:
    return "-" if v is None else ("yes" if v else "NO")


COLUMNS = ("scenario", "result", "procs", "peak MiB", "slowdown [95%]", "identical", "latest weights", "detail")


def format_table(results: list[PlacementResult], cfg: PlacementConfig) -> str:
    """The rows as a terminal table, then each process's own numbers, then what the columns mean."""
    head = (f"placement on {cfg.target} ({results[0].backend}, devices {results[0].mode})" if results
            else f"placement on {cfg.target}") + f": {cfg.steps} timed steps per phase, timeout {cfg.timeout_s:g} s"
    rows = [(r.scenario, r.result, str(r.processes), "-" if r.peak_mb is None else f"{r.peak_mb:.1f}",
             _x(r.slowdown, r.slowdown_lo, r.slowdown_hi), _yn(r.identical), _yn(r.latest_weights),
             (r.detail or r.visibility or (f"handoff {r.handoff_ms:.1f} ms" if r.handoff_ms else ""))[:80])
            for r in results]
    widths = [max(len(c), *(len(x[i]) for x in rows)) if rows else len(c) for i, c in enumerate(COLUMNS)]
    lines = [head] + ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
                      for row in [COLUMNS, tuple("-" * w for w in widths), *rows]]
    for r in results:
        for x in r.per_process:
            if x.get("slowdown") is not None:
                lines.append(f"  {r.scenario} {x['role']} (pid {x['pid']}): {x['alone_ms']:.1f} ms alone, "
                             f"{x['together_ms']:.1f} ms together = {_x(x['slowdown'], x['lo'], x['hi'])}; "
                             f"peak {'-' if x.get('peak_mb') is None else format(x['peak_mb'], '.1f')} MiB; "
                             f"identical {_yn(x.get('identical'))}")
        if r.refusal:
            lines.append(f"  {r.scenario}: {r.refused_role}: {r.refusal[:300]}")
        if r.handoff_ms is not None:
            lines.append(f"  {r.scenario}: the trainer hands its weights in {r.handoff_ms:.1f} ms per step (copy to "
                         "the host, send; waiting for the generator included)")
        if r.error:
            lines.append(f"  {r.scenario}: {r.error[:300]}")
    lines.append("slowdown: the slowest process's per-step median together / alone (wall clock), 95% interval as "
                 "the speed gate's; identical: losses, final weights and decoded tokens as when alone")
    return "\n".join(lines)
