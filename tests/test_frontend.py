"""The js/ extension in a real browser (headless Chromium) against a real ComfyUI server.

Checks what a person sees: the editor loads with no console error from our extension, the node
search finds our nodes, an example workflow loads from ComfyUI's template browser, is queued
with the Run button, runs, and each MemoryKit node's badge shows the figures of its report in
``/history``; hovering a badge and the MemoryKit sidebar panel show the full report.
Screenshots go to ``test_artifacts/``. Without Chromium/chromedriver/selenium the tests FAIL
with the command that installs them (``scripts/install_browser.sh``).
"""
from __future__ import annotations

import time
from decimal import ROUND_HALF_UP, Decimal, localcontext

import pytest

from harness import browser as br
from harness.browser import APP
from harness.server import PACK_DIR_NAME

TEMPLATE = "free_memory_sd15"  # example_workflows/free_memory_sd15.json

# --- the badge's figures, from a report (mirrors js/memorykit_format.js for the fields our
# --- nodes report; the test compares what the page shows with what /history holds)
BASE_FIELDS = {"label", "time", "host", "cuda", "models"}
LABELS = {"unloaded_bytes": "unloaded", "freed_vram_bytes": "VRAM freed", "released_cache_bytes": "cache released"}


def fmt_bytes(n: int) -> str:
    """JS ``formatBytes``: binary units; ``toFixed`` rounds half up on the exact value."""
    def fixed(unit: int, places: int) -> str:
        with localcontext() as ctx:
            ctx.prec = 80
            return str((Decimal(n) / Decimal(unit)).quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP))
    a = abs(n)
    if a >= 2**30:
        return f"{fixed(2**30, 2)} GiB"
    if a >= 2**20:
        return f"{fixed(2**20, 1)} MiB"
    if a >= 2**10:
        return f"{fixed(2**10, 1)} KiB"
    return f"{n} B"


def expected_figures(rep: dict) -> list[str]:
    figs = []
    if rep["cuda"]:
        label = "VRAM peak" if len(rep["cuda"]) == 1 else f"VRAM peak (max of {len(rep['cuda'])})"
        figs.append(f"{label} {fmt_bytes(max(d['peak_allocated_bytes'] for d in rep['cuda']))}")
    for key, v in rep.items():
        if key in BASE_FIELDS or isinstance(v, (list, dict)) or v == 0:
            continue
        assert key.endswith("_bytes"), f"this test does not know how the badge shows {key!r}"
        figs.append(f"{LABELS.get(key, key[:-len('_bytes')].replace('_', ' '))} {fmt_bytes(v)}")
    figs.append(f"RAM peak {fmt_bytes(rep['host']['rss_peak_bytes'])}")
    return figs


def test_badge_figures_formatting():
    assert [fmt_bytes(n) for n in (512, 2048, 5 * 2**20, int(1.125 * 2**30))] == \
        ["512 B", "2.0 KiB", "5.0 MiB", "1.13 GiB"]


# --- browser ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    try:
        drv = br.start_chromium()
    except br.BrowserUnavailable as e:
        pytest.fail(f"The browser test cannot run: {e}", pytrace=False)
    yield drv
    br.stop_chromium(drv)


def _assert_no_errors_from_us(drv):
    errors = br.our_console_errors(drv.get_log("browser"), PACK_DIR_NAME)
    assert not errors, "console errors from the MemoryKit extension:\n" + "\n".join(e["message"] for e in errors)


def test_editor_loads_without_errors_from_our_extension(server, browser):
    br.open_editor(browser, server.url)
    time.sleep(1.5)  # let late module errors reach the console
    # ComfyUI serves the pack's js/ (WEB_DIRECTORY); memorykit.js registered (open_editor waits
    # for it), so the two modules it imports loaded too.
    served = [u for u in server.get("/extensions") if f"/extensions/{PACK_DIR_NAME}/" in u]
    assert {u.rsplit("/", 1)[-1] for u in served} >= {"memorykit.js", "memorykit_format.js", "memorykit_panel.js"}, served
    from selenium.webdriver.common.by import By
    assert browser.find_elements(By.CSS_SELECTOR, ".memorykit-reports-tab-button"), "no MemoryKit sidebar button"
    _assert_no_errors_from_us(browser)


