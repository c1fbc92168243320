"""Every CSV portharness writes or reads back: one writer, one reader.

A text cell a spreadsheet would run as a formula (one starting with ``=``, ``+``, ``-``, ``@``, a tab or
a carriage return, such as a model id ``=cmd|' /C calc'!A0``) is written with a leading apostrophe,
as OWASP's CSV-injection advice says. A cell that already starts with apostrophes before such a
character gets one more, so reading strips exactly one and gives back what was written (`restore`).
Numbers are written as they are. Files are written atomically (`harness.files`) and read as UTF-8
with or without a spreadsheet's byte-order mark.
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness import files

if TYPE_CHECKING:
    import pandas as pd

_FORMULA = re.compile(r"'*[=+\-@\t\r]")
_DEFUSED = re.compile(r"'+[=+\-@\t\r]")


def defuse(value: Any) -> Any:
    """`value` as a cell no spreadsheet runs: formula-looking text gets a leading apostrophe."""
    return "'" + value if isinstance(value, str) and _FORMULA.match(value) else value


def restore(cell: str) -> str:
    """A cell as it was before `defuse`."""
    return cell[1:] if _DEFUSED.match(cell) else cell


def format_rows(rows: Iterable[Sequence[Any]]) -> str:
    """CSV text (``\\n`` line ends) of `rows`, every text cell defused."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    for row in rows:
        w.writerow([defuse(v) for v in row])
    return buf.getvalue()


def write(path: str | os.PathLike, header: Sequence[str], rows: Iterable[Sequence[Any]], *,
          comments: Sequence[str] = ()) -> Path:
    """Write a CSV file atomically: ``# comment`` lines, the header, then the rows."""
    text = "".join(f"# {c}\n" if c else "#\n" for c in comments) + format_rows([header, *rows])
    return files.write_text(path, text)


def frame_text(df: pd.DataFrame) -> str:
    """CSV text of a pandas frame (no index), every text cell and column name defused."""
    import pandas as pd

    out = df.copy()
    for col in out.columns:
        if pd.api.types.is_object_dtype(out[col]) or pd.api.types.is_string_dtype(out[col]):
            out[col] = out[col].map(defuse)
    out.columns = [defuse(c) for c in out.columns]
    return out.to_csv(index=False, lineterminator="\n")


def write_frame(df: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Write a pandas frame as CSV, atomically."""
    return files.write_text(path, frame_text(df))


def parse_line(line: str, *, strict: bool = False) -> list[str]:
    """The cells of one CSV line, restored (csv.Error on a malformed line with ``strict``)."""
    return [restore(c) for c in next(csv.reader([line], strict=strict), [])]


def read_text(path: str | os.PathLike, what: str = "CSV file") -> str:
    """A CSV file's text (UTF-8; a byte-order mark is not part of the first cell); ValueError naming `what`
    (its option), the file and why it cannot be read."""
    return files.read_text(path, what)


def read_frame(path: str | os.PathLike) -> pd.DataFrame:
    """A CSV file as a pandas frame, text cells and column names restored."""
    import pandas as pd

    df = pd.read_csv(path, encoding="utf-8-sig")
    for col in df.columns:
        if pd.api.types.is_object_dtype(df[col]) or pd.api.types.is_string_dtype(df[col]):
            df[col] = df[col].map(lambda v: restore(v) if isinstance(v, str) else v)
    df.columns = [restore(c) if isinstance(c, str) else c for c in df.columns]
    return df
