"""Scheduling, retry, quarantine and attribution policy: pure decisions over plain data, no processes.

At cluster scale one sick device must not sink a run, one flaky model must not condemn a device, and
a healthy device that is the only one must not stop itself. Only evidence that the device itself is at
fault may strike it; a model's recorded result comes only from a device that has not failed others.

Words. An attempt *survives* when its worker lived to report a target-side outcome with no device
fault (pass, drift, unsupported_op, a raised crash, oom, ...): the device can run models, and that
model becomes its *canary*. It *runs cleanly* when the target ran it to the end (pass, pass_declared,
drift, missing_grad): the model is fine. A *death* is a worker that died or timed out in a phase that
runs on the device (`harness.phases`: the step, its re-runs at full precision, eagerly or recompiled, the
localization, the timing), the reference having passed. A device's *streak* is the
distinct models that died on it since it last survived one. A device is *trusted* when it is active,
has survived a model, has no strike and no other model in its streak.

The attribution rule (`settle`), one row per kind of evidence from one attempt of model M on device D:

  evidence                              | strike D?                    | M next                         | recorded for M
  --------------------------------------+------------------------------+--------------------------------+-------------------------
  device fault: the backend says so     | yes, at once                 | another active device it has   | nothing; no device left:
  (lost device, ECC; its client's       |                              | not faulted on (outside        | device_error, pending
  connection refused / reset / timed    |                              | --retries)                     | (runs again on --resume)
  out), in any phase                    |                              |                                |
    ... its client could not reach it   | quarantine at once: nobody   | (as above)                     | (as above)
    at all (connection refused, after   | serves it; each further model|                                |
    the client's own reconnect window)  | would wait out that window   |                                |
  reference side (load_fail, ref_fail,  | no: the target never ran     | -                              | that outcome
  ref_nondeterministic, a CPU-phase     |                              |                                |
  death)                                |                              |                                |
  death (segfault, hang) on D           | provisionally: M joins D's   | retried (--retries) on a       | the death, from a trusted
                                        | streak                       | device it has not died on, D   | D; from an untrusted D
                                        |                              | again if D is the only one     | only after one more try
                                        |                              |                                | after the rest of the
                                        |                              |                                | queue (if any: it may
                                        |                              |                                | vouch for a device)
    ... then D survives another model   | streak revoked               |                                |
    ... then M dies on a trusted D' too | M's part revoked: M fails    |                                | that death
                                        | by itself                    |                                |
    ... then M runs cleanly on D' != D  | yes, for good                |                                | flaky (a matched result:
                                        |                              |                                | pass or pass_declared);
                                        |                              |                                | its clean result
                                        |                              |                                | once D is quarantined
  raised crash, non-finite drift on D   | no                           | retried on another device      | the last outcome
    ... then M runs cleanly on D' != D  | yes                          |                                | flaky (as above)
  after failing on D: a clean run on D  | no: the same device is not   | -                              | that outcome (flaky if it
  itself, or unsupported_op / oom /     | "elsewhere"; unsupported_op  |                                | passed)
  drift anywhere                        | is not a clean run           |                                |
  strikes + streak reach                | quarantine; but if the streak| a *probe*: D's canary runs on  |
  --quarantine-after                    | counts and D has a canary,   | D first (D takes nothing else):|
                                        | probe first                  | survives -> streak revoked;    |
                                        |                              | dies -> quarantine             |
  D's node left the cluster (Ray: the   | no strike: every device of   | another device, outside        | nothing (an `interrupted`
  node died or was removed; its actors  | that node leaves the fleet   | --retries, like a quarantine's | attempt, `node_lost`)
  with it)                              | (`lose`; a spare comes in)   | interruption                   |

A model spread over several devices (--parallel) runs on a *group* slot (``sim:0+sim:1``): its evidence is
this table's, and a quarantine replaces only the group's device at fault (`harness.fleet.slots`).

A Ray actor is a worker: its death (segfault, OOM kill) or timeout is the same evidence as a worker
process's, on the device it holds. Devices are named per node (`host/sim:0`), so strikes, streaks and
quarantine are per node and device: one node's sick chip does not stop the others of its type.

On quarantine (`quarantine`) a hot spare, if one is held back, takes D's place; models recorded flaky
only because of D get their clean result (`Quarantined.relabel`); models whose recorded result was a
death on D are re-opened (`Quarantined.reopen`, then `reopen`): they run again elsewhere, or wait as
pending `device_error` rows; and no attempt on D counts toward any model's retries any more.

Worked cases (tests/test_policy.py has them as a table):

- one device, a model that segfaults deterministically: it dies, dies again on the retry (the same
  device), D has survived other models, so D is trusted and the crash is recorded; the next model that
  survives revokes the streak. Two such models in a row: the streak reaches 2, D's canary re-runs,
  survives, the streak is revoked: the run finishes, its only device in service. A device that kills
  every model: deaths of different models pile up, nothing survives (or the canary dies too): it is
  quarantined, and its victims are pending `device_error` rows, not crashes;
- three devices, `--spare 1`, sim:0 and sim:1 killing (or hanging) every model: different models die
  on each, nothing survives there, no canary: both are quarantined, the spare comes in, the victims'
  attempts there stop counting and they run on sim:2, whose results are recorded;
- scheduling: models are handed out one at a time as workers free up, biggest first where a size is
  known (`biggest_first`); a suspicious failure's first device is *cordoned* until the re-run (it
  takes only retries, `pick_job`); a job goes back to a device it failed on only when every active
  device is one; a new or idle worker goes where the waiting work can run (`pick_device`, `idle_move`),
  never beyond a device's capacity (one Ray actor per device);
- `--rerun-flaky N`: a model whose attempts disagreed is sampled N more times after the run and is
  `flaky` only if the samples really flip between a matched and a failing outcome (`needs_rerun`,
  `rerun_verdict`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from harness.fleet.slots import out_of_service, replacement
from harness.outcomes import DEVICE_SIDE, MATCHED, RAN, REFERENCE_SIDE, RETRYABLE, severity
from harness.parallel.spec import members
from harness.phases import DEVICE_PHASES  # where a death is evidence against the device
from harness.results.rows import Attempt, Measurement

POOL_START_GRACE_S = 60.0


@dataclass(eq=False)
class Job:
    """One model awaiting its final outcome, with every attempt so far."""

    id: str
    attempts: list[Attempt] = field(default_factory=list)
    avoid: set[str] = field(default_factory=set)  # devices it should not go back to
    faulted: set[str] = field(default_factory=set)  # devices that had a device fault running it: never again
    last: Measurement | None = None  # its clean result after earlier failures (for relabelling)
    deferred: bool = False  # died on an untrusted device with its retries spent: tried once more, last
    probe: str = ""  # a canary run deciding this device's streak (not a row of its own)


@dataclass
class Fleet:
    """The devices of one run and what the policy has concluded about them."""

    active: list[str]
    spares: list[str] = field(default_factory=list)
    quarantine_after: int = 2
    retries: int = 1
    quarantined: list[str] = field(default_factory=list)
    spares_used: list[str] = field(default_factory=list)
    strikes: Counter[str] = field(default_factory=Counter)  # lasting evidence (faults, clean elsewhere)
    deaths: dict[str, list[Job]] = field(default_factory=dict)  # device -> its streak (provisional strikes)
    canary: dict[str, str] = field(default_factory=dict)  # device -> the model it last survived
    probing: set[str] = field(default_factory=set)  # devices whose canary is re-running
    died_here: dict[str, list[Job]] = field(default_factory=dict)  # device -> jobs recorded with a death there
    probation: dict[str, set[str]] = field(default_factory=dict)  # device -> jobs whose failure there awaits a re-run
    flaky_on: dict[str, list[Job]] = field(default_factory=dict)  # device -> jobs marked flaky because of it
    faults_seen: int = 0
    blamed: dict[str, str] = field(default_factory=dict)  # group slot -> its device the last rank at fault ran on
    devices: list[str] = field(default_factory=list)  # the run's devices, in order; a stage plans from those not
    gone: list[str] = field(default_factory=list)  # ... that quarantines took out (`slots.out_of_service`)

    def count(self, device: str) -> int:
        """Strikes against `device`: lasting ones plus its streak."""
        return self.strikes[device] + len(self.deaths.get(device, []))


@dataclass
class Quarantined:
    device: str
    spare: str | None  # the hot spare brought in, if any
    relabel: list[Job]  # jobs recorded as flaky only because of this device: their last result stands
    reopen: list[Job] = field(default_factory=list)  # jobs recorded with a death on it: not their result
    why: str = ""  # the evidence, in words
    member: str = ""  # a group's device at fault (the one the spare replaced), "" for a single device


@dataclass
class Settled:
    """What to do with a job after one attempt: retry it, or record `outcome`."""

    retry: bool = False
    defer: bool = False  # retry it after the rest of the queue
    outcome: str = ""
    pending: bool = False  # recorded, but not the model's result: run it again on resume
    quarantined: list[Quarantined] = field(default_factory=list)
    probes: list[Job] = field(default_factory=list)  # canary runs to queue first


def suspicious(m: Measurement) -> bool:
    """Could a different device have given a different answer?"""
    return m.outcome in RETRYABLE or (m.outcome == "drift" and m.nonfinite)


def evidence(m: Measurement, phase: str = "") -> str:
    """What one attempt says about its device: fault, death, survived, or none (reference side, or a
    death outside the device's phases). `phase` is where a worker death or timeout struck ("" for a
    result the worker sent)."""
    if m.device_fault:
        return "fault"
    if (m.parallel or {}).get("culprit", {}).get("kind") == "death":  # a rank died or hung on its device
        return "death"
    if phase:
        return "death" if phase in DEVICE_PHASES and m.outcome in ("crash", "timeout") else "none"
    return "none" if m.outcome in REFERENCE_SIDE or m.outcome == "timeout" else "survived"


def trusted(fleet: Fleet, device: str, job: Job | None = None) -> bool:
    """Has `device` shown it runs models, and failed no model other than `job`?"""
    return (device in fleet.active and device in fleet.canary and not fleet.strikes[device]
            and all(j is job for j in fleet.deaths.get(device, [])))


def never_worked(fleet: Fleet) -> bool:
    """The target failed (device faults, quarantines) and no model ever survived on it."""
    return not fleet.canary and bool(fleet.faults_seen or fleet.quarantined)


def ready_to_assign(all_ready: bool, waited_s: float, grace_s: float = POOL_START_GRACE_S) -> bool:
    """Hand out work once the initial pool is up (or after a grace period), so the first worker to
    finish importing does not drain a short list before the others can take part."""
    return all_ready or waited_s > grace_s


def _usable(fleet: Fleet, job: Job, device: str, load: Counter[str] | None = None) -> bool:
    return device not in job.avoid and device not in job.faulted and device not in fleet.probing and (
        load is None or not load[device])


def pick_device(fleet: Fleet, load: Counter[str], queue: Iterable[Job] = (), cap: int | None = None) -> str | None:
    """The device for a new worker: a waiting probe's, else the fewest workers, preferring one the
    first waiting job can use (ties: the earliest). `cap`: workers a device can hold (None: any
    number); None when every active device is full."""
    free = [d for d in fleet.active if cap is None or load[d] < cap]
    if not free:
        return None
    queue = list(queue)
    for job in queue:
        if job.probe in free and not load[job.probe]:
            return job.probe
    head = next((j for j in queue if not j.probe), None)
    return min(free, key=lambda d: (load[d], head is not None and not _usable(fleet, head, d),
                                    fleet.active.index(d)))


def workers(jobs: int, queued: int, devices: int, per_device: int | None) -> int:
    """How many workers a run keeps: --jobs (0: one per device), never more than the devices can hold nor
    than there are jobs to hand out, and at least one."""
    n = jobs or devices
    if per_device is not None:
        n = min(n, devices * per_device)
    return max(1, min(n, queued))


def biggest_first(ids: Sequence[str], sizes: dict[str, float | None]) -> list[str]:
    """The order to hand models out in: those of known size biggest first (a big model started last
    would keep one device busy long after the others ran dry), then the rest in list order."""
    known = sorted((i for i in ids if sizes.get(i)), key=lambda i: -float(sizes[i] or 0))
    return known + [i for i in ids if not sizes.get(i)]


def idle_move(fleet: Fleet, queue: Iterable[Job], load: Counter[str]) -> str | None:
    """Where an idle worker that no waiting job may use should go instead: a device without a worker
    that a waiting probe or job can use (None: stay)."""
    for job in queue:
        if job.probe:
            if job.probe in fleet.active and not load[job.probe]:
                return job.probe
            continue
        free = [d for d in fleet.active if _usable(fleet, job, d, load)]
        if free:
            return free[0]
    return None


def pick_job(fleet: Fleet, device: str, queue: Iterable[Job]) -> Job | None:
    """The job an idle worker on `device` should take next, or None to leave it idle."""
    if device not in fleet.active:
        return None
    if device in fleet.probing:
        return next((j for j in queue if j.probe == device), None)  # it takes nothing else meanwhile
    cordoned = bool(fleet.probation.get(device))
    for job in queue:
        if job.probe or device in job.faulted:
            continue  # another device's probe; or it met a device fault here
        if cordoned and not job.attempts:
            continue  # a cordoned device takes retries only
        if device in job.avoid and not {d for d in fleet.active if d not in job.faulted} <= job.avoid:
            continue  # it failed here and another active device can take it
        return job
    return None


def quarantine(fleet: Fleet, device: str, canary_died: bool = False, why: str = "") -> Quarantined:
    """Take `device` out of service; bring in a hot spare if one is held back. `why`: the evidence in
    words, when it is not the device's strikes (its node left the cluster)."""
    streak = [j.id for j in fleet.deaths.get(device, [])]
    why = why or ", ".join(
        ([f"{fleet.strikes[device]} strike(s) (device faults, models that ran cleanly elsewhere)"]
         if fleet.strikes[device] else [])
        + ([f"{len(streak)} different model(s) whose worker died there with none surviving in between "
            f"({', '.join(streak[:3])}{' ...' if len(streak) > 3 else ''})"] if streak else [])
        + ([f"then its canary {fleet.canary[device]}, which it ran before, died too"] if canary_died else []))
    fleet.quarantined.append(device)
    fleet.probation.pop(device, None)
    fleet.probing.discard(device)
    if device in fleet.active:
        fleet.active.remove(device)
    spare, member = replacement(device, fleet.blamed.pop(device, ""), fleet.spares, fleet.spares_used)
    if spare is not None:
        fleet.active.append(spare)
    why = "; ".join(part for part in (why, member and f"at fault: {member}") if part)
    fleet.gone.extend(d for d in out_of_service(device, member) if d not in fleet.gone)
    return Quarantined(device, spare, fleet.flaky_on.pop(device, []), fleet.died_here.pop(device, []), why, member)


