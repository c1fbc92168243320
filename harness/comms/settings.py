"""Communication settings real backends ship, as one value: what the shaped process group obeys.

Backends ship communication defaults that silently cost speed (TorchTPU's "skinny" collectives cost
30-40% end to end) and place processes differently (one per chip vs one per host). Each such knob is
a field of `CollectiveSettings`:

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

This module depends only on torch (it is the vocabulary, `shaped.py` the behaviour).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace

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