def _empty_canvas_point(drv):
    """Client coordinates of a canvas point with no node or group under it."""
    return br.wait_for(drv, f"""(() => {{
        const c = {APP}.canvas, r = c.canvas.getBoundingClientRect();
        for (let fy = 0.9; fy > 0.2; fy -= 0.1) for (let fx = 0.35; fx < 0.8; fx += 0.1) {{
            const x = r.left + r.width * fx, y = r.top + r.height * fy;
            const [gx, gy] = c.ds.convertCanvasToOffset([x - r.left, y - r.top]);
            if (!c.graph.getNodeOnPos(gx, gy) && !c.graph.getGroupOnPos?.(gx, gy)
                && document.elementFromPoint(x, y) === c.canvas) return [x, y];
        }}
        return null; }})()""", 10, "an empty spot on the canvas")


def test_node_search_finds_our_nodes(server, browser):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    br.open_editor(browser, server.url)
    br.close_dialogs(browser)
    x, y = _empty_canvas_point(browser)
    body = browser.find_element(By.TAG_NAME, "body")
    ActionChains(browser).move_to_element_with_offset(body, 0, 0).perform()  # (0, 0) = body centre
    rect = body.rect
    ActionChains(browser).move_to_element_with_offset(body, int(x - rect["width"] / 2), int(y - rect["height"] / 2)) \
        .double_click().perform()
    box = br.wait_for(browser, "document.querySelector('.comfy-vue-node-search-box input')", 10, "the node search box")

    def results(query):
        box.clear()
        box.send_keys(query)
        time.sleep(0.8)
        return browser.execute_script("""return [...document.querySelectorAll('.option-container')].map(o => [
            o.querySelector('.option-display-name')?.innerText.trim(), o.querySelector('.option-category')?.innerText.trim()])""")

    for query, display in [("Free Memory", "Free Memory"), ("Memory Report", "Memory Report")]:
        found = results(query)
        hit = [r for r in found if r[0] and r[0].splitlines()[0].strip() == display]
        assert hit, f"search {query!r} did not list {display!r}: {found}"
        assert "MemoryKit" in (hit[0][1] or ""), hit
    ours = results("MemoryKit")  # node ids start with MemoryKit
    assert {"Free Memory", "Memory Report"} <= {r[0].splitlines()[0].strip() for r in ours if r[0]}, ours
    # Pick "Free Memory" as a person would: the node lands in the graph.
    results("Free Memory")
    box.send_keys(Keys.ENTER)
    br.wait_for(browser, f"{APP}.graph.nodes.some(n => n.type === 'MemoryKitFreeMemory')", 10,
                "the Free Memory node to be added from the search")
    _assert_no_errors_from_us(browser)


def _open_template(drv, name):
    from selenium.webdriver.common.by import By
    br.wait_for(drv, "document.querySelector('.templates-tab-button')", 30, "the Templates button")
    time.sleep(1)  # a new user's editor opens the template browser by itself, shortly after loading
    if not any(d.is_displayed() for d in drv.find_elements(By.CSS_SELECTOR, ".p-dialog")):
        drv.find_element(By.CSS_SELECTOR, ".templates-tab-button").click()
    search = br.wait_for(drv, "[...document.querySelectorAll(\".p-dialog input[placeholder='Search...']\")]"
                              ".find(e => e.offsetParent)", 30, "the template browser")
    search.send_keys(name)
    card = br.wait_for(drv, f"document.querySelector(\"[data-testid='template-workflow-{name}']\")", 30,
                       f"the template card of {name} (example_workflows/ served as templates)")
    card.click()


def _badge_texts(drv) -> dict:
    return drv.execute_script(f"""const out = {{}};
        for (const n of {APP}.graph.nodes) if (n.memorykit && !n.memorykit.stale && n.__memorykitBadge)
            out[String(n.id)] = n.__memorykitBadge().text;
        return out;""")


