"""Expected-outcome baselines: a committed file per configuration, checked every night.

This is the convention of PyTorch's accuracy CI (``ci_expected_accuracy/<config>.csv`` and
``check_accuracy.py``): the file says what each model is *expected* to do on one (model list,
target, settings); the nightly fails on a new failure **and** on an unexpected pass, so the file is
kept true (a fix lands together with its baseline update), and a flaky list with reasons keeps known
noise out of the gate. Unlike "vs last night", the gate exists on the first night and a regression
is never lost because yesterday's artifact expired.

File: ``model_lists/expected/<list>--<target>--<settings slug>.csv``; ``#`` header lines name the
configuration (read back and compared with the run: checking a run against another configuration's
file is bad input), then ``model,outcome,detail`` sorted by model. ``detail`` is the failing op
(``unsupported_op``) or the first drifting module's type (``drift``): it is compared but does not gate.

Each model is classified as one of :data:`STATUSES`; ``new_failure`` and ``unexpected_pass`` gate.
Pure functions and dataclasses; which runs of a DB are checked is `harness.analysis.nights`' job.
"""

from __future__ import annotations

import difflib
import fnmatch
import io
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from harness import csvio, files
from harness.analysis.fingerprint import FailureGroup, group_rows
from harness.analysis.matrix import column_records, settings_label
from harness.analysis.perfgate import PerfGate, format_gate, gate
from harness.outcomes import DEVICE_SIDE, MATCHED, NOT_THE_MODELS, OUTCOMES, severity
from harness.results.codec import canonical_json

COLUMNS = ("model", "outcome", "detail")
_MAGIC = "# portharness expected outcomes"

# Every classification, gating ones first (the order the summary prints them in).
STATUSES = ("new_failure", "unexpected_pass", "flaky", "missing", "new_model", "expected_failure", "pass")
GATING = frozenset({"new_failure", "unexpected_pass"})
_MEANING = {
    "new_failure": "worse than expected: a regression (or a different failure)",
    "unexpected_pass": "better than expected: fixed or improved, update the expected file",
    "flaky": "flipped between attempts, or on the flaky list: not gating",
    "missing": "expected but without a target verdict tonight (not run, or a load/reference/device failure)",
    "new_model": "not in the expected file: add it with `baseline update`",
    "expected_failure": "fails as expected",
    "pass": "passes as expected",
}


# ----------------------------------------------------------------------------------------------
# Configurations and file names
# ----------------------------------------------------------------------------------------------

_UNSAFE = re.compile(r"[^A-Za-z0-9._=+-]+")


def _safe(text: str) -> str:
    """Filesystem-safe on every OS: anything but letters, digits and ``._=+-`` becomes ``_``."""
    return _UNSAFE.sub("_", text).strip("_") or "_"


def list_key(list_name: str) -> str:
    """A list as named in a run (``smoke``, ``model_lists/smoke.csv``, ``/abs/two.csv``) -> its name."""
    name = str(list_name)
    return Path(name).stem if name.endswith(".csv") else name


def settings_slug(settings: dict[str, Any]) -> str:
    """``{"precision": "highest", "ops": "full"}`` -> ``ops=full-precision=highest`` (keys sorted)."""
    parts = []
    for key in sorted(settings):
        value = settings[key]
        text = value if isinstance(value, str) else canonical_json(value)
        parts.append(f"{_safe(str(key))}={_safe(text)}")
    return "-".join(parts) or "default"


@dataclass(frozen=True)
class Config:
    """What a baseline is about: one model list on one target with one settings dict."""

    list_name: str
    target: str
    settings_json: str  # canonical JSON, so equal settings compare equal

    @classmethod
    def of(cls, list_name: str, target: str, settings: dict[str, Any]) -> Config:
        return cls(list_key(list_name), str(target), canonical_json(settings or {}))

    @property
    def settings(self) -> dict[str, Any]:
        return json.loads(self.settings_json)

    @property
    def file_name(self) -> str:
        """``<list>--<target>--<settings slug>.csv``."""
        return f"{_safe(self.list_name)}--{_safe(self.target)}--{settings_slug(self.settings)}.csv"

    def describe(self) -> str:
        return f"list {self.list_name}, target {self.target}, settings {self.settings_json}"


