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


# Open dialogs: PrimeVue's (.p-dialog, frontend 1.32) and the newer role=dialog ones (1.49);
# both are position: fixed, so "shown" is judged by getClientRects, not offsetParent.
_OPEN_DIALOGS = ("[...document.querySelectorAll('.p-dialog, [role=dialog]')]"
                 ".filter(d => d.getClientRects().length && getComputedStyle(d).visibility !== 'hidden')")


def frontend_version(drv) -> str:
    """The frontend's version ("1.32.9"), or "unknown"."""
    return drv.execute_script("return window.__COMFYUI_FRONTEND_VERSION__ || 'unknown'")


def close_dialogs(drv, quiet: float = 1.5, timeout: float = 20) -> None:
    """Close every open dialog with Escape, until none has been open for ``quiet`` seconds (the
    template browser opens by itself for a new user, shortly after the editor loads)."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys
    deadline = time.time() + timeout
    calm_since = time.time()
    while time.time() < deadline:
        if drv.execute_script(f"return {_OPEN_DIALOGS}.length"):
            ActionChains(drv).send_keys(Keys.ESCAPE).perform()
            time.sleep(0.3)
            drv.execute_script(f"""for (const d of {_OPEN_DIALOGS}) {{
                const b = [...d.querySelectorAll('button')].find(b => /close/i.test(b.getAttribute('aria-label') || '')
                    || /close/i.test(b.className) || b.querySelector('.pi-times'));
                b?.click(); }}""")
            calm_since = time.time()
        elif time.time() - calm_since >= quiet:
            return
        time.sleep(0.25)
    left = drv.execute_script(f"return {_OPEN_DIALOGS}.map(d => d.outerHTML.slice(0, 300))")
    raise RuntimeError(f"a dialog stays open after pressing Escape: {left}")


def _empty_canvas_point(drv):
    """Client coordinates of a canvas point with no node or group under it."""
    return wait_for(drv, f"""(() => {{
        const c = {APP}.canvas, r = c.canvas.getBoundingClientRect();
        for (let fy = 0.9; fy > 0.2; fy -= 0.1) for (let fx = 0.35; fx < 0.8; fx += 0.1) {{
            const x = r.left + r.width * fx, y = r.top + r.height * fy;
            const [gx, gy] = c.ds.convertCanvasToOffset([x - r.left, y - r.top]);
            if (!c.graph.getNodeOnPos(gx, gy) && !c.graph.getGroupOnPos?.(gx, gy)
                && document.elementFromPoint(x, y) === c.canvas) return [x, y];
        }}
        return null; }})()""", 10, "an empty spot on the canvas")


def move_to(drv, x: float, y: float):
    """An ActionChains with the pointer moved to client point (x, y)."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    body = drv.find_element(By.TAG_NAME, "body")
    ActionChains(drv).move_to_element_with_offset(body, 0, 0).perform()  # (0, 0) = body centre
    rect = body.rect
    return ActionChains(drv).move_to_element_with_offset(body, int(x - rect["width"] / 2), int(y - rect["height"] / 2))


def open_node_search(drv):
    """Double-click an empty canvas spot; returns the node search box's input (1.32: PrimeVue
    AutoComplete in .comfy-vue-node-search-box; 1.49: a dialog with "Add a node...")."""
    x, y = _empty_canvas_point(drv)
    move_to(drv, x, y).double_click().perform()
    return wait_for(drv, "document.querySelector('.comfy-vue-node-search-box input')"
                         " || [...document.querySelectorAll('[role=dialog] input')].find(e => e.getClientRects().length)",
                    10, "the node search box")


def search_results(drv) -> list[list[str]]:
    """The node search's visible results as [display name, text of the whole entry]."""
    return drv.execute_script("""return [...document.querySelectorAll('.option-container, [role=dialog] [role=option]')]
        .filter(o => o.getClientRects().length)
        .map(o => [(o.querySelector('.option-display-name')?.innerText ?? o.innerText).split('\\n')[0].trim(),
                   o.innerText])""")


def open_template(drv, name: str, pack_title: str) -> None:
    """Open ``example_workflows/<name>.json`` from ComfyUI's template browser as a person does:
    the sidebar's Templates button, the pack's entry (1.49 lists custom nodes' templates under
    "Extensions"; 1.32 shows them in its list), the search box, the card."""
    from selenium.webdriver.common.keys import Keys
    wait_for(drv, "document.querySelector('.templates-tab-button')", 30, "the Templates button")
    find_search = ("[...document.querySelectorAll('.p-dialog input, [role=dialog] input')]"
                   ".find(e => e.getClientRects().length && /^Search/.test(e.placeholder))")
    if not drv.execute_script(f"return !!({find_search})"):  # not open yet: close other dialogs, open it
        close_dialogs(drv)
        drv.execute_script("document.querySelector('.templates-tab-button').click()")
    wait_for(drv, find_search, 30, "the template browser's search box")
    entry = drv.execute_script(
        "return [...document.querySelectorAll('.p-dialog *, [role=dialog] *')].find(e => e.children.length === 0"
        " && e.getClientRects().length && e.innerText && e.innerText.trim() === arguments[0])", pack_title)
    if entry is not None:
        entry.click()
        time.sleep(1)
    search = wait_for(drv, find_search, 30, "the template browser's search box")
    search.send_keys(Keys.CONTROL, "a")
    search.send_keys(Keys.BACKSPACE)
    search.send_keys(name)
    time.sleep(1.5)  # the list re-renders as the search settles
    wait_for(drv, f"""(() => {{ const c = document.querySelector("[data-testid='template-workflow-{name}']");
        if (!c) return false; c.scrollIntoView({{block: 'center'}}); c.click(); return true; }})()""", 30,
             f"the template card of {name} (example_workflows/ served as templates)")


