"""Headless Chromium (Debian's ``chromium`` + ``chromium-driver``) driven by Selenium, for the
browser tests of the ``js/`` extension against a real ComfyUI server.

Nothing is downloaded: the browser and its driver come from the system (``scripts/
install_browser.sh`` installs them), and Selenium is given both paths, so Selenium Manager
never runs.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from . import paths

ARTIFACTS = paths.REPO / "test_artifacts"
INSTALL_HINT = ("run `bash scripts/install_browser.sh` (Debian/Ubuntu: apt-get install chromium chromium-driver) "
                "and `pip install -r requirements-dev.txt` (selenium)")

CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--window-size=1600,1000",
)


class BrowserUnavailable(RuntimeError):
    """Chromium, chromedriver or Selenium is missing; the message says how to install them."""


def find_browser() -> tuple[str, str]:
    """Paths of the Chromium binary and of chromedriver (``$CHROMIUM_BIN`` / ``$CHROMEDRIVER``
    override). Raises :class:`BrowserUnavailable` naming what is missing."""
    chromium = os.environ.get("CHROMIUM_BIN") or shutil.which("chromium") or shutil.which("chromium-browser")
    driver = os.environ.get("CHROMEDRIVER") or shutil.which("chromedriver")
    missing = [name for name, p in (("chromium", chromium), ("chromedriver", driver)) if not p]
    if missing:
        raise BrowserUnavailable(f"{' and '.join(missing)} not found on PATH: {INSTALL_HINT}")
    return chromium, driver


def start_chromium():
    """A Selenium WebDriver for a fresh headless Chromium (own ``--user-data-dir``, removed by
    :func:`stop_chromium`). Browser console messages are kept for ``driver.get_log('browser')``."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as e:
        raise BrowserUnavailable(f"selenium is not installed ({e}): {INSTALL_HINT}") from e
    chromium, driver_path = find_browser()
    profile = tempfile.mkdtemp(prefix="mk-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in CHROMIUM_FLAGS + (f"--user-data-dir={profile}",):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        drv = webdriver.Chrome(service=Service(driver_path), options=opts)
    except Exception:
        shutil.rmtree(profile, ignore_errors=True)
        raise
    drv._mk_profile = profile
    return drv


def stop_chromium(drv) -> None:
    try:
        drv.quit()
    finally:
        shutil.rmtree(getattr(drv, "_mk_profile", ""), ignore_errors=True)


def wait_for(drv, js: str, timeout: float = 60, what: str = "") -> object:
    """Poll ``return <js>`` in the page until it is truthy; returns its value or raises
    TimeoutError naming ``what``."""
    deadline = time.time() + timeout
    while True:
        val = drv.execute_script(f"return {js}")
        if val:
            return val
        if time.time() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what or js}")
        time.sleep(0.25)


# Expression for the ComfyUI app object in the page (the frontend exposes it as window.comfyAPI).
APP = "window.comfyAPI.app.app"


def open_editor(drv, url: str) -> None:
    """Load the editor and wait until the graph exists and every extension has run its setup."""
    drv.get(url)
    wait_for(drv, f"!!(window.comfyAPI?.app?.app?.graph && {APP}.canvas && {APP}.vueAppReady)", 120,
             "the ComfyUI editor to load")
    wait_for(drv, f"{APP}.extensions.some(e => e.name === 'MemoryKit.Reports')", 30,
             "the MemoryKit extension to register")


def close_dialogs(drv) -> None:
    """Close any open dialog (the template browser opens by itself for a new user) with Escape."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    for _ in range(6):
        if not any(d.is_displayed() for d in drv.find_elements(By.CSS_SELECTOR, ".p-dialog")):
            return
        ActionChains(drv).send_keys(Keys.ESCAPE).perform()
        time.sleep(0.4)
    raise RuntimeError("a dialog stays open after pressing Escape")


def our_console_errors(entries: list[dict], pack_dir: str) -> list[dict]:
    """Browser-console entries at error level that come from this pack's extension: a failed
    load of one of its files (under ``/extensions/<pack_dir>/``), or a script error whose message
    or stack names MemoryKit (our modules, our extension name). Failed requests to other hosts
    that merely carry our node ids (the editor asks the offline Comfy Registry about every node
    pack) are not ours."""
    out = []
    for e in entries:
        if e.get("level") not in ("SEVERE", "ERROR"):
            continue
        msg = e.get("message", "")
        if f"/extensions/{pack_dir}/" in msg or (e.get("source") != "network" and "memorykit" in msg.lower()):
            out.append(e)
    return out


def screenshot(drv, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    drv.save_screenshot(str(path))
    return path