# ----------------------------------------------------------------------------------------------
# The expected file
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Expected:
    """One model's expected outcome."""

    model: str
    outcome: str
    detail: str = ""


@dataclass
class ExpectedFile:
    config: Config
    rows: dict[str, Expected]  # model id -> expectation
    path: str = ""


def _text(v: Any) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return ""
    return str(v)


def detail_of(row: dict[str, Any]) -> str:
    """What is worth pinning beside the outcome: the failing op or the first drifting module's type; for a
    declared-precision pass, whether full precision confirmed it (or a drift it hid)."""
    confirm = _text(row.get("confirm"))
    if row.get("outcome") == "unsupported_op":
        return _text(row.get("unsupported_op"))
    if row.get("outcome") == "drift":
        return " ".join(x for x in (_text(row.get("first_drift_module_type")), f"({confirm})" if confirm else "") if x)
    if row.get("outcome") == "pass_declared":
        return confirm
    return ""


def expected_rows(df: pd.DataFrame) -> list[Expected]:
    """The expectations a run's rows give, sorted by model. A device-side row (the device failed, the
    model is re-run on resume) is not the model's result and is left out."""
    out: dict[str, Expected] = {}
    for row in _records(df):
        if row["outcome"] in DEVICE_SIDE:
            continue
        out[row["model_id"]] = Expected(row["model_id"], row["outcome"], detail_of(row))
    return [out[m] for m in sorted(out)]


def format_expected(config: Config, rows: list[Expected], *, command: str = "") -> str:
    """The file's text: header comments naming the configuration, then sorted CSV rows."""
    buf = io.StringIO()
    buf.write(f"{_MAGIC} for one configuration; checked by `portharness baseline check`.\n")
    buf.write(f"# list: {config.list_name}\n# target: {config.target}\n# settings: {config.settings_json}\n")
    if command:
        buf.write(f"# regenerate: {command}\n")
    buf.write(csvio.format_rows([COLUMNS, *((r.model, r.outcome, r.detail) for r in sorted(rows, key=lambda r: r.model))]))
    return buf.getvalue()


def write_expected(path: str | os.PathLike, config: Config, rows: list[Expected], *, command: str = "") -> Path:
    """Write the expected file atomically (a half-written baseline must never be committed)."""
    p = Path(path)
    if not p.parent.is_dir():
        raise FileNotFoundError(f"directory {p.parent} for the expected file does not exist")
    return files.write_text(p, format_expected(config, rows, command=command))


def read_expected_header(p: Path, *, what: str = "expected file") -> tuple[Config, list[tuple[int, str]]]:
    """The configuration a baseline file's ``#`` header names, and its other non-empty lines (numbered)."""
    if not p.exists():
        raise FileNotFoundError(f"{what} {p} does not exist; create it with `portharness baseline update`")
    header: dict[str, str] = {}
    body: list[tuple[int, str]] = []
    text = csvio.read_text(p, what)  # a spreadsheet's byte-order mark is not part of the first line
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("#"):
            key, sep, value = line[1:].partition(":")
            if sep and key.strip() in ("list", "target", "settings"):
                header[key.strip()] = value.strip()
        elif line.strip():
            body.append((n, line))
    missing = [k for k in ("list", "target", "settings") if k not in header]
    if missing:
        raise ValueError(f"{p}: header lacks '# {missing[0]}: ...'; regenerate it with `portharness baseline update`")
    try:
        settings = json.loads(header["settings"])
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: '# settings:' is not JSON ({e})") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{p}: '# settings:' must be a JSON object")
    return Config(header["list"], header["target"], canonical_json(settings)), body


