"""The js/ extension in a real browser (headless Chromium) against a real ComfyUI server.

Checks what a person sees, on the frontend the ComfyUI tree ships (1.32 with 0.3.75, 1.49 with
0.33; ``$MEMORYKIT_FRONT_END_ROOT`` serves another build, e.g. an unpacked
``comfyui-frontend-package``'s ``static/``): the editor loads with no console error from our
extension; the node search finds our nodes; the template browser lists and opens an example
workflow; every example workflow, opened as its file has it (real model file names, served as
stand-ins; only Wan's and Flux 2's text encoders are replaced) and queued with the Run button, shows
on each MemoryKit node a
badge with its report's headline figures (as in ``/history``), well-formed units, never wider
than the node, "+N" for the rest; hovering a badge and the MemoryKit sidebar panel show the
full report, newest first; a rerun after a page reload (all cached) shows the last figures
marked "cached" (read back from /history). Screenshots go to ``test_artifacts/frontend-<version>/``.
``MEMORYKIT_FRONTEND_EXAMPLES=cover`` runs the badge check on the fewest examples that hold every
MemoryKit node type between them (``examples.covering_examples``; ``scripts/test.sh`` does so on
the frontends the ComfyUI trees ship, and runs every example on the newest frontend).

Without Chromium/chromedriver/selenium the tests are skipped with the reason (and the command
that installs them); with ``REQUIRE_BROWSER=1`` (CI) they fail instead.
"""
from __future__ import annotations

import json
import os
import time

import pytest

from harness import badge_dom
from harness import browser as br
from harness import examples
from harness.badges import bad_figures, badge_matches, split_badge
from harness.browser import APP
from harness.server import PACK_DIR_NAME, ComfyServer

VUE = os.environ.get("MEMORYKIT_VUE_NODES") == "1"
HOVER_EXAMPLE = "free_memory_sd15"
TEMPLATE = "free_memory_sd15"
CACHED_EXAMPLE = "fp8_layerwise_sd15"
BADGE_EXAMPLES = (examples.covering_examples() if os.environ.get("MEMORYKIT_FRONTEND_EXAMPLES") == "cover"
                  else examples.example_names())



# --- fixtures -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    try:
        drv = br.start_chromium()
    except br.BrowserUnavailable as e:
        if os.environ.get("REQUIRE_BROWSER") == "1":
            pytest.fail(f"REQUIRE_BROWSER=1 but the browser test cannot run: {e}", pytrace=False)
        pytest.skip(f"browser tests skipped: {e}")
    yield drv
    br.stop_chromium(drv)


@pytest.fixture(scope="module")
def ui_server(request, browser, fixture_models):
    """The session's server, or (``$MEMORYKIT_FRONT_END_ROOT`` set) one serving that frontend build."""
    root = os.environ.get("MEMORYKIT_FRONT_END_ROOT")
    if not root:
        yield request.getfixturevalue("server")
        return
    with ComfyServer(extra_args=("--front-end-root", root)) as srv:
        yield srv


@pytest.fixture(scope="module")
def ui_object_info(ui_server) -> dict:
    return ui_server.object_info()


@pytest.fixture(scope="module")
def editor(ui_server, browser):
    """The editor, opened once; returns the frontend's version string. ``$MEMORYKIT_VUE_NODES=1``
    turns on the Vue node renderer ("Nodes 2.0", frontend 1.53 and later) first."""
    ui_server.post("/settings", {"Comfy.VueNodes.Enabled": VUE})
    badge_dom.install_console_hook(browser, PACK_DIR_NAME)
    br.open_editor(browser, ui_server.url)
    assert badge_dom.vue_on(browser) == VUE, "the Vue node renderer setting did not take"
    return br.frontend_version(browser)


def _renderers(drv, version: str):
    """The renderers each badge check runs in, switched in turn in the same page (the figures of
    one run, no rerun): with ``$MEMORYKIT_VUE_NODES=1`` Nodes 2.0, then the classic canvas
    (Nodes 2.0 restored after); else the classic canvas only. Yields the screenshot label."""
    if not VUE:
        yield version
        return
    try:
        yield f"{version}-vue"
        badge_dom.set_vue(drv, False)
        yield f"{version}-classic"
    finally:
        badge_dom.set_vue(drv, True)


def _label(version: str) -> str:
    return f"{version}-vue" if VUE else version


def _assert_no_errors_from_us(drv):
    errors = br.our_console_errors(drv.get_log("browser"), PACK_DIR_NAME)
    assert not errors, "console errors from the MemoryKit extension:\n" + "\n".join(e["message"] for e in errors)
    # warnings too (a deprecated frontend API read by our code warns): raised from our files' code
    warned = badge_dom.our_warnings(drv)
    assert not warned, "console warnings/errors raised from the MemoryKit extension's code:\n" + "\n".join(warned)