def _maybe_quarantine(fleet: Fleet, device: str, out: Settled) -> None:
    """Quarantine `device` if its strikes reached the limit (after a probe, when its streak counts and
    it has a canary to re-run)."""
    if device not in fleet.active or device in fleet.probing or fleet.count(device) < fleet.quarantine_after:
        return
    if fleet.deaths.get(device) and device in fleet.canary:
        fleet.probing.add(device)
        out.probes.append(Job(fleet.canary[device], probe=device))
        return
    out.quarantined.append(quarantine(fleet, device))


def strike(fleet: Fleet, device: str) -> Quarantined | None:
    """One lasting strike against `device`; its quarantine when that was one too many."""
    if device in fleet.quarantined or device not in fleet.active:
        return None
    fleet.strikes[device] += 1
    out = Settled()
    _maybe_quarantine(fleet, device, out)
    return out.quarantined[0] if out.quarantined else None


def interrupt(job: Job, device: str, why: str = "quarantine") -> None:
    """`job` was running on `device` when the device was quarantined (or its node was lost): it must
    run elsewhere, and this attempt measured nothing of the model."""
    job.attempts.append(Attempt(device=device, outcome="interrupted", error_type=why))
    job.avoid.add(device)


UNREACHED = "its backend's client could not reach it (connection refused)"
NODE_LOST = "node_lost"  # an interrupted attempt's error_type when its node left the cluster
UNREACHABLE = "unreachable"  # ... when Ray could not reach its actor (the actor is ended)


