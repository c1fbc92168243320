"""Build the report site: read the run from the store, prepare the output dir, render each page.

The DB is read completely before anything is written, so a bad DB or run id never touches
``out_dir``; and ``out_dir`` is only rebuilt when it is empty or holds a previous report.
Every template is rendered with autoescaping on: model ids, error messages and tracebacks are
untrusted text and must never become markup.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import pandas as pd

from harness import __version__, files
from harness.analysis.diff import DiffResult, diff_runs, previous_comparable
from harness.analysis.fingerprint import FailureGroup, group_failures
from harness.analysis.matrix import op_coverage, op_support, outcome_counts, with_config
from harness.analysis.nights import night_runs
from harness.analysis.trend import read_history
from harness.analysis.worklist import Worklist
from harness.analysis.worklist import load as load_worklist
from harness.files import safe_name
from harness.outcomes import COLOURS, OUTCOMES
from harness.report.collectives import collective_faults_view, collectives_view, model_settings_view
from harness.report.links import Command, row_links
from harness.report.nightly import regression_groups_view, trend_view
from harness.report.parallel import in_parallel, page_workers
from harness.report.perf import perf_diff_view, perf_row_view, speed_view
from harness.report.placement import PAGE as PLACEMENT_PAGE
from harness.report.placement import latest as latest_placements
from harness.report.placement import placement_view
from harness.report.repros import copy_repros
from harness.report.summary import summary_view
from harness.report.views import (
    diff_view,
    drift_view,
    fmt,
    history_view,
    matrix_data,
    op_anchor,
    records,
    row_view,
    run_view,
)
from harness.report.worklist import OP_DIR, TOP, op_pages, worklist_view
from harness.results.dbfile import StoreError
from harness.results.rows import utc_now
from harness.results.store import ResultStore
from harness.results.variations import shown_run

PACKAGE_DIR = Path(__file__).resolve().parent
TEMPLATES_DIR = PACKAGE_DIR / "templates"
ASSETS_DIR = PACKAGE_DIR / "assets"
MARKER = ".portharness-report"
FAULTS_PAGE = "collective-faults.html"
NAV = (
    ("index.html", "Summary"),
    ("matrix.html", "Matrix"),
    ("ops.html", "Op coverage"),
    ("drift.html", "Drift"),
    ("collectives.html", "Collectives"),
)


# ----------------------------------------------------------------------------------------------
# Input and output
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _RunData:
    """What the pages need from the store, read in one go so the DB is closed before writing."""

    run_id: str
    df: pd.DataFrame  # the run's results, with a ``config`` column
    runs: pd.DataFrame  # every run in the DB
    run: dict[str, Any]  # the selected run's row of ``runs``
    hist: pd.DataFrame  # every result in the DB, for the model pages' history
    coll: pd.DataFrame  # collective benchmarks shown on the collectives page
    coll_run: str | None  # the run they come from
    faults: pd.DataFrame  # fault-scenario rows shown on the collective-faults page (when there are any)
    faults_runs: list[str]  # the runs they come from
    placements: pd.DataFrame  # placement scenarios' latest rows (the placement page, when there are any)
    base: tuple[str, pd.DataFrame, str] | None  # diff base: run id, its results, where from


def _load(
    db_path: str | os.PathLike,
    run_id: str | None,
    base_run: str | None,
    base_db: str | os.PathLike | None,
    night: bool = False,
) -> _RunData:
    """Read the run (default: the latest with results) and everything around it from the store.

    With ``night`` (and no ``run_id``) the latest run of every configuration is read, so a merged
    nightly DB with several settings is one site: a matrix column per setting, a row per setting on
    each model page; the header names the first configuration's run."""
    with ResultStore(db_path, read_only=True) as store:
        if night and run_id is None and len(nights := night_runs(store, ("models",))) > 1:
            return _load_night(store, [r["run_id"] for r in nights], base_db)
        # a model run (op runs have their own pages), else a benchmark's (collectives), never a harvest
        rid = shown_run(store, run_id, "model results to report") or store.latest_run()
        if rid is None:
            raise StoreError(f"{db_path} contains no runs yet; nothing to report.")
        df = with_config(store.results(rid))  # raises StoreError for an unknown run id
        runs = store.runs()
        # Collective benchmarks are usually their own run (list "collectives"): show the selected run's,
        # else the latest benchmark run in the DB.
        coll_run = rid if store.collectives(rid).shape[0] else store.latest_run(has_collectives=True)
        faults = _latest_faults(store, rid)
        hist = store.history()
        return _RunData(
            run_id=rid,
            df=df,
            runs=runs,
            run=runs[runs.run_id == rid].iloc[0].to_dict(),
            hist=hist,
            coll=store.collectives(coll_run) if coll_run else store.collectives(rid),
            coll_run=coll_run,
            faults=faults,
            faults_runs=sorted(set(faults.run_id)) if not faults.empty else [],
            placements=latest_placements(store),
            base=_resolve_base(store, rid, base_run, base_db, hist),
        )


