"""What the page shows of the MemoryKit badges, measured the way a person sees them, per renderer.

- Nodes 2.0 (Vue nodes): the badge is our chip in the node's DOM element (``[data-node-id=<id>]
  [data-memorykit-badge]``): its text and its box against the node's box are read from the DOM.
- Classic canvas: the canvas cannot be read back as text, so the text comes from the page's state,
  and the row's extent is recorded from one real frame: every ``roundRect`` the canvas context
  draws above a node's title (the badge pills, ours and the frontend's source/``#id`` chip) in that
  node's coordinates. Independent of how the extension measures its room.

Console: :func:`install_console_hook` (before the page loads) records every ``console.warn`` /
``console.error`` whose call stack passes through the pack's files (``/extensions/<pack>/``), e.g.
a deprecated frontend API the pack reads; :func:`our_warnings` returns them.
"""
from __future__ import annotations

import time

from .browser import APP

# One frame's badge-row pills, per node: {id: {left, right, width, chips}} in graph units, node-local.
_ROWS_JS = f"""const c = {APP}.canvas, ctx = c.canvas.getContext('2d'), dpr = window.devicePixelRatio || 1;
const rects = [], orig = ctx.roundRect;
ctx.roundRect = function (x, y, w, h) {{ const t = this.getTransform(); rects.push([t.e / dpr, t.f / dpr, x, y, w, h]);
  return orig.apply(this, arguments); }};
try {{ c.draw(true, true); }} finally {{ delete ctx.roundRect; }}
const TH = LiteGraph.NODE_TITLE_HEIGHT, out = {{}};
for (const n of c.graph.nodes) {{
  const [px, py] = c.ds.convertOffsetToCanvas(n.pos);
  const row = rects.filter(([e, f, x, y, w, h]) => Math.abs(e - px) < 0.5 && Math.abs(f - py) < 0.5 && y + h <= -TH + 0.5);
  if (row.length) out[String(n.id)] = {{left: Math.min(...row.map(r => r[2])),
    right: Math.max(...row.map(r => r[2] + r[4])), width: n.size[0], chips: row.length}};
}}
return out;"""

# The page's state of every node with a report: {id: {type, text, report, cached, stale, drawnAt}}.
_STATE_JS = f"""const out = {{}};
for (const n of {APP}.graph.nodes) {{
  if (!n.memorykit || !n.__memorykitBadge) continue;
  const st = n.memorykit;
  out[String(n.id)] = {{type: n.type, text: st.badge?.text ?? null, report: st.report, cached: !!st.cached,
    stale: !!st.stale, drawnAt: st.drawnAt ?? null}};
}}
return out;"""

_CHIP_JS = """const n = document.querySelector(`[data-node-id="${arguments[0]}"]`);
const chip = n && n.querySelector('[data-memorykit-badge]');
if (!chip) return {node: !!n, chip: false};
const a = chip.getBoundingClientRect(), b = n.getBoundingClientRect();
return {node: true, chip: true, text: chip.innerText.trim(), attr: chip.getAttribute('data-memorykit-badge'),
  box: [a.left, a.top, a.right, a.bottom], node_box: [b.left, b.top, b.right, b.bottom],
  inside: a.left >= b.left - 0.5 && a.right <= b.right + 0.5 && a.top >= b.top - 0.5 && a.bottom <= b.bottom + 0.5};"""


def vue_on(drv) -> bool:
    """Whether the page draws Vue nodes (the frontend's own setting)."""
    return bool(drv.execute_script(f"return {APP}.extensionManager?.setting?.get?.('Comfy.VueNodes.Enabled') === true"))


def set_vue(drv, on: bool, timeout: float = 30) -> None:
    """Switch the renderer in the open page through the frontend's setting (as the settings
    dialog does) and wait until the nodes are drawn by it."""
    from .browser import wait_for
    drv.execute_script(f"await {APP}.extensionManager.setting.set('Comfy.VueNodes.Enabled', arguments[0]);", on)
    want = "true" if on else "false"
    wait_for(drv, f"({APP}.extensionManager.setting.get('Comfy.VueNodes.Enabled') === true) === {want}"
                  f" && !!document.querySelector('[data-node-id]') === {want}", timeout,
             f"the {'Vue' if on else 'classic'} node renderer")
    drv.execute_script(f"{APP}.canvas.setDirty(true, true);")
    time.sleep(0.6)