def lose(fleet: Fleet, devices: Iterable[str], node: str) -> list[Quarantined]:
    """`node` left the cluster with `devices`: none of them is in service any more. Not evidence
    against anything that ran there (no strike); held-back spares on it are gone too, active ones
    are quarantined so that a spare elsewhere takes their place."""
    lost = set(devices)  # a group of the node's devices goes with them, whether or not it had a worker
    fleet.gone.extend(d for d in sorted(lost) if d not in fleet.gone)
    gone = [d for d in [*fleet.active, *fleet.spares] if d in lost or set(members(d)) <= lost]
    fleet.spares[:] = [d for d in fleet.spares if d not in gone]
    for d in gone:
        fleet.blamed.pop(d, None)  # (no device of a group stands by on a node that is gone)
        fleet.deaths.pop(d, None)  # a streak on a node that died is not the models'
    return [quarantine(fleet, d, why=f"its node {node} left the cluster") for d in gone if d in fleet.active]


def own(job: Job, quarantined: Iterable[str] = ()) -> list[Attempt]:
    """The attempts that measured the model itself: not interrupted, no device fault, not on a device
    since quarantined (those were the devices')."""
    gone = set(quarantined)
    return [a for a in job.attempts if a.outcome != "interrupted" and not a.device_fault and a.device not in gone]