def _latest_faults(store: ResultStore, run_id: str) -> pd.DataFrame:
    """The latest row of each (backend, world size, setting, scenario) over every fault run in the DB
    (``collectives --faults`` records one run per target and world size); the selected run's rows win."""
    every = store.collective_faults()
    if every.empty:
        return every
    every = every.assign(_own=every.run_id == run_id).sort_values(["_own", "finished_at"], kind="stable")
    key = ["target", "backend", "world_size", "setting", "scenario"]
    return every.drop_duplicates(key, keep="last").drop(columns="_own")


def _load_night(store: ResultStore, rids: list[str], base_db: str | os.PathLike | None) -> _RunData:
    """`_load` for several runs (one per configuration); the diff base is each configuration's
    previous run in this DB, or every configuration's latest run in ``base_db``."""
    df = with_config(pd.concat([store.results(r) for r in rids], ignore_index=True))
    runs = store.runs()
    hist = store.history()
    if base_db is not None:
        with ResultStore(base_db, read_only=True) as bs:
            base_ids = [r["run_id"] for r in night_runs(bs)]
            base_df = _base_rows(bs, base_ids) if base_ids else None
            where = str(base_db)
    else:
        base_ids = [b for b in (previous_comparable(store, r) for r in rids) if b is not None]
        base_df = _base_rows(store, base_ids, hist) if base_ids else None
        where = "this DB"
    coll_run = store.latest_run(has_collectives=True)
    faults = _latest_faults(store, rids[0])
    return _RunData(
        run_id=rids[0],
        df=df,
        runs=runs,
        run=runs[runs.run_id == rids[0]].iloc[0].to_dict(),
        hist=hist,
        coll=store.collectives(coll_run) if coll_run else store.collectives(rids[0]),
        coll_run=coll_run,
        faults=faults,
        faults_runs=sorted(set(faults.run_id)) if not faults.empty else [],
        placements=latest_placements(store),
        base=("+".join(base_ids), base_df, where) if base_df is not None else None,
    )


def _base_rows(store: ResultStore, run_ids: list[str], hist: pd.DataFrame | None = None) -> pd.DataFrame:
    """The diff base as the light history rows (outcome, ratio, op, error type): the diff never reads the
    metrics, attempts and tracebacks whose JSON was a fifth of loading a 5,000-model report (a model
    removed since the base is described by its op or error type, without its message)."""
    for rid in run_ids:
        if not store.has_run(rid):
            store.results(rid)  # StoreError naming the recent runs
    hist = store.history() if hist is None else hist
    rows = hist[hist["run_id"].isin(run_ids)].reset_index(drop=True)
    perf = store.perf(run_ids)  # the speed gate's measurements (--perf runs only)
    if perf.empty:
        return rows
    key = ["run_id", "model_id", "target", "settings_json"]
    return rows.merge(perf[[*key, "perf"]], on=key, how="left")


def _resolve_base(store: ResultStore, run_id: str, base_run: str | None, base_db: str | os.PathLike | None,
                  hist: pd.DataFrame | None = None) -> tuple[str, pd.DataFrame, str] | None:
    """(base run id, its rows, where from), or None when there is nothing to compare with."""
    if base_db is not None:
        with ResultStore(base_db, read_only=True) as bs:
            rid = base_run or bs.latest_run(has_results=True)
            if rid is None:
                raise StoreError(f"base DB {base_db} contains no runs")
            return rid, _base_rows(bs, [rid]), str(base_db)
    rid = base_run or previous_comparable(store, run_id)
    if rid is None:
        return None
    return rid, _base_rows(store, [rid], hist), "this DB"