def frame_nodes(drv, node_ids: list[int]) -> None:
    """Pan and zoom (at most 100 %) the canvas so the given nodes and their badges are in view."""
    drv.execute_script(f"""const c = {APP}.canvas, g = c.graph, ids = arguments[0];
        const ns = ids.map(i => g.getNodeById(i)).filter(Boolean);
        if (!ns.length) return;
        const th = LiteGraph.NODE_TITLE_HEIGHT + 26;
        const x0 = Math.min(...ns.map(n => n.pos[0])) - 20, y0 = Math.min(...ns.map(n => n.pos[1] - th)) - 20;
        const x1 = Math.max(...ns.map(n => n.pos[0] + n.size[0])) + 20, y1 = Math.max(...ns.map(n => n.pos[1] + n.size[1])) + 20;
        // the free part of the canvas: right of the sidebar, below the tab/menu bars, left of the minimap
        const r = c.canvas.getBoundingClientRect(), L = 90, T = 150, W = r.width - L - 380, H = r.height - T - 40;
        const s = Math.min(1, W / (x1 - x0), H / (y1 - y0));
        c.ds.scale = s; c.ds.offset = [-x0 + L / s + (W / s - (x1 - x0)) / 2, -y0 + T / s + (H / s - (y1 - y0)) / 2];
        c.setDirty(true, true);""", node_ids)
    time.sleep(0.4)


def badge_point(drv, node_id: int) -> list[float]:
    """Client coordinates of the middle of our badge on node ``node_id`` (framed at 100 %)."""
    drv.execute_script(f"""const c = {APP}.canvas, n = c.graph.getNodeById(arguments[0]), r = c.canvas.getBoundingClientRect();
        c.ds.scale = 1; c.ds.offset = [-n.pos[0] + r.width / 3, -n.pos[1] + r.height / 2]; c.setDirty(true, true);""", node_id)
    time.sleep(0.4)
    return drv.execute_script(f"""const c = {APP}.canvas, n = c.graph.getNodeById(arguments[0]);
        const ctx = document.createElement('canvas').getContext('2d');
        const bs = n.badges.map(b => typeof b === 'function' ? b() : b), ours = n.__memorykitBadge();
        const ws = bs.map(b => b.getWidth(ctx)), total = ws.reduce((a, w) => a + w + 2, 0);
        let x = n.pos[0] + (n.badgePosition === 'top-left' ? 0 : n.size[0] - total);
        for (let i = 0; i < bs.length && bs[i] !== ours; i++) x += ws[i] + 2;
        const i = bs.indexOf(ours);
        const gx = x + ws[i] / 2, gy = n.pos[1] - LiteGraph.NODE_TITLE_HEIGHT - 2 - (ours.height ?? 20) / 2;
        const p = c.ds.convertOffsetToCanvas([gx, gy]), r = c.canvas.getBoundingClientRect();
        return [p[0] + r.left, p[1] + r.top];""", node_id)


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
    """Save a PNG of the page as ``test_artifacts/<name>`` (``name`` may hold subfolders)."""
    path = ARTIFACTS / name
    path.parent.mkdir(parents=True, exist_ok=True)
    drv.save_screenshot(str(path))
    return path


def node_screenshot(drv, node_ids: list[int], name: str, margin: int = 12) -> Path | None:
    """Save a PNG of the page cropped to the given nodes with their badges as
    ``test_artifacts/<name>``; None when they are not on screen."""
    box = drv.execute_script(f"""const c = {APP}.canvas, g = c.graph, r = c.canvas.getBoundingClientRect();
        const ns = arguments[0].map(i => g.getNodeById(i)).filter(Boolean);
        if (!ns.length) return null;
        // Vue nodes ("Nodes 2.0"): the nodes' DOM boxes (their badge row is inside the node)
        const els = ns.map(n => document.querySelector(`[data-node-id="${{n.id}}"]`));
        if (els.every(Boolean)) {{
            const rs = els.map(e => e.getBoundingClientRect());
            return [Math.min(...rs.map(q => q.left)), Math.min(...rs.map(q => q.top)),
                    Math.max(...rs.map(q => q.right)), Math.max(...rs.map(q => q.bottom)), window.devicePixelRatio || 1];
        }}
        const th = LiteGraph.NODE_TITLE_HEIGHT + 24;
        const a = c.ds.convertOffsetToCanvas([Math.min(...ns.map(n => n.pos[0])), Math.min(...ns.map(n => n.pos[1] - th))]);
        const b = c.ds.convertOffsetToCanvas([Math.max(...ns.map(n => n.pos[0] + n.size[0])),
                                              Math.max(...ns.map(n => n.pos[1] + n.size[1]))]);
        return [a[0] + r.left, a[1] + r.top, b[0] + r.left, b[1] + r.top, window.devicePixelRatio || 1];""", node_ids)
    if not box:
        return None
    import io

    from PIL import Image
    x0, y0, x1, y1, dpr = box
    img = Image.open(io.BytesIO(drv.get_screenshot_as_png()))
    crop = [int(max(0, (x0 - margin) * dpr)), int(max(0, (y0 - margin) * dpr)),
            int(min(img.width, (x1 + margin) * dpr)), int(min(img.height, (y1 + margin) * dpr))]
    if crop[2] - crop[0] < 40 or crop[3] - crop[1] < 40:
        return None
    path = ARTIFACTS / name
    path.parent.mkdir(parents=True, exist_ok=True)
    img.crop(crop).save(path)
    return path
