"""A ``torch.distributed`` backend for `sim` tensors, with the communication settings real backends ship.

Why this exists: an accelerator port is not done when single-device numerics match. Backends ship
communication defaults that silently cost speed (TorchTPU's "skinny" collectives cost 30-40% end to
end) and place processes differently (one per chip vs one per host). Importing this module registers
the ``sim`` c10d backend, so ``dist.init_process_group("sim", ...)`` followed by ``dist.all_reduce``
or ``DistributedDataParallel`` on `sim` tensors works as on ``nccl``, and every setting below can be
switched to measure what it costs (``harness.collectives`` does the measuring).

How: `ShapedProcessGroup` is a Python ``dist.ProcessGroup`` subclass (torch 2.13 cannot construct a
``c10d.Backend`` from Python, but a ``ProcessGroup`` subclass returned by an ``extended_api`` creator
replaces the whole group and its virtual methods are reachable from C++, which is what DDP's reducer
calls). Each collective is turned into a plan of messages on a *transport* (a gloo ``Backend`` on the
host tensors behind `sim` tensors, like PyTorch's OpenReg ``ProcessGroupOCCL`` over gloo); the same
class over gloo/nccl on plain CPU/CUDA tensors is registered as ``shaped_gloo`` / ``shaped_nccl`` so a
``--target cpu`` / ``cuda`` run measures the same settings and its rows are comparable.

Settings (env vars are read when this module is imported; the API changes them at run time; every
rank must use the same settings at the same time, as with NCCL env vars):

=============== ================================== ============== =========================================
setting         env var                            default        meaning
=============== ================================== ============== =========================================
skinny          PORTHARNESS_SIM_SKINNY             0 (fused)      1: split each tensor into pieces of
                PORTHARNESS_SIM_SKINNY_BYTES       65536          ``skinny_bytes``, one collective per piece,
                                                                  each waited before the next (serialised)
bucket size     PORTHARNESS_SIM_BUCKET_MB          25 (DDP's)     DDP ``bucket_cap_mb`` and the bucket that
                                                                  ``allreduce_coalesced`` packs tensors into;
                                                                  0: no coalescing, one collective per tensor
message cap     PORTHARNESS_SIM_MAX_MESSAGE_BYTES  0 (no cap)     max bytes per message; larger tensors are
                                                                  chunked, chunks issued back to back (async)
placement       PORTHARNESS_SIM_PLACEMENT          per-device     per-host: ranks are grouped into hosts;
                PORTHARNESS_SIM_RANKS_PER_HOST     2              each host reduces locally, the host leaders
                                                                  run the inter-host collective, and each
                                                                  leader broadcasts back to its host
=============== ================================== ============== =========================================

API: `CollectiveSettings` (frozen dataclass), `get_collective_settings`, `set_collective_settings`,
the `collective_settings(**changes)` context manager, `parse_setting("skinny+per-host:2")` for the
benchmark's setting names (see `SETTING_GRAMMAR`), and `settings_from_env`.

Modelling choices worth knowing when reading numbers: skinny pieces and per-host stages run
synchronously (a call returns when its last message is done, so DDP cannot overlap them with backward
compute); fused and capped messages are issued asynchronously and complete through a future, as on
nccl. Host groups are created lazily, member-only, from the group's store (``PrefixStore``), not with
``dist.new_group``: the creator runs before the default group exists and ``new_group`` would need
every rank of the world to take part. Shaped by the settings: ``allreduce``,
``allreduce_coalesced``, ``broadcast``, ``allgather`` / ``all_gather_single`` (``all_gather_into_tensor``),
``reduce_scatter`` / ``reduce_scatter_single`` (``reduce_scatter_tensor``). Passed straight to the
transport, unshaped: ``reduce``, ``gather``, ``scatter``, ``alltoall``, ``all_to_all_single``,
``send``/``recv``, ``barrier``.

Use::

    import torch, torch.distributed as dist
    import harness.sim.distributed as simdist  # after torch: registers the backends
    dist.init_process_group("sim", store=store, rank=rank, world_size=world)
    t = torch.ones(4).to(f"sim:{rank % harness.sim.device_count()}")
    with simdist.collective_settings(simdist.parse_setting("skinny")):
        dist.all_reduce(t)

Two things DDP on sim users meet that are not about communication (both belong to the sim tensor /
device layer): autograd only runs on ``sim:0`` (torch 2.13's Python PrivateUse1 device guard reports
one device, so backward on ``sim:1`` trips an engine assert; each rank is its own process, so train
on its own ``sim:0``), and ``model.to("sim")`` unties tied weights (GPT-2's ``lm_head``/``wte``):
call ``model.tie_weights()`` after moving.

This module depends only on torch (and `harness.sim`); nothing here knows about the harness runner.
"""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from .tensor import SimTensor, inner

