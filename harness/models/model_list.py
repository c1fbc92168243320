"""Model lists: which models a run covers, as plain CSV files in ``model_lists/``.

A list is a CSV file with a header row; lines whose first non-blank character is ``#`` are
comments.  The format is documented in ``model_lists/README.md``.  Errors name the file and line
and say how to fix them, because lists are edited by hand.
"""

from __future__ import annotations

import csv
import difflib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import csvio
from harness.models.heads import HEADS, task_for_architecture

COLUMNS = (
    "id",
    "source",
    "arch",
    "task",
    "modality",
    "inputs",
    "tags",
    "revision",
    "trust_remote_code",
    "atol",
    "rtol",
    "path",
    "parallel",
)
REQUIRED_COLUMNS = ("id", "source", "task")
SOURCES = ("tiny", "hub", "local")
DEFAULT_LISTS = ("tiny-zoo", "smoke", "hub-top")
_TRUE = {"true", "1", "yes", "y"}
_FALSE = {"false", "0", "no", "n", ""}
_SIZE_TAG = re.compile(r"(\d+(?:\.\d+)?)([KkMBT])")  # a parameter-count tag: 110M, 2.9B
_SIZE_UNITS = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


class ModelListError(ValueError):
    """A model list that cannot be read; the message is ``path:line: problem, fix``."""


class UnknownModelError(LookupError):
    """A model id that no list contains and that is neither a local directory nor a hub id."""


@dataclass(frozen=True)
class ModelEntry:
    """One model to run.  ``inputs`` overrides input generation (see harness.models.inputs)."""

    id: str
    source: str
    arch: str = ""
    task: str = "base"
    modality: str = ""
    inputs: dict[str, Any] = field(default_factory=dict, hash=False)
    tags: tuple[str, ...] = ()
    revision: str | None = None
    trust_remote_code: bool = False
    atol: float | None = None
    rtol: float | None = None
    path: str | None = None
    parallel: str = ""  # how this model is spread over devices (`harness.parallel.spec`): "" the run's, "none" one

    def __post_init__(self) -> None:
        # entries travel to worker processes as dicts (dataclasses.asdict / JSON): normalise
        if not isinstance(self.tags, tuple):
            object.__setattr__(self, "tags", tuple(self.tags or ()))
        if self.inputs is None:
            object.__setattr__(self, "inputs", {})

    def to_row(self) -> dict[str, str]:
        """The CSV cells for this entry (inverse of parsing)."""
        return {
            "id": self.id,
            "source": self.source,
            "arch": self.arch,
            "task": self.task,
            "modality": self.modality,
            "inputs": json.dumps(self.inputs, sort_keys=True) if self.inputs else "",
            "tags": ";".join(self.tags),
            "revision": self.revision or "",
            "trust_remote_code": "true" if self.trust_remote_code else "",
            "atol": "" if self.atol is None else repr(self.atol),
            "rtol": "" if self.rtol is None else repr(self.rtol),
            "path": self.path or "",
            "parallel": self.parallel,
        }

    @property
    def params(self) -> float | None:
        """Its parameter count when a tag gives it (`110M`, `2.9B`, `7B`); None when unknown."""
        for tag in self.tags:
            m = _SIZE_TAG.fullmatch(tag)
            if m:
                return float(m[1]) * _SIZE_UNITS[m[2].upper()]
        return None


# ----------------------------------------------------------------------------------------------
# locating lists
# ----------------------------------------------------------------------------------------------


def list_dirs() -> list[Path]:
    """Where bare list names are looked up: ``$PORTHARNESS_MODEL_LISTS`` then the repo's model_lists/."""
    dirs = [Path(p) for p in os.environ.get("PORTHARNESS_MODEL_LISTS", "").split(os.pathsep) if p]
    dirs.append(Path(__file__).resolve().parents[2] / "model_lists")
    return dirs


def resolve_list(name_or_path: str) -> Path:
    """A list name (``tiny-zoo``) or a path -> the CSV file."""
    p = Path(name_or_path)
    if p.suffix == ".csv" or os.sep in name_or_path or "/" in name_or_path:
        if p.is_file():
            return p
        raise ModelListError(f"{name_or_path}: no such model list file; check the path")
    for d in list_dirs():
        candidate = d / f"{name_or_path}.csv"
        if candidate.is_file():
            return candidate
    known = sorted({f.stem for d in list_dirs() if d.is_dir() for f in d.glob("*.csv")})
    raise ModelListError(
        f"{name_or_path}: no model list of that name in {', '.join(str(d) for d in list_dirs())}; "
        f"known lists: {', '.join(known) or 'none'}"
    )


