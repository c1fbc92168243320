"""Headless-Chromium test of the report opened from disk (file://), the way people open CI artifacts.

Needs Debian's ``chromium`` + ``chromium-driver`` (``/usr/bin/chromedriver``) and selenium; skips with
the reason when they are absent. Screenshots go to ``$PORTHARNESS_ARTIFACTS`` (default: a tmp dir).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness.files import safe_name
from harness.fleet.runner import RunConfig, run_models
from harness.models.model_list import load_model_list
from harness.report.build import build_report
from harness.results.rows import ResultRow
from harness.results.store import ResultStore

pytestmark = pytest.mark.browser
REPO = Path(__file__).resolve().parents[1]

CHROMEDRIVER = Path(os.environ.get("PORTHARNESS_CHROMEDRIVER", "/usr/bin/chromedriver"))
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
CHROME_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
    "--window-size=1400,1000",
)

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed (pip install selenium)")
from selenium.common.exceptions import NoAlertPresentException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support import expected_conditions as EC  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

if not CHROMEDRIVER.exists() or not Path(CHROMIUM).exists():
    pytest.skip(
        f"headless Chromium not available ({CHROMEDRIVER} / {CHROMIUM} missing): "
        "apt-get install -y chromium chromium-driver",
        allow_module_level=True,
    )


REAL_RUN = True  # one-line switch: False builds the report from synthetic rows instead of a real run

# A real, small, deterministic run on sim's defaults (bf16 matmul inputs, the young op set): three tiny models
# that pass within the declared precision (pass_declared: outputs beyond the fp32 envelope, the case whose
# labels must not say drift), one that lacks an op (the summary's "implement first") and one hub id that
# cannot load (offline), so the matrix has more than one outcome to filter by.
REAL_LIST = """id,source,arch,task,modality,inputs,tags,revision,trust_remote_code,atol,rtol,path
tiny/bert/base,tiny,bert,base,text,,,,,,,
tiny/gpt2/causal-lm,tiny,gpt2,causal-lm,text,,,,,,,
tiny/vit/image-cls,tiny,vit,image-cls,vision,,,,,,,
tiny/mixtral/causal-lm,tiny,mixtral,causal-lm,text,,moe,,,,,
portharness-test/no-such-model,hub,bert,base,text,,,,,,,
"""


def _real_run(out: Path) -> Path:
    """`portharness run` on REAL_LIST with the sim target, into ``out/real.db``."""
    lst, db = out / "browser-list.csv", out / "real.db"
    lst.write_text(REAL_LIST)
    cmd = [sys.executable, "-m", "harness.cli", "run", "--list", str(lst), "--target", "sim", "--db", str(db)]
    cmd += ["--precision", "default", "--ops", "young", "--jobs", "2", "--timeout", "240", "--quiet"]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=out)
    assert proc.returncode == 0 and db.exists(), (
        f"real run failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    )
    return db


def _synthetic(write_synthetic_db: Callable[..., list[str]]) -> Callable[[Path], Path]:
    def build(out: Path) -> Path:
        db = out / "synthetic.db"
        write_synthetic_db(db, 40, runs=2, seed=7)  # two runs (diff page), collectives, hostile strings
        return db

    return build


def _shared(tmp_path_factory: pytest.TempPathFactory, name: str, build) -> Path:
    """Build once per test session even under xdist (workers share the session's temp root)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out = root / f"browser-{name}"
    out.mkdir(exist_ok=True)
    with open(root / f"browser-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = out / "done"
        if not done.exists():
            db = build(out)
            build_report(db, out / "site")
            done.write_text(str(db))
    return Path(done.read_text())


@pytest.fixture(scope="module")
def real_run_db(tmp_path_factory: pytest.TempPathFactory, write_synthetic_db) -> Path:
    """The DB of a real small run (or synthetic rows when REAL_RUN is False); its site is next to it."""
    return _shared(
        tmp_path_factory,
        "real" if REAL_RUN else "synthetic",
        _real_run if REAL_RUN else _synthetic(write_synthetic_db),
    )


@pytest.fixture(scope="module")
def site(real_run_db: Path) -> Path:
    return real_run_db.parent / "site"


@pytest.fixture(scope="module")
def synthetic_db(tmp_path_factory: pytest.TempPathFactory, write_synthetic_db) -> Path:
    """Synthetic rows with every page (diff, collectives) and hostile strings in error messages."""
    return _shared(tmp_path_factory, "synthetic", _synthetic(write_synthetic_db))


@pytest.fixture(scope="module")
def artifacts() -> Path:
    path = Path(os.environ.get("PORTHARNESS_ARTIFACTS") or tempfile.mkdtemp(prefix="portharness-artifacts-"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[webdriver.Chrome]:
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in CHROME_FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chrome-profile')}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    drv.set_page_load_timeout(30)
    try:
        yield drv
    finally:
        drv.quit()


def _open(driver: webdriver.Chrome, page: Path) -> list[dict]:
    """Load ``page`` from disk and return its SEVERE console entries."""
    driver.get(page.resolve().as_uri())
    WebDriverWait(driver, 10).until(lambda d: d.execute_script("return document.readyState") == "complete")
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def _visible_rows(driver: webdriver.Chrome) -> int:
    return len(driver.find_elements(By.CSS_SELECTOR, "#matrix-body tr"))


def _results(db: Path):
    with ResultStore(db, create=False) as st:
        return st.results(st.latest_run())


@pytest.mark.long
def test_every_page_loads_cleanly(
    driver: webdriver.Chrome, site: Path, synthetic_db: Path, artifacts: Path
) -> None:
    synthetic_site = synthetic_db.parent / "site"
    pages = []
    for root in (site, synthetic_site):
        pages += sorted(root.glob("*.html")) + sorted((root / "models").glob("*.html"))[:10]
    assert {p.name for p in pages} >= {
        "index.html",
        "matrix.html",
        "ops.html",
        "drift.html",
        "collectives.html",
        "diff.html",
    }
    for page in pages:
        severe = _open(driver, page)
        assert not severe, f"{page.name}: console errors {severe}"
        assert driver.title.endswith("portharness"), page
        assert driver.find_elements(By.TAG_NAME, "h1"), page
    _open(driver, site / "index.html")
    driver.save_screenshot(str(artifacts / "report-index.png"))


def test_matrix_filters_change_row_count(
    driver: webdriver.Chrome, site: Path, real_run_db: Path, artifacts: Path
) -> None:
    df = _results(real_run_db)
    assert not _open(driver, site / "matrix.html")
    total = df.model_id.nunique()
    assert _visible_rows(driver) == total
    assert driver.find_element(By.ID, "row-count").text == f"{total} of {total} models"

    # Free text: a model id narrows the table to the rows containing it.
    target = sorted(df.model_id)[0]
    box = driver.find_element(By.ID, "filter-text")
    box.send_keys(target)
    expected = sum(1 for m in df.model_id.unique() if target.lower() in m.lower())
    WebDriverWait(driver, 5).until(lambda d: _visible_rows(d) == expected)
    assert expected < total
    box.clear()
    box.send_keys("zz-no-such-model-zz")
    WebDriverWait(driver, 5).until(lambda d: _visible_rows(d) == 0)
    assert driver.find_element(By.ID, "matrix-empty").is_displayed()
    box.clear()
    driver.find_element(By.ID, "filter-reset").click()
    WebDriverWait(driver, 5).until(lambda d: _visible_rows(d) == total)

    # Outcome: the rarest outcome present shows exactly its models.
    counts = Counter(df.outcome)
    outcome, n = min(counts.items(), key=lambda kv: (kv[1], kv[0]))
    Select(driver.find_element(By.ID, "filter-outcome")).select_by_value(outcome)
    WebDriverWait(driver, 5).until(lambda d: _visible_rows(d) == n)
    if len(counts) > 1:
        assert n < total
    assert all(c.text == outcome for c in driver.find_elements(By.CSS_SELECTOR, "#matrix-body .chip"))
    driver.save_screenshot(str(artifacts / "report-matrix-filtered.png"))

    # Arch filter combined with the outcome filter.
    Select(driver.find_element(By.ID, "filter-outcome")).select_by_value("")
    arch = sorted(a for a in df.arch.unique() if a)[0]
    Select(driver.find_element(By.ID, "filter-arch")).select_by_value(arch)
    WebDriverWait(driver, 5).until(lambda d: _visible_rows(d) == int((df.arch == arch).sum()))

    # Filters are kept in the URL hash, so index.html's outcome links open a pre-filtered matrix.
    assert not _open(driver, site / "matrix.html")
    driver.get((site / "matrix.html").resolve().as_uri() + f"#outcome={outcome}")
    driver.refresh()
    WebDriverWait(driver, 5).until(lambda d: _visible_rows(d) == n)


def test_matrix_sort(driver: webdriver.Chrome, site: Path) -> None:
    assert not _open(driver, site / "matrix.html")
    header = next(h for h in driver.find_elements(By.CSS_SELECTOR, "#matrix-head th") if h.text == "model")
    header.click()
    first = [a.text for a in driver.find_elements(By.CSS_SELECTOR, "#matrix-body a.model")]
    header.click()
    second = [a.text for a in driver.find_elements(By.CSS_SELECTOR, "#matrix-body a.model")]
    assert second == first[::-1] and len(first) > 1
    assert header.get_attribute("aria-sort") == "descending"


def test_model_link_opens_model_page(
    driver: webdriver.Chrome, site: Path, real_run_db: Path, artifacts: Path
) -> None:
    assert not _open(driver, site / "matrix.html")
    link = driver.find_elements(By.CSS_SELECTOR, "#matrix-body a.model")[0]
    model_id = link.text
    link.click()
    WebDriverWait(driver, 10).until(EC.presence_of_element_located((By.ID, "model-id")))
    assert driver.find_element(By.ID, "model-id").text == model_id
    assert model_id in driver.title
    assert driver.current_url.endswith(f"models/{safe_name(model_id)}.html")
    assert not [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
    driver.save_screenshot(str(artifacts / "report-model.png"))


def test_injected_markup_stays_text(driver: webdriver.Chrome, synthetic_db: Path) -> None:
    """Error messages containing <script> render as text and run nothing."""
    df = _results(synthetic_db)
    hostile = df[df.error_message.str.contains("<script>", regex=False)]
    assert not hostile.empty
    row = hostile.iloc[0]
    assert not _open(driver, synthetic_db.parent / "site" / "models" / f"{safe_name(row.model_id)}.html")
    assert driver.find_element(By.CSS_SELECTOR, "pre.error").text.strip() == row.error_message.strip()
    with pytest.raises(NoAlertPresentException):
        driver.switch_to.alert  # noqa: B018  (an executed alert() would be pending here)


@pytest.fixture(scope="module")
def trend_site(tmp_path_factory: pytest.TempPathFactory, write_synthetic_db) -> Path:
    """A site whose history holds three nights of two configurations."""
    from test_report import three_night_history

    out = tmp_path_factory.mktemp("browser-trend")
    db = out / "nights.db"
    write_synthetic_db(db, 40, runs=3, seed=11, collectives=False)
    build_report(db, out / "site", history=three_night_history(db, out / "history.jsonl"))
    return out / "site"


def test_trend_page_draws_three_nights_per_setting(driver: webdriver.Chrome, trend_site: Path, artifacts: Path) -> None:
    assert not _open(driver, trend_site / "trend.html")
    charts = driver.find_elements(By.CSS_SELECTOR, "section.trend svg.trend")
    assert len(charts) == 2
    for chart in charts:
        for cls in ("pass", "ran", "matched"):
            points = chart.find_elements(By.CSS_SELECTOR, f"circle.point.{cls}")
            assert len(points) == 3
            assert all(p.is_displayed() and p.size["width"] > 0 for p in points)
        assert chart.size["width"] > 300 and chart.size["height"] > 150
    rows = driver.find_elements(By.CSS_SELECTOR, "section.trend tbody tr")
    assert len(rows) == 6
    assert driver.find_elements(By.CSS_SELECTOR, "ul.changes li.appeared")
    nav = driver.find_element(By.CSS_SELECTOR, "header.top nav a.active")
    assert nav.text == "Trend"
    driver.save_screenshot(str(artifacts / "report-trend.png"))
    assert (artifacts / "report-trend.png").stat().st_size > 10_000


GENERATE_LIST = """id,source,arch,task,modality,inputs,tags,revision,trust_remote_code,atol,rtol,path
tiny/llama/causal-lm,tiny,llama,causal-lm,text,,,,,,,
"""
HOSTILE_TOKEN = "<img src=x onerror=alert(7)>"


@pytest.fixture(scope="module")
def generate_site(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    """A night of two real runs (inference; generate with sim's planted cache bug on the static cache), plus a
    generate row whose tokens and message are markup; the site with both configurations side by side."""
    out = tmp_path_factory.mktemp("browser-generate")
    lst, db = out / "l.csv", out / "g.db"
    lst.write_text(GENERATE_LIST)
    base = {"precision": "default", "ops": "young"}
    # in-process runner, one worker: the real runs, without an interpreter start per run (the CLI's own
    # generate options are tested in tests/test_generate.py)
    for settings in (base, {**base, "mode": "generate", "cache": "static", "numerics": "cache-off-by-one"}):
        summary = run_models(load_model_list(str(lst)), RunConfig(settings=settings, jobs=1, retries=0, progress=False),
                             db, list_name="generate")
        assert summary.unfinished == 0
    with ResultStore(db) as st:
        rid = st.latest_run()
        rows = {r["model_id"]: r for r in st.results(rid).to_dict("records")}
        llama = rows["tiny/llama/causal-lm"]
        hostile = {k: v for k, v in llama.items() if k in ResultRow.__dataclass_fields__}
        hostile.update(model_id="org/<b>gen</b>", error_message="<script>alert(8)</script> decoded",
                       ref_tokens=[[HOSTILE_TOKEN, 1]], target_tokens=[[HOSTILE_TOKEN, "<b>2</b>"]],
                       first_divergent_step=1)
        st.record(ResultRow(**hostile))
    build_report(db, out / "site", night=True)
    return out / "site", llama, hostile


def test_decoding_section_draws_steps_and_tokens_beside_inference(
    driver: webdriver.Chrome, generate_site: tuple[Path, dict, dict], artifacts: Path
) -> None:
    site, llama, hostile = generate_site
    assert llama["outcome"] == "drift" and llama["first_drift_step"] == 2
    assert not _open(driver, site / "models" / f"{safe_name(llama['model_id'])}.html")
    configs = driver.find_elements(By.CSS_SELECTOR, "table.configs tbody tr")
    assert len(configs) == 2 and any("mode=generate" in r.text for r in configs)
    row = next(r for r in configs if "mode=generate" in r.text)
    assert f"{int(llama['tokens_matched'])}/8" in row.text and "step 2" in row.text
    chart = driver.find_element(By.CSS_SELECTOR, "svg.steps")
    assert chart.is_displayed() and chart.size["width"] > 300
    declared = chart.find_elements(By.CSS_SELECTOR, "circle.point.declared")
    assert len(declared) == 8
    bad = [p.get_attribute("class").split() for p in declared]
    assert ["bad" in c for c in bad][:3] == [False, False, True]  # steps 0 and 1 inside the bound, 2 beyond
    assert chart.find_elements(By.CSS_SELECTOR, "line.drift-step")
    strip = driver.find_element(By.CSS_SELECTOR, "table.tokens")
    cells = strip.find_elements(By.CSS_SELECTOR, "tr:nth-child(2) td")
    assert [c.text for c in cells] == [str(t) for t in llama["target_tokens"][0]]
    assert llama["first_divergent_step"] == llama["tokens_matched"] == 2  # the bug flips a token where it starts
    assert len(strip.find_elements(By.CSS_SELECTOR, "td.diverged")) >= 1
    driver.save_screenshot(str(artifacts / "report-generate.png"))

    assert not _open(driver, site / "models" / f"{safe_name(hostile['model_id'])}.html")
    assert driver.find_element(By.ID, "model-id").text == hostile["model_id"]
    strip = driver.find_element(By.CSS_SELECTOR, "table.tokens")
    assert HOSTILE_TOKEN in [c.text for c in strip.find_elements(By.TAG_NAME, "td")]
    assert strip.find_element(By.CSS_SELECTOR, "td.diverged").text == "<b>2</b>"
    assert not strip.find_elements(By.CSS_SELECTOR, "img, b, script")
    assert driver.find_element(By.CSS_SELECTOR, "pre.error").text.startswith("<script>")
    with pytest.raises(NoAlertPresentException):
        driver.switch_to.alert  # noqa: B018


@contextlib.contextmanager
def _viewport(driver: webdriver.Chrome, width: int = 1400, height: int = 900) -> Iterator[None]:
    """The page laid out in exactly width x height CSS pixels (a laptop's browser window)."""
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
    try:
        yield
    finally:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def _above_the_fold(driver: webdriver.Chrome, elements: list) -> bool:
    height = driver.execute_script("return window.innerHeight")
    return bool(elements) and all(0 <= e.rect["y"] and e.rect["y"] + e.rect["height"] <= height for e in elements)


def test_summary_first_screen_says_what_to_fix_first(
    driver: webdriver.Chrome, site: Path, real_run_db: Path, artifacts: Path
) -> None:
    """At 1400x900, without scrolling: the headline, the missing ops to implement, the largest failure groups
    and the outcomes that occurred (no rows of zeros); nothing pushes the page sideways."""
    df = _results(real_run_db)
    counts = Counter(df.outcome)
    with _viewport(driver):
        assert not _open(driver, site / "index.html")
        ops = driver.find_elements(By.CSS_SELECTOR, "#fix-first tbody tr")
        assert [r.find_element(By.TAG_NAME, "code").text for r in ops] == ["aten::sort.stable"]
        groups = driver.find_elements(By.CSS_SELECTOR, "#top-groups tbody tr")
        assert {r.find_element(By.CSS_SELECTOR, ".chip").text for r in groups} == {"unsupported_op", "load_fail"}
        legend = driver.find_elements(By.CSS_SELECTOR, "#outcome-legend li")
        assert {li.find_element(By.CSS_SELECTOR, ".chip").text for li in legend} == set(counts)  # no zero rows
        assert all(int(li.find_element(By.CSS_SELECTOR, ".num").text) > 0 for li in legend)
        cards = driver.find_elements(By.CSS_SELECTOR, "#ran-pct, #matched-pct")
        assert _above_the_fold(driver, cards + ops + groups + legend)
        assert driver.find_element(By.CSS_SELECTOR, "svg.stack text.seg").text.startswith("pass_declared")
        assert driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
        # the per-architecture headline: an architecture that is all pass_declared ran and matched 100%
        bert = next(r for r in driver.find_elements(By.CSS_SELECTOR, "#by-arch + div table tbody tr")
                    if r.find_elements(By.TAG_NAME, "td")[0].text == "gpt2")
        assert [c.text for c in bert.find_elements(By.TAG_NAME, "td")[2:4]] == ["100.0%", "100.0%"]
        driver.save_screenshot(str(artifacts / "report-summary-1400x900.png"))


_JUDGED_OK = {"pass": {"within fp32"}, "pass_declared": {"within fp32", "within declared"},
              "flaky": {"within fp32", "within declared"}}


def _badges(driver: webdriver.Chrome) -> dict[str, list[str]]:
    """Per result section of a model page: its outcome chip and its outputs' judgements."""
    out = {}
    for section in driver.find_elements(By.CSS_SELECTOR, "section.result"):
        outcome = section.find_element(By.CSS_SELECTOR, "h2 .chip").text
        out[section.find_element(By.TAG_NAME, "h2").text] = [
            outcome, *(b.get_attribute("data-judgement") for b in section.find_elements(By.CSS_SELECTOR, ".chip.judged"))]
    return out


def test_no_per_output_badge_contradicts_the_row(
    driver: webdriver.Chrome, site: Path, real_run_db: Path, generate_site: tuple[Path, dict, dict], artifacts: Path
) -> None:
    df = _results(real_run_db)
    seen = Counter()
    for model, outcome in zip(df.model_id, df.outcome, strict=True):
        assert not _open(driver, site / "models" / f"{safe_name(model)}.html")
        for _, (shown, *judged) in _badges(driver).items():
            assert shown == outcome
            if outcome in _JUDGED_OK:
                assert set(judged) <= _JUDGED_OK[outcome], (model, outcome, judged)
            seen.update(judged)
        if outcome == "pass_declared":
            assert "FAIL" not in driver.find_element(By.TAG_NAME, "main").text
            driver.save_screenshot(str(artifacts / "report-model-pass-declared.png"))
    assert seen["within declared"] > 0  # the case the labels used to get wrong was there to be judged
    # decoding: a drift from step 2 on (sim's cache bug) badges steps 0 and 1 within, not drift
    gsite, llama, _ = generate_site
    assert not _open(driver, gsite / "models" / f"{safe_name(llama['model_id'])}.html")
    section = next(s for s in driver.find_elements(By.CSS_SELECTOR, "section.result") if "mode=generate" in s.text)
    steps = {r.find_element(By.TAG_NAME, "code").text: r.find_element(By.CSS_SELECTOR, ".chip.judged")
             .get_attribute("data-judgement") for r in section.find_elements(By.CSS_SELECTOR, "table.outputs tbody tr")}
    assert steps["logits/step0"] != "beyond" and steps["logits/step1"] != "beyond"
    assert steps["logits/step2"] == "beyond"
    driver.save_screenshot(str(artifacts / "report-decoding.png"))