SKINNY_ENV = "PORTHARNESS_SIM_SKINNY"
SKINNY_BYTES_ENV = "PORTHARNESS_SIM_SKINNY_BYTES"
BUCKET_MB_ENV = "PORTHARNESS_SIM_BUCKET_MB"
MAX_MESSAGE_ENV = "PORTHARNESS_SIM_MAX_MESSAGE_BYTES"
PLACEMENT_ENV = "PORTHARNESS_SIM_PLACEMENT"
RANKS_PER_HOST_ENV = "PORTHARNESS_SIM_RANKS_PER_HOST"

DEFAULT_SKINNY_BYTES = 64 * 1024
DEFAULT_BUCKET_MB = 25.0  # torch.nn.parallel.DistributedDataParallel's bucket_cap_mb default
DEFAULT_RANKS_PER_HOST = 2
PLACEMENTS = ("per-device", "per-host")

SETTING_GRAMMAR = (
    "a setting is one or more of these joined by '+': fused (the baseline), skinny[:PIECE], "
    "bucket:SIZE (0 = no coalescing), cap:SIZE, per-device, per-host[:RANKS_PER_HOST]; "
    "SIZE is bytes with an optional k/m/g suffix (KiB/MiB/GiB), e.g. 'skinny:16k+per-host:2'"
)

BACKEND_NAME = "sim"
TRANSPORTS = {"sim": "gloo", "shaped_gloo": "gloo", "shaped_nccl": "nccl"}


