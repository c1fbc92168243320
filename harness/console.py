"""What the CLI prints: the verdict of one model, a run's summary, tables of a result frame."""

from __future__ import annotations

import math
import re
import sys
from typing import Any

import pandas as pd
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from harness.outcomes import BEYOND, BY_NAME, DEVICE_SIDE, JUDGEMENTS, OUTCOMES, headline, output_judgement
from harness.phases import PHASES
from harness.results.rows import compile_summary, round_floats

SHOW_OUTPUTS = 16  # outputs listed by `check`; the rest are summarised (all are in --json)

_VERDICT_FIELDS = [
    ("outcome", None),
    ("model", "model_id"),
    ("arch / task", None),
    ("target", "device"),
    ("settings", None),
    ("before it died", "earlier_outcome"),
    ("unsupported op", None),
    ("cpu fallback", None),
    ("error", None),
    ("first drifting op", None),
    ("repro", "repro_path"),
    ("first drifting module", None),
    ("first drifting param", "first_drift_param"),
    ("missing gradients", None),
    ("train step", None),
    ("first drifting step", None),
    ("decoding", None),
    ("compiled", None),
    ("graph breaks", None),
    ("contract", "contract"),
    ("at full precision", None),
    ("fp32 ratio (<=1 within)", "rmse_ratio"),
    ("declared ratio (<=1 within)", "declared_ratio"),
    ("max abs err", "max_abs_err"),
    ("max rel err", "max_rel_err"),
    ("min cosine", None),
    ("judged by", None),
    ("ref", "ref_cache"),
    ("phases s (peak MB)", None),
    ("load / ref / target s", None),
    ("peak RSS MB", "peak_rss_mb"),
    ("speed (--perf)", None),
    ("slowest ops (self time)", None),
    ("device peak MB (--perf)", "perf_peak_mem_mb"),
]

_LABEL_WIDTH = max(len(label) for label, _ in _VERDICT_FIELDS)

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_ONE_LINE = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def terminal_text(text: str, one_line: bool = False) -> str:
    """`text` safe for a terminal: control characters (an ANSI escape in a model id, a list path or an op
    name from a DB) shown as ``\\x1b`` instead of acting; newlines and tabs kept, unless `one_line` (an error
    message: a value from the user or a DB cannot make it two lines)."""
    return (_ONE_LINE if one_line else _CONTROL).sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class _Console(Console):
    def on_broken_pipe(self) -> None:
        raise BrokenPipeError  # the CLI ends quietly with one exit code for every command (rich: exit 1)


def _console() -> Console:
    return _Console(highlight=False, soft_wrap=True, width=200 if not sys.stdout.isatty() else None)


