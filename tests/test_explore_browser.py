"""The run explorer's page in a real headless browser (Debian's chromium through chromedriver) on real runs:
a finished quickstart run, one whose trainer was killed and restarted by the watchdog (``restarted_run``,
tests/conftest.py), and an agent run whose rollout was killed mid-conversation (``agent_run``).

Every panel must have drawn data, the restart must be marked on the curves and the timeline, and the tokens
of an opened trajectory must carry the versions its spool file holds; an agent episode's masked turn is grey.
The static export must do the same from a file:// URL. Screenshots of each panel go to test-artifacts/explore/
(docs/explore.md shows them).
Needs chromium and chromium-driver: the README's test command installs them (scripts/install_browser.sh).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from chaos_script import load_script
from test_e2e import ROOT, submit_args

from hpcrl.explore.export import export_html
from hpcrl.explore.reader import RunView
from hpcrl.explore.server import make_server, serve_in_thread, url_of
from hpcrl.metrics.writer import read_metrics
from hpcrl.spool.format import read_group

pytestmark = [pytest.mark.slow, pytest.mark.browser]
ARTIFACTS = ROOT / "test-artifacts" / "explore"
CURVES = {"reward": "reward/mean", "policy loss": "loss/pg_loss", "entropy": "loss/entropy",
          "clip fraction": "loss/clip_fraction", "samples/s": "throughput/samples_per_s"}
SHOTS = load_script("explore_shots")
wait = SHOTS.wait


@pytest.fixture(scope="module")
def browser():
    try:
        driver = SHOTS.chrome()
    except RuntimeError as e:
        pytest.fail(str(e))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def start(run: Path, cache: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hpcrl.submit", "--config", str(ROOT / "configs/quickstart.yaml"),
                             *submit_args(run, cache, *overrides)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def finished(tmp_path_factory, cache) -> Path:
    run = tmp_path_factory.mktemp("explore") / "finished"
    proc = start(run, cache, "trainer.total_steps=12", "admission.max_staleness=2", "eval.every_steps=4")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return run


def check_page(driver, run: Path, name: str) -> None:
    """Every panel drew the run's data; one trajectory's token colours follow its spool file's versions."""
    from selenium.webdriver.common.by import By
    wait(driver, lambda d: d.execute_script("return document.body.dataset.loaded === '1'"), what="page loaded")
    rows = read_metrics(run / "logs" / "metrics.jsonl")
    steps = len(rows)
    curves = {c.get_attribute("data-title"): int(c.get_attribute("data-points"))
              for c in driver.find_elements(By.CSS_SELECTOR, ".curve")}
    for title in ("reward", "held-out accuracy", "policy loss", "samples/s"):
        assert curves.get(title, 0) > 0, (title, curves)
    for title, key in CURVES.items():  # a step that skipped its update (uniform rewards) logs no loss statistics
        assert curves.get(title, 0) == sum(key in r for r in rows), (title, curves)
    staleness = driver.find_element(By.ID, "staleness")
    assert staleness.get_attribute("data-buckets") and int(staleness.get_attribute("data-points")) == steps
    drawn = driver.execute_script("return document.getElementById('staleness').data"
                                  ".reduce((n, t) => n + t.y.filter((y) => y > 0).length, 0)")
    assert drawn > 0
    timeline = driver.find_element(By.ID, "timeline")
    assert int(timeline.get_attribute("data-events")) > 0  # checkpoints, published versions, the end
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#groups tbody tr[data-path]"), what="groups listed")
    row = driver.find_elements(By.CSS_SELECTOR, "#groups tbody tr[data-path]")[-1]
    path = row.get_attribute("data-path")
    row.click()
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#group .sample .tok[data-version]"), what="tokens")
    group = read_group(run / "spool" / path)
    for i, sample in enumerate(group.samples):
        toks = driver.find_elements(By.CSS_SELECTOR, f"#group .sample[data-sample='{i}'] .tok")
        assert [int(t.get_attribute("data-version")) for t in toks] == sample.versions.tolist()
        colours = {int(t.get_attribute("data-version")): t.value_of_css_property("background-color") for t in toks}
        lo, hi = group.version_range()
        if hi > lo and lo in colours and hi in colours:
            assert colours[lo] != colours[hi]  # the versions are told apart by colour
    severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, severe
    SHOTS.shoot(driver, ARTIFACTS, name)


def test_the_page_of_a_finished_run(browser, finished) -> None:
    srv = make_server(RunView(finished), "127.0.0.1", 0)
    serve_in_thread(srv)
    try:
        browser.get(url_of(srv))
        check_page(browser, finished, "finished")
        assert browser.find_element("id", "refresh").text == "done"  # a finished run is not polled
    finally:
        srv.shutdown()
        srv.server_close()


def test_the_page_of_a_run_with_a_restart_marks_it(browser, restarted_run) -> None:
    restarted = restarted_run
    srv = make_server(RunView(restarted), "127.0.0.1", 0, token="t0ken")
    serve_in_thread(srv)
    try:
        browser.get(url_of(srv))  # the token in the URL, then the cookie for every request after it
        check_page(browser, restarted, "restarted")
        restarts = browser.execute_script(
            "return document.getElementById('curve-reward').layout.shapes.filter((s) => s.line.color === '#d62728')"
            ".length")
        assert restarts >= 1  # the trainer's restart as a dashed line on the curves
        kinds = browser.execute_script("return document.getElementById('timeline').data.map((t) => t.name)")
        assert any(k.startswith("restart") for k in kinds) and any(k.startswith("checkpoint") for k in kinds), kinds
    finally:
        srv.shutdown()
        srv.server_close()


