"""The model page's decoding section (generate mode): the per-step ratio chart and the token strip.

The chart plots each step's logits ratio (fp32 bound and declared bound) from the row's `metrics`; the
strip shows, per batch row, the reference's greedy tokens over the target's free-running ones, the first
divergent step highlighted and the steps after it dimmed (from there the two decode different histories).
Everything from the row stays text: escaping is Jinja's job.
"""

from __future__ import annotations

from typing import Any

from harness.outcomes import output_judgement
from harness.report.svg import as_number, svg_steps
from harness.results.rows import output_step


def _int(v: Any) -> int | None:
    f = as_number(v)
    return int(f) if f is not None and f.is_integer() else None


def _rows(v: Any) -> list[list[Any]]:
    return [list(r) for r in v if isinstance(r, (list, tuple))] if isinstance(v, (list, tuple)) else []


def _shown(tok: Any, text: dict[str, str]) -> str:
    """A token as the strip shows it: its text where the tokenizer gave one (spaces and newlines visible),
    else its id."""
    piece = text.get(str(tok))
    if piece is None:
        return str(tok)
    return piece.replace(" ", "\u00b7").replace("\n", "\u23ce") or "\u2205"  # middle dot, return, empty set


def _strip(ref: list[list[Any]], target: list[list[Any]], first: int | None,
           text: dict[str, str] | None = None) -> list[dict[str, Any]]:
    text = text or {}
    out = []
    for b, want in enumerate(ref):
        got = target[b] if b < len(target) else []
        cells = []
        for k, tok in enumerate(got):
            differs = k >= len(want) or tok != want[k]
            cls = "after" if first is not None and k > first else "diverged" if differs else ""
            cells.append({"text": _shown(tok, text), "id": str(tok), "cls": cls})
        out.append({"row": b, "ref": [{"text": _shown(t, text), "id": str(t)} for t in want], "target": cells})
    return out


def decoding_view(r: dict[str, Any]) -> dict[str, Any] | None:
    """The decoding section of one row (None: not a generate-mode row)."""
    new_tokens = _int(r.get("new_tokens"))
    if new_tokens is None:
        return None
    metrics = r.get("metrics") if isinstance(r.get("metrics"), dict) else {}
    text = {str(k): str(v) for k, v in r["token_text"].items()} if isinstance(r.get("token_text"), dict) else {}
    steps = []
    for name, m in metrics.items():
        k = output_step(str(name))
        if k is not None and isinstance(m, dict):
            steps.append((k, as_number(m.get("rmse_ratio")), as_number(m.get("declared_ratio")), output_judgement(m)))
    steps.sort(key=lambda s: s[0])
    first_drift = _int(r.get("first_drift_step"))
    first_div = _int(r.get("first_divergent_step"))
    matched = _int(r.get("tokens_matched"))
    margin, envelope = as_number(r.get("divergence_margin")), as_number(r.get("divergence_envelope"))
    summary = []
    if first_drift is not None:
        summary.append(("first drifting step", f"{first_drift} of {new_tokens}"
                        + (" (step 0 clean: the cache path)" if first_drift else " (the prompt's forward)")))
    if matched is not None:
        summary.append(("free-running tokens matched", f"{matched}/{new_tokens}"))
    if first_div is not None:
        detail = str(r.get("divergence") or "")
        if margin is not None and envelope is not None:
            detail += f" (reference top-2 margin {margin:.3g}, declared envelope {envelope:.3g})"
        summary.append((f"first divergent step {first_div}", detail))
    return {
        "summary": summary,
        "svg": svg_steps(steps, first_drift=first_drift) if steps else None,
        "tokens": _strip(_rows(r.get("ref_tokens")), _rows(r.get("target_tokens")), first_div, text),
        "decoded": bool(text),
        "where": f"step {first_drift}" if first_drift is not None else "",
        "matched": f"{matched}/{new_tokens}" if matched is not None else "",
    }