_DICT_ATTRS = frozenset(dir(dict))


class _Environment(jinja2.Environment):
    """Jinja with a cheaper ``x.name`` on the view dicts every page is made of.

    Jinja resolves ``x.name`` by trying the attribute first and the item on AttributeError; on a dict
    that raises and catches an exception for every field, which was a third of the time spent on
    thousands of model pages. Same result, same precedence (a dict's methods still win): names that
    are not dict attributes go straight to the item."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRS:
            try:
                return obj[attribute]
            except KeyError:
                pass
        return super().getattr(obj, attribute)


def _env() -> jinja2.Environment:
    """Jinja environment over the templates shipped in the package."""
    if not TEMPLATES_DIR.is_dir():
        raise FileNotFoundError(
            f"report templates not found in {TEMPLATES_DIR} (a broken install: reinstall portharness)"
        )
    env = _Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
        auto_reload=False,  # templates do not change during a build: no stat() per page (thousands of pages)
        autoescape=True,  # every template: model-supplied text must never become markup
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["fmt"] = fmt
    env.globals["OUTCOMES"] = OUTCOMES
    env.globals["OUTCOME_COLORS"] = COLOURS
    return env


# Every name the site has at its top level: a rebuild removes those the new site lacks (a diff page
# from a build that had a base), and leaves anything else a user put there alone.
SITE_NAMES = (MARKER, "assets", "models", "repro", OP_DIR, "index.html", "matrix.html", "ops.html", "drift.html",
              "collectives.html", FAULTS_PAGE, "placement.html", "diff.html", "trend.html")


def check_out(out: str | os.PathLike) -> None:
    """Refuse an output directory before anything is read, run or written: a file, a non-empty directory
    that is not a previous report, or one that cannot be written (StoreError / OutputError)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise StoreError(f"report output {out} exists and is not a directory; pass a directory with --out")
    ours = (files.STAGE_PREFIX, files.OLD_PREFIX)  # what a killed build left in a directory it had just made
    if out.exists() and any(not n.name.startswith(ours) for n in out.iterdir()) and not (out / MARKER).exists():
        raise StoreError(
            f"report output {out} is a non-empty directory that is not a portharness report; "
            "refusing to write into it. Pass an empty or new --out directory."
        )
    files.check_writable(out, create_parents=True, directory=True)


def _prepare_out(out: Path, stage: Path) -> None:
    """The site's fixed files in the staging directory; what an older, killed build left in `out` goes."""
    for left in [*out.glob(".models-new-*"), *out.glob(".models-old-*")]:  # left by older portharness versions
        shutil.rmtree(left, ignore_errors=True)
    (stage / MARKER).write_text("generated by portharness report; this directory is rebuilt on each run\n")
    assets = stage / "assets"
    assets.mkdir()
    if not ASSETS_DIR.is_dir():
        raise FileNotFoundError(
            f"report assets not found in {ASSETS_DIR} (a broken install: reinstall portharness)"
        )
    for f in ASSETS_DIR.iterdir():
        if f.is_file():
            shutil.copyfile(f, assets / f.name)
    # Outcome colours have one home (harness/outcomes.py); the stylesheet for them is generated from it.
    (assets / "outcomes.css").write_text(
        "".join(f".o-{name} {{ background: {colour}; }}\n" for name, colour in COLOURS.items())
        + ".o-none { background: #d0d7de; color: #57606a; }\n.chip.fallback { outline: 2px dashed #6a1b9a; }\n"
    )


# ----------------------------------------------------------------------------------------------
# Pages
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Site:
    """Where and how pages are written; ``common`` is what every page's base template shows."""

    env: jinja2.Environment
    out: Path
    common: dict[str, Any]

    def render(
        self, template: str, rel: str, *, root: str = "", active: str | None = None, **ctx: Any
    ) -> None:
        dest = self.out / rel
        page = self.env.get_template(template).render(
            **self.common, root=root, active=dest.name if active is None else active, **ctx
        )
        dest.write_text(page, encoding="utf-8")