def _shot(drv, version: str, name: str):
    return br.screenshot(drv, f"frontend-{version}/{name}.png")


# --- editor, search, templates --------------------------------------------------------------
def test_editor_loads_without_errors_from_our_extension(ui_server, browser, editor):
    time.sleep(1.5)  # let late module errors reach the console
    served = [u for u in ui_server.get("/extensions") if f"/extensions/{PACK_DIR_NAME}/" in u]
    assert {u.rsplit("/", 1)[-1] for u in served} >= {"memorykit.js", "memorykit_format.js", "memorykit_panel.js"}, served
    # the sidebar button: a class up to frontend 1.49, a data-testid from 1.53
    assert br.wait_for(browser, "document.querySelector('.memorykit-reports-tab-button, "
                                "[data-testid=memorykit-reports-tab-button]')", 10, "the MemoryKit sidebar button")
    _assert_no_errors_from_us(browser)


def test_node_search_finds_our_nodes(ui_server, browser, editor):
    from selenium.webdriver.common.keys import Keys
    br.close_dialogs(browser)
    box = br.open_node_search(browser)

    def results(query):
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(Keys.BACKSPACE)
        box.send_keys(query)
        time.sleep(1.0)
        return br.search_results(browser)

    for query, display in [("Free Memory", "Free Memory"), ("Memory Report", "Memory Report")]:
        found = results(query)
        hit = [r for r in found if r[0] == display]
        assert hit, f"search {query!r} did not list {display!r}: {found}"
        assert "MemoryKit" in hit[0][1], hit
    ours = {r[0] for r in results("MemoryKit")}  # node ids start with MemoryKit
    assert {"Free Memory", "Memory Report", "FP8 Layerwise Cast", "Group Offload"} <= ours, ours
    results("Free Memory")
    box.send_keys(Keys.ENTER)
    br.wait_for(browser, f"{APP}.graph.nodes.some(n => n.type === 'MemoryKitFreeMemory')", 10,
                "the Free Memory node to be added from the search")
    _assert_no_errors_from_us(browser)


def test_template_browser_opens_an_example(ui_server, browser, editor):
    # a fresh page, as a person opening the template browser has: after the node search the
    # 1.32 frontend's search overlay keeps the template browser from opening
    br.open_editor(browser, ui_server.url)
    br.open_template(browser, TEMPLATE, PACK_DIR_NAME)
    ui = json.loads((examples.EXAMPLES / f"{TEMPLATE}.json").read_text())
    want = sorted(n["type"] for n in ui["nodes"])
    try:
        br.wait_for(browser, f"{APP}.graph.nodes.filter(n => n.type.startsWith('MemoryKit')).length === "
                             f"{sum(t.startswith('MemoryKit') for t in want)}", 30, f"the graph of {TEMPLATE}")
    finally:
        _shot(browser, _label(editor), "template_loaded")
    got = sorted(browser.execute_script(f"return {APP}.graph.nodes.map(n => n.type)"))
    assert got == want
    br.close_dialogs(browser)


def test_template_thumbnails_load(ui_server, browser, editor):
    """Every template card's picture: the template browser asks
    ``/api/workflow_templates/<pack folder>/<name>.jpg`` for each example workflow; each must be
    served as a JPEG the browser decodes."""
    got = browser.execute_script("""return Promise.all(arguments[0].map(async n => {
        const r = await fetch(`/api/workflow_templates/${arguments[1]}/${n}.jpg`);
        let size = null;
        try { const b = await createImageBitmap(await r.blob()); size = [b.width, b.height]; } catch (e) {}
        return [n, r.status, r.headers.get('content-type'), size]; }))""", examples.example_names(), PACK_DIR_NAME)
    bad = [g for g in got if g[1] != 200 or "image/jpeg" not in (g[2] or "") or not g[3] or min(g[3]) < 64]
    assert not bad, f"template thumbnails not served as decodable JPEGs (name, status, type, size): {bad}"


# --- badges -------------------------------------------------------------------------------
def _run_in_editor(server, drv, timeout=600) -> dict:
    """Click Run; wait for the one new /history entry; return it."""
    from selenium.webdriver.common.by import By
    br.close_dialogs(drv)
    known = set(server.get("/history"))
    br.wait_for(drv, "document.querySelector(\"[data-testid='queue-button']\")", 30, "the Run button")
    drv.find_element(By.CSS_SELECTOR, "[data-testid='queue-button']").click()
    deadline = time.time() + timeout
    while True:
        new = {k: v for k, v in server.get("/history").items() if k not in known}
        if new and all(v.get("status", {}).get("completed") is not None for v in new.values()):
            break
        if time.time() > deadline:  # a hang, not a speed check
            raise TimeoutError(f"the queued workflow did not finish:\n{server.log_tail()}")
        time.sleep(0.5)
    assert len(new) == 1, f"the Run button queued {len(new)} prompts"
    entry = next(iter(new.values()))
    assert entry["status"]["status_str"] == "success", entry["status"]
    return entry


