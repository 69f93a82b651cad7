// ComfyUI-MemoryKit frontend extension (comfyui-frontend-package >= 1.32).
//
// After a prompt runs, every node whose UI output carries a `memorykit_report` (Memory Report,
// Free Memory and the technique nodes) gets a badge with its technique's headline figures (the
// report's `badge` list), fitted to the room the node leaves ("+N" for the rest): on the classic
// canvas in the badge row above its title, in Nodes 2.0 (Vue nodes) as a chip in the node's own
// badge row (memorykit_render.js has the per-renderer geometry); hovering the badge shows the full report, and the "MemoryKit" sidebar panel lists the reports
// of the last runs, newest first. A node ComfyUI did not rerun (cached) keeps its last figures,
// marked "cached" (after a page reload they are read back from /history). Data comes only from
// the nodes' UI outputs (the `executed` event → node.onExecuted) and /history.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { badgeText } from "./memorykit_format.js";
import { HoverCard, PANEL_ID, ReportPanel } from "./memorykit_panel.js";
import { BADGE_ATTR, bump, classicRoom, measuringRow, readTick, vueNodesOn, vueRoom, watchTick } from "./memorykit_render.js";

const COLORS = {
  fresh: { fg: "#e3fbfb", bg: "#14505a" },
  stale: { fg: "#b8c2c2", bg: "#3a3f44" }, // a new run started; figures are from the previous one
  cached: { fg: "#d9e4e4", bg: "#35505a" }, // ComfyUI reused the node's output: figures of its last run
};
const CACHED_PREFIX = "cached · ";
const MAX_RUNS = 5; // runs kept in the panel

// Reports of the runs so far, newest first: [{promptId, started, entries: Map(node id → entry)}];
// entry = {id, title, report, text, stale, cached}.
const runs = [];
let cachedIds = new Set(); // nodes ComfyUI reported as cached in the current run

function currentRun() {
  if (!runs.length) runs.unshift({ promptId: null, started: Date.now(), entries: new Map() });
  return runs[0];
}
const panel = new ReportPanel(() => runs.map((r) => ({ ...r, entries: [...r.entries.values()].reverse() })),
  (id) => selectNode(id));
const hover = new HoverCard();
let measureCtx = null;

function graphNodes() {
  return app.canvas?.graph?.nodes ?? app.graph?.nodes ?? [];
}

function selectNode(id) {
  const node = graphNodes().find((n) => String(n.id) === String(id));
  if (!node) return;
  app.canvas.selectNode?.(node);
  app.canvas.centerOnNode?.(node);
  app.canvas.setDirty?.(true, true);
}

function openPanel(id) {
  const tabs = app.extensionManager?.sidebarTab;
  if (tabs && tabs.activeSidebarTabId !== PANEL_ID) tabs.toggleSidebarTab(PANEL_ID);
  setTimeout(() => panel.reveal(id), 50);
}

function measureCtx2d() {
  return (measureCtx ??= document.createElement("canvas").getContext("2d"));
}

const ROOM_TTL_MS = 500; // classic canvas: the row is re-measured at most this often (or on a resize)

/** Classic canvas: the room our badge has, re-measured when the node's width changes or it is old. */
function classicRoomCached(node, st) {
  const now = Date.now();
  if (st.roomWidth !== node.width || !(now - st.roomAt < ROOM_TTL_MS)) {
    st.room = Math.max(24, Math.floor(classicRoom(node, node.__memorykitBadge)));
    st.roomWidth = node.width;
    st.roomAt = now;
  }
  return st.room;
}

/**
 * The badge for a node's current state, its text fitted to the room the node's badge row leaves
 * (so it stays inside the node); rebuilt only when the state, the renderer or that room changes.
 * Classic canvas: an LGraphBadge that records where it was drawn (for the hover card); Nodes 2.0:
 * the chip's text, colours and our attribute (the hover card listens on the chip's element).
 */
