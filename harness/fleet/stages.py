"""A run's devices and stages: how each model of the list is spread (its list's `parallel` cell, else the
run's --parallel) and the fleet each stage runs on (`slots.stages` says why a run goes in stages)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from harness.backends import adapter_for, load_backends
from harness.fleet import policy, slots
from harness.fleet.executor import executor_for
from harness.fleet.runconfig import RunConfig
from harness.models.model_list import ModelEntry
from harness.parallel.spec import chosen, parse


def shard(entries: list[ModelEntry], spec: str) -> list[ModelEntry]:
    """Select shard i of N (1-based, 'i/N') by position in id order, so shards never overlap."""
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"bad shard {spec!r}: expected i/N with 1 <= i <= N, e.g. 2/8") from None
    if not 1 <= i <= n:
        raise ValueError(f"bad shard {spec!r}: expected i/N with 1 <= i <= N, e.g. 2/8")
    ordered = sorted(entries, key=lambda e: e.id)
    return ordered[i - 1 :: n]


def fleet_for(config: RunConfig, entries: Sequence[ModelEntry] = ()) -> policy.Fleet:
    """Check the configuration and the target (ValueError saying what is wrong); the devices to use:
    this host's, or every node's of a cluster (named `<node>/<device>`), as the first stage's slots. Every
    way the models of `entries` are spread must fit the devices."""
    config.validate()
    load_backends(config.backends)
    found = list(config.devices or executor_for(config.executor).devices(config.target, config.ray_address))
    shared = adapter_for(config.target).ranks_share_device
    spread = ways(entries, config.settings) or {"": chosen("", "", config.settings.get("parallel"))}
    planned = [slots.plan(found, config.spare, world(way), shared=shared) for way, _ in of(spread)]
    active, spares = planned[0]
    return policy.Fleet(active, spares, quarantine_after=config.quarantine_after, retries=config.retries,
                        devices=found)


def ways(entries: Sequence[ModelEntry], settings: Mapping[str, Any]) -> dict[str, str]:
    """Model id -> how it runs ("" one device, else its spec); ValueError naming a model whose cell is no spec."""
    return {e.id: chosen(e.id, e.parallel, settings.get("parallel")) for e in entries}


def world(way: str) -> int:
    """Devices per model of `way`."""
    return parse(way).world if way else 1


def of(spread: Mapping[str, str]) -> list[tuple[str, list[str]]]:
    """The stages of a run whose models are spread as `spread` says (`slots.stages`)."""
    return slots.stages(spread, {w: world(w) for w in set(spread.values())})


def fleet_after(old: policy.Fleet, way: str, spare: int, *, shared: bool) -> policy.Fleet:
    """The next stage's fleet: slots for `way` from the devices still in service, the quarantines, spares used
    and faults seen carried over; ValueError when too few devices are left for it."""
    active, spares = slots.plan([d for d in old.devices if d not in old.gone], spare, world(way), shared=shared)
    return policy.Fleet(active, spares, quarantine_after=old.quarantine_after, retries=old.retries,
                        quarantined=old.quarantined, spares_used=old.spares_used, faults_seen=old.faults_seen,
                        devices=old.devices, gone=old.gone)