def settle(fleet: Fleet, job: Job, m: Measurement, device: str, duration_s: float, phase: str = "",
           others_waiting: bool = False) -> Settled:
    """Record attempt `m` of `job` on `device` and decide (the table in this module's docstring):
    retry it, or its final outcome. `phase`: where a worker death or timeout struck; `others_waiting`:
    whether other models are queued or running (they may show meanwhile that a device works)."""
    kind = evidence(m, phase)
    culprit = (m.parallel or {}).get("culprit", {})
    if culprit and kind in ("fault", "death"):  # the group's device by the rank's position (the fleet's name)
        group, rank = members(device), culprit.get("rank")
        fleet.blamed[device] = group[rank] if isinstance(rank, int) and 0 <= rank < len(group) else ""
    elif kind == "survived":
        fleet.blamed.pop(device, None)
    job.attempts.append(Attempt(device=device, outcome=m.outcome, error_type=m.error_type, exit_code=m.exit_code,
                                signal=m.signal, duration_s=round(duration_s, 3), device_fault=m.device_fault,
                                phase=phase))
    out = Settled()
    if job.probe:
        _probe_done(fleet, job.probe, kind, out)
        return out
    if kind == "fault":
        fleet.faults_seen += 1
        fleet.strikes[device] += 1
        if m.device_unreachable and device in fleet.active:  # nothing runs there until it is back
            out.quarantined.append(quarantine(fleet, device, why=UNREACHED))
        else:
            _maybe_quarantine(fleet, device, out)
        job.faulted.add(device)
        job.avoid.add(device)
        return _elsewhere(fleet, job, out)
    if kind == "survived":
        fleet.deaths.pop(device, None)  # it runs models: its streak was the models'
        fleet.canary[device] = job.id
    elif kind == "death":
        if trusted(fleet, device, job):  # a device that runs others kills it too: it fails by itself
            for d, streak in fleet.deaths.items():
                if d != device and job in streak:
                    streak.remove(job)
        streak = fleet.deaths.setdefault(device, [])
        if job not in streak:
            streak.append(job)
        _maybe_quarantine(fleet, device, out)
    failed = [a for a in own(job, fleet.quarantined)[:-1] if a.outcome not in REFERENCE_SIDE]
    if failed and m.outcome in RAN:
        # It ran cleanly after failing: where that was another device, the failure was the device's.
        for d in dict.fromkeys(a.device for a in failed if a.device != device):
            if job in fleet.deaths.get(d, []):
                fleet.deaths[d].remove(job)
            if d in fleet.active:
                fleet.strikes[d] += 1
                _maybe_quarantine(fleet, d, out)
        job.last = m
        if m.outcome not in MATCHED or all(a.device in fleet.quarantined for a in failed):
            out.outcome = m.outcome
        else:
            out.outcome = "flaky"
            for d in dict.fromkeys(a.device for a in failed):
                fleet.flaky_on.setdefault(d, []).append(job)
        release(fleet, job)
        return out
    if device in fleet.quarantined:  # this very failure quarantined it: not the model's result
        return _elsewhere(fleet, job, out)
    if suspicious(m) and len(own(job, fleet.quarantined)) - 1 < fleet.retries and fleet.active:
        job.avoid.add(device)
        fleet.probation.setdefault(device, set()).add(job.id)
        out.retry = True
        return out
    if kind == "death" and not trusted(fleet, device, job) and not job.deferred and others_waiting:
        job.deferred = True  # no device has vouched for this verdict yet: once more, after the others
        job.avoid.add(device)
        release(fleet, job)  # its device is not cordoned meanwhile: the others are what may vouch for it
        out.retry = out.defer = True
        return out
    out.outcome = m.outcome
    if kind == "death":
        fleet.died_here.setdefault(device, []).append(job)
    release(fleet, job)
    return out


