"""The fleet's slots: the devices a run uses, the hot spares it holds back, and the groups its models take
under --parallel (`harness.fleet.policy` decides what happens to them; pure functions, no processes).

A model spread over several devices runs on a *group* slot (``sim:0+sim:1``), one rank per device. The group
is the unit of scheduling, and its evidence is the policy table's, with the rank at fault named by the launch
(`Measurement.parallel["culprit"]`): a rank killed by a signal, or the one rank that hung while its peers
finished or gave up on it, is a death on the group; a rank's device fault is a device fault. When a group is
quarantined, only its device at fault leaves: a spare device takes its place beside the group's healthy
devices (``sim:0+sim:4``); with no device named, every device of the group is replaced, or none without
enough spares on its node. A parallel run's spares are single devices, the odd device out of the grouping among
them; on a Ray cluster a group is on one node, as its replacement is.

A list may spread its models differently (its `parallel` column): the run goes in *stages*, one per way, the
single-device models first, then by group size. A stage's workers are gone before the next stage's start, so a
device a process owns alone (a chip, one process each) is free again, and a group never waits for devices
that single-device models hold: no deadlock, whatever the mix. Each stage re-plans its slots from the devices
still in service: a device quarantined in one stage stays out of the next.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from harness.parallel.spec import groups, members, node


def split_devices(devices: Sequence[str], spare: int) -> tuple[list[str], list[str]]:
    """(active, spares): the last `spare` devices are held back."""
    if spare < 0:
        raise ValueError(f"--spare {spare}: must be >= 0")
    if spare >= len(devices):
        raise ValueError(f"--spare {spare} leaves no active device out of {len(devices)} ({list(devices)})")
    return list(devices[: len(devices) - spare]), list(devices[len(devices) - spare :])


def plan(devices: Sequence[str], spare: int, world: int = 1, *, shared: bool = False) -> tuple[list[str], list[str]]:
    """(active slots, spare devices): `spare` devices held back; under --parallel (`world` > 1) the others in
    groups of `world` (`shared`: one device all ranks share, as the CPU's gloo control), the odd device out
    standing by as a spare too."""
    active, spares = split_devices(devices, spare)
    if world == 1:
        return active, spares
    grouped = groups(active, world, shared=shared)
    used = {d for g in grouped for d in members(g)}
    return grouped, [d for d in active if d not in used] + spares


def replacement(slot: str, member: str, spares: list[str], used: list[str]) -> tuple[str | None, str]:
    """What takes quarantined `slot`'s place, moved from `spares` to `used`: a spare; for a group, the group with
    `member` (its device at fault; "": every device) replaced by spare devices, in place. Returns (the slot that
    comes in, or None; the group's device at fault, "" for a single device)."""
    group = members(slot)
    if len(group) == 1:
        if not spares:
            return None, ""
        used.append(spares[0])
        return spares.pop(0), ""
    bad = [member] if member in group else list(group)
    need = sum(d in bad for d in group)  # (a shared device, `cpu+cpu`, fills every position)
    here = [d for d in spares if node(d) == node(group[0])]  # a group's devices are on one node
    if len(here) < need:
        spares.extend(d for d in dict.fromkeys(group) if d not in bad)  # its healthy devices stand by
        return None, member
    taken = here[:need]
    spares[:] = [d for d in spares if d not in taken]
    used.extend(taken)
    fresh = iter(taken)
    return "+".join(next(fresh) if d in bad else d for d in group), member


def stages(ways: Mapping[str, str], worlds: Mapping[str, int]) -> list[tuple[str, list[str]]]:
    """[(way, the model ids run that way, in the given order)]: one stage per way ("" one device, else a spec)
    of `ways` (model id -> way), the single-device stage first, then by `worlds` (way -> devices per model)."""
    by_way: dict[str, list[str]] = {}
    for mid, way in ways.items():
        by_way.setdefault(way, []).append(mid)
    return sorted(by_way.items(), key=lambda kv: (worlds.get(kv[0], 1), kv[0]))


def out_of_service(slot: str, member: str) -> list[str]:
    """The devices a quarantine of `slot` takes out of the run: its device at fault (`member`), else all of it."""
    return [member] if member else list(dict.fromkeys(members(slot)))