function currentBadge(node) {
  const probe = measuringRow();
  if (probe) return probe;
  readTick(); // the Vue badge row depends on it (memorykit_render.js)
  const st = node.memorykit;
  if (!st) return emptyBadge();
  const vue = vueNodesOn();
  const look = st.stale ? "stale" : st.cached ? "cached" : "fresh";
  const c = COLORS[look];
  const make = (text) => new window.LGraphBadge({ text, fgColor: c.fg, bgColor: c.bg, fontSize: 12 });
  let room, width;
  if (vue) {
    const v = vueRoom(node);
    room = Math.floor(v.room);
    width = v.width;
  } else {
    room = classicRoomCached(node, st);
    width = (t) => make(t).getWidth(measureCtx2d());
  }
  const key = `${vue}|${look}|${room}`;
  if (!st.badge || st.badgeKey !== key) {
    const text = badgeText(st.report, room, width, st.cached ? CACHED_PREFIX : "");
    if (vue) {
      st.badge = { text, fgColor: c.fg, bgColor: c.bg, [BADGE_ATTR]: String(node.id) };
    } else {
      const badge = make(text);
      badge.draw = function (ctx, x, y) { // where the row put it (node-local), for the hover card
        st.drawnAt = [x + (this.xOffset ?? 0), y + (this.yOffset ?? 0), this.getWidth(ctx), this.height];
        return window.LGraphBadge.prototype.draw.call(this, ctx, x, y);
      };
      st.badge = badge;
    }
    st.badgeKey = key;
    st.badgeRoom = room;
  }
  return st.badge;
}

/** Nodes 2.0: after the rows are laid out, re-fit the chips whose room differs from the guess. */
function refitVue(rounds = 3) {
  if (!vueNodesOn()) return;
  requestAnimationFrame(() => requestAnimationFrame(() => {
    let changed = false;
    for (const node of graphNodes()) {
      const st = node.memorykit;
      if (!st?.badge) continue;
      const v = vueRoom(node);
      if (v.laidOut && Math.floor(v.room) !== st.badgeRoom) changed = true;
    }
    if (changed) {
      bump();
      if (rounds > 1) refitVue(rounds - 1);
    }
  }));
}

/** Every renderer redraws our badges (the canvas now; Vue rows re-read their providers). */
function redraw() {
  bump();
  refitVue();
  app.canvas?.setDirty?.(true, true);
}

let _empty = null;
function emptyBadge() {
  return (_empty ??= new window.LGraphBadge({ text: "" }));
}

function installBadge(node) {
  if (node.__memorykitBadge) return true;
  if (!window.LGraphBadge || !Array.isArray(node.badges)) return false;
  const provider = () => currentBadge(node);
  node.badges.push(provider);
  node.__memorykitBadge = provider;
  return true;
}

/** Record a node's report (called from its onExecuted with the UI output, or from /history). */
function onReport(node, output, cached = cachedIds.has(String(node.id))) {
  const report = output?.memorykit_report?.[0];
  if (!report || typeof report !== "object") return;
  const text = Array.isArray(output.text) ? output.text[0] : undefined;
  node.memorykit = { report, text, stale: false, cached };
  if (!installBadge(node) && !onReport.warned) {
    onReport.warned = true;
    console.warn("[MemoryKit] this frontend has no node badges; reports are in the MemoryKit sidebar panel.");
  }
  const id = String(node.id);
  const run = currentRun();
  run.entries.delete(id);
  run.entries.set(id, { id, title: node.title || node.type, report, text, stale: false, cached });
  panel.refresh();
  redraw();
}

/** Cached nodes with no figures in this page (e.g. after a reload): their last report from /history. */
async function restoreCached(ids) {
  const want = graphNodes().filter((n) => ids.has(String(n.id)) && !n.memorykit);
  if (!want.length) return;
  let history;
  try {
    // The server's own format ({prompt_id: {prompt: [number, id, prompt, extra, outputs], outputs}}),
    // the same on every frontend (api.getHistory's shape changed between frontends).
    const res = await api.fetchApi("/history?max_items=64");
    history = await res.json();
  } catch (err) {
    return;
  }
  const items = Object.values(history ?? {});
  // Newest first; an entry's prompt must hold the same node type under that id.
  const sorted = [...items].sort((a, b) => (b.prompt?.[0] ?? 0) - (a.prompt?.[0] ?? 0));
  for (const node of want) {
    const id = String(node.id);
    for (const h of sorted) {
      const out = h.outputs?.[id];
      if (out?.memorykit_report && h.prompt?.[2]?.[id]?.class_type === node.type) {
        if (!node.memorykit) onReport(node, out, true);
        break;
      }
    }
  }
  redraw();
}