def _elsewhere(fleet: Fleet, job: Job, out: Settled) -> Settled:
    """Not the model's result: run it on another device, or record it pending with none left."""
    if any(d not in job.faulted for d in fleet.active):
        out.retry = True
    else:
        out.outcome, out.pending = "device_error", True
        release(fleet, job)
    return out


def _probe_done(fleet: Fleet, device: str, kind: str, out: Settled) -> None:
    fleet.probing.discard(device)
    if device not in fleet.active:
        return
    if kind in ("fault", "death"):  # it no longer runs a model it ran before
        fleet.faults_seen += kind == "fault"
        out.quarantined.append(quarantine(fleet, device, canary_died=True))
        return
    fleet.deaths.pop(device, None)  # it still does: the streak was the models'
    _maybe_quarantine(fleet, device, out)


def reopen(fleet: Fleet, job: Job) -> Settled:
    """`job` was recorded with a death on a device since quarantined: run it again, or pending."""
    job.deferred = False
    return _elsewhere(fleet, job, Settled())


def release(fleet: Fleet, job: Job) -> None:
    """`job` has its final outcome: it no longer holds any device on probation."""
    for a in job.attempts:
        fleet.probation.get(a.device, set()).discard(job.id)


def left_out(planned: Iterable[str], finished: Iterable[str], selected: Iterable[str]) -> set[str]:
    """The jobs a run planned and has not finished that a resume with `selected` would not run. A run planned
    nothing when it was recorded before plans were kept: nothing can be told left out."""
    return set(planned) - set(finished) - set(selected)