def test_the_static_export_opens_from_a_file(browser, restarted_run, tmp_path) -> None:
    restarted = restarted_run
    out = export_html(RunView(restarted), tmp_path / "report.html", groups_per_kind=5)
    browser.get(out.as_uri())
    check_page(browser, restarted, "export")
    assert browser.find_element("id", "refresh").text.startswith("exported")


def test_the_page_follows_a_live_run(browser, restarted_run, tmp_path) -> None:
    """A copy of the run cut back to its first half (no DONE marker, half of its records): the page polls,
    draws the records appended meanwhile, and stops polling once the run is done."""
    run = tmp_path / "live"
    shutil.copytree(restarted_run, run, symlinks=True)
    (run / "DONE").unlink()
    lines = (run / "logs" / "metrics.jsonl").read_text().splitlines(keepends=True)
    half = len(lines) // 2
    (run / "logs" / "metrics.jsonl").write_text("".join(lines[:half]))
    srv = make_server(RunView(run), "127.0.0.1", 0)
    serve_in_thread(srv)
    try:
        browser.get(url_of(srv))
        wait(browser, lambda d: d.execute_script("return document.body.dataset.loaded === '1'"), what="page")
        points = lambda d: int(d.find_element("id", "curve-reward").get_attribute("data-points"))  # noqa: E731
        assert points(browser) == half and browser.find_element("id", "refresh").text.startswith("live")
        with open(run / "logs" / "metrics.jsonl", "a") as f:
            f.write("".join(lines[half:]))
        wait(browser, lambda d: points(d) == len(lines), timeout=20, what="the appended records drawn")
        (run / "DONE").write_text("")
        wait(browser, lambda d: d.find_element("id", "refresh").text == "done", timeout=20, what="polling ends")
    finally:
        srv.shutdown()
        srv.server_close()


def click_fresh(driver, css: str) -> bool:
    """Click the element ``css`` finds; False if the page re-rendered it between the look and the click (a
    listing refreshed while the test clicks), so a ``wait`` tries again with the new element."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    try:
        driver.find_element(By.CSS_SELECTOR, css).click()
    except StaleElementReferenceException:
        return False
    return True


def test_an_agent_episode_shows_what_was_trained_and_what_was_masked(browser, agent_run) -> None:
    """The agent run of tests/conftest.py (its rollout killed and resubmitted): a two-turn episode opened from the
    trajectories panel shows the feedback turn the loss masked in grey and the model's turns in version colours,
    token for token as the spool file holds them; the timeline has each rollout job's start and the restart."""
    from selenium.webdriver.common.by import By
    spool = agent_run / "spool"
    path, group = next((p, g) for p in sorted(spool.glob("trained/*/*.h5")) if (g := read_group(p))
                       and any(len(s.response_ids) and not s.loss_mask.all() for s in g.samples))
    step = int(path.parent.name.removeprefix("step_"))
    srv = make_server(RunView(agent_run), "127.0.0.1", 0)
    serve_in_thread(srv)
    try:
        browser.get(url_of(srv))
        wait(browser, lambda d: d.execute_script("return document.body.dataset.loaded === '1'"), what="page")
        kinds = browser.execute_script("return document.getElementById('timeline').data.map((t) => t.name)")
        assert any(k.startswith("restart") for k in kinds) and any(k.startswith("start") for k in kinds), kinds
        starts = browser.execute_script("return document.getElementById('timeline').data"
                                        ".find((t) => t.name.startsWith('start')).text")
        assert sum("rollout-0 start" in t for t in starts) == 2, starts  # the first job and the resubmitted one
        for name, value in (("step_min", step), ("step_max", step)):
            field = browser.find_element(By.CSS_SELECTOR, f"#filters [name={name}]")
            field.clear()
            field.send_keys(str(value))
        browser.find_element(By.CSS_SELECTOR, "#filters button[type=submit]").click()
        rel = str(path.relative_to(spool))
        row = f"#groups tbody tr[data-path='{rel}']"
        wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, row), what="the episode's group listed")
        wait(browser, lambda d: click_fresh(d, row), what="the episode's group clicked")
        wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#group .sample .tok[data-version]"), what="tokens")
        grey = None
        for i, sample in enumerate(group.samples):
            toks = browser.find_elements(By.CSS_SELECTOR, f"#group .sample[data-sample='{i}'] .tok")
            assert [t.get_attribute("data-trained") == "1" for t in toks] == [bool(m) for m in sample.loss_mask]
            assert [int(t.get_attribute("data-version")) for t in toks] == sample.versions.tolist()
            for t, trained in zip(toks, sample.loss_mask):
                colour = t.value_of_css_property("background-color")
                if not trained:
                    assert grey in (None, colour)  # every masked token the same grey
                    grey = colour
        assert grey is not None
        trained = browser.find_elements(By.CSS_SELECTOR, "#group .tok[data-trained='1']")
        assert grey not in {t.value_of_css_property("background-color") for t in trained}
        assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        SHOTS.shoot(browser, ARTIFACTS, "agent")
    finally:
        srv.shutdown()
        srv.server_close()