def _derived(label: str, row: dict[str, Any]) -> Any:
    if label == "outcome":
        o = BY_NAME.get(row.get("outcome") or "")
        return (row.get("outcome", "") + (f": {o.meaning}" if o is not None and o.matched else "")
                + (" (ran with CPU fallback)" if row.get("fallback_ops") else ""))
    if label == "min cosine":
        return min_cosine_text(row)
    if label == "arch / task":
        return f"{row.get('arch', '')} / {row.get('task', '')}"
    if label == "settings":
        return " ".join(f"{k}={v}" for k, v in sorted((row.get("settings") or {}).items()))
    if label == "error":
        parts = [row.get("error_type") or "", round_floats(row.get("error_message") or "")]
        return ": ".join(p for p in parts if p) or None
    if label == "unsupported op":
        op, dtype = row.get("unsupported_op"), row.get("unsupported_dtype")
        return f"{op} (dtype {dtype})" if op and dtype else op
    if label == "cpu fallback":
        ops = row.get("fallback_ops") or {}
        if not row.get("op_census"):
            return None
        return ", ".join(f"{op} x{n}" for op, n in sorted(ops.items())) if ops else "none (every op ran natively)"
    if label == "first drifting op":
        op = row.get("first_drift_op")
        if not op:
            return None
        inputs = ", ".join(row.get("first_drift_op_inputs") or [])
        return f"{op} in {row.get('first_drift_op_module') or '(top)'} ({inputs})"
    if label == "first drifting module":
        m = row.get("first_drift_module")
        return f"{m} ({row.get('first_drift_module_type', '')})" if m else None
    if label == "missing gradients":
        return ", ".join(row.get("missing_grads") or []) or None
    if label == "train step":
        if not row.get("loss_kind"):
            return None
        nums = [("worst grad ratio", row.get("grad_worst_ratio")), ("grad norm ratio", row.get("grad_norm_ratio")),
                ("loss delta", row.get("loss_delta"))]
        return f"loss {row['loss_kind']}; " + ", ".join(f"{k} {v:.4g}" for k, v in nums if v is not None)
    if label == "first drifting step":
        k = row.get("first_drift_step")
        if k is None:
            return None
        return f"{k} of {row.get('new_tokens')}" + (" (step 0 clean: the cache path)" if k else " (the prompt's forward)")
    if label == "decoding":
        if row.get("tokens_matched") is None:
            return None
        text = f"free-running tokens matched {row['tokens_matched']}/{row.get('new_tokens')}"
        if row.get("first_divergent_step") is not None:
            margin, envelope = row.get("divergence_margin"), row.get("divergence_envelope")
            text += (f"; first divergent step {row['first_divergent_step']}: {row.get('divergence')} "
                     f"(reference top-2 margin {margin:.3g}, declared envelope {envelope:.3g})"
                     if margin is not None and envelope is not None else "")
        return text
    if label == "at full precision":  # the confirmation of a pass within the declared precision
        return f"{row['confirm']}: {row.get('confirm_note', '')}" if row.get("confirm") else None
    if label == "compiled":
        return compile_summary(row) or None
    if label == "graph breaks":
        reasons = row.get("graph_break_reasons") or []
        return "; ".join(f"[{i}] {r}" for i, r in enumerate(reasons, 1)) or None
    if label == "judged by":
        parts = [f"{row['oracle']} oracle"] if row.get("oracle") else []
        if row.get("ops_checked") is not None:
            sampled = row.get("ops_sampled_out")
            what = "compiled graph nodes" if (row.get("settings") or {}).get("compile") else "op calls"
            parts.append(f"{row['ops_checked']} {what} checked" + (f" ({sampled} repeats sampled out)" if sampled else ""))
        return "; ".join(parts) or None
    if label == "phases s (peak MB)":
        phases = row.get("phases") or {}
        if not isinstance(phases, dict) or not phases:
            return None
        order = sorted(phases, key=lambda n: PHASES.index(n) if n in PHASES else len(PHASES))
        return ", ".join(f"{n} cached" if phases[n].get("cached") else
                         f"{n} {phases[n].get('s', 0):.2f} ({phases[n].get('peak_rss_mb', 0):.0f})" for n in order)
    if label in ("speed (--perf)", "slowest ops (self time)"):
        return _perf_text(label, row.get("perf"))
    ts = [row.get(k) for k in ("load_time_s", "ref_time_s", "target_time_s")]
    return " / ".join("-" if t is None else f"{t:.3f}" for t in ts)


def _ms(s: dict[str, Any]) -> str:
    return f"{s['median'] * 1e3:.3g} ms (IQR {s['q1'] * 1e3:.3g}-{s['q3'] * 1e3:.3g})"