def _badges(drv) -> dict:
    """node id → the badge as the page shows it (harness.badge_dom.badges)."""
    return badge_dom.badges(drv)


def _check_badges(badges: dict, reports: dict, name: str, cached: bool = False) -> None:
    assert set(reports) <= set(badges), f"{name}: nodes with a report but no badge: {set(reports) - set(badges)}"
    for nid, b in badges.items():
        if b["stale"]:
            continue
        figs = b["report"].get("badge")
        assert figs, f"{name} node {nid}: report without badge figures"
        assert b["text"], f"{name} node {nid}: the node shows no MemoryKit badge ({b['detail']})"
        assert not bad_figures(figs), f"{name} node {nid}: badly formed figures {bad_figures(figs)}"
        if nid in reports and b["type"] != "MemoryKitGroupOffload":  # Group Offload updates after sampling
            assert b["report"] == reports[nid] | {"badge": figs}, f"{name} node {nid}: page and /history differ"
            assert figs == reports[nid]["badge"]
        assert badge_matches(b["text"], figs), f"{name} node {nid}: badge {b['text']!r} vs figures {figs}"
        assert split_badge(b["text"])[0] == cached == b["cached"], (name, nid, b["text"])
        assert b["inside"], f"{name} node {nid}: the badge row does not fit inside the node: {b['detail']}"


def _load_test_graph(drv, server, name: str, object_info: dict) -> dict:
    """Open the example in the editor as a user does: the file's own graph, widget values and real
    model file names (the server lists the stand-ins under those names, ``harness.stand_ins``);
    only a Wan or Flux 2 text encoder is replaced by the test text encode
    (``examples.template_as_run``). Returns the UI graph loaded."""
    ui = examples.template_as_run(name)
    drv.execute_script(f"await {APP}.loadGraphData(arguments[0]); {APP}.canvas.setDirty(true, true);", ui)
    br.wait_for(drv, f"{APP}.graph.nodes.length === {len(ui['nodes'])}", 30, f"the graph of {name}")
    return ui


@pytest.mark.parametrize("name", BADGE_EXAMPLES)
def test_example_badges(ui_server, browser, editor, ui_object_info, name):
    if examples.unavailable(name):
        pytest.skip(examples.unavailable(name))
    _load_test_graph(browser, ui_server, name, ui_object_info)
    entry = _run_in_editor(ui_server, browser)
    reports = {nid: ui["memorykit_report"][0] for nid, ui in entry["outputs"].items() if "memorykit_report" in ui}
    assert reports, f"{name}: no MemoryKit report in /history"
    br.wait_for(browser, f"{APP}.graph.nodes.filter(n => n.memorykit && !n.memorykit.stale).length >= {len(reports)}",
                30, f"{len(reports)} MemoryKit badges")
    time.sleep(0.3)
    for label in _renderers(browser, editor):
        badges = _badges(browser)
        _check_badges(badges, reports, f"{name} ({label})")
        for nid, b in badges.items() if not label.endswith("-classic") else ():
            # one picture per node kind (README screenshots come from these; the first renderer only)
            badge_dom.center_on(browser, int(nid))
            br.node_screenshot(browser, [int(nid)], f"frontend-{label}/nodes/{name}-{b['type']}.png")
        browser.execute_script(f"{APP}.canvas.ds.scale = 1; {APP}.canvas.setDirty(true, true);")
        br.frame_nodes(browser, [int(n) for n in reports])
        _shot(browser, label, name)
        br.node_screenshot(browser, [int(n) for n in badges], f"frontend-{label}/nodes/{name}-all.png")
        _assert_no_errors_from_us(browser)