# ----------------------------------------------------------------------------------------------
# Settings
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CollectiveSettings:
    """One point in the space of communication settings; the defaults are the fused baseline."""

    skinny: bool = False
    skinny_bytes: int = DEFAULT_SKINNY_BYTES
    bucket_mb: float = DEFAULT_BUCKET_MB
    max_message_bytes: int = 0
    placement: str = "per-device"
    ranks_per_host: int = DEFAULT_RANKS_PER_HOST

    def __post_init__(self) -> None:
        if self.skinny_bytes <= 0:
            raise ValueError(f"skinny_bytes must be a positive byte count, got {self.skinny_bytes}")
        if self.bucket_mb < 0:
            raise ValueError(f"bucket_mb must be >= 0 (0 = no coalescing), got {self.bucket_mb}")
        if self.max_message_bytes < 0:
            raise ValueError(f"max_message_bytes must be >= 0 (0 = no cap), got {self.max_message_bytes}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {self.placement!r}; expected one of {', '.join(PLACEMENTS)}")
        if self.ranks_per_host < 1:
            raise ValueError(f"ranks_per_host must be >= 1, got {self.ranks_per_host}")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 1024 * 1024)

    def message_limit(self) -> int:
        """Largest message in bytes (0 = unlimited): the smaller of the skinny piece and the cap."""
        limits = [b for b in (self.skinny_bytes if self.skinny else 0, self.max_message_bytes) if b > 0]
        return min(limits) if limits else 0

    def as_dict(self) -> dict:
        return asdict(self)


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name, "")
    if raw == "":
        return default
    try:
        return parse_size(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a byte count (optionally with k/m/g)") from None


def settings_from_env(environ: Mapping[str, str] | None = None) -> CollectiveSettings:
    """Settings from the ``PORTHARNESS_SIM_*`` env vars (see the module docstring), defaults elsewhere."""
    env = os.environ if environ is None else environ
    skinny_raw = env.get(SKINNY_ENV, "0").strip().lower()
    if skinny_raw not in ("0", "1", "false", "true", "no", "yes", ""):
        raise ValueError(f"{SKINNY_ENV}={skinny_raw!r}: expected 0 or 1")
    bucket_raw = env.get(BUCKET_MB_ENV, "")
    try:
        bucket_mb = float(bucket_raw) if bucket_raw else DEFAULT_BUCKET_MB
    except ValueError:
        raise ValueError(f"{BUCKET_MB_ENV}={bucket_raw!r}: expected a number of MiB") from None
    try:
        rph = int(env.get(RANKS_PER_HOST_ENV, "") or DEFAULT_RANKS_PER_HOST)
    except ValueError:
        raise ValueError(
            f"{RANKS_PER_HOST_ENV}={env.get(RANKS_PER_HOST_ENV)!r}: expected an integer"
        ) from None
    return CollectiveSettings(
        skinny=skinny_raw in ("1", "true", "yes"),
        skinny_bytes=_env_int(env, SKINNY_BYTES_ENV, DEFAULT_SKINNY_BYTES),
        bucket_mb=bucket_mb,
        max_message_bytes=_env_int(env, MAX_MESSAGE_ENV, 0),
        placement=env.get(PLACEMENT_ENV, "") or "per-device",
        ranks_per_host=rph,
    )


_settings = settings_from_env()


def get_collective_settings() -> CollectiveSettings:
    """The settings every `ShapedProcessGroup` in this process applies to its next collective."""
    return _settings


def set_collective_settings(settings: CollectiveSettings | None = None, **changes: object) -> None:
    """Replace the settings (``None``: back to the env-var defaults), optionally changing fields.

    Call it on every rank with the same values between collectives; ranks that disagree split the
    same tensor into different messages and hang or fail like mismatched NCCL settings would.
    """
    global _settings
    base = settings_from_env() if settings is None else settings
    _settings = replace(base, **changes) if changes else base  # type: ignore[arg-type]


@contextmanager
def collective_settings(settings: CollectiveSettings | None = None, **changes: object) -> Iterator[None]:
    """Run the block with other settings (a `CollectiveSettings`, field changes, or both)."""
    global _settings
    prev = _settings
    set_collective_settings(prev if settings is None else settings, **changes)
    try:
        yield
    finally:
        _settings = prev


_SUFFIX = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20}
_SUFFIX.update({"g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30})


def parse_size(text: str | int) -> int:
    """``'64k'`` -> 65536; plain integers are bytes. Raises ValueError with the accepted forms."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    s = str(text).strip().lower()
    num = s.rstrip("kmgib")
    unit = s[len(num) :]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in _SUFFIX or value < 0 or not num:
        raise ValueError(
            f"bad size {text!r}: expected bytes with an optional k/m/g suffix, e.g. 4096, 64k, 16m"
        )
    n = value * _SUFFIX[unit]
    if n != int(n):
        raise ValueError(f"bad size {text!r}: not a whole number of bytes")
    return int(n)


def parse_setting(spec: str, base: CollectiveSettings | None = None) -> CollectiveSettings:
    """Turn a setting name such as ``'skinny'``, ``'cap:256k'`` or ``'skinny+per-host:2'`` into settings.

    Starts from ``base`` (default: the fused baseline, not the env vars, so a name means the same on
    every machine). Unknown names raise ValueError listing the grammar.
    """
    s = CollectiveSettings() if base is None else base
    if not spec or not spec.strip():
        raise ValueError(f"empty setting name; {SETTING_GRAMMAR}")
    for token in spec.strip().split("+"):
        name, _, value = token.strip().partition(":")
        name = name.strip().lower()
        try:
            if name == "fused" and not value:
                s = replace(s, skinny=False)
            elif name == "skinny":
                s = replace(s, skinny=True, skinny_bytes=parse_size(value) if value else s.skinny_bytes)
            elif name == "bucket" and value:
                s = replace(s, bucket_mb=parse_size(value) / (1 << 20))
            elif name == "cap" and value:
                s = replace(s, max_message_bytes=parse_size(value))
            elif name == "per-device" and not value:
                s = replace(s, placement="per-device")
            elif name == "per-host":
                s = replace(s, placement="per-host", ranks_per_host=int(value) if value else s.ranks_per_host)
            else:
                raise ValueError(f"unknown setting {token.strip()!r} in {spec!r}")
        except ValueError as exc:
            msg = str(exc)
            if "unknown setting" not in msg:
                msg = f"bad setting {token.strip()!r} in {spec!r}: {msg}"
            raise ValueError(f"{msg}; {SETTING_GRAMMAR}") from None
    return s


# ----------------------------------------------------------------------------------------------
# Message plans
# ----------------------------------------------------------------------------------------------


def pieces(numel: int, element_size: int, limit_bytes: int) -> list[tuple[int, int]]:
    """Element ranges ``[(start, stop), ...]`` of messages no bigger than ``limit_bytes`` (0 = one)."""
    if numel == 0:
        return [(0, 0)]
    if limit_bytes <= 0:
        return [(0, numel)]
    step = max(1, limit_bytes // element_size)
    return [(a, min(a + step, numel)) for a in range(0, numel, step)]


def _opts(cls: type, src: object | None, **fields: object) -> object:
    o = cls()
    if src is not None:
        if hasattr(src, "reduceOp") and hasattr(o, "reduceOp"):
            o.reduceOp = src.reduceOp
        if hasattr(src, "timeout"):
            o.timeout = src.timeout
    for k, v in fields.items():
        setattr(o, k, v)
    return o


class _Messages:
    """Issues the messages of one stage; serial (skinny) waits each one before issuing the next."""

    def __init__(self, serial: bool) -> None:
        self.serial = serial
        self.works: list = []

    def add(self, work) -> None:
        if self.serial:
            work.wait()
        else:
            self.works.append(work)

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works = []


@dataclass(frozen=True)
class _Hosts:
    """Which emulated host a rank sits on under per-host placement."""

    world: int
    rank: int
    per_host: int

    @property
    def host(self) -> int:
        return self.rank // self.per_host

    @property
    def local(self) -> int:
        return self.rank % self.per_host

    @property
    def n_hosts(self) -> int:
        return self.world // self.per_host

    def first(self, host: int) -> int:
        return host * self.per_host


def _flat(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(
            f"collective on a non-contiguous tensor (shape {tuple(t.shape)}, stride {t.stride()}); "
            "pass a contiguous tensor, as nccl requires"
        )
    return t.view(-1)


# ----------------------------------------------------------------------------------------------
# The process group
# ----------------------------------------------------------------------------------------------


def make_transport(kind: str, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta):
    """A c10d ``Backend`` of ``kind`` ('gloo' or 'nccl') over ``store``: the wire under the settings."""
    if kind == "gloo":
        return c10d.ProcessGroupGloo(store, rank, size, timeout)
    if kind == "nccl":
        nccl = getattr(c10d, "ProcessGroupNCCL", None)
        if nccl is None:
            raise RuntimeError("this torch build has no NCCL; use --target cpu or sim")
        opts = nccl.Options()
        opts._timeout = timeout
        return nccl(store, rank, size, opts)
    raise ValueError(f"unknown transport {kind!r}; expected gloo or nccl")


class ShapedProcessGroup(dist.ProcessGroup):
    """A process group that runs each collective as a plan of messages shaped by `CollectiveSettings`.

    ``unwrap`` maps a caller tensor to the tensor the transport sees (`inner` for sim tensors, the
    identity for CPU/CUDA); results are written in place into the caller's tensors and the returned
    work's future holds the caller's tensors, as DDP's reducer expects.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        *,
        transport: str = "gloo",
        unwrap: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
        name: str = "shaped_gloo",
    ) -> None:
        super().__init__(rank, size)
        self._store = store
        self._timeout = timeout
        self._kind = transport
        self._unwrap = unwrap
        self._name = name
        self._world = make_transport(transport, store, rank, size, timeout)
        self._sub: dict[tuple, object] = {}
        self._lock = threading.Lock()

    # -- plumbing -------------------------------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 (c10d's name)
        return self._name

    @property
    def transport(self):
        """The world-sized transport backend (gloo/nccl): for barriers and timing outside the settings."""
        return self._world

    def _subgroup(self, key: tuple, ranks: Sequence[int]):
        """Member-only transport over ``ranks``, created on first use (all members reach it together)."""
        with self._lock:
            g = self._sub.get(key)
            if g is None:
                prefix = "portharness/" + "/".join(map(str, key))
                g = make_transport(
                    self._kind,
                    dist.PrefixStore(prefix, self._store),
                    list(ranks).index(self.rank()),
                    len(ranks),
                    self._timeout,
                )
                self._sub[key] = g
            return g

    def _hosts(self, s: CollectiveSettings) -> _Hosts:
        if self.size() % s.ranks_per_host:
            raise ValueError(
                f"per-host placement with {s.ranks_per_host} ranks per host needs a world size divisible "
                f"by {s.ranks_per_host}, got {self.size()}"
            )
        return _Hosts(self.size(), self.rank(), s.ranks_per_host)

    def _intra(self, h: _Hosts):
        if h.per_host == 1:
            return None
        first = h.first(h.host)
        return self._subgroup(("host", h.per_host, h.host), range(first, first + h.per_host))

    def _leaders(self, h: _Hosts):
        if h.n_hosts == 1 or h.local != 0:
            return None
        return self._subgroup(("leaders", h.per_host), [h.first(i) for i in range(h.n_hosts)])

    def _host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [self._unwrap(t) for t in tensors]

    def _finish(self, pending: list, result: list):
        """A Work whose future yields ``result`` (the caller's tensors) once ``pending`` is done."""
        futs = []
        for w in pending:
            try:
                futs.append(w.get_future())
            except RuntimeError:  # some gloo works (reduce_scatter) have no future: complete it here
                w.wait()
        if not futs:
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(result)
            return c10d._create_work_from_future(fut)
        done = torch.futures.collect_all(futs)

        def _then(f: torch.futures.Future) -> list:
            for sub in f.value():
                sub.value()  # re-raises a failed message
            return result

        return c10d._create_work_from_future(done.then(_then))

    # -- stage primitives (host tensors, one transport, settings-shaped messages) ----------------

    def _stage_allreduce(self, g, flat: torch.Tensor, opts, s: CollectiveSettings) -> _Messages:
        m = _Messages(s.skinny)
        for a, b in pieces(flat.numel(), flat.element_size(), s.message_limit()):
            m.add(g.allreduce([flat[a:b]], _opts(c10d.AllreduceOptions, opts)))
        return m

    def _stage_reduce(self, g, flat: torch.Tensor, root: int, opts, s: CollectiveSettings) -> _Messages:
        m = _Messages(s.skinny)
        for a, b in pieces(flat.numel(), flat.element_size(), s.message_limit()):
            m.add(g.reduce([flat[a:b]], _opts(c10d.ReduceOptions, opts, rootRank=root, rootTensor=0)))
        return m

    def _stage_broadcast(self, g, flat: torch.Tensor, root: int, opts, s: CollectiveSettings) -> _Messages:
        m = _Messages(s.skinny)
        for a, b in pieces(flat.numel(), flat.element_size(), s.message_limit()):
            m.add(g.broadcast([flat[a:b]], _opts(c10d.BroadcastOptions, opts, rootRank=root, rootTensor=0)))
        return m

    def _stage_allgather(self, g, outs: list[torch.Tensor], flat: torch.Tensor, opts, s) -> _Messages:
        m = _Messages(s.skinny)
        for a, b in pieces(flat.numel(), flat.element_size(), s.message_limit()):
            m.add(g.allgather([[o[a:b] for o in outs]], [flat[a:b]], _opts(c10d.AllgatherOptions, opts)))
        return m

    def _stage_reduce_scatter(self, g, out: torch.Tensor, ins: list[torch.Tensor], opts, s) -> _Messages:
        m = _Messages(s.skinny)
        for a, b in pieces(out.numel(), out.element_size(), s.message_limit()):
            m.add(
                g.reduce_scatter([out[a:b]], [[i[a:b] for i in ins]], _opts(c10d.ReduceScatterOptions, opts))
            )
        return m

    def _stage_gather(
        self, g, outs: list[torch.Tensor] | None, flat: torch.Tensor, root: int, s
    ) -> _Messages:
        m = _Messages(s.skinny)
        for a, b in pieces(flat.numel(), flat.element_size(), s.message_limit()):
            o = [[x[a:b] for x in outs]] if outs is not None else []
            m.add(g.gather(o, [flat[a:b]], _opts(c10d.GatherOptions, None, rootRank=root)))
        return m

    def _stage_scatter(self, g, out: torch.Tensor, ins: list[torch.Tensor] | None, root: int, s) -> _Messages:
        m = _Messages(s.skinny)
        for a, b in pieces(out.numel(), out.element_size(), s.message_limit()):
            i = [[x[a:b] for x in ins]] if ins is not None else []
            m.add(g.scatter([out[a:b]], i, _opts(c10d.ScatterOptions, None, rootRank=root)))
        return m

    # -- collectives ----------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: c10d.AllreduceOptions | None = None) -> c10d.Work:
        """In-place all_reduce of each tensor, split/staged by the settings; what DDP's reducer calls."""
        return self._finish(self._allreduce_host(self._host(tensors), opts, _settings), list(tensors))

    def _allreduce_host(self, host: list[torch.Tensor], opts, s: CollectiveSettings) -> list:
        pending: list = []
        for t in host:
            flat = _flat(t)
            if s.placement == "per-device":
                pending += self._stage_allreduce(self._world, flat, opts, s).works
                continue
            h = self._hosts(s)
            intra, leaders = self._intra(h), self._leaders(h)
            if intra is not None:
                self._stage_reduce(intra, flat, 0, opts, s).wait()
            if leaders is not None:
                self._stage_allreduce(leaders, flat, opts, s).wait()
            if intra is not None:
                self._stage_broadcast(intra, flat, 0, opts, s).wait()
        return pending

    def allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: c10d.AllreduceCoalescedOptions | None = None
    ) -> c10d.Work:
        """Pack tensors into buckets of ``bucket_mb`` (0: none), one allreduce per bucket."""
        s = _settings
        host = self._host(tensors)
        cap = s.bucket_bytes
        buckets: list[list[torch.Tensor]] = []
        size = 0
        for t in host:
            nbytes = t.numel() * t.element_size()
            if not buckets or cap == 0 or size + nbytes > cap or buckets[-1][0].dtype != t.dtype:
                buckets.append([])
                size = 0
            buckets[-1].append(t)
            size += nbytes
        for bucket in buckets:
            flat = torch._utils._flatten_dense_tensors(bucket) if len(bucket) > 1 else bucket[0]
            for w in self._allreduce_host([flat], opts, s):
                w.wait()
            if len(bucket) > 1:
                for dst, src in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket), strict=True):
                    dst.copy_(src)
        return self._finish([], list(tensors))

    def broadcast(self, tensors: list[torch.Tensor], opts: c10d.BroadcastOptions | None = None) -> c10d.Work:
        """Broadcast from ``opts.rootRank`` (DDP's initial state sync and per-forward buffer sync)."""
        s = _settings
        root = opts.rootRank if opts is not None else 0
        pending: list = []
        for t in self._host(tensors):
            flat = _flat(t)
            if s.placement == "per-device":
                pending += self._stage_broadcast(self._world, flat, root, opts, s).works
                continue
            h = self._hosts(s)
            src = _Hosts(h.world, root, h.per_host)
            intra, leaders = self._intra(h), self._leaders(h)
            if intra is not None and h.host == src.host and src.local != 0:
                self._stage_broadcast(intra, flat, src.local, opts, s).wait()
            if leaders is not None:
                self._stage_broadcast(leaders, flat, src.host, opts, s).wait()
            if intra is not None and (h.host != src.host or src.local == 0):
                self._stage_broadcast(intra, flat, 0, opts, s).wait()
        return self._finish(pending, list(tensors))

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: c10d.AllgatherOptions | None = None,
    ) -> c10d.Work:
        """List all_gather (DDP checks parameter shapes across ranks with it)."""
        s = _settings
        pending: list = []
        for outs, t in zip(output_tensors, input_tensors, strict=True):
            pending += self._allgather_one(self._host(outs), _flat(self._unwrap(t)), opts, s)
        return self._finish(pending, list(output_tensors))

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: c10d.AllgatherOptions | None = None
    ) -> c10d.Work:
        """``all_gather_into_tensor``: rank r's input lands in row r of ``output``."""
        s = _settings
        out = _flat(self._unwrap(output))
        flat = _flat(self._unwrap(input))
        if out.numel() != flat.numel() * self.size():
            raise ValueError(
                f"all_gather_into_tensor: output has {out.numel()} elements, expected world size "
                f"{self.size()} x input {flat.numel()}"
            )
        rows = list(out.view(self.size(), -1))
        return self._finish(self._allgather_one(rows, flat, opts, s), [output])

    def _allgather_one(self, outs: list[torch.Tensor], flat: torch.Tensor, opts, s) -> list:
        outs = [_flat(o) for o in outs]
        if s.placement == "per-device":
            return self._stage_allgather(self._world, outs, flat, opts, s).works
        h = self._hosts(s)
        intra, leaders = self._intra(h), self._leaders(h)
        n = flat.numel()
        full = flat.new_empty(h.world * n)
        rows = list(full.view(h.world, n)) if n else [full[:0]] * h.world
        first = h.first(h.host)
        if intra is not None:
            local_rows = rows[first : first + h.per_host] if h.local == 0 else None
            self._stage_gather(intra, local_rows, flat, 0, s).wait()
        else:
            rows[first].copy_(flat)
        if leaders is not None:
            blocks = list(full.view(h.n_hosts, h.per_host * n))
            self._stage_allgather(leaders, blocks, blocks[h.host].clone(), opts, s).wait()
        if intra is not None:
            self._stage_broadcast(intra, full, 0, opts, s).wait()
        for o, r in zip(outs, rows, strict=True):
            o.copy_(r)
        return []

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: c10d.ReduceScatterOptions | None = None,
    ) -> c10d.Work:
        """List reduce_scatter: rank r gets the reduction of everyone's ``input_tensors[0][r]``."""
        s = _settings
        pending: list = []
        for t, ins in zip(output_tensors, input_tensors, strict=True):
            pending += self._reduce_scatter_one(
                _flat(self._unwrap(t)), [_flat(i) for i in self._host(ins)], opts, s
            )
        return self._finish(pending, list(output_tensors))

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: c10d.ReduceScatterOptions | None = None
    ) -> c10d.Work:
        """``reduce_scatter_tensor``: rank r gets the reduction of row r of everyone's ``input``."""
        s = _settings
        out = _flat(self._unwrap(output))
        flat = _flat(self._unwrap(input))
        if flat.numel() != out.numel() * self.size():
            raise ValueError(
                f"reduce_scatter_tensor: input has {flat.numel()} elements, expected world size "
                f"{self.size()} x output {out.numel()}"
            )
        rows = list(flat.view(self.size(), -1))
        return self._finish(self._reduce_scatter_one(out, rows, opts, s), [output])

    def _reduce_scatter_one(self, out: torch.Tensor, ins: list[torch.Tensor], opts, s) -> list:
        if s.placement == "per-device":
            return self._stage_reduce_scatter(self._world, out, ins, opts, s).works
        h = self._hosts(s)
        intra, leaders = self._intra(h), self._leaders(h)
        n = out.numel()
        full = torch.cat(ins) if ins else out.new_empty(0)
        if intra is not None:
            self._stage_reduce(intra, full, 0, opts, s).wait()
        first = h.first(h.host)
        if h.local == 0:
            if leaders is not None:
                block = full.new_empty(h.per_host * n)
                blocks = list(full.view(h.n_hosts, h.per_host * n))
                self._stage_reduce_scatter(leaders, block, blocks, opts, s).wait()
            else:
                block = full[first * n : (first + h.per_host) * n]
            host_rows = list(block.view(h.per_host, n)) if n else [block[:0]] * h.per_host
        if intra is not None:
            self._stage_scatter(intra, out, host_rows if h.local == 0 else None, 0, s).wait()
        else:
            out.copy_(host_rows[0])
        return []

    _allgather_base = all_gather_single  # the pre-2.10 names, still what some C++ callers use
    _reduce_scatter_base = reduce_scatter_single

    def barrier(self, opts: c10d.BarrierOptions | None = None) -> c10d.Work:
        """A transport barrier (never shaped: nothing to split)."""
        return self._world.barrier(opts if opts is not None else c10d.BarrierOptions())

    # -- pass-through (not shaped by the settings): so they work and fail clearly, not via dispatch --

    def _through(self, work, result: list):
        return self._finish([work], result)

    def reduce(self, tensors, opts=None):
        return self._through(
            self._world.reduce(self._host(tensors), opts or c10d.ReduceOptions()), list(tensors)
        )

    def gather(self, output_tensors, input_tensors, opts=None):
        outs = [self._host(o) for o in output_tensors]
        work = self._world.gather(outs, self._host(input_tensors), opts or c10d.GatherOptions())
        return self._through(work, list(output_tensors))

    def scatter(self, output_tensors, input_tensors, opts=None):
        ins = [self._host(i) for i in input_tensors]
        work = self._world.scatter(self._host(output_tensors), ins, opts or c10d.ScatterOptions())
        return self._through(work, list(output_tensors))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        work = self._world.alltoall_base(
            self._unwrap(output),
            self._unwrap(input),
            output_split_sizes,
            input_split_sizes,
            opts or c10d.AllToAllOptions(),
        )
        return self._through(work, [output])

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None):
        work = self._world.alltoall(
            self._host(output_tensors), self._host(input_tensors), opts or c10d.AllToAllOptions()
        )
        return self._through(work, list(output_tensors))

    def send(self, tensors, dst_rank, tag=0):
        return self._through(self._world.send(self._host(tensors), dst_rank, tag), list(tensors))

    def recv(self, tensors, src_rank, tag=0):
        return self._through(self._world.recv(self._host(tensors), src_rank, tag), list(tensors))


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------


def _unwrap_sim(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, SimTensor):
        raise RuntimeError(
            f"the sim process group got a tensor on {t.device}; collectives on the 'sim' backend need sim "
            "tensors (move it with .to('sim'), as nccl needs cuda tensors)"
        )
    return inner(t)


def _creator(name: str) -> Callable:
    def create(opts: c10d._DistributedBackendOptions, backend_options: object = None) -> ShapedProcessGroup:
        return ShapedProcessGroup(
            opts.store,
            opts.group_rank,
            opts.group_size,
            opts.timeout,
            transport=TRANSPORTS[name],
            unwrap=_unwrap_sim if name == BACKEND_NAME else (lambda t: t),
            name=name,
        )

    return create


_DEVICES = {"sim": ["sim"], "shaped_gloo": ["cpu"], "shaped_nccl": ["cuda"]}


def register() -> None:
    """Register the ``sim``, ``shaped_gloo`` and ``shaped_nccl`` c10d backends (idempotent)."""
    for name, devices in _DEVICES.items():
        if name.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(name, _creator(name), extended_api=True, devices=devices)


register()