# ----------------------------------------------------------------------------------------------
# parsing
# ----------------------------------------------------------------------------------------------


def _parse_bool(value: str, where: str, column: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ModelListError(f"{where}: bad {column} value {value!r}, write true or false")


def _parse_float(value: str, where: str, column: str) -> float | None:
    v = value.strip()
    if not v:
        return None
    try:
        f = float(v)
    except ValueError:
        raise ModelListError(f"{where}: bad {column} value {value!r}, write a number such as 1e-4") from None
    if not math.isfinite(f) or f < 0:
        raise ModelListError(f"{where}: bad {column} value {value!r}, it must be a finite number >= 0")
    return f


def _parse_inputs(value: str, where: str) -> dict[str, Any]:
    v = value.strip()
    if not v:
        return {}
    try:
        parsed = json.loads(v)
    except json.JSONDecodeError as e:
        raise ModelListError(
            f"{where}: bad JSON in inputs ({e.msg} at char {e.pos}): {v!r}; write a JSON object such as "
            f'"{{""seq_len"": 16}}" (quote the cell and double the inner quotes)'
        ) from None
    if not isinstance(parsed, dict):
        raise ModelListError(f'{where}: inputs must be a JSON object such as {{"seq_len": 16}}, got {v!r}')
    return parsed


def _row_to_entry(cells: dict[str, str], where: str, base_dir: Path) -> ModelEntry:
    model_id = cells.get("id", "").strip()
    if not model_id:
        raise ModelListError(f"{where}: empty id, every row needs an id")
    source = cells.get("source", "").strip().lower()
    if source not in SOURCES:
        raise ModelListError(
            f"{where}: bad source {cells.get('source', '')!r} for {model_id!r}, "
            f"use one of {', '.join(SOURCES)}"
        )
    arch = cells.get("arch", "").strip()
    task = cells.get("task", "").strip() or "base"
    if task not in HEADS:
        close = difflib.get_close_matches(task, list(HEADS), n=3)
        hint = f"did you mean {', '.join(close)}?" if close else f"known tasks: {', '.join(sorted(HEADS))}"
        raise ModelListError(f"{where}: unknown task {task!r} for {model_id!r}; {hint}")
    if source == "tiny" and not arch:
        raise ModelListError(f"{where}: tiny entry {model_id!r} needs an arch (a transformers model_type)")
    path = cells.get("path", "").strip() or None
    if source == "local":
        if not path:
            raise ModelListError(f"{where}: local entry {model_id!r} needs a path to a saved model directory")
        if not os.path.isabs(path):
            path = str((base_dir / path).resolve())
    revision = cells.get("revision", "").strip() or None
    tags = tuple(t.strip() for t in cells.get("tags", "").split(";") if t.strip())
    return ModelEntry(
        id=model_id,
        source=source,
        arch=arch,
        task=task,
        modality=cells.get("modality", "").strip(),
        inputs=_parse_inputs(cells.get("inputs", ""), where),
        tags=tags,
        revision=revision,
        trust_remote_code=_parse_bool(cells.get("trust_remote_code", ""), where, "trust_remote_code"),
        atol=_parse_float(cells.get("atol", ""), where, "atol"),
        rtol=_parse_float(cells.get("rtol", ""), where, "rtol"),
        path=path,
        parallel=cells.get("parallel", "").strip().lower(),  # read by the fleet (`harness.parallel.spec.chosen`)
    )


def parse_model_list(text: str, path: str = "<string>", base_dir: Path | None = None) -> list[ModelEntry]:
    """Parse list text; ``path`` only labels error messages."""
    base_dir = base_dir or Path(path).resolve().parent
    header: list[str] | None = None
    header_line = 0
    entries: list[ModelEntry] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}:{lineno}"
        try:
            cells = csvio.parse_line(line, strict=True)
        except csv.Error as e:
            raise ModelListError(
                f"{where}: unparseable CSV ({e}); quote cells that contain commas or quotes "
                f"and keep each row on one line"
            ) from None
        if header is None:
            header = [c.strip() for c in cells]
            header_line = lineno
            for col in header:
                if col not in COLUMNS:
                    close = difflib.get_close_matches(col, COLUMNS, n=1)
                    hint = f"did you mean {close[0]!r}?" if close else f"known columns: {', '.join(COLUMNS)}"
                    raise ModelListError(f"{where}: unknown column {col!r}; {hint}")
            dupes = {c for c in header if header.count(c) > 1}
            if dupes:
                raise ModelListError(f"{where}: column {sorted(dupes)[0]!r} appears twice in the header")
            missing = [c for c in REQUIRED_COLUMNS if c not in header]
            if missing:
                raise ModelListError(
                    f"{where}: missing required column(s) {', '.join(missing)}; the header "
                    f"must name at least {', '.join(REQUIRED_COLUMNS)}"
                )
            continue
        if len(cells) > len(header):
            raise ModelListError(
                f"{where}: row has {len(cells)} cells but the header (line {header_line}) has "
                f"{len(header)}; quote cells that contain commas"
            )
        row = dict(zip(header, cells, strict=False))
        entry = _row_to_entry(row, where, base_dir)
        if entry.id in seen:
            raise ModelListError(
                f"{where}: duplicate id {entry.id!r} (first on line {seen[entry.id]}); "
                f"ids must be unique, remove or rename one of the two rows"
            )
        seen[entry.id] = lineno
        entries.append(entry)
    if header is None:
        raise ModelListError(
            f"{path}:1: empty model list; expected a header line such as '{','.join(COLUMNS)}'"
        )
    return entries


