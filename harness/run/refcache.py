"""The reference cache: named CPU tensors and a little metadata per key, shared by runs, shards and hosts.

One entry per key (`refkey`): a directory ``entries/<key[:2]>/<key>/`` holding ``tensors.safetensors``
(the reference side's named tensors) and ``index.json`` (the metadata, the tensor file's size and
SHA-256, the key's parts, and a SHA-256 of the index itself). Nothing here knows what the tensors mean.

- Writers fill a directory beside the entry and rename it into place (`files.atomic_dir`): a reader
  sees a whole entry or none, two writers of one key leave the first one's entry (the second drops its
  copy), and a writer killed at any point leaves only a ``.tmp`` directory no reader opens (`prune`
  removes it once its process is gone).
- Readers trust nothing they have not checked: an index that does not parse or match its digest, a
  tensor file of the wrong size or digest, tensors other than the index names: the entry is removed
  (renamed away first, so no reader sees half of it) and the caller recomputes.
- A hit touches the index, so `prune --max-size` removes what was used least recently.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness import files
from harness.run.refkey import file_digest

FORMAT = 1
TENSORS = "tensors.safetensors"
INDEX = "index.json"
TAG = "CACHEDIR.TAG"  # https://bford.info/cachedir/: backup tools skip the directory
_TAG_TEXT = "Signature: 8a477f597d28d172789f06886806bc55\n# portharness reference cache (portharness cache stats)\n"
PARTIAL_AFTER_S = 3600.0  # a partial write from another host untouched this long is a killed writer's


@dataclass
class Entry:
    tensors: dict[str, torch.Tensor]  # in the order they were stored
    meta: dict[str, Any]


@dataclass
class Info:
    """What `scan` sees of one entry without reading its tensors."""

    path: Path
    bytes: int
    last_used: float  # the index's modification time (touched on every hit)
    body: dict[str, Any] | None  # the index, None if it does not parse or match its digest


@dataclass
class Scan:
    entries: list[Info] = field(default_factory=list)
    partial: list[Path] = field(default_factory=list)  # writes in progress, or left by killed writers


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _index_text(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True)
    return json.dumps({"body": body, "sha256": _digest(canonical.encode())}, sort_keys=True, indent=1)


def _read_index(path: Path) -> dict[str, Any]:
    """The index body; ValueError if it does not parse or match its digest."""
    doc = json.loads(path.read_text())
    body = doc.get("body") if isinstance(doc, dict) else None
    if not isinstance(body, dict) or _digest(json.dumps(body, sort_keys=True).encode()) != doc.get("sha256"):
        raise ValueError("the index does not match its checksum")
    if body.get("format") != FORMAT:
        raise ValueError(f"entry format {body.get('format')!r}, this portharness writes {FORMAT}")
    return body


def _same_parts(recorded: Any, parts: dict[str, Any]) -> None:
    """ValueError naming the first component an entry's index records differently from `parts`."""
    want = json.loads(json.dumps(parts, sort_keys=True, default=str))
    if not isinstance(recorded, dict):
        raise ValueError("the index records no key components")
    for name in sorted(set(want) | set(recorded)):
        if recorded.get(name) != want.get(name):
            raise ValueError(f"the index records another {name} ({str(recorded.get(name))[:120]}; this run's: "
                             f"{str(want.get(name))[:120]})")


def _storable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor contiguous on the CPU, owning its storage (safetensors refuses shared storage)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        t = t.detach().to("cpu")
        storage = t.untyped_storage()
        whole = t.is_contiguous() and t.storage_offset() == 0 and storage.nbytes() == t.numel() * t.element_size()
        if not whole or (t.numel() and storage.data_ptr() in seen):
            t = t.contiguous().clone()
        if t.numel():
            seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def default_root(db: str | os.PathLike) -> Path:
    """Where `check` and `run` keep the cache when not told: ``ref-cache/`` beside the result DB (shard
    DBs in one directory share it)."""
    return Path(os.path.abspath(db)).parent / "ref-cache"


