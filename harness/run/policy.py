"""Scheduling, retry and quarantine policy: pure decisions over plain data, no processes.

At cluster scale one sick device must not sink a run, and one flaky model must not condemn a device.
The rules, each a function here so it is unit-testable with made-up devices and jobs:

- a suspicious failure (a retryable outcome, or drift with non-finite outputs) is retried on another
  device within the retry budget; while it awaits that re-run its first device is *cordoned*: it
  takes only retries, not fresh models (`pick_job`);
- a device collects a *strike* for every device fault the backend reports and for every model that
  failed on it but ran cleanly elsewhere; at `quarantine_after` strikes it is *quarantined*: it leaves
  the active set and a hot spare, if one is held back, takes its place (`settle`, `strike`);
- a device fault is never the model's result: the model goes to another healthy device (outside the
  retry budget); with none left its `device_error` row waits for a resume (`Settled.pending`);
- a model that failed and then passed elsewhere is `flaky`, unless every device it failed on has been
  quarantined: then its clean result stands, also when the quarantine comes later (`Quarantined.relabel`);
- with `--rerun-flaky N`, a model whose attempts disagreed is sampled N more times after the run and is
  `flaky` only if the samples really flip between a matched and a failing outcome (`needs_rerun`,
  `rerun_verdict`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from harness.outcomes import DEVICE_SIDE, MATCHED, RETRYABLE, severity
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


@dataclass
class Fleet:
    """The devices of one run and what the policy has concluded about them."""

    active: list[str]
    spares: list[str] = field(default_factory=list)
    quarantine_after: int = 2
    retries: int = 1
    quarantined: list[str] = field(default_factory=list)
    spares_used: list[str] = field(default_factory=list)
    strikes: Counter[str] = field(default_factory=Counter)
    probation: dict[str, set[str]] = field(default_factory=dict)  # device -> jobs whose failure there awaits a re-run
    flaky_on: dict[str, list[Job]] = field(default_factory=dict)  # device -> jobs marked flaky because of it
    faults_seen: int = 0


@dataclass
class Quarantined:
    device: str
    spare: str | None  # the hot spare brought in, if any
    relabel: list[Job]  # jobs recorded as flaky only because of this device: their last result stands


@dataclass
class Settled:
    """What to do with a job after one attempt: retry it, or record `outcome`."""

    retry: bool = False
    outcome: str = ""
    pending: bool = False  # recorded, but not the model's result: run it again on resume
    quarantined: list[Quarantined] = field(default_factory=list)


def split_devices(devices: Sequence[str], spare: int) -> tuple[list[str], list[str]]:
    """(active, spares): the last `spare` devices are held back."""
    if spare < 0:
        raise ValueError(f"--spare {spare}: must be >= 0")
    if spare >= len(devices):
        raise ValueError(f"--spare {spare} leaves no active device out of {len(devices)} ({list(devices)})")
    return list(devices[: len(devices) - spare]), list(devices[len(devices) - spare :])


def suspicious(m: Measurement) -> bool:
    """Could a different device have given a different answer?"""
    return m.outcome in RETRYABLE or (m.outcome == "drift" and m.nonfinite)


def ready_to_assign(all_ready: bool, waited_s: float, grace_s: float = POOL_START_GRACE_S) -> bool:
    """Hand out work once the initial pool is up (or after a grace period), so the first worker to
    finish importing does not drain a short list before the others can take part."""
    return all_ready or waited_s > grace_s


def pick_device(fleet: Fleet, load: Counter[str]) -> str | None:
    """The active device with the fewest workers (ties: the earliest)."""
    if not fleet.active:
        return None
    return min(fleet.active, key=lambda d: (load[d], fleet.active.index(d)))


def pick_job(fleet: Fleet, device: str, queue: Iterable[Job], worker_devices: Iterable[str]) -> Job | None:
    """The job an idle worker on `device` should take next, or None to leave it idle."""
    if device not in fleet.active:
        return None
    cordoned = bool(fleet.probation.get(device))
    everywhere = {d for d in worker_devices if d in fleet.active}
    for job in queue:
        if device in job.faulted:
            continue  # it met a device fault here
        if cordoned and not job.attempts:
            continue  # a cordoned device takes retries only
        if device in job.avoid and not everywhere <= job.avoid:
            continue  # it failed here and another device can take it
        return job
    return None


def quarantine(fleet: Fleet, device: str) -> Quarantined:
    """Take `device` out of service; bring in a hot spare if one is held back."""
    fleet.quarantined.append(device)
    fleet.probation.pop(device, None)
    if device in fleet.active:
        fleet.active.remove(device)
    spare = None
    if fleet.spares:
        spare = fleet.spares.pop(0)
        fleet.active.append(spare)
        fleet.spares_used.append(spare)
    return Quarantined(device, spare, fleet.flaky_on.pop(device, []))


def strike(fleet: Fleet, device: str) -> Quarantined | None:
    """One strike against `device`; its quarantine when that was one too many."""
    if device in fleet.quarantined or device not in fleet.active:
        return None
    fleet.strikes[device] += 1
    if fleet.strikes[device] >= fleet.quarantine_after:
        return quarantine(fleet, device)
    return None


def interrupt(job: Job, device: str) -> None:
    """`job` was running on `device` when the device was quarantined: it must run elsewhere."""
    job.attempts.append(Attempt(device=device, outcome="interrupted", error_type="quarantine"))
    job.avoid.add(device)


def settle(fleet: Fleet, job: Job, m: Measurement, device: str, duration_s: float) -> Settled:
    """Record attempt `m` of `job` on `device` and decide: retry elsewhere, or the final outcome."""
    job.attempts.append(
        Attempt(
            device=device,
            outcome=m.outcome,
            error_type=m.error_type,
            exit_code=m.exit_code,
            signal=m.signal,
            duration_s=round(duration_s, 3),
            device_fault=m.device_fault,
        )
    )
    out = Settled()

    def hit(dev: str) -> None:
        q = strike(fleet, dev)
        if q is not None:
            out.quarantined.append(q)

    if m.device_fault:
        fleet.faults_seen += 1
        hit(device)
        job.faulted.add(device)
        job.avoid.add(device)
        if any(d not in job.faulted for d in fleet.active):
            out.retry = True
        else:
            out.outcome, out.pending = m.outcome, True
            release(fleet, job)
        return out
    # Device faults were the device's, not failures of the model: they make nothing flaky.
    failed_before = [a for a in job.attempts[:-1] if a.outcome != "interrupted" and not a.device_fault]
    if failed_before and not suspicious(m):
        # It ran cleanly here after failing elsewhere: those failures were the devices' (or flakes).
        for a in failed_before:
            hit(a.device)
        job.last = m
        if m.outcome != "pass" or all(a.device in fleet.quarantined for a in failed_before):
            out.outcome = m.outcome
        else:
            out.outcome = "flaky"
            for a in failed_before:
                fleet.flaky_on.setdefault(a.device, []).append(job)
        release(fleet, job)
        return out
    retries_used = sum(1 for a in job.attempts if a.outcome != "interrupted" and not a.device_fault) - 1
    if suspicious(m) and retries_used < fleet.retries and fleet.active:
        job.avoid.add(device)
        fleet.probation.setdefault(device, set()).add(job.id)
        out.retry = True
        return out
    out.outcome = m.outcome
    release(fleet, job)
    return out


def release(fleet: Fleet, job: Job) -> None:
    """`job` has its final outcome: it no longer holds any device on probation."""
    for a in job.attempts:
        fleet.probation.get(a.device, set()).discard(job.id)


def counted(job: Job) -> list[str]:
    """The outcomes `job`'s attempts measured, device faults and interruptions left out (those were
    the device's, not the model's)."""
    return [a.outcome for a in job.attempts if a.outcome != "interrupted" and not a.device_fault]


def needs_rerun(job: Job, outcome: str) -> bool:
    """Whether a finished job should be sampled again: its attempts disagreed (e.g. a crash, then a
    pass on retry). A pending device-side row is not a result yet, so it is not sampled."""
    return len(set(counted(job))) > 1 and outcome not in DEVICE_SIDE


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