def _perf_text(label: str, perf: Any) -> str | None:
    """The --perf lines: medians with their spread, the ratio with its interval; the profile's top ops."""
    if not isinstance(perf, dict) or not perf:
        return None
    if label == "slowest ops (self time)":
        prof = perf.get("profile") or {}
        ops, total = prof.get("ops") or [], prof.get("total_us") or 0
        if not ops or not total:
            return perf.get("profile_error")
        return ", ".join(f"{op} {us / total:.0%}" for op, us in ops[:5]) + f" of {total / 1e3:.3g} ms per step"
    if perf.get("error"):
        return f"not measured: {perf['error']}"
    parts = [f"{side} {_ms(perf[side])}" for side in ("target", "eager", "reference") if side in perf]
    if "ratio" in perf:
        r = perf["ratio"]
        parts.append(f"target/reference {r['median']:.3g}x (95% interval {r['lo']:.3g}-{r['hi']:.3g})")
    if "speedup" in perf:
        parts.append(f"compiled speedup {perf['speedup']['median']:.3g}x over eager")
    n = next((perf[k]["n"] for k in ("target", "reference") if k in perf), 0)
    return "; ".join(parts) + f"; {n} rounds in {perf.get('wall_s', 0):.1f} s" + (f"; {perf['note']}" if perf.get("note") else "")


def confirm_line(counts: dict[str, int]) -> str:
    """The confirmation of pass_declared rows at full precision, as one line (`run` and `matrix` print it)."""
    return (f"  at full precision: {counts.get('confirmed', 0)} pass_declared confirmed, {counts.get('unconfirmed', 0)} "
            f"unconfirmed (the declared precision may hide a bug there), {counts.get('hidden drift', 0)} drift(s) "
            "the declared precision hid")


def verdict_lines(row: dict[str, Any]) -> list[str]:
    """The `portharness check` verdict for one result row, as aligned text lines."""
    lines = []
    for label, key in _VERDICT_FIELDS:
        val = row.get(key) if key is not None else _derived(label, row)
        if val in (None, "", " / "):
            continue
        if isinstance(val, float):
            val = f"{val:.4g}"
        lines.append(f"  {label:<{_LABEL_WIDTH}} {str(val)[:300]}")
    metrics = row.get("metrics") if isinstance(row.get("metrics"), dict) else {}
    shown = metrics
    if metrics:
        contract = row.get("contract") or "the declared precision"
        lines.append(f"  outputs (each judged as the row: within fp32 / within declared {contract} / beyond):")
        if len(metrics) > SHOW_OUTPUTS:  # a training step has three per parameter: the worst first
            ranked = sorted(metrics, key=lambda k: (-_rank(metrics[k]), -(_num(metrics[k], "declared_ratio") or 0),
                                                     -(_num(metrics[k], "rmse_ratio") or 0)))
            shown = {k: metrics[k] for k in ranked[:SHOW_OUTPUTS]}
        width = min(max(len(n) for n in shown), 60)
        for name, m in shown.items():
            lines.append(f"    {output_judgement(m) or '-':<15} {name:<{width}} " + output_numbers(m))
    if len(shown) < len(metrics):
        rest = [output_judgement(m) for k, m in metrics.items() if k not in shown]
        lines.append(f"    ... {len(rest)} more: " + ", ".join(f"{rest.count(j)} {j}" for j in JUDGEMENTS if j in rest)
                     + " (--json lists all)")
    if row.get("worker_output"):
        text = str(row["worker_output"]).rstrip("\n").splitlines()
        lines.append(f"  {'worker output':<{_LABEL_WIDTH}} {len(text)} line(s) printed while the model ran, kept in "
                     f"the row (--json, the report's model page); last: {text[-1][:120] if text else ''}")
    if row.get("traceback") and row.get("outcome") not in ("pass", "drift"):
        lines.append("  traceback (trimmed):")
        lines.append("    " + row["traceback"].replace("\n", "\n    "))
    return lines


def _num(m: Any, key: str) -> float | None:
    v = m.get(key) if isinstance(m, dict) else None
    return v if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None


def _rank(m: Any) -> int:
    j = output_judgement(m)
    return JUDGEMENTS.index(j) if j else -1