def _common(
    data: _RunData, db_path: str | os.PathLike, *, has_diff: bool, has_trend: bool = False
) -> dict[str, Any]:
    faults = [(FAULTS_PAGE, "Collective faults")] if not data.faults.empty else []
    faults += [(PLACEMENT_PAGE, "Placement")] if not data.placements.empty else []
    return {
        **run_view(data.run),
        "nav": list(NAV) + faults + ([("diff.html", "Diff")] if has_diff else [])
        + ([("trend.html", "Trend")] if has_trend else []),
        "generated_at": utc_now(),
        "harness_version": __version__,
        "db_name": Path(db_path).name,
    }


def _render_index(site: _Site, data: _RunData, configs: list[str], res: DiffResult | None, hrefs: dict[str, str],
                  cov: pd.DataFrame, groups: list[FailureGroup], work: Worklist | None = None) -> None:
    site.render("index.html", "index.html",
                **summary_view(data.df, data.runs, configs, res, cov=cov, groups=groups, hrefs=hrefs),
                speed=speed_view(data.df, hrefs), perf_regressions=len(res.perf.regressions) + len(res.perf.kernels) if res is not None else 0,
                work=worklist_view(work, hrefs, top=TOP))


def _render_matrix(site: _Site, df: pd.DataFrame, configs: list[str], hrefs: dict[str, str]) -> None:
    total = sum(outcome_counts(df).values())
    empty = {"configs": [], "outcomes": list(OUTCOMES), "rows": []}
    site.render(
        "matrix.html", "matrix.html", data=matrix_data(df, configs, hrefs) if total else empty, total=total
    )


def _render_ops(
    site: _Site, df: pd.DataFrame, cov: pd.DataFrame, opinfo_csv: str | os.PathLike | None, hrefs: dict[str, str],
    work: Worklist | None = None,
) -> None:
    site.render(
        "ops.html",
        "ops.html",
        ops=[{**o, "anchor": op_anchor(o["op"])} for o in records(cov)],
        support=records(op_support(df)) if not df.empty else [],
        has_opinfo=opinfo_csv is not None,
        opinfo_name=Path(opinfo_csv).name if opinfo_csv is not None else "",
        hrefs=hrefs,
        work=worklist_view(work, hrefs),
    )


def _render_collectives(site: _Site, data: _RunData, hrefs: dict[str, str]) -> None:
    # Name the benchmark run only when it is not the run the rest of the site shows.
    other_run = data.coll_run if data.coll_run and data.coll_run != data.run_id else ""
    site.render("collectives.html", "collectives.html", groups=collectives_view(data.coll), coll_run=other_run,
                per_model=model_settings_view(data.df, hrefs))


def _render_collective_faults(site: _Site, data: _RunData) -> None:
    """Only when the DB has fault scenarios (then the nav links it)."""
    if data.faults.empty:
        return  # a previous report's page goes with the rebuild (SITE_NAMES)
    other = [r for r in data.faults_runs if r != data.run_id]
    site.render("collective-faults.html", FAULTS_PAGE, faults_runs=other, **collective_faults_view(data.faults))