def counted(job: Job, quarantined: Iterable[str] = ()) -> list[str]:
    """The outcomes `job`'s attempts measured, device faults, interruptions and attempts on quarantined
    devices left out (those were the devices', not the model's)."""
    return [a.outcome for a in own(job, quarantined)]


def needs_rerun(job: Job, outcome: str, quarantined: Iterable[str] = ()) -> bool:
    """Whether a finished job should be sampled again: its attempts disagreed (e.g. a crash, then a
    pass on retry). A pending device-side row is not a result yet, so it is not sampled."""
    return len(set(counted(job, quarantined))) > 1 and outcome not in DEVICE_SIDE


def rerun_verdict(first: str, reruns: Sequence[str]) -> str:
    """The outcome of a model whose attempts disagreed, from its first verdict's measured outcome
    (`first`: the attempt the run settled on) and the outcomes of N reruns.

    The earlier disagreement is what made it suspect; the reruns decide:

    * every rerun agrees with `first` -> `first` (stable; the odd attempt was a one-off);
    * the samples (`first` and the reruns) hold both a matched and a failing outcome -> `flaky`
      (it really flips: sometimes it passes, sometimes not);
    * they only flip among failures (or only among matched outcomes) -> the most common sample, ties
      to the worse one: never `flaky`, which counts as matched.
    """
    if not reruns:
        return first
    samples = [first, *reruns]
    if all(r == first for r in reruns):
        return first
    matched = sum(1 for s in samples if s in MATCHED)
    if 0 < matched < len(samples):
        return "flaky"
    counts = Counter(samples)
    return max(counts, key=lambda o: (counts[o], severity(o)))
