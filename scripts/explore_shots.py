"""Screenshots of the run explorer's panels for a run, from a real headless browser.

    python scripts/explore_shots.py <run_dir> <out_dir> [--prefix NAME] [--filters 'step_min=150&kind=trained']

Serves the run on a free loopback port, opens the page in Debian's chromium (through chromedriver:
`bash scripts/install_browser.sh`), opens a trajectory of the first page (one whose tokens span policy versions
if there is one, else the best rewarded), and writes <out_dir>/<prefix>-<panel>.png for each panel. docs/explore.md's pictures come from it;
tests/test_explore_browser.py drives the browser with :func:`chrome`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PANELS = ("panel-curves", "panel-staleness", "panel-timeline", "panel-trajectories")


def chrome(width: int = 1400, height: int = 1000):
    """A headless chromium driven through chromedriver, browser console logs kept (``get_log("browser")``)."""
    missing = [b for b in ("chromium", "chromedriver") if not shutil.which(b)]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not installed: run `bash scripts/install_browser.sh` "
                           "(the README's test command does)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--allow-file-access-from-files"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    driver.set_page_load_timeout(60)
    return driver


def wait(driver, check, timeout: float = 30.0, what: str = "") -> None:
    from selenium.webdriver.support.ui import WebDriverWait
    WebDriverWait(driver, timeout).until(lambda d: check(d), message=what)


def shoot(driver, out_dir: Path, prefix: str) -> list[Path]:
    """Each panel of the page now open in ``driver`` as a PNG."""
    from selenium.webdriver.common.by import By
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for panel in PANELS:
        p = out_dir / f"{prefix}-{panel}.png"
        element = driver.find_element(By.ID, panel)
        driver.execute_script("arguments[0].scrollIntoView({block: 'start'});", element)
        element.screenshot(str(p))
        paths.append(p)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--prefix", default="explore")
    ap.add_argument("--filters", default="", help="query of the trajectory listing, e.g. 'kind=dropped'")
    args = ap.parse_args()
    from selenium.webdriver.common.by import By

    from hpcrl.explore.reader import RunView
    from hpcrl.explore.server import make_server, serve_in_thread, url_of
    srv = make_server(RunView(args.run_dir), "127.0.0.1", 0)
    serve_in_thread(srv)
    driver = chrome(1300, 1000)
    try:
        driver.get(url_of(srv))
        wait(driver, lambda d: d.execute_script("return document.body.dataset.loaded === '1'"), what="page")
        wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#groups tbody tr[data-path]"), what="groups")
        if args.filters:  # fill the trajectory filters and list again
            first = driver.find_element(By.CSS_SELECTOR, "#groups tbody tr[data-path]").get_attribute("data-path")
            for pair in args.filters.split("&"):
                key, _, value = pair.partition("=")
                driver.execute_script("document.querySelector(`#filters [name='${arguments[0]}']`).value = "
                                      "arguments[1];", key, value)
            driver.find_element(By.CSS_SELECTOR, "#filters button").click()
            wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, "#groups tbody tr").get_attribute("data-path")
                 != first, what="filtered groups")
        rows = driver.find_elements(By.CSS_SELECTOR, "#groups tbody tr[data-path]")
        # a group whose tokens span policy versions (an interrupted generation), else the best rewarded
        cells = [[td.text for td in r.find_elements(By.TAG_NAME, "td")] for r in rows]
        best = max(zip(rows, cells), key=lambda rc: ("–" in rc[1][2], float(rc[1][4].replace("—", "-1"))))[0]
        best.click()
        wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#group .tok[data-version]"), what="tokens")
        for p in shoot(driver, args.out_dir, args.prefix):
            print(p)
    finally:
        driver.quit()
        srv.shutdown()
        srv.server_close()


if __name__ == "__main__":
    main()