class RefCache:
    """The cache under `root` (created on the first write)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    @property
    def memo(self) -> Path:
        """Where digests of local checkpoint files are remembered (`refkey.checkpoint_digest`)."""
        return self.root / "files"

    def path(self, key: str) -> Path:
        return self.root / "entries" / key[:2] / key

    def get(self, key: str, parts: dict[str, Any] | None = None) -> tuple[Entry | None, str]:
        """(the entry, "") on a hit; (None, "") when there is none; (None, why) when there was one that
        could not be trusted (removed) or read. `parts`: the key's components (`refkey.components`), which the
        entry's index must record too: an index naming another torch, transformers or code version, or
        anything else, is not this key's whatever key it claims."""
        where = self.path(key)
        if not where.is_dir():
            return None, ""
        try:
            body = _read_index(where / INDEX)
            if body.get("key") != key:
                raise ValueError("the index is another key's")
            if parts is not None:
                _same_parts(body.get("components"), parts)
            tensor_file = where / body["tensors"]["file"]
            size = tensor_file.stat().st_size
            if size != body["tensors"]["bytes"]:
                raise ValueError(f"tensor file of {size} bytes, {body['tensors']['bytes']} written")
            if file_digest(tensor_file) != body["tensors"]["sha256"]:
                raise ValueError("the tensor file does not match its checksum")
            from safetensors.torch import load_file

            loaded = load_file(tensor_file)
            names = body["tensors"]["names"]
            if sorted(loaded) != sorted(names):
                raise ValueError("the tensor file holds other tensors than its index names")
        except FileNotFoundError:
            if not where.exists():
                return None, ""  # removed meanwhile (pruned, or found corrupt by another reader)
            return self._untrusted(where, "a file of the entry is missing")
        except PermissionError as e:
            return None, f"the cached entry could not be read ({e.strerror}); computed"
        except Exception as e:  # anything else wrong with it: never trusted, removed, recomputed
            return self._untrusted(where, f"{type(e).__name__}: {str(e)[:200]}")
        try:
            os.utime(where / INDEX)  # last used, for prune --max-size
        except OSError:
            pass
        return Entry({n: loaded[n] for n in names}, body.get("meta", {})), ""

    def _untrusted(self, where: Path, why: str) -> tuple[None, str]:
        try:
            files.remove_dir(where)
        except files.OutputError:
            return None, f"recomputed: the cached entry is corrupt ({why}) and could not be removed"
        return None, f"recomputed: the cached entry was corrupt ({why}); removed"

    def put(self, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any], parts: dict[str, Any]) -> str:
        """Store an entry; what happened, for the row: "stored", or "computed (not stored: why)"."""
        from safetensors.torch import save_file

        try:
            self._tag()
            with files.atomic_dir(self.path(key)) as stage:
                save_file(_storable(tensors), stage / TENSORS)
                body = {
                    "format": FORMAT, "key": key, "created": time.time(), "components": parts, "meta": meta,
                    "tensors": {"file": TENSORS, "bytes": (stage / TENSORS).stat().st_size,
                                "sha256": file_digest(stage / TENSORS), "names": list(tensors)},
                }
                (stage / INDEX).write_text(_index_text(body))
        except FileExistsError:
            return "computed (another run stored the same entry meanwhile)"
        except files.OutputError as e:
            return f"computed (not stored: {e})"
        except Exception as e:  # a tensor safetensors cannot hold, metadata JSON cannot: the row goes on
            return f"computed (not stored: {type(e).__name__}: {str(e)[:200]})"
        return "stored"

    def _tag(self) -> None:
        if not (self.root / TAG).exists():
            self.root.mkdir(parents=True, exist_ok=True)
            files.write_text(self.root / TAG, _TAG_TEXT)


def is_cache(root: Path) -> bool:
    return (root / TAG).is_file()


def scan(root: Path) -> Scan:
    """Every entry and partial write under `root` (indexes read, tensors not)."""
    found = Scan()
    for shard in sorted((root / "entries").glob("*")):
        if not shard.is_dir():
            continue
        for path in sorted(shard.iterdir()):
            if path.name.startswith(".") and path.name.endswith(files.TMP_SUFFIX):
                found.partial.append(path)
                continue
            if not path.is_dir():
                continue
            try:
                size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
                used = (path / INDEX).stat().st_mtime if (path / INDEX).exists() else path.stat().st_mtime
            except OSError:
                continue  # removed meanwhile
            try:
                body: dict[str, Any] | None = _read_index(path / INDEX)
            except (OSError, ValueError):
                body = None
            found.entries.append(Info(path, size, used, body))
    return found


def _tree_bytes(path: Path) -> int:
    try:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    except OSError:
        return 0


def stats(root: Path) -> dict[str, Any]:
    """Entries, bytes, last-used range, and counts by versions and mode, for `portharness cache stats`."""
    s = scan(root)
    groups: dict[str, dict[str, int]] = {}
    for info in s.entries:
        parts = (info.body or {}).get("components", {})
        v = parts.get("versions", {})
        label = (f"torch {v.get('torch', '?')}, transformers {v.get('transformers', '?')}, portharness "
                 f"{v.get('portharness', '?')} (code {v.get('code', '?')}), {parts.get('mode', '?')}"
                 if info.body is not None else "unreadable index (removed by prune)")
        g = groups.setdefault(label, {"entries": 0, "bytes": 0})
        g["entries"] += 1
        g["bytes"] += info.bytes
    used = [i.last_used for i in s.entries]
    return {
        "root": str(root),
        "entries": len(s.entries),
        "bytes": sum(i.bytes for i in s.entries),
        "oldest_use": min(used) if used else None,
        "newest_use": max(used) if used else None,
        "groups": groups,
        "partial": len(s.partial),
        "partial_bytes": sum(_tree_bytes(p) for p in s.partial),
    }


def prune(root: Path, *, older_than_s: float | None = None, max_bytes: int | None = None,
          partial_after_s: float = PARTIAL_AFTER_S, dry_run: bool = False) -> dict[str, Any]:
    """Remove entries unused for `older_than_s`, then the least recently used until the rest fit in
    `max_bytes`; entries whose index is unreadable, and partial writes of writers that are gone, always."""
    s = scan(root)
    now = time.time()
    removed: list[Info] = []
    keep: list[Info] = []
    for info in s.entries:
        old = older_than_s is not None and now - info.last_used > older_than_s
        (removed if info.body is None or old else keep).append(info)
    if max_bytes is not None:
        keep.sort(key=lambda i: i.last_used)
        total = sum(i.bytes for i in keep)
        while keep and total > max_bytes:
            gone = keep.pop(0)
            total -= gone.bytes
            removed.append(gone)
    partial = [p for p in s.partial if files.stale_partial(p, partial_after_s)]
    partial_bytes = sum(_tree_bytes(p) for p in partial)
    if not dry_run:
        for info in removed:
            files.remove_dir(info.path)
        for p in partial:
            files.remove_dir(p)
    return {
        "root": str(root), "dry_run": dry_run,
        "removed": len(removed), "removed_bytes": sum(i.bytes for i in removed),
        "partial_removed": len(partial), "partial_bytes": partial_bytes,
        "kept": len(keep), "kept_bytes": sum(i.bytes for i in keep),
    }