/** Classic canvas: is graph position [x, y] on our badge of `node` (where the row last drew it)? */
function badgeHit(node, x, y) {
  const at = node.memorykit?.drawnAt;
  if (!at || node.flags?.collapsed) return false;
  const [bx, by, bw, bh] = at;
  const lx = x - node.pos[0], ly = y - node.pos[1];
  return lx >= bx && lx <= bx + bw && ly >= by && ly <= by + bh;
}

function showCard(node, e) {
  const st = node.memorykit;
  const note = st.stale ? " (previous run)" : st.cached ? " (cached: figures of its last run)" : "";
  hover.show(e.clientX, e.clientY, node.id, `#${node.id} ${node.title || node.type}${note}`, st.report, st.text);
}

function onPointerMove(e) {
  const canvas = app.canvas;
  if (!canvas?.convertEventToCanvasOffset || vueNodesOn()) return;
  const [x, y] = canvas.convertEventToCanvasOffset(e);
  const node = graphNodes().find((n) => badgeHit(n, x, y));
  if (node) showCard(node, e);
  else hover.hide();
}

/** Nodes 2.0: the card follows the pointer over our chip in the node's DOM element. */
function onDomPointer(e) {
  const chip = e.target?.closest?.(`[${BADGE_ATTR}]`);
  if (!chip) {
    if (hover.fromDom) hover.hide();
    hover.fromDom = false;
    return;
  }
  const id = chip.getAttribute(BADGE_ATTR);
  const node = graphNodes().find((n) => String(n.id) === id);
  if (!node?.memorykit) return;
  showCard(node, e);
  hover.fromDom = true;
}

app.registerExtension({
  name: "MemoryKit.Reports",

  async beforeRegisterNodeDef(nodeType) {
    // Every node type: any node whose UI output carries a memorykit_report gets a badge.
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (output) {
      const r = onExecuted?.apply(this, arguments);
      try {
        onReport(this, output);
      } catch (err) {
        console.warn("[MemoryKit] could not show the report of node", this.id, err);
      }
      return r;
    };
  },

  nodeCreated(node) {
    // MemoryKit nodes get their (empty) badge slot up front, so renderers that read the badge
    // list once (Vue nodes) show the figures when they arrive.
    if (node.constructor?.nodeData?.category?.startsWith("MemoryKit")) installBadge(node);
  },

  getNodeMenuItems(node) {
    if (!node?.memorykit) return [];
    return [{ content: "Show memory report (MemoryKit)", callback: () => openPanel(node.id) }];
  },

  async init() {
    // registered before the first graph loads, so every Vue node's badge row reads the tick
    const tabs = app.extensionManager?.sidebarTab ?? app.extensionManager;
    tabs?.registerSidebarTab?.(panel.tab());
    watchTick(PANEL_ID);
  },

  async setup() {
    api.addEventListener("execution_start", (ev) => {
      cachedIds = new Set();
      runs.unshift({ promptId: ev.detail?.prompt_id ?? null, started: Date.now(), entries: new Map() });
      runs.splice(MAX_RUNS);
      for (const r of runs.slice(1)) for (const e of r.entries.values()) e.stale = true;
      for (const node of graphNodes()) if (node.memorykit) node.memorykit.stale = true;
      panel.refresh();
      redraw();
    });
    api.addEventListener("execution_cached", (ev) => {
      cachedIds = new Set((ev.detail?.nodes ?? []).map(String));
      for (const node of graphNodes()) {
        const id = String(node.id);
        if (!cachedIds.has(id) || !node.memorykit) continue;
        node.memorykit.stale = false; // ComfyUI reused this node's output: its figures still hold
        node.memorykit.cached = true;
        const st = node.memorykit;
        currentRun().entries.set(id, { id, title: node.title || node.type, report: st.report, text: st.text,
          stale: false, cached: true });
      }
      restoreCached(cachedIds);
      panel.refresh();
      redraw();
    });
    const canvasEl = app.canvasEl ?? app.canvas?.canvas;
    canvasEl?.addEventListener("pointermove", onPointerMove);
    canvasEl?.addEventListener("pointerleave", () => hover.hide());
    document.addEventListener("pointermove", onDomPointer, { passive: true });
  },
});
