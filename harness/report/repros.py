"""The repro scripts rows name, copied into a site: only scripts portharness wrote, whatever a DB names."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any


def copy_repros(out: Path, rows: list[dict[str, Any]]) -> dict[str, str]:
    """Copy each row's repro (script + saved inputs) into the site; repro path -> link from a model page."""
    links: dict[str, str] = {}
    for r in rows:
        path = Path(str(r.get("repro_path") or ""))
        if not path.name or not path.is_file() or not is_repro(path):
            continue  # a DB names any path it likes: only our own repro scripts go into a site people browse
        dest = out / "repro"
        dest.mkdir(exist_ok=True)
        for f in (path, path.with_suffix(".pt")):
            if f.is_file():
                shutil.copyfile(f, dest / f.name)
        links[str(path)] = f"../repro/{path.name}"
    return links


def is_repro(path: Path) -> bool:
    """Whether `path` is a repro script portharness wrote (its suffix and first line), not any file a DB names."""
    if path.suffix != ".py":
        return False
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().startswith('"""Repro (portharness)')
    except (OSError, UnicodeDecodeError):
        return False
