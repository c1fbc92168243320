"""The reference cache's key: everything the reference side of one model depends on, as one digest.

A cached reference side is only as good as its key: a component that changes the fp32 reference, the
fp64 oracle or the expected reference and is missing here would hand a model yesterday's answer. So the
key takes, besides what the user chose:

- the model: a tiny build's id (its weights come from the seed and our code), a hub checkpoint's commit
  (the one transformers resolved, else the pinned revision; neither: not cached), a local
  checkpoint's file contents (digested once per file version; `checkpoint_digest`);
- its config and its inputs as built (digests of their values, so a change to how either is made
  changes the key even where no version moved);
- seed, mode, the settings that reach the CPU side (the adapter's `reference_settings`: not those only
  its target run sees), the declared contract, the oracle's limits;
- torch, transformers and portharness versions, and a digest of the code that computes the reference
  side (`code_digest`: a checkout between releases is a different harness);
- the CPU's kernel set and torch's thread count: fp32 results on the CPU may differ in their last bits
  between AVX2 and AVX-512 kernels, and between reductions split over different thread counts.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import harness
from harness import files
from harness.models.model_list import ModelEntry
from harness.run.oracle import COPY_MAX_PARAMS, DEFAULT_MAX_PARAMS

KEY_FORMAT = 1
# Modules of harness/run that run no part of the reference side (orchestration, the target, diagnostics):
# a change to them keeps the cache. Every other module there, and all of harness/models, is in the key.
_NOT_REFERENCE = frozenset({"runner", "pool", "policy", "worker", "target", "localize", "opcheck", "repro", "zoo",
                            "memory", "refcache", "__init__"})
_CHUNK = 1 << 24


class NoKey(Exception):
    """This model's reference side cannot be keyed (why, for the row); it is computed and not cached."""


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """Digest of the source that computes the reference side (see `_NOT_REFERENCE`)."""
    root = Path(harness.__file__).resolve().parent
    sources = [*(root / "models").rglob("*.py"), root / "backends" / "contracts.py",
               *(p for p in (root / "run").glob("*.py") if p.stem not in _NOT_REFERENCE)]
    h = hashlib.sha256()
    for path in sorted(sources):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def versions() -> dict[str, str]:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "portharness": harness.__version__, "code": code_digest()}


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_digest(directory: str, memo: Path | None) -> str:
    """Digest of every file under a local checkpoint `directory` (names and contents). A file's digest is
    remembered in `memo` under its identity (path, size, inode, modification and change times: a rewrite
    changes the change time, which no tool can set back), so a nightly reads each file once per version."""
    root = Path(directory).resolve()
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        st = path.stat()
        ident = hashlib.sha256(f"{path}|{st.st_size}|{st.st_ino}|{st.st_mtime_ns}|{st.st_ctime_ns}".encode()).hexdigest()
        known = memo / f"{ident}.sha256" if memo is not None else None
        digest = _read_memo(known)
        if digest is None:
            digest = file_digest(path)
            if known is not None:
                try:
                    known.parent.mkdir(parents=True, exist_ok=True)
                    files.write_text(known, digest)
                except (OSError, files.OutputError):
                    pass  # a cache that cannot remember: digest again next time
        h.update(str(path.relative_to(root)).encode() + b"\0" + digest.encode())
    return h.hexdigest()


def _read_memo(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return text if len(text) == 64 and all(c in "0123456789abcdef" for c in text) else None


def values_digest(values: dict[str, Any]) -> str:
    """Digest of named values: each tensor's dtype, shape and bytes (in lists, tuples and dicts too);
    anything else by its repr."""
    h = hashlib.sha256()
    _update(h, values)
    return h.hexdigest()


def _update(h: Any, v: Any) -> None:
    if isinstance(v, torch.Tensor):
        t = v.detach().to("cpu").contiguous()
        h.update(f"tensor {t.dtype}{tuple(t.shape)}:".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(v, dict):
        h.update(f"dict {len(v)}:".encode())
        for k in sorted(v, key=str):
            h.update(f"{k!r}=".encode())
            _update(h, v[k])
    elif isinstance(v, list | tuple):
        h.update(f"{type(v).__name__} {len(v)}:".encode())
        for x in v:
            _update(h, x)
    else:
        h.update(repr(v).encode())
    h.update(b";")


def config_digest(config: Any) -> str:
    """Digest of a model config's values (not where it was read from, nor the writer's version)."""
    values = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    public = {k: v for k, v in values.items() if not k.startswith("_") and k != "transformers_version"}
    return hashlib.sha256(json.dumps(public, sort_keys=True, default=str).encode()).hexdigest()


def model_identity(entry: ModelEntry, config: Any, memo: Path | None) -> dict[str, Any]:
    if entry.source == "local":
        return {"files": checkpoint_digest(entry.path or entry.id, memo)}
    if entry.source == "hub":
        commit = getattr(config, "_commit_hash", None) or entry.revision
        if not commit:
            raise NoKey("a hub model with no known revision: pin one in the list's revision column")
        return {"id": entry.id, "revision": commit}
    return {"id": entry.id}


def components(entry: ModelEntry, config: Any, inputs: dict[str, Any], *, mode: str, contract: str,
               settings: dict[str, Any], seed: int, memo: Path | None = None) -> dict[str, Any]:
    """The key's parts, as JSON-able values (kept in the entry's index, so `cache stats` can say what
    an entry is for). `settings`: the adapter's `reference_settings`."""
    described = {k: v for k, v in asdict(entry).items() if k in ("id", "source", "arch", "task", "inputs",
                                                                  "trust_remote_code")}
    if entry.source == "local":
        described.pop("id")  # the files are the identity: a copy elsewhere is the same model
    return {
        "format": KEY_FORMAT,
        "model": model_identity(entry, config, memo),
        "entry": described,
        "config": config_digest(config),
        "inputs": values_digest(inputs),
        "seed": seed,
        "mode": mode,
        "settings": settings,
        "contract": contract,
        "oracle": {"max_params": int(settings.get("oracle_max_params", DEFAULT_MAX_PARAMS)),
                   "copy_max_params": COPY_MAX_PARAMS},
        "versions": versions(),
        "cpu": {"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()},
    }


def key_of(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
