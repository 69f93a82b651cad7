// ComfyUI-MemoryKit frontend extension (comfyui-frontend-package >= 1.32).
//
// After a prompt runs, every node whose UI output carries a `memorykit_report` (Memory Report,
// Free Memory and the technique nodes) gets a badge above its title with its figures (peak
// VRAM / RAM and the technique's own fields); hovering the badge shows the full report, and the
// "MemoryKit" sidebar panel lists every report of the last run. Data comes only from the
// nodes' UI outputs (the `executed` event → node.onExecuted): prompts submitted through the API
// behave the same without a browser.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { badgeText } from "./memorykit_format.js";
import { HoverCard, PANEL_ID, ReportPanel } from "./memorykit_panel.js";

const BADGE_GAP = 2; // LGraphNode.drawBadges' default gap (px, graph units)
const COLORS = {
  fresh: { fg: "#e3fbfb", bg: "#14505a" },
  stale: { fg: "#b8c2c2", bg: "#3a3f44" }, // a new run started; figures are from the previous one
};

// Reports of the last run, in arrival order: node id → {id, title, report, text, stale}.
const lastRun = new Map();
const panel = new ReportPanel(() => [...lastRun.values()], (id) => selectNode(id));
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
  const room = Math.max(80, node.width - otherBadgesWidth(node) - 4);
  if (!st.badge || st.badgeStale !== st.stale || st.badgeRoom !== room) {
    const c = st.stale ? COLORS.stale : COLORS.fresh;
    const make = (text) => new window.LGraphBadge({ text, fgColor: c.fg, bgColor: c.bg, fontSize: 12 });
    const text = badgeText(st.report, room, (t) => make(t).getWidth(measureCtx2d()));
    st.badge = make(text);
    st.badgeStale = st.stale;
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

/** Record a node's report (called from its onExecuted with the UI output). */
function onReport(node, output) {
  const report = output?.memorykit_report?.[0];
  if (!report || typeof report !== "object") return;
  const text = Array.isArray(output.text) ? output.text[0] : undefined;
  node.memorykit = { report, text, stale: false };
  if (!installBadge(node) && !onReport.warned) {
    onReport.warned = true;
    console.warn("[MemoryKit] this frontend has no node badges; reports are in the MemoryKit sidebar panel.");
  }
  const id = String(node.id);
  lastRun.delete(id);
  lastRun.set(id, { id, title: node.title || node.type, report, text, stale: false });
  panel.refresh();
  node.setDirtyCanvas?.(true, true);
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
      hover.show(e.clientX, e.clientY, node.id, `#${node.id} ${node.title || node.type}${st.stale ? " (previous run)" : ""}`,
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
    api.addEventListener("execution_start", () => {
      for (const e of lastRun.values()) e.stale = true;
      for (const node of graphNodes()) if (node.memorykit) node.memorykit.stale = true;
      panel.refresh();
      app.canvas?.setDirty?.(true, true);
    });
    api.addEventListener("execution_success", () => {
      // Reports of nodes that did not run this time are not part of the last run.
      for (const [id, e] of [...lastRun]) if (e.stale) lastRun.delete(id);
      panel.refresh();
    });
    const canvasEl = app.canvasEl ?? app.canvas?.canvas;
    canvasEl?.addEventListener("pointermove", onPointerMove);
    canvasEl?.addEventListener("pointerleave", () => hover.hide());
  },
});