def center_on(drv, node_id: int, scale: float = 1.0) -> None:
    """Pan the canvas so node ``node_id`` sits in the middle of the free area, at ``scale``."""
    drv.execute_script(f"""const c = {APP}.canvas, n = c.graph.getNodeById(arguments[0]), r = c.canvas.getBoundingClientRect();
        c.ds.scale = arguments[1];
        c.ds.offset = [-n.pos[0] + (r.width / 2 - n.size[0] / 2) / arguments[1], -n.pos[1] + (r.height / 2 - n.size[1] / 2) / arguments[1]];
        c.setDirty(true, true);""", node_id, scale)
    time.sleep(0.4)


def vue_chip(drv, node_id: int, timeout: float = 10) -> dict:
    """Our chip in Vue node ``node_id`` (centred on screen at 100 %, so it is mounted and drawn in
    full): text, box, node box, inside. Waits up to ``timeout`` s for it to appear."""
    center_on(drv, node_id)
    deadline = time.time() + timeout
    while True:
        got = drv.execute_script(_CHIP_JS, str(node_id))
        if got["chip"] or time.time() > deadline:
            return got
        time.sleep(0.25)


def badges(drv) -> dict:
    """node id → {type, text, report, cached, stale, inside, detail}: ``text`` and ``inside`` (the
    badge lies inside the node: Vue — chip box in node box; classic — the drawn row within the
    node's width) as the page shows them, each node centred on screen at 100 % first (so it is
    drawn, and mounted in Vue mode). ``text`` is None where the node shows no badge."""
    state = drv.execute_script(_STATE_JS)
    vue = vue_on(drv)
    for nid, b in state.items():
        if vue:
            chip = vue_chip(drv, int(nid))
            b["text"] = chip.get("text")
            b["inside"] = bool(chip.get("inside"))
            b["detail"] = chip
        else:
            center_on(drv, int(nid))
            row = drv.execute_script(_ROWS_JS).get(nid)
            b["text"] = drv.execute_script(_STATE_JS).get(nid, {}).get("text")
            b["inside"] = bool(row) and row["left"] >= -0.5 and row["right"] <= row["width"] + 0.5
            b["detail"] = row
    return state


def badge_point(drv, node_id: int) -> list[float]:
    """Client coordinates of the middle of our badge on node ``node_id`` (centred at 100 %)."""
    if vue_on(drv):
        chip = vue_chip(drv, node_id)
        assert chip["chip"], f"node {node_id} shows no MemoryKit chip: {chip}"
        x0, y0, x1, y1 = chip["box"]
        return [(x0 + x1) / 2, (y0 + y1) / 2]
    center_on(drv, node_id)
    return drv.execute_script(f"""const c = {APP}.canvas, n = c.graph.getNodeById(arguments[0]);
        const [x, y, w, h] = n.memorykit.drawnAt, r = c.canvas.getBoundingClientRect();
        const p = c.ds.convertOffsetToCanvas([n.pos[0] + x + w / 2, n.pos[1] + y + h / 2]);
        return [p[0] + r.left, p[1] + r.top];""", node_id)


def install_console_hook(drv, pack_dir: str) -> None:
    """Before every page load: record console warnings/errors raised from the pack's code."""
    drv.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": f"""
        window.__memorykitConsole = [];
        Error.stackTraceLimit = 64;
        for (const level of ['warn', 'error']) {{
            const orig = console[level];
            console[level] = function (...args) {{
                const stack = new Error().stack || '';
                if (stack.includes('/extensions/{pack_dir}/'))
                    window.__memorykitConsole.push(level + ': ' + args.map(a => String(a?.message ?? a)).join(' ')
                        + '\\n' + stack.split('\\n').slice(2, 6).join('\\n'));
                return orig.apply(this, args);
            }};
        }}"""})


def our_warnings(drv) -> list[str]:
    """Console warnings/errors raised from the pack's code on this page (see install_console_hook)."""
    return drv.execute_script("return window.__memorykitConsole || []")
