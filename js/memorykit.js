// ComfyUI-MemoryKit frontend extension (comfyui-frontend-package >= 1.32).
//
// After a prompt runs, every node whose UI output carries a `memorykit_report` (Memory Report,
// Free Memory and the technique nodes) gets a badge above its title with its technique's
// headline figures (the report's `badge` list), fitted to the node's width ("+N" for the rest);
// hovering the badge shows the full report, and the "MemoryKit" sidebar panel lists the reports
// of the last runs, newest first. A node ComfyUI did not rerun (cached) keeps its last figures,
// marked "cached" (after a page reload they are read back from /history). Data comes only from
// the nodes' UI outputs (the `executed` event → node.onExecuted) and /history.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { badgeText } from "./memorykit_format.js";
import { HoverCard, PANEL_ID, ReportPanel } from "./memorykit_panel.js";

const BADGE_GAP = 2; // LGraphNode.drawBadges' default gap (px, graph units)
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

/** Width (px, graph units) the node's other badges take in its badge row. */
function otherBadgesWidth(node) {
  const ctx = measureCtx2d();
  let w = 0;
  for (const b of node.badges) {
    if (b === node.__memorykitBadge) continue;
    const badge = typeof b === "function" ? b() : b;
    if (badge?.getWidth) w += badge.getWidth(ctx) + BADGE_GAP;
  }
  return w;
}

/**
 * The badge for a node's current state, its text fitted to the room the node's width leaves
 * next to its other badges (so it does not run over the neighbouring node); rebuilt only when
 * the state or that room changes.
 */
function currentBadge(node) {
  const st = node.memorykit;
  if (!st) return emptyBadge();
  const room = Math.max(24, node.width - otherBadgesWidth(node));
  const look = st.stale ? "stale" : st.cached ? "cached" : "fresh";
  if (!st.badge || st.badgeLook !== look || st.badgeRoom !== room) {
    const c = COLORS[look];
    const make = (text) => new window.LGraphBadge({ text, fgColor: c.fg, bgColor: c.bg, fontSize: 12 });
    const prefix = st.cached ? CACHED_PREFIX : "";
    const text = badgeText(st.report, room, (t) => make(t).getWidth(measureCtx2d()), prefix);
    st.badge = make(text);
    st.badgeLook = look;
    st.badgeRoom = room;
  }
  return st.badge;
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
  node.setDirtyCanvas?.(true, true);
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
  app.canvas?.setDirty?.(true, true);
}

/** The badge of `node` under graph position [x, y], if our badge is drawn there. */
function badgeHit(node, x, y) {
  if (!node.memorykit || !node.__memorykitBadge || node.flags?.collapsed) return false;
  const titleH = window.LiteGraph?.NODE_TITLE_HEIGHT ?? 30;
  const badges = node.badges.map((b) => (typeof b === "function" ? b() : b));
  const ours = badges.indexOf(node.memorykit.badge);
  if (ours < 0) return false;
  const widths = badges.map((b) => b.getWidth(measureCtx2d()));
  const total = widths.reduce((a, w) => a + w + BADGE_GAP, 0);
  const leftAligned = node.badgePosition === "top-left";
  let x0 = node.pos[0] + (leftAligned ? 0 : node.width - total);
  for (let i = 0; i < ours; i++) x0 += widths[i] + BADGE_GAP;
  const bottom = node.pos[1] - titleH - BADGE_GAP;
  const top = bottom - (node.memorykit.badge.height ?? 20);
  return x >= x0 && x <= x0 + widths[ours] && y >= top && y <= bottom;
}

function onPointerMove(e) {
  const canvas = app.canvas;
  if (!canvas?.convertEventToCanvasOffset) return;
  const [x, y] = canvas.convertEventToCanvasOffset(e);
  for (const node of graphNodes()) {
    if (badgeHit(node, x, y)) {
      const st = node.memorykit;
      const note = st.stale ? " (previous run)" : st.cached ? " (cached: figures of its last run)" : "";
      hover.show(e.clientX, e.clientY, node.id, `#${node.id} ${node.title || node.type}${note}`,
        st.report, st.text);
      return;
    }
  }
  hover.hide();
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

  async setup() {
    const tabs = app.extensionManager?.sidebarTab ?? app.extensionManager;
    tabs?.registerSidebarTab?.(panel.tab());
    api.addEventListener("execution_start", (ev) => {
      cachedIds = new Set();
      runs.unshift({ promptId: ev.detail?.prompt_id ?? null, started: Date.now(), entries: new Map() });
      runs.splice(MAX_RUNS);
      for (const r of runs.slice(1)) for (const e of r.entries.values()) e.stale = true;
      for (const node of graphNodes()) if (node.memorykit) node.memorykit.stale = true;
      panel.refresh();
      app.canvas?.setDirty?.(true, true);
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
      app.canvas?.setDirty?.(true, true);
    });
    const canvasEl = app.canvasEl ?? app.canvas?.canvas;
    canvasEl?.addEventListener("pointermove", onPointerMove);
    canvasEl?.addEventListener("pointerleave", () => hover.hide());
  },
});