def _render_models(
    site: _Site, df: pd.DataFrame, hist: pd.DataFrame, hrefs: dict[str, str], also: Callable[[], None] | None = None,
    links: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> None:
    """One page per model. A night has thousands, so this is the report's hot loop: the template is
    looked up once and the shared context built once (``_Site.render`` per page did both each time)."""
    history = history_view(hist)
    by_model: dict[str, list[dict[str, Any]]] = {}
    rows_all = records(df)
    repro_links = copy_repros(site.out, rows_all)
    for r in rows_all:
        r["repro_link"] = repro_links.get(str(r.get("repro_path") or ""), "")
        by_model.setdefault(r["model_id"], []).append(r)
    template = site.env.get_template("model.html")
    shared = {**site.common, "root": "../", "active": ""}
    # Pages go to a fresh directory (the staging site) that then replaces models/ whole: on ext4, creating
    # thousands of files in a new directory and dropping the old one is several times faster than
    # unlinking or truncating them one by one where they are (measured with 5,000 pages: ~0.5 s against 5-7 s).
    new = site.out / "models"
    new.mkdir()

    def write(chunk: list[tuple[str, list[dict[str, Any]]]]) -> None:
        for model, rows in chunk:
            page = template.render(
                shared,
                model_id=model,
                rows=[{**row_view(r), "perf": perf_row_view(r.get("perf")), **(links(r) if links else {})}
                      for r in sorted(rows, key=lambda r: r["config"])],
                history=history.get(model, []),
            )
            with open(new / hrefs[model].removeprefix("models/"), "w", encoding="utf-8") as f:
                f.write(page)

    items = list(by_model.items())
    in_parallel(items, write, page_workers(len(items)), also)


def build_report(
    db_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    run_id: str | None = None,
    base_run: str | None = None,
    base_db: str | os.PathLike | None = None,
    opinfo_csv: str | os.PathLike | None = None,
    history: str | os.PathLike | None = None,
    night: bool = False,
    command: Command | None = None,
) -> Path:
    """Render the static site for ``run_id`` (default latest) into ``out_dir``; returns index.html.

    The diff page compares with ``base_run`` (same DB), the latest run of ``base_db``, or by default
    the previous comparable run in the DB when there is one. With ``history`` (a nightly history
    file, `harness.analysis.trend`) the site gets a trend page. With ``night`` the site shows the latest
    run of every configuration in the DB (a merged nightly DB holding several settings). With ``command``
    (`harness.cli.options.check_command`) each model page shows the command that reproduces its row.
    """
    out = Path(out_dir)
    env = _env()
    data = _load(db_path, run_id, base_run, base_db, night)
    if history is not None and not Path(history).exists():  # anything else: read_history says what
        raise FileNotFoundError(f"history file {history} does not exist")
    entries = read_history(history) if history is not None else None  # read (and checked) before writing
    work = load_worklist(db_path, data.run_id)  # the op run of the shown configuration, if any
    check_out(out)
    with files.replaced_dir(out, stale=SITE_NAMES) as stage:  # the old site stays whole if this fails
        _prepare_out(out, stage)
        _build(env, stage, data, db_path, entries, opinfo_csv, command, work)
    return out / "index.html"


def _render_worklist(site: _Site, work: Worklist | None, hrefs: dict[str, str]) -> None:
    """One page per op overload of the op run, with its variations."""
    pages = op_pages(work, hrefs, {})
    if not pages:
        return
    assert work is not None
    links = copy_repros(site.out, [r for r in work.variations.to_dict("records") if r.get("repro_path")])
    (site.out / OP_DIR).mkdir(exist_ok=True)
    for page in op_pages(work, hrefs, links):
        site.render("op.html", page["file"], root="../", active="ops.html", page=page)


def _build(env: jinja2.Environment, stage: Path, data: _RunData, db_path: str | os.PathLike,
           entries: list[dict[str, Any]] | None, opinfo_csv: str | os.PathLike | None, command: Command | None,
           work: Worklist | None = None) -> None:
    df, base = data.df, data.base
    site = _Site(env, stage, _common(data, db_path, has_diff=base is not None, has_trend=entries is not None))
    configs = sorted(df["config"].unique()) if not df.empty else []
    models = sorted(df["model_id"].unique()) if not df.empty else []
    hrefs = {m: f"models/{safe_name(m)}.html" for m in models}

    cov = op_coverage(df, opinfo_csv) if not df.empty else pd.DataFrame()  # reads the OpInfo CSV
    groups = group_failures(df)
    # before the model pages: a page says when the speed gate flagged it
    res = diff_runs(base[1], df, base_run=base[0], head_run=data.run_id) if base is not None else None

    def site_pages() -> None:
        _render_index(site, data, configs, res, hrefs, cov, groups, work)
        _render_matrix(site, df, configs, hrefs)
        _render_ops(site, df, cov, opinfo_csv, hrefs, work)
        _render_worklist(site, work, hrefs)
        site.render("drift.html", "drift.html", **drift_view(df, hrefs))
        _render_collectives(site, data, hrefs)
        _render_collective_faults(site, data)
        if not data.placements.empty:
            site.render("placement.html", PLACEMENT_PAGE, **placement_view(data.placements))
        if res is not None and base is not None:
            diff = {**diff_view(res, hrefs), "groups": regression_groups_view(res, hrefs),
                    "perf": perf_diff_view(res.perf, hrefs)}
            site.render("diff.html", "diff.html", diff=diff, base_from=base[2])
        if entries is not None:
            site.render("trend.html", "trend.html", **trend_view(entries))

    # The site's own pages are rendered while forked workers write model pages (when there are many).
    _render_models(site, df, data.hist, hrefs, also=site_pages, links=row_links(groups, cov, res, command))
