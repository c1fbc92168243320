"""The committed perf baseline: expected speed per model for one configuration, beside its expected outcomes.

``<list>--<target>--<settings>.perf.csv`` sits next to the expected-outcome file of the same configuration
(`harness.analysis.baseline`). `baseline update` writes it from a run measured with ``--perf``; `baseline
check` then gates tonight's run on it with the same test as `diff` (`harness.analysis.perfgate`): a model
slower by the threshold beyond both measurements' noise is a perf regression.

It keeps what the test needs, per model: the compared quantity's median and the interval of that median,
the number of rounds, the CPU reference's median (to scale the op profile by the machine's speed), and
the profile's total and top ops (``op=µs[lo:hi]`` separated by spaces: the op's self time per step and the
interval of it over the profiled rounds) to name the op that added the time and judge each kernel's own. The
numbers are the machine's: commit it from the machine (or runner type) the nightly runs on.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import Any

import pandas as pd

from harness import csvio, files
from harness.analysis.baseline import Config, _records, read_expected_header
from harness.analysis.perfgate import QUANTITIES, perf_of

COLUMNS = ("model", "quantity", "median", "lo", "hi", "n", "reference_s", "profile_us", "top_ops")
_MAGIC = "# portharness expected speed"
TOP_OPS = 12


def perf_path(expected_path: str | os.PathLike) -> Path:
    """``x.csv`` -> ``x.perf.csv``: the perf baseline beside an expected-outcome file."""
    p = Path(expected_path)
    return p.with_name(p.name.removesuffix(".csv") + ".perf.csv")


def perf_rows(df: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """Model -> its ``perf`` measurement, for the run's rows measured with ``--perf``."""
    if "perf" not in df.columns:
        return {}
    out = {}
    for row in _records(df, extra=("perf",)):
        perf = perf_of(row)
        if perf is not None:
            out[row["model_id"]] = perf
    return out


def _g(v: Any) -> str:
    return "" if v is None else f"{float(v):.6g}"


def format_perf(config: Config, perfs: dict[str, dict[str, Any]], *, command: str = "") -> str:
    buf = io.StringIO()
    buf.write(f"{_MAGIC} for one configuration; checked by `portharness baseline check` (--perf runs).\n")
    buf.write(f"# list: {config.list_name}\n# target: {config.target}\n# settings: {config.settings_json}\n")
    buf.write("# quantity: ratio = target/reference latency per interleaved round, target = target latency (s); "
              "lo-hi: 95% interval of the median\n")
    if command:
        buf.write(f"# regenerate: {command}\n")
    rows: list[list[Any]] = [list(COLUMNS)]
    for model in sorted(perfs):
        perf = perfs[model]
        q = next(k for k in QUANTITIES if isinstance(perf.get(k), dict))
        s = perf[q]
        prof = perf.get("profile") or {}
        ci = prof.get("ci") or {}
        ops = " ".join(f"{op}={us:g}" + (f"[{ci[op][0]:g}:{ci[op][1]:g}]" if op in ci else "")
                       for op, us in (prof.get("ops") or [])[:TOP_OPS])
        rows.append([model, q, _g(s["median"]), _g(s.get("lo")), _g(s.get("hi")), s.get("n", ""),
                     _g((perf.get("reference") or {}).get("median")), _g(prof.get("total_us")), ops])
    buf.write(csvio.format_rows(rows))
    return buf.getvalue()


def write_perf(path: str | os.PathLike, config: Config, perfs: dict[str, dict[str, Any]], *, command: str = "") -> Path:
    """Write the perf baseline atomically."""
    return files.write_text(Path(path), format_perf(config, perfs, command=command))


def _num(p: Path, n: int, name: str, text: str, *, required: bool = False) -> float | None:
    if not text.strip():
        if required:
            raise ValueError(f"{p}:{n}: {name} must not be empty")
        return None
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"{p}:{n}: {name} {text!r} is not a number") from None
    if not 0 < v < math.inf:  # nan, inf: a model that leaves the gate without a word
        raise ValueError(f"{p}:{n}: {name} {text!r} must be a positive finite number")
    return v


def read_perf(path: str | os.PathLike) -> tuple[Config, dict[str, dict[str, Any]]]:
    """The configuration and, per model, a ``perf`` measurement as a row holds it; ValueError
    ``path:line: what is wrong`` on anything malformed."""
    p = Path(path)
    config, body = read_expected_header(p, what="perf baseline")
    if not body:
        raise ValueError(f"{p}: no '{','.join(COLUMNS)}' header row")
    (first_n, first), *data = body
    if csvio.parse_line(first) != list(COLUMNS):
        raise ValueError(f"{p}:{first_n}: expected the header row '{','.join(COLUMNS)}', got {first!r}")
    out: dict[str, dict[str, Any]] = {}
    for n, line in data:
        cells = csvio.parse_line(line)
        if len(cells) != len(COLUMNS):
            raise ValueError(f"{p}:{n}: expected {len(COLUMNS)} cells ({','.join(COLUMNS)}), got {len(cells)}")
        model, q, med, lo, hi, count, ref, total, ops = (c.strip() for c in cells)
        if q not in QUANTITIES:
            raise ValueError(f"{p}:{n}: quantity {q!r} for {model!r}: expected {' or '.join(QUANTITIES)}")
        if model in out:
            raise ValueError(f"{p}:{n}: model {model!r} is listed twice")
        median = _num(p, n, "median", med, required=True)
        low, high = _num(p, n, "lo", lo) or median, _num(p, n, "hi", hi) or median
        if not low <= median <= high:
            raise ValueError(f"{p}:{n}: lo {lo!r} and hi {hi!r} for {model!r} must bracket the median {med!r}")
        perf: dict[str, Any] = {q: {"median": median, "lo": low, "hi": high, "n": int(_num(p, n, "n", count) or 0)}}
        if (ref_s := _num(p, n, "reference_s", ref)) is not None:
            perf["reference"] = {"median": ref_s}
        if (total_us := _num(p, n, "profile_us", total)) is not None:
            pairs, ci = [], {}
            for item in ops.split():
                op, sep, us = item.rpartition("=")
                if not sep or not op:
                    raise ValueError(f"{p}:{n}: top_ops entry {item!r}: expected 'aten::op=µs' or 'aten::op=µs[lo:hi]'")
                us, bracket, interval = us.partition("[")
                value = _num(p, n, f"top_ops {op}", us, required=True)
                pairs.append([op, value])
                if bracket:
                    lo_us, colon, hi_us = interval.removesuffix("]").partition(":")
                    low_us, high_us = _num(p, n, f"top_ops {op} lo", lo_us), _num(p, n, f"top_ops {op} hi", hi_us)
                    if not (colon and interval.endswith("]") and low_us and high_us and low_us <= value <= high_us):
                        raise ValueError(f"{p}:{n}: top_ops entry {item!r}: the interval must read [lo:hi] around µs")
                    ci[op] = [low_us, high_us]
            perf["profile"] = {"total_us": total_us, "ops": pairs, **({"ci": ci} if ci else {})}
            if len(pairs) >= TOP_OPS:  # the row's other ops were dropped here: none of them had more than the last
                perf["profile"]["floor_us"] = min(us for _, us in pairs)
        out[model] = perf
    return config, out
