"""Joining a Ray cluster for a run: the address checked in bounded time (something that answers but is not
Ray is one line, not minutes of Ray's own retries), the connection (or a Ray instance of this host alone),
and the devices its nodes offer as *slots*, `<node>/<device>` (`gpu-host-3/cuda:5`), which `raypool` runs
actors on.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from harness.backends import adapter_for, device_type

RAY_MISSING = "--executor ray needs Ray on this machine and on every node: pip install 'portharness[ray]'"
CONNECT_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 5.0  # one Ray call to what answers at --ray-address


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
    count: int = 1  # devices it is: a --parallel group's, a placement group of one bundle each (`rayranks`)


SLOTS: dict[str, Slot] = {}  # the cluster's slots as last seen (`devices`), and the groups made of them (`slot`)


def slot(key: str) -> Slot:
    """The slot of a fleet key: one device's, or a --parallel group's (`<node>/sim:0+<node>/sim:1`: a placement
    group of its devices on that node, whose worker's ranks are actors of their own there, `rayranks`)."""
    if key not in SLOTS:
        parts = [SLOTS[k] for k in key.split("+")]
        if len({p.node_id for p in parts}) != 1:
            raise ValueError(f"{key}: a group's devices must be on one node")
        first = parts[0]
        SLOTS[key] = Slot(key=key, node_id=first.node_id, host=first.host, device="+".join(p.device for p in parts),
                          resource=first.resource, assigned=first.assigned, threads=sum(p.threads for p in parts),
                          count=len(parts))
    return SLOTS[key]
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
        counts = [int(n["Resources"].get(resource, 0)) for n in nodes]
        if want is not None and any(counts):
            raise ValueError(f"--target {target}: no node of {where} has a device {kind}:{want}; its nodes offer "
                             f"{kind}:0..{kind}:{max(counts) - 1} ({', '.join(f'{n}: {c}' for n, c in zip(names, counts, strict=True) if c)})")
        offered = sorted({r for n in nodes for r in n["Resources"]
                          if not r.startswith(("node:", "memory", "object_store"))})
        declare = ("(Ray counts them itself on hosts that have them)" if adapter.ray_assigns else
                   f"(declare it on each host: ray start ... --resources '{{\"{resource}\": N}}')")
        raise ValueError(f"--target {target}: no node of {where} offers the '{resource}' resource {declare}; "
                         f"its nodes offer: {', '.join(offered) or 'nothing'}")
    SLOTS.clear()
    SLOTS.update(found)
    return list(found)