def read_expected(path: str | os.PathLike) -> ExpectedFile:
    """Parse an expected file; ValueError ``path:line: what is wrong`` on anything malformed."""
    p = Path(path)
    config, body = read_expected_header(p)
    if not body:
        raise ValueError(f"{p}: no '{','.join(COLUMNS)}' header row")
    (first_n, first), *data = body
    if csvio.parse_line(first) != list(COLUMNS):
        raise ValueError(f"{p}:{first_n}: expected the header row '{','.join(COLUMNS)}', got {first!r}")
    rows: dict[str, Expected] = {}
    for n, line in data:
        cells = csvio.parse_line(line)
        if len(cells) != len(COLUMNS):
            raise ValueError(f"{p}:{n}: expected {len(COLUMNS)} cells (model,outcome,detail), got {len(cells)}")
        model, outcome, detail = (c.strip() for c in cells)
        if not model or not outcome:
            raise ValueError(f"{p}:{n}: model and outcome must not be empty")
        if outcome not in OUTCOMES:
            close = difflib.get_close_matches(outcome, OUTCOMES, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known outcomes: {', '.join(OUTCOMES)}"
            raise ValueError(f"{p}:{n}: unknown outcome {outcome!r} for {model!r}; {hint}")
        if model in rows:
            raise ValueError(f"{p}:{n}: model {model!r} is listed twice")
        rows[model] = Expected(model, outcome, detail)
    return ExpectedFile(config, rows, str(p))


def read_flaky(path: str | os.PathLike) -> dict[str, str]:
    """Known-flaky models with their reasons: ``model-id-or-pattern  # why it is flaky`` per line.

    The same file works as ``portharness diff --flaky-allowlist``; here every entry needs its reason,
    so the list says why each model is excused (ValueError ``path:line`` otherwise).
    """
    p = Path(path)
    out: dict[str, str] = {}
    for n, line in enumerate(files.read_text(p, "--flaky").splitlines(), 1):
        entry, _, reason = line.partition("#")
        entry, reason = entry.strip(), reason.strip()
        if not entry:
            continue
        if not reason:
            raise ValueError(f"{p}:{n}: flaky entry {entry!r} has no reason; write '{entry}  # why it is flaky'")
        out[entry] = reason
    return out


def _flaky_reason(model: str, flaky: dict[str, str]) -> str | None:
    for pattern, reason in flaky.items():
        if model == pattern or fnmatch.fnmatchcase(model, pattern):
            return reason
    return None


# ----------------------------------------------------------------------------------------------
# The check
# ----------------------------------------------------------------------------------------------


@dataclass
class ModelStatus:
    """One model's classification against the expected file."""

    model: str
    status: str
    expected: str = ""
    actual: str = ""
    expected_detail: str = ""
    actual_detail: str = ""
    note: str = ""  # why (flaky reason, "fixed", detail changes...)
    group: str = ""  # the failure fingerprint of the actual row, if it failed


@dataclass
class CheckResult:
    config: Config
    run_id: str
    expected_path: str
    verdicts: list[ModelStatus] = field(default_factory=list)
    new_failure_groups: list[FailureGroup] = field(default_factory=list)
    perf: PerfGate | None = None  # against the perf baseline beside the expected file, when there is one
    perf_path: str = ""

    @property
    def counts(self) -> dict[str, int]:
        c = dict.fromkeys(STATUSES, 0)
        for v in self.verdicts:
            c[v.status] += 1
        return c

    @property
    def gating(self) -> list[ModelStatus]:
        return [v for v in self.verdicts if v.status in GATING]

    @property
    def ok(self) -> bool:
        return not self.gating and not (self.perf is not None and (self.perf.regressions or self.perf.kernels
                                                                     or self.perf.settings))

    def by_status(self, status: str) -> list[ModelStatus]:
        return [v for v in self.verdicts if v.status == status]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: counts, the verdict, every non-passing model, new failures by group."""
        return {
            "ok": self.ok,
            "verdict": verdict_line(self),
            "run_id": self.run_id,
            "expected": self.expected_path,
            "list": self.config.list_name,
            "target": self.config.target,
            "settings": self.config.settings,
            "counts": self.counts,
            "models": [asdict(v) for v in self.verdicts if v.status != "pass" or v.note],
            "new_failure_groups": [g.to_dict() for g in self.new_failure_groups],
            "perf_expected": self.perf_path,
            "perf": self.perf.to_dict() if self.perf is not None else None,
        }


def _records(df: pd.DataFrame, extra: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Latest row per model, as dicts with only the columns the check reads (nights are large)."""
    if df.empty:
        return []
    if "run_started_at" in df.columns:
        df = df.sort_values("run_started_at", kind="stable")
    cols = ("model_id", "outcome", "unsupported_op", "first_drift_module_type", "confirm", "error_message", "error_type",
            *extra)
    return list({r["model_id"]: r for r in column_records(df, cols)}.values())


def classify(expected: Expected | None, actual: str | None, *, flaky_reason: str | None = None) -> tuple[str, str]:
    """(status, note) for one model: its expectation (None: not in the file) against tonight's outcome
    (None: not run). The rules, in order:

    * not in the file -> ``new_model``; not run -> ``missing``;
    * the expected outcome -> ``pass`` / ``expected_failure`` (``flaky`` when both say flaky);
    * otherwise on the flaky list, or labelled ``flaky`` tonight -> ``flaky``;
    * no target verdict tonight (load/reference/device failure) -> ``missing``;
    * a failure where the file said the model could not be tested -> ``new_failure``;
    * better (lower severity) than expected -> ``unexpected_pass``; another matched outcome of the
      same severity (pass <-> pass_declared) -> ``pass`` with a note; worse, or a different failure
      of the same severity -> ``new_failure``.
    """
    if expected is None:
        return "new_model", ""
    if actual is None:
        return "missing", "not in tonight's run"
    e = expected.outcome
    if actual == e:
        if actual == "flaky":
            return "flaky", "expected flaky"
        return ("pass" if actual in MATCHED else "expected_failure"), ""
    if flaky_reason is not None:
        return "flaky", f"on the flaky list: {flaky_reason}"
    if actual == "flaky":
        return "flaky", "its outcome flipped between attempts"
    if actual in NOT_THE_MODELS:
        return "missing", f"no target verdict tonight ({actual})"
    if e in NOT_THE_MODELS and actual not in MATCHED:
        return "new_failure", f"the file says {e}; tonight the target ran it: {actual}"
    if severity(actual) < severity(e):
        return "unexpected_pass", "fixed" if actual in MATCHED else f"improved ({e} -> {actual})"
    if actual in MATCHED and e in MATCHED and severity(actual) == severity(e):
        # e.g. pass <-> pass_declared: matched either way, as the diff sees it; the file should say which
        return "pass", f"matched as {actual}, not {e} (update the file)"
    return "new_failure", ""


def check(
    expected: ExpectedFile,
    df: pd.DataFrame,
    *,
    run_config: Config | None = None,
    run_id: str = "",
    flaky: dict[str, str] | None = None,
    perf: tuple[str, dict[str, dict[str, Any]]] | None = None,
    perf_threshold: float = 1.2,
    perf_allowlist: dict[str, str] | None = None,
) -> CheckResult:
    """Classify every model of ``df`` (one run's results) against ``expected``.

    ``run_config`` is the run's configuration: it must be the file's (ValueError naming both
    otherwise), since a run checked against another configuration's expectations means nothing.
    ``perf`` is the perf baseline (its path, and per model a ``perf`` measurement): the run's models
    measured with ``--perf`` are gated on it (`harness.analysis.perfgate`).
    """
    if run_config is not None and run_config != expected.config:
        raise ValueError(
            f"run {run_id or '?'} is {run_config.describe()}, but {expected.path or 'the expected file'} is for "
            f"{expected.config.describe()}; use the expected file named {run_config.file_name}"
        )
    flaky = flaky or {}
    rows = {r["model_id"]: r for r in _records(df)}
    res = CheckResult(expected.config, run_id, expected.path)
    failing: list[dict[str, Any]] = []
    for model in sorted(expected.rows.keys() | rows.keys()):
        exp, row = expected.rows.get(model), rows.get(model)
        actual = None if row is None else str(row["outcome"])
        status, note = classify(exp, actual, flaky_reason=_flaky_reason(model, flaky))
        v = ModelStatus(model, status, expected=exp.outcome if exp else "", actual=actual or "",
                    expected_detail=exp.detail if exp else "", actual_detail=detail_of(row) if row else "",
                    note=note)
        if status == "expected_failure" and v.expected_detail != v.actual_detail:
            v.note = f"detail changed: {v.expected_detail or '-'} -> {v.actual_detail or '-'} (update the file)"
        if row is not None and actual not in MATCHED:
            groups = group_rows([row])
            v.group = groups[0].label if groups else ""
            if status == "new_failure":
                failing.append(row)
        res.verdicts.append(v)
    res.new_failure_groups = group_rows(failing)
    if perf is not None:
        res.perf_path, expected_perf = perf
        tonight = {r["model_id"]: r for r in _records(df, extra=("perf",))} if "perf" in df.columns else {}
        label = settings_label(res.config.target, res.config.settings)
        res.perf = gate([(m, label, {"perf": expected_perf[m]}, tonight.get(m)) for m in sorted(expected_perf)],
                        threshold=perf_threshold, allowlist=perf_allowlist)
    return res


def count_line(rows: list[Expected]) -> str:
    """``drift 3, pass 5`` for the rows of an expected file."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    return ", ".join(f"{o} {n}" for o, n in sorted(counts.items()))


def verdict_line(res: CheckResult) -> str:
    """One line for a job summary: OK / FAIL with the gating counts."""
    c = res.counts
    head = "OK" if res.ok else "FAIL"
    perf = (f", {len(res.perf.regressions)} perf regression(s) of {res.perf.compared} timed"
            + (f", {len(res.perf.kernels)} kernel regression(s)" if res.perf.kernels else "")
            + (f" ({len(res.perf.inconclusive)} inconclusive, not counted)" if res.perf.inconclusive else "")
            if res.perf is not None else "")
    return (f"{head}: {c['new_failure']} new failure(s), {c['unexpected_pass']} unexpected pass(es){perf}; "
            f"{c['pass']} pass, {c['expected_failure']} expected failure(s), {c['flaky']} flaky, "
            f"{c['missing']} missing, {c['new_model']} new model(s)")


def format_check(res: CheckResult, *, limit: int = 50) -> str:
    """The human summary: configuration, counts, new failures by group, then each class of model."""
    lines = [f"baseline check of run {res.run_id} against {res.expected_path}",
             f"  {res.config.describe()}",
             "  " + "  ".join(f"{s}={n}" for s, n in res.counts.items())]
    if res.new_failure_groups:
        lines.append(f"\nNEW FAILURES by group ({len(res.new_failure_groups)}):")
        for g in res.new_failure_groups[:limit]:
            lines.append(f"  {g.count:>4} x {g.label}")
            lines.append(f"         {', '.join(g.models[:5])}{' ...' if g.count > 5 else ''}")
    for status in STATUSES:
        items = [v for v in res.by_status(status) if status not in ("pass", "expected_failure") or v.note]
        if not items:
            continue
        title = status.upper().replace("_", " ") if status in GATING else status.replace("_", " ")
        if status == "expected_failure":
            title = "expected failures whose detail changed"
        if status == "pass":
            title = "passes whose matched outcome changed"
        lines.append(f"\n{title} ({len(items)}): {_MEANING[status]}")
        for v in items[:limit]:
            arrow = f"{v.expected or '-'} -> {v.actual or '-'}"
            extra = "; ".join(x for x in (v.note, v.group) if x)
            lines.append(f"  {v.model}  {arrow}" + (f"  [{extra}]" if extra else ""))
        if len(items) > limit:
            lines.append(f"  ... and {len(items) - limit} more")
    if res.perf is not None:
        lines.append(f"\nperf baseline {res.perf_path}: " + (f"{res.perf.compared} model(s) timed tonight and in it"
                     if res.perf.compared else "no model of tonight's run was timed (--perf) and is in it"))
        lines += format_gate(res.perf, limit=limit)
    lines.append("\nRESULT: " + verdict_line(res))
    return "\n".join(lines)