def output_numbers(m: dict[str, Any]) -> str:
    """One output's ratios and error, the declared ratio beside the fp32 one (rounded: these are read)."""
    def g(key: str) -> str:
        v = _num(m, key)
        return "-" if v is None else f"{v:.3g}"

    note = str(m.get("note") or "") if isinstance(m, dict) else ""
    return (f"fp32 ratio {g('rmse_ratio'):<8} declared ratio {g('declared_ratio'):<8} max abs {g('max_abs'):<9}"
            + (f" {note}" if note else "")).rstrip()


def min_cosine_text(row: dict[str, Any]) -> str | None:
    """The row's lowest cosine, naming its output; a near-zero output's cosine is said to mean nothing
    (a gradient that cancels to zero points in the direction of its rounding noise)."""
    v = row.get("min_cosine")
    if not isinstance(v, int | float) or isinstance(v, float) and math.isnan(v):
        return None
    metrics = row.get("metrics") if isinstance(row.get("metrics"), dict) else {}
    name = min((k for k in metrics if _num(metrics[k], "cosine") is not None),
               key=lambda k: metrics[k]["cosine"], default=None)
    if name is None or v >= 0.99:  # nothing to explain
        return f"{v:.4g}"
    m = metrics[name]
    if m.get("near_zero") and output_judgement(m) != BEYOND:
        return (f"{v:.4g} ({name}: near zero, below its family's noise floor, so its cosine compares rounding "
                f"noise and means nothing; the rmse rule judges it {output_judgement(m)})")
    return f"{v:.4g} ({name})"


def clean_row(row: dict[str, Any]) -> dict[str, Any]:
    """NaN (pandas' missing value) -> None, so JSON and the verdict see 'no value'."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}


def outcome_table(counts: dict[str, int], total: int) -> str:
    """One line per outcome that occurred, most frequent first, with its share."""
    return "\n".join(
        f"  {o:<22} {n:>6}  {n / max(total, 1):6.1%}" for o, n in sorted(counts.items(), key=lambda kv: -kv[1])
    )


def print_frame(title: str, df: pd.DataFrame) -> None:
    """A titled table on stdout (every row and column: this is what people grep)."""
    console = _console()
    console.print(Text(f"\n== {terminal_text(title)} =="))
    if df.empty:
        console.print("(none)")
        return
    frame = df.reset_index() if not isinstance(df.index, pd.RangeIndex) else df
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col in frame.columns:
        table.add_column(Text(terminal_text(str(col))),
                         justify="right" if pd.api.types.is_numeric_dtype(frame[col]) else "left")
    pct = [str(c).endswith("%") for c in frame.columns]  # percentages (0-100) print as 85.0%, as the report does
    for rec in frame.itertuples(index=False):  # Text: a '[red]' in a model id is not rich markup
        table.add_row(*(Text("" if v is None or (isinstance(v, float) and math.isnan(v))
                             else f"{v:.1f}%" if p and isinstance(v, int | float) else terminal_text(str(v)))
                        for v, p in zip(rec, pct, strict=True)))
    console.print(table)


def headline_line(counts: dict[str, int]) -> str:
    """'ran 76.2% (1098/1441) | numerics matched 100.0% (1098/1098)': the two figures TorchTPU publishes."""
    h = headline(counts)
    ran = f"{h['ran_pct']:.1f}%" if h["ran_pct"] is not None else "-"
    matched = f"{h['matched_pct']:.1f}%" if h["matched_pct"] is not None else "-"
    left_out = ", ".join(f"{o} {n}" + (" (pending: rerun with --resume)" if o in DEVICE_SIDE else "")
                         for o, n in h["excluded"].items())
    return (f"  ran {ran} ({h['ran']}/{h['tested']}) | numerics matched {matched} ({h['matched']}/{h['ran']})"
            + (f" | not counted: {left_out}" if left_out else ""))


def outcome_line(counts: dict[str, int]) -> str:
    return "  " + "  ".join(f"{o}={counts[o]}" for o in OUTCOMES if counts.get(o))
