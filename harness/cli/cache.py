"""`cache stats` and `cache prune`: the reference cache (`harness.run.refcache`) seen and trimmed."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
from pathlib import Path

_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$", re.IGNORECASE)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_BYTES = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_age(text: str) -> float:
    """'30d' -> seconds (s, m, h, d, w; a bare number is seconds)."""
    m = _AGE.match(text)
    if not m:
        raise ValueError(f"--older-than {text!r}: expected a number with s, m, h, d or w, e.g. 30d or 12h")
    return float(m.group(1)) * _SECONDS[m.group(2).lower()]


def parse_size(text: str) -> int:
    """'20G' -> bytes (K, M, G, T are powers of 1024; a bare number is bytes)."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"--max-size {text!r}: expected bytes, or a number with K, M, G or T, e.g. 20G or 500M")
    return int(float(m.group(1)) * _BYTES[m.group(2).lower()])


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _when(t: float | None) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC") if t else "-"


def _root(args: argparse.Namespace) -> Path:
    """The cache the command names; ValueError (exit 2, nothing touched) unless it is one."""
    from harness.run.refcache import default_root, is_cache

    root = Path(args.ref_cache) if args.ref_cache else default_root(args.db)
    if not root.exists():
        raise ValueError(f"no reference cache at {root}: nothing was stored there (give --ref-cache DIR, or the "
                         "--db its runs wrote)")
    if not root.is_dir():
        raise ValueError(f"--ref-cache {root}: not a directory")
    if not is_cache(root):
        raise ValueError(f"{root} is not a portharness reference cache (no CACHEDIR.TAG written by one); "
                         "nothing was touched")
    return root


def cmd_cache(args: argparse.Namespace) -> int:
    from harness.run.refcache import prune, stats

    if args.cache_command == "prune":
        if args.older_than is None and args.max_size is None:
            raise ValueError("cache prune: give --older-than AGE (e.g. 30d), --max-size SIZE (e.g. 20G), or both")
        older = parse_age(args.older_than) if args.older_than is not None else None
        size = parse_size(args.max_size) if args.max_size is not None else None
        root = _root(args)
        from harness.files import check_writable

        check_writable(root / "entries", directory=True)  # a read-only cache: one line, nothing removed
        done = prune(root, older_than_s=older, max_bytes=size, dry_run=args.dry_run)
        if args.json:
            print(json.dumps(done, indent=2))
            return 0
        verb = "would remove" if args.dry_run else "removed"
        print(f"reference cache {root}: {verb} {done['removed']} entries ({human_bytes(done['removed_bytes'])}) and "
              f"{done['partial_removed']} partial writes of writers that are gone "
              f"({human_bytes(done['partial_bytes'])}); {done['kept']} entries kept ({human_bytes(done['kept_bytes'])})")
        return 0
    found = stats(_root(args))
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    print(f"reference cache {found['root']}: {found['entries']} entries, {human_bytes(found['bytes'])}")
    print(f"  last used: {_when(found['oldest_use'])} .. {_when(found['newest_use'])}")
    for label, g in sorted(found["groups"].items(), key=lambda kv: -kv[1]["entries"]):
        print(f"  {label}: {g['entries']} entries, {human_bytes(g['bytes'])}")
    print(f"  partial writes (in progress, or left by killed writers): {found['partial']}"
          + (f" ({human_bytes(found['partial_bytes'])}; `cache prune` removes those whose writer is gone)"
             if found["partial"] else ""))
    return 0