def test_hover_panel_and_cached_rerun(ui_server, browser, editor, ui_object_info):
    """Hover a badge → the full report (readable, no JSON); node menu → the panel, newest first."""
    _load_test_graph(browser, ui_server, HOVER_EXAMPLE, ui_object_info)
    entry = _run_in_editor(ui_server, browser)
    reports = {nid: ui["memorykit_report"][0] for nid, ui in entry["outputs"].items() if "memorykit_report" in ui}
    br.wait_for(browser, f"{APP}.graph.nodes.filter(n => n.memorykit && !n.memorykit.stale).length === {len(reports)}",
                30, "the badges")
    free_id = next(nid for nid, r in reports.items() if "unloaded_bytes" in r)
    text = entry["outputs"][free_id]["text"][0]
    for label in _renderers(browser, editor):
        browser.execute_script("document.querySelector('[data-testid=memorykit-hover]')?.style.setProperty('display', 'none')")
        pt = badge_dom.badge_point(browser, int(free_id))
        br.move_to(browser, *pt).perform()
        hover = br.wait_for(browser, "(() => { const e = document.querySelector('[data-testid=memorykit-hover]');"
                                     " return e && e.style.display !== 'none' && e.innerText; })()", 10,
                            f"the report card on hovering Free Memory's badge ({label})")
        assert text.splitlines()[-1] in hover and f"#{free_id} Free Memory" in hover, hover
        assert "{" not in hover, f"raw JSON in the hover card: {hover}"
        _shot(browser, label, "hover")
        _assert_no_errors_from_us(browser)

    centre = browser.execute_script(f"""const c = {APP}.canvas, n = c.graph.getNodeById(arguments[0]);
        const p = c.ds.convertOffsetToCanvas([n.pos[0] + n.size[0] / 2, n.pos[1] + n.size[1] / 2]);
        const r = c.canvas.getBoundingClientRect(); return [p[0] + r.left, p[1] + r.top];""", int(free_id))
    br.move_to(browser, *centre).context_click().perform()
    item = br.wait_for(browser, "[...document.querySelectorAll('.litemenu-entry, .p-contextmenu-item, [role=menuitem]')]"
                                ".find(e => e.innerText.trim() === 'Show memory report (MemoryKit)')", 10,
                       "our entry in the node's context menu")
    item.click()
    panel = br.wait_for(browser, "document.querySelector('[data-testid=memorykit-panel]')?.innerText", 10, "the MemoryKit panel")
    order = browser.execute_script("return [...document.querySelectorAll('[data-testid=memorykit-panel] [data-run=\"0\"]')]"
                                   ".map(e => e.dataset.nodeId)")
    assert set(order) == set(reports), (order, reports.keys())
    assert order == list(reversed(list(reports))), f"panel order {order}, run order {list(reports)}: newest first"
    for nid, rep in reports.items():
        assert f"#{nid} " in panel, panel
        for fig in rep["badge"]:
            assert fig in panel, (fig, panel)
    assert "{" not in panel, "raw JSON in the panel"
    _shot(browser, _label(editor), "panel")

    _assert_no_errors_from_us(browser)


def _cached_ids(entry: dict) -> set[str]:
    return {str(n) for kind, msg in entry["status"].get("messages", []) if kind == "execution_cached"
            for n in msg.get("nodes", [])}


def test_cached_rerun_after_reload_shows_last_figures(ui_server, browser, editor, ui_object_info):
    """After a page reload, rerunning an unchanged workflow: nodes ComfyUI reuses (cached) show
    the figures of their last run, marked "cached"; the others show their new figures."""
    _load_test_graph(browser, ui_server, CACHED_EXAMPLE, ui_object_info)
    _run_in_editor(ui_server, browser)
    br.open_editor(browser, ui_server.url)  # a page reload: the page forgets every report
    _load_test_graph(browser, ui_server, CACHED_EXAMPLE, ui_object_info)
    entry = _run_in_editor(ui_server, browser)
    cached = _cached_ids(entry)
    fresh = {nid: ui["memorykit_report"][0] for nid, ui in entry["outputs"].items() if "memorykit_report" in ui}
    kinds = {n["id"]: n["type"] for n in json.loads((examples.EXAMPLES / f"{CACHED_EXAMPLE}.json").read_text())["nodes"]}
    ours = {str(i) for i, t in kinds.items() if t.startswith("MemoryKit")}
    want_cached = (ours & cached) - set(fresh)
    assert want_cached, f"nothing of ours was cached: cached {cached}, reports {set(fresh)}"
    br.wait_for(browser, f"{APP}.graph.nodes.filter(n => n.memorykit && n.memorykit.cached).length === {len(want_cached)}",
                30, f"the cached nodes' badges ({sorted(want_cached)})")
    for label in _renderers(browser, editor):
        badges = _badges(browser)
        for nid in want_cached:
            assert badges[nid]["text"], f"cached node {nid} shows no MemoryKit badge ({label}): {badges[nid]['detail']}"
            assert badges[nid]["cached"] and badges[nid]["text"].startswith("cached · "), (label, badges[nid])
            assert badge_matches(badges[nid]["text"], badges[nid]["report"]["badge"]), (label, badges[nid])
            assert badges[nid]["inside"], (label, badges[nid])
        _check_badges({k: v for k, v in badges.items() if k not in want_cached}, fresh, f"{CACHED_EXAMPLE} ({label})")
        br.frame_nodes(browser, [int(n) for n in want_cached | set(fresh)])
        _shot(browser, label, "cached")
        _assert_no_errors_from_us(browser)