def test_template_runs_and_badges_match_history(server, browser, fixture_models):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    br.open_editor(browser, server.url)
    _open_template(browser, TEMPLATE)
    br.wait_for(browser, f"{APP}.graph.nodes.filter(n => n.type === 'MemoryKitMemoryReport').length === 2 && "
                         f"{APP}.graph.nodes.some(n => n.type === 'MemoryKitFreeMemory')", 30, "the template's graph")
    br.close_dialogs(browser)
    known = set(server.get("/history"))
    browser.find_element(By.CSS_SELECTOR, "[data-testid='queue-button']").click()
    deadline = time.time() + 600
    while True:
        new = {k: v for k, v in server.get("/history").items() if k not in known}
        if new and all(v.get("status", {}).get("completed") is not None for v in new.values()):
            break
        if time.time() > deadline:  # a hang, not a speed check
            raise TimeoutError(f"the queued workflow did not finish:\n{server.log_tail()}")
        time.sleep(1)
    assert len(new) == 1, f"the Run button queued {len(new)} prompts"
    entry = next(iter(new.values()))
    assert entry["status"]["status_str"] == "success", entry["status"]
    reports = {nid: ui["memorykit_report"][0] for nid, ui in entry["outputs"].items() if "memorykit_report" in ui}
    assert set(reports) == {"6", "7", "8"}, reports.keys()
    assert reports["8"]["models"] == []  # the Memory Report after Free Memory: nothing loaded

    br.wait_for(browser, f"{APP}.graph.nodes.filter(n => n.memorykit && !n.memorykit.stale).length === 3", 30,
                "three MemoryKit badges")
    texts = _badge_texts(browser)
    assert set(texts) == set(reports), texts
    for nid, rep in reports.items():
        expected = expected_figures(rep)
        shown = texts[nid].split(" · ")
        more = int(shown.pop()[1:]) if shown[-1].startswith("+") else 0
        assert shown and shown == expected[:len(shown)] and len(shown) + more == len(expected), \
            f"node {nid}: badge {texts[nid]!r}, report says {expected}"
        assert any(ch.isdigit() for ch in shown[0]), texts[nid]
    if not reports["6"]["cuda"]:  # CPU run: Memory Report's badge has room for its one figure
        assert texts["6"] == " · ".join(expected_figures(reports["6"]))

    # Frame the three MemoryKit nodes at 100 % and hover Free Memory's badge: the full report shows.
    pt = browser.execute_script(f"""const c = {APP}.canvas, g = c.graph, a = g.getNodeById(6), n = g.getNodeById(7);
        c.ds.scale = 1; c.ds.offset = [-a.pos[0] + 160, -a.pos[1] + 330]; c.setDirty(true, true);
        const b = n.__memorykitBadge(), ctx = document.createElement('canvas').getContext('2d');
        const gx = n.pos[0] + n.width - 2 - b.getWidth(ctx) / 2, gy = n.pos[1] - LiteGraph.NODE_TITLE_HEIGHT - 2 - b.height / 2;
        const p = c.ds.convertOffsetToCanvas([gx, gy]), r = c.canvas.getBoundingClientRect();
        return [p[0] + r.left, p[1] + r.top];""")
    time.sleep(0.5)
    shot = br.screenshot(browser, "frontend_badges.png")
    body = browser.find_element(By.TAG_NAME, "body")
    rect = body.rect
    ActionChains(browser).move_to_element_with_offset(body, int(pt[0] - rect["width"] / 2),
                                                      int(pt[1] - rect["height"] / 2)).perform()
    hover = br.wait_for(browser, "(() => { const e = document.querySelector('[data-testid=memorykit-hover]');"
                                 " return e && e.style.display !== 'none' && e.innerText; })()", 10,
                        "the report card on hovering Free Memory's badge")
    text7 = entry["outputs"]["7"]["text"][0]
    assert text7.splitlines()[-1] in hover and "#7 Free Memory" in hover, hover
    br.screenshot(browser, "frontend_hover.png")

    # Right-click Free Memory → "Show memory report (MemoryKit)" opens the MemoryKit sidebar
    # panel, which lists all three reports with their figures.
    ActionChains(browser).move_by_offset(-150, 200).context_click().perform()
    item = br.wait_for(browser, "[...document.querySelectorAll('.litemenu-entry, .p-contextmenu-item, [role=menuitem]')]"
                                ".find(e => e.innerText.trim() === 'Show memory report (MemoryKit)')", 10,
                       "our entry in the node's context menu")
    item.click()
    panel = br.wait_for(browser, "document.querySelector('[data-testid=memorykit-panel]')?.innerText", 10,
                        "the MemoryKit panel")
    for nid, rep in reports.items():
        assert f"#{nid} " in panel, panel
        for fig in expected_figures(rep):
            head, number, unit = fig.rsplit(" ", 2)
            assert f"{head}: {number} {unit}" in panel, (fig, panel)
    br.screenshot(browser, "frontend_panel.png")
    assert shot.stat().st_size > 10_000
    _assert_no_errors_from_us(browser)
