"""Inline SVG charts for the report, drawn in Python.

The site must work offline from ``file://``, so there is no JS plotting library: each chart is an
SVG string put into the page as markup. Styling is by class (``style.css``), so the pages need no
inline styles and the Content-Security-Policy can stay strict. Labels that may come from the data
are escaped here, since the result is marked safe for Jinja.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence
from typing import Any

from markupsafe import Markup

from harness.outcomes import COLOURS, OUTCOMES


def as_number(v: Any) -> float | None:
    """``v`` as a float, or None for None, NaN and non-numbers; infinities are kept (they print as inf)."""
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


# Tick labels are 11px (style.css ``svg .label``); 7px per character over-estimates their width a little,
# so labels spaced by the estimate never touch.
_LABEL_PX_PER_CHAR = 7
_LABEL_GAP_PX = 8
_MAX_TICK_LABELS = 10
_MIN_TICK_PX = 4  # closest spacing at which unlabelled decade ticks still read as ticks
_BOUND_TEXT = "bound (ratio 1)"


def _label_px(text: str) -> int:
    return len(text) * _LABEL_PX_PER_CHAR


def _decade_stride(first: int, last: int, px_per_decade: float, *, right_margin: float) -> int:
    """Smallest 1-2-5 stride (in decades) whose labels neither overlap nor exceed the label budget.

    Without it every decade gets a label, and a run with ratios from 1e-300 to 1e3 (a vanishing
    output next to a broken one) prints hundreds of labels on top of each other. The spacing also
    covers the shift of a last label pulled in from the right edge.
    """
    longest = max(_label_px(f"1e{d}") for d in (first, last))
    widest = longest + _LABEL_GAP_PX + max(0.0, longest / 2 - right_margin)
    mantissa, scale = 0, 1
    while True:
        stride = (1, 2, 5)[mantissa] * scale
        n_labels = last // stride - -(-first // stride) + 1  # multiples of stride in [first, last]
        if stride * px_per_decade >= widest and n_labels <= _MAX_TICK_LABELS:
            return stride
        mantissa = (mantissa + 1) % 3
        scale *= 10 if mantissa == 0 else 1


def _bound_label(x: float, y: float, *, right_edge: float) -> str:
    """The 'bound (ratio 1)' caption right of the bound line, or left of it when it would be clipped.

    The bound sits only half a decade from the right edge at minimum, which is a few pixels on a wide range.
    """
    if x + 4 + _label_px(_BOUND_TEXT) <= right_edge:
        return f'<text class="label" x="{x + 4:.1f}" y="{y}">{_BOUND_TEXT}</text>'
    return f'<text class="label" x="{x - 4:.1f}" y="{y}" text-anchor="end">{_BOUND_TEXT}</text>'


def _decade_ticks(
    lo: float, hi: float, *, left: float, plot_width: float, axis_y: float, width: int, right_margin: float
) -> list[str]:
    """Tick marks and ``1eN`` labels under a log10 axis spanning ``lo``..``hi`` decades."""
    first, last = math.ceil(lo), math.floor(hi)
    px_per_decade = plot_width / (hi - lo)
    stride = _decade_stride(first, last, px_per_decade, right_margin=right_margin)
    parts = []
    for d in range(first, last + 1):
        labelled = d % stride == 0  # multiples of the stride, so 1e0 (the bound) always gets a label
        if not labelled and px_per_decade < _MIN_TICK_PX:
            continue  # unlabelled decade ticks this close together would only draw a comb
        x = left + (d - lo) / (hi - lo) * plot_width  # same arithmetic as the bars, so ticks line up
        parts.append(f'<line class="tick" x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 5}"/>')
        if labelled:
            tx = min(x, width - _label_px(f"1e{d}") / 2)  # a long label on the right edge stays inside
            parts.append(
                f'<text class="label" x="{tx:.1f}" y="{axis_y + 18}" text-anchor="middle">1e{d}</text>'
            )
    return parts


def svg_histogram(
    values: Iterable[float], *, bin_width: float = 0.25, width: int = 720, height: int = 260,
    xlabel: str = "rmse(fp64, target) / allowed bound (log scale)",
) -> Markup:
    """Histogram of log10(rmse_ratio); bars right of 0 (ratio > 1, i.e. drift) are highlighted."""
    logs = [math.log10(v) for v in values if v is not None and math.isfinite(v) and v > 0]
    if not logs:
        return Markup('<p class="empty">no finite positive rmse_ratio values in this run</p>')
    lo = math.floor(min(min(logs), -1.0) / bin_width) * bin_width
    hi = math.ceil(max(max(logs), 0.5) / bin_width) * bin_width
    if hi - lo < bin_width:
        hi = lo + bin_width
    nbins = max(1, round((hi - lo) / bin_width))
    counts = [0] * nbins
    for x in logs:
        counts[min(nbins - 1, int((x - lo) / bin_width))] += 1
    top = max(counts)
    ml, mr, mt, mb = 44, 12, 14, 40
    pw, ph = width - ml - mr, height - mt - mb
    bw = pw / nbins

    def xpos(v: float) -> float:
        return ml + (v - lo) / (hi - lo) * pw

    parts = [
        f'<svg class="hist" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" role="img" aria-label="histogram of log10 rmse_ratio">'
    ]
    for i, c in enumerate(counts):
        if not c:
            continue
        h = c / top * ph
        left = lo + i * bin_width
        cls = "bar drift" if left >= 0 else "bar ok"
        parts.append(
            f'<rect class="{cls}" x="{ml + i * bw + 1:.1f}" y="{mt + ph - h:.1f}" width="{max(bw - 2, 1):.1f}" '
            f'height="{h:.1f}"><title>10^{left:g} .. 10^{left + bin_width:g}: {c}</title></rect>'
        )
    parts.append(f'<line class="axis" x1="{ml}" y1="{mt + ph}" x2="{ml + pw}" y2="{mt + ph}"/>')
    parts.append(f'<line class="axis" x1="{ml}" y1="{mt}" x2="{ml}" y2="{mt + ph}"/>')
    parts += _decade_ticks(lo, hi, left=ml, plot_width=pw, axis_y=mt + ph, width=width, right_margin=mr)
    x0 = xpos(0.0)
    parts.append(f'<line class="bound" x1="{x0:.1f}" y1="{mt}" x2="{x0:.1f}" y2="{mt + ph}"/>')
    parts.append(_bound_label(x0, mt + 10, right_edge=width))
    for frac in (0.5, 1.0):
        y = mt + ph - frac * ph
        parts.append(
            f'<text class="label" x="{ml - 6}" y="{y + 4:.1f}" text-anchor="end">{round(top * frac)}</text>'
        )
    parts.append(
        f'<text class="label" x="{ml + pw / 2:.1f}" y="{height - 4}" text-anchor="middle">'
        f"{html.escape(xlabel)}</text>"
    )
    parts.append("</svg>")
    return Markup("".join(parts))


def svg_bars(items: Sequence[dict[str, Any]], *, width: int = 720, ref: float = 1.0) -> Markup:
    """Horizontal bar chart: items with label, value, optional lo/hi whiskers; a line at ``ref``."""
    items = [i for i in items if as_number(i.get("value")) is not None and math.isfinite(as_number(i["value"]) or 0)]
    if not items:
        return Markup('<p class="empty">no ratios to plot</p>')
    row_h, ml, mr, mt, mb = 22, 240, 60, 8, 26
    height = mt + mb + row_h * len(items)
    vmax = (
        max(max((as_number(i.get("hi")) or 0) for i in items), max(as_number(i["value"]) or 0 for i in items), ref)
        * 1.08
    )
    pw = width - ml - mr

    def xpos(v: float) -> float:
        return ml + max(v, 0) / vmax * pw

    parts = [
        f'<svg class="bars" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" role="img" aria-label="ratio per setting">'
    ]
    for n, it in enumerate(items):
        y = mt + n * row_h
        v = float(it["value"])
        label = html.escape(str(it["label"]))
        cls = "bar slow" if v > ref else "bar fast"
        parts.append(
            f'<text class="label" x="{ml - 6}" y="{y + row_h * 0.65:.1f}" text-anchor="end">{label}</text>'
            f'<rect class="{cls}" x="{ml}" y="{y + 3}" width="{xpos(v) - ml:.1f}" height="{row_h - 6}">'
            f"<title>{label}: {v:.3g}</title></rect>"
        )
        lo_, hi_ = as_number(it.get("lo")), as_number(it.get("hi"))
        right = max(v, hi_ if hi_ is not None and math.isfinite(hi_) else v)
        parts.append(
            f'<text class="label" x="{xpos(right) + 4:.1f}" y="{y + row_h * 0.65:.1f}">{v:.3g}</text>'
        )
        if lo_ is not None and hi_ is not None and math.isfinite(lo_) and math.isfinite(hi_):
            yc = y + row_h / 2
            parts.append(
                f'<line class="whisker" x1="{xpos(lo_):.1f}" y1="{yc}" x2="{xpos(hi_):.1f}" y2="{yc}"/>'
            )
    xr = xpos(ref)
    parts.append(f'<line class="bound" x1="{xr:.1f}" y1="{mt}" x2="{xr:.1f}" y2="{height - mb}"/>')
    parts.append(
        f'<text class="label" x="{xr:.1f}" y="{height - 8}" text-anchor="middle">{ref:g} (baseline)</text>'
    )
    parts.append("</svg>")
    return Markup("".join(parts))


def svg_outcome_bar(counts: dict[str, int], *, width: int = 720, height: int = 26) -> Markup:
    """One stacked bar of outcome counts (SVG so no inline styles are needed), what works first; a segment
    wide enough carries its outcome and count as a label (the page's legend names every segment)."""
    total = sum(counts.values())
    if not total:
        return Markup("")
    parts = [
        f'<svg class="stack" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" role="img" aria-label="outcomes: '
        + ", ".join(f"{o} {counts[o]}" for o in OUTCOMES[::-1] if counts.get(o)) + '">'
    ]
    x = 0.0
    for outcome in OUTCOMES[::-1]:
        c = counts.get(outcome, 0)
        if not c:
            continue
        w = c / total * width
        parts.append(
            f'<rect x="{x:.2f}" y="0" width="{w:.2f}" height="{height}" fill="{COLOURS[outcome]}">'
            f"<title>{outcome}: {c} ({c / total:.1%})</title></rect>"
        )
        label = f"{outcome} {c}"
        if w >= _label_px(label) + 10:
            parts.append(f'<text class="seg" x="{x + 5:.2f}" y="{height / 2 + 4:.1f}">{label}</text>')
        x += w
    parts.append("</svg>")
    return Markup("".join(parts))


_MAX_X_LABELS = 8


def svg_lines(
    labels: Sequence[str],
    series: Sequence[tuple[str, str, Sequence[float | None]]],
    *,
    width: int = 720,
    height: int = 250,
    y_max: float = 100.0,
    unit: str = "%",
) -> Markup:
    """Line chart of a few series over the same x points (nights), e.g. pass / ran / matched %.

    ``series`` is (name, css class, one value per label; None = no value that night: the line breaks
    there). Every point is a ``circle.point.<class>`` with a tooltip, so one night still shows.
    """
    n = len(labels)
    if not n or not any(v is not None for _, _, values in series for v in values):
        return Markup('<p class="empty">no points to plot</p>')
    ml, mr, mt, mb = 44, 16, 30, 46
    pw, ph = width - ml - mr, height - mt - mb

    def xpos(i: int) -> float:
        return ml + (pw / 2 if n == 1 else i / (n - 1) * pw)

    def ypos(v: float) -> float:
        return mt + ph - max(0.0, min(v, y_max)) / y_max * ph

    parts = [
        f'<svg class="trend" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" role="img" aria-label="{html.escape(", ".join(s[0] for s in series))} per night">'
    ]
    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
        y = ypos(frac * y_max)
        parts.append(f'<line class="grid" x1="{ml}" y1="{y:.1f}" x2="{ml + pw}" y2="{y:.1f}"/>')
        parts.append(f'<text class="label" x="{ml - 6}" y="{y + 4:.1f}" text-anchor="end">{frac * y_max:g}{unit}</text>')
    parts.append(f'<line class="axis" x1="{ml}" y1="{mt + ph}" x2="{ml + pw}" y2="{mt + ph}"/>')
    stride = max(1, math.ceil(n / _MAX_X_LABELS))
    for i, label in enumerate(labels):
        x = xpos(i)
        parts.append(f'<line class="tick" x1="{x:.1f}" y1="{mt + ph}" x2="{x:.1f}" y2="{mt + ph + 4}"/>')
        if i % stride == 0 or i == n - 1:
            half = _label_px(str(label)) / 2  # the first and last labels stay inside the picture
            tx = min(max(x, half), width - half)
            parts.append(f'<text class="label" x="{tx:.1f}" y="{mt + ph + 18}" text-anchor="middle">'
                         f"{html.escape(str(label))}</text>")
    lx = ml
    for name, cls, values in series:
        cls = html.escape(cls)
        # Legend: a short line and the name, left to right above the plot.
        parts.append(f'<line class="line {cls}" x1="{lx}" y1="12" x2="{lx + 18}" y2="12"/>'
                     f'<text class="label" x="{lx + 22}" y="16">{html.escape(name)}</text>')
        lx += 40 + _label_px(name)
        run: list[str] = []
        for i, v in enumerate(list(values) + [None]):  # the trailing None flushes the last segment
            if v is None:
                if len(run) > 1:
                    parts.append(f'<polyline class="line {cls}" points="{" ".join(run)}"/>')
                run = []
                continue
            run.append(f"{xpos(i):.1f},{ypos(v):.1f}")
        for i, v in enumerate(values):
            if v is not None:
                parts.append(f'<circle class="point {cls}" cx="{xpos(i):.1f}" cy="{ypos(v):.1f}" r="3.5">'
                             f"<title>{html.escape(name)} {html.escape(str(labels[i]))}: {v:.1f}{unit}</title></circle>")
    parts.append("</svg>")
    return Markup("".join(parts))


def svg_steps(steps: Sequence[tuple], *, first_drift: int | None = None,
              width: int = 720, height: int = 220) -> Markup:
    """Per decoding step, the logits' error over the fp32 bound and over the declared bound (log scale,
    ratio 1 dashed); ``steps`` is (step, fp32 ratio, declared ratio or None[, judgement]). The first
    drifting step is marked. Points of a step judged beyond (`harness.outcomes`) are ``.point.bad``: an
    fp32 ratio above 1 inside the declared envelope is what pass_declared means, not a finding."""
    values = [v for s in steps for v in s[1:3] if v is not None and math.isfinite(v) and v > 0]
    if not values:
        return Markup('<p class="empty">no per-step ratios recorded</p>')
    lo = min(math.floor(math.log10(min(values))), -1)
    hi = max(math.ceil(math.log10(max(values))), 1)
    ml, mr, mt, mb = 44, 16, 30, 40
    pw, ph = width - ml - mr, height - mt - mb
    n = max(len(steps), 1)

    def xpos(i: int) -> float:
        return ml + (pw / 2 if n == 1 else i / (n - 1) * pw)

    def ypos(v: float) -> float:
        return mt + ph - (min(max(math.log10(v), lo), hi) - lo) / (hi - lo) * ph

    parts = [
        f'<svg class="steps" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" role="img" aria-label="logits error ratio per decoding step">'
    ]
    for d in range(lo, hi + 1):
        y = ypos(10.0**d)
        parts.append(f'<line class="grid" x1="{ml}" y1="{y:.1f}" x2="{ml + pw}" y2="{y:.1f}"/>'
                     f'<text class="label" x="{ml - 6}" y="{y + 4:.1f}" text-anchor="end">1e{d}</text>')
    y1 = ypos(1.0)
    parts.append(f'<line class="bound" x1="{ml}" y1="{y1:.1f}" x2="{ml + pw}" y2="{y1:.1f}"/>')
    parts.append(f'<line class="axis" x1="{ml}" y1="{mt + ph}" x2="{ml + pw}" y2="{mt + ph}"/>')
    for i, (k, *_) in enumerate(steps):
        x = xpos(i)
        cls = "tick drift-step" if k == first_drift else "tick"
        parts.append(f'<line class="{cls}" x1="{x:.1f}" y1="{mt + ph}" x2="{x:.1f}" y2="{mt + ph + 4}"/>'
                     f'<text class="label" x="{x:.1f}" y="{mt + ph + 18}" text-anchor="middle">{int(k)}</text>')
    if first_drift is not None and any(s[0] == first_drift for s in steps):
        x = xpos([s[0] for s in steps].index(first_drift))
        parts.append(f'<line class="drift-step" x1="{x:.1f}" y1="{mt}" x2="{x:.1f}" y2="{mt + ph}"/>'
                     f'<text class="label" x="{x + 4:.1f}" y="{mt + 10}">first drifting step</text>')
    lx = ml
    for name, cls, col in (("fp32 ratio", "fp32", 1), ("declared ratio", "declared", 2)):
        points = [(i, s[col]) for i, s in enumerate(steps) if s[col] is not None and math.isfinite(s[col]) and s[col] > 0]
        if not points:
            continue
        parts.append(f'<line class="line {cls}" x1="{lx}" y1="12" x2="{lx + 18}" y2="12"/>'
                     f'<text class="label" x="{lx + 22}" y="16">{name}</text>')
        lx += 40 + _label_px(name)
        parts.append(f'<polyline class="line {cls}" points="'
                     + " ".join(f"{xpos(i):.1f},{ypos(v):.1f}" for i, v in points) + '"/>')
        for i, v in points:
            beyond = steps[i][3] == "beyond" if len(steps[i]) > 3 and steps[i][3] else True  # no judgement: v > 1
            bad = " bad" if v > 1 and beyond else ""
            parts.append(f'<circle class="point {cls}{bad}" cx="{xpos(i):.1f}" cy="{ypos(v):.1f}" r="3.5">'
                         f"<title>step {int(steps[i][0])}: {name} {v:.3g}</title></circle>")
    parts.append(f'<text class="label" x="{ml + pw / 2:.1f}" y="{height - 4}" text-anchor="middle">'
                 "decoding step (0: the prompt's forward; from 1: through the cache)</text>")
    parts.append("</svg>")
    return Markup("".join(parts))


def svg_spread(items: Sequence[dict[str, Any]], *, width: int = 720, unit: str = "ms") -> Markup:
    """Box plots on one linear axis from 0: per item (label, min, q1, median, q3, max; lo/hi: the median's
    interval, drawn as a band), the whiskers cut at q3 + 3 IQR so a burst of other work does not squash the
    boxes (a cut whisker ends in an arrow; its tooltip has the real maximum)."""
    rows = [i for i in items if all(as_number(i.get(k)) is not None for k in ("min", "q1", "median", "q3", "max"))]
    if not rows:
        return Markup('<p class="empty">no timings to plot</p>')
    row_h, ml, mr, mt, mb = 28, 110, 20, 8, 26
    height = mt + mb + row_h * len(rows)
    cap = {id(i): float(i["q3"]) + 3 * (float(i["q3"]) - float(i["q1"])) for i in rows}
    vmax = max(min(float(i["max"]), cap[id(i)]) for i in rows) * 1.05 or 1.0
    pw = width - ml - mr

    def x(v: float) -> float:
        return ml + min(max(v, 0.0), vmax) / vmax * pw

    parts = [f'<svg class="spread" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
             f'width="{width}" height="{height}" role="img" aria-label="timing spread per step">']
    for n, it in enumerate(rows):
        y = mt + n * row_h
        yc = y + row_h / 2
        mn, q1, med, q3, mx = (float(it[k]) for k in ("min", "q1", "median", "q3", "max"))
        hi_end = min(mx, cap[id(it)])
        label = html.escape(str(it["label"]))
        tip = html.escape(f"{it['label']}: median {med:.3g} {unit}, IQR {q1:.3g}-{q3:.3g}, min {mn:.3g}, max {mx:.3g}")
        parts.append(f'<text class="label" x="{ml - 6}" y="{yc + 4:.1f}" text-anchor="end">{label}</text>')
        parts.append(f'<line class="whisker" x1="{x(mn):.1f}" y1="{yc}" x2="{x(hi_end):.1f}" y2="{yc}"/>')
        if hi_end < mx:
            parts.append(f'<text class="label" x="{x(hi_end) + 2:.1f}" y="{yc + 4:.1f}">›</text>')
        parts.append(f'<rect class="box" x="{x(q1):.1f}" y="{y + 5}" width="{max(x(q3) - x(q1), 1):.1f}" '
                     f'height="{row_h - 10}"><title>{tip}</title></rect>')
        lo, hi = as_number(it.get("lo")), as_number(it.get("hi"))
        if lo is not None and hi is not None:
            parts.append(f'<rect class="interval" x="{x(lo):.1f}" y="{y + 9}" width="{max(x(hi) - x(lo), 1):.1f}" '
                         f'height="{row_h - 18}"/>')
        parts.append(f'<line class="median" x1="{x(med):.1f}" y1="{y + 3}" x2="{x(med):.1f}" y2="{y + row_h - 3}"/>')
    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
        v = frac * vmax
        parts.append(f'<text class="label" x="{x(v):.1f}" y="{height - 8}" text-anchor="middle">{v:.3g}</text>')
    parts.append(f'<text class="label" x="{ml - 6}" y="{height - 8}" text-anchor="end">{html.escape(unit)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))
