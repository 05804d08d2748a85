"""Headless Chromium from the system's packages, driven by Selenium through the system's
chromedriver (no browser or driver is downloaded), for the dashboard's browser tests.

    from util_browser import require_browser
    require_browser()          # module level: skips the module, saying why, without them
    from util_browser import browser_fixture, open_page, console_errors, shot, wait_for
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
DRIVER = shutil.which("chromedriver")
SCREENSHOTS = Path(__file__).resolve().parent / "screenshots"  # git-ignored
CHROMIUM_ARGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1280,900")


def require_browser() -> None:
    if not CHROMIUM or not DRIVER:
        pytest.skip("needs Chromium and chromedriver on PATH (Debian: apt-get install chromium chromium-driver)",
                    allow_module_level=True)
    pytest.importorskip("selenium.webdriver", reason="needs the selenium package (pip install selenium)")


def start_browser(tmp: Path):
    """Headless Chromium with a fresh profile in `tmp`; downloads go to `driver.downloads`."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in (*CHROMIUM_ARGS, f"--user-data-dir={tmp / 'profile'}"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(options=opts, service=Service(DRIVER, log_output=str(tmp / "chromedriver.log")))
    drv.downloads = tmp / "downloads"
    drv.downloads.mkdir()
    drv.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(drv.downloads)})
    return drv


def browser_fixture(scope: str = "module"):
    """A pytest fixture yielding a started browser, quit at the end of its scope."""

    @pytest.fixture(scope=scope)
    def _browser(tmp_path_factory):
        drv = start_browser(tmp_path_factory.mktemp("browser"))
        yield drv
        drv.quit()

    return _browser


def wait_for(drv, cond, timeout: float):
    """Poll `cond(driver)` until truthy; an element replaced by a re-render meanwhile is polled again."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(drv, timeout, poll_frequency=0.05,
                         ignored_exceptions=(NoSuchElementException, StaleElementReferenceException)).until(cond)


def open_page(drv, srv, hash_: str, ready: str) -> None:
    """Load /ui at `hash_` (a real navigation) and wait for the CSS selector `ready`."""
    drv.get("about:blank")
    drv.get(f"{srv.url}/ui{hash_}")
    wait_for(drv, lambda d: d.find_elements("css selector", ready), 15)


def console_errors(drv, allow: tuple[str, ...] = ()) -> list[str]:
    """Errors the page logged since the last call (uncaught exceptions, failed loads), less those
    containing one of `allow`."""
    return [e["message"] for e in drv.get_log("browser")
            if e["level"] == "SEVERE" and not any(a in e["message"] for a in allow)]


def shot(drv, name: str) -> None:
    SCREENSHOTS.mkdir(exist_ok=True)
    drv.save_screenshot(str(SCREENSHOTS / f"{name}.png"))


def select(drv, css: str, value: str) -> None:
    """Choose the option `value` of the <select> at `css`."""
    from selenium.webdriver.support.ui import Select

    Select(drv.find_element("css selector", css)).select_by_value(value)


def api_get(srv, path: str, **params) -> dict:
    """GET a JSON route of the server (200 expected)."""
    import httpx

    r = httpx.get(srv.url + path, params=params, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def wait_finished(srv, task_id: str, timeout: float = 30) -> dict:
    """A task's status once it has finished (status 3)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = api_get(srv, f"/v1/tasks/{task_id}/status")
        if st["status"] == 3:
            return st
        time.sleep(0.05)
    raise AssertionError(f"{task_id} still running after {timeout}s: {st}")


def api_post(srv, path: str, body: dict | None = None, **params) -> dict:
    """POST to a JSON route of the server (200 expected; a 429 queue_full is retried while the
    queue drains)."""
    import time

    import httpx

    for _ in range(100):
        r = httpx.post(srv.url + path, json=body if body is not None else {}, params=params, timeout=30)
        if r.status_code != 429:
            break
        time.sleep(0.05)
    assert r.status_code == 200, r.text
    return r.json()