def load_model_list(name_or_path: str) -> list[ModelEntry]:
    """Read a model list by bare name (``tiny-zoo`` -> model_lists/tiny-zoo.csv) or by path."""
    path = resolve_list(name_or_path)
    try:
        text = path.read_text(encoding="utf-8-sig")  # a spreadsheet's UTF-8 BOM is not part of the header
    except UnicodeDecodeError as e:
        raise ModelListError(f"{path}:1: not UTF-8 text ({e.reason}); save the list as UTF-8 CSV") from None
    except OSError as e:
        raise ModelListError(f"{path}: cannot read ({e.strerror})") from None
    return parse_model_list(text, str(path), path.parent)


def write_model_list(entries: list[ModelEntry], path: str | Path, header_comment: str = "") -> None:
    """Write entries as a list file (all columns, `parallel` where an entry has one; deterministic order of
    the given entries)."""
    columns = [c for c in COLUMNS if c != "parallel" or any(e.parallel for e in entries)]
    rows = [[e.to_row().get(c, "") for c in columns] for e in entries]
    csvio.write(path, columns, rows, comments=header_comment.splitlines())


# ----------------------------------------------------------------------------------------------
# single ids
# ----------------------------------------------------------------------------------------------


def find_entry(
    model_id: str, lists: tuple[str, ...] | list[str] = DEFAULT_LISTS, task: str | None = None
) -> ModelEntry:
    """Resolve one id for ``portharness check MODEL_ID``.

    Order: the given lists (missing lists are skipped), then a local directory holding
    config.json (source=local), then anything shaped like a hub id (source=hub, task ``base``
    unless given).  Unknown ``tiny/...`` ids raise UnknownModelError with close matches.
    """
    known: list[str] = []
    for name in lists:
        try:
            entries = load_model_list(name)
        except ModelListError as e:
            if "no model list of that name" in str(e) or "no such model list" in str(e):
                continue
            raise
        for e in entries:
            if e.id == model_id:
                return e if task is None or task == e.task else _with_task(e, task)
        known.extend(e.id for e in entries)
    path = Path(model_id).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        arch, saved_as = "", ""
        try:
            config = json.loads((path / "config.json").read_text())
            arch = str(config.get("model_type", ""))
            saved_as = str((config.get("architectures") or [""])[0])
        except (OSError, ValueError, AttributeError, TypeError, IndexError):
            pass
        # the head it was saved with (GPT2LMHeadModel -> causal-lm) unless --task says otherwise
        task = task or (task_for_architecture(arch, saved_as) if arch and saved_as else None) or "base"
        return ModelEntry(id=str(path), source="local", arch=arch, task=task, path=str(path.resolve()))
    if model_id.startswith("tiny/"):
        close = difflib.get_close_matches(model_id, known, n=5, cutoff=0.5)
        hint = f"close matches: {', '.join(close)}" if close else "run `portharness zoo` to list tiny models"
        raise UnknownModelError(f"unknown tiny model {model_id!r}; {hint}")
    if _HUB_ID.match(model_id) and not model_id.endswith((".csv", ".json")):
        return ModelEntry(id=model_id, source="hub", task=task or "base")
    close = difflib.get_close_matches(model_id, known, n=5, cutoff=0.5)
    raise UnknownModelError(
        f"unknown model {model_id!r}: not in {', '.join(lists)}, not a directory with config.json and not a "
        f"hub id (org/name)" + (f"; close matches: {', '.join(close)}" if close else "")
    )


def _with_task(entry: ModelEntry, task: str) -> ModelEntry:
    from dataclasses import replace

    return replace(entry, task=task)
