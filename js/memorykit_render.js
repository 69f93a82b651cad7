// Where the figures badge sits on each node renderer, and how much room it has there.
//
// Classic canvas (LiteGraph): the node's badge row is drawn by `node.drawBadges(ctx)`, right-aligned
// above the title. Up to frontend 1.52 the source chip and the `#id` badge are entries of
// `node.badges`; from 1.53 the frontend draws them from its own list in the same row. So the room
// is measured by drawing the row once into a recording context (our badge left empty) and taking
// the span of what was drawn, the same on every frontend.
//
// Nodes 2.0 (Vue nodes, frontend >= 1.53, `Comfy.VueNodes.Enabled`): the row is DOM chips built
// from `node.badges` (text, colours, other properties become attributes of the chip) in a computed
// value that re-runs only when reactive state it read changes. The room is measured in the node's
// DOM element (`[data-node-id]`); the re-run is triggered through `watchTick`/`bump` below.
import { app } from "../../scripts/app.js";

export const BADGE_GAP = 2; // LGraphNode.drawBadges' default gap (px, graph units)
export const BADGE_ATTR = "data-memorykit-badge"; // attribute of our chip in a Vue node (value: node id)
const VUE_ROW_GUESS = 110; // px taken by the row's other chips and paddings before our chip is first laid out

let measuring = false;
let measureCtx = null;
const NO_BADGE = { text: "", height: 0, getWidth: () => 0, draw() {} };

function ctx2d() {
  return (measureCtx ??= document.createElement("canvas").getContext("2d"));
}

/** True when the Vue node renderer ("Nodes 2.0") draws the nodes (public settings API). */
export function vueNodesOn() {
  try {
    return app.extensionManager?.setting?.get?.("Comfy.VueNodes.Enabled") === true;
  } catch (err) {
    return false;
  }
}

/** While the classic row is being measured our provider must return NO_BADGE (see classicRoom). */
export function measuringRow() {
  return measuring ? NO_BADGE : null;
}

/**
 * Room (px, graph units) the node's classic badge row leaves for our badge: the node's width less
 * what the row draws besides ours (recorded from one `node.drawBadges` into a context that only
 * records rectangles and text) and the gaps. Falls back to summing `node.badges` where the node has
 * no drawBadges.
 */
export function classicRoom(node, ours) {
  const ctx = ctx2d();
  let left = Infinity;
  let right = -Infinity;
  const note = (x, w) => {
    left = Math.min(left, x);
    right = Math.max(right, x + w);
  };
  if (typeof node.drawBadges === "function") {
    const rec = Object.create(ctx); // reads (font, measureText) go to the real context; draws are recorded
    const measure = (t) => ctx.measureText(t);
    Object.assign(rec, {
      measureText: measure, beginPath() {}, fill() {}, stroke() {}, save() {}, restore() {},
      roundRect: (x, y, w) => note(x, w), rect: (x, y, w) => note(x, w), fillRect: (x, y, w) => note(x, w),
      fillText: (t, x) => note(x, measure(t).width), drawImage: (img, x, y, w) => note(x, w ?? 0),
    });
    Object.defineProperty(rec, "font", { get: () => ctx.font, set: (x) => { ctx.font = x; }, configurable: true });
    for (const k of ["fillStyle", "strokeStyle", "textBaseline", "textAlign", "globalAlpha"]) {
      let v = ctx[k];
      Object.defineProperty(rec, k, { get: () => v, set: (x) => { v = x; }, configurable: true });
    }
    measuring = true;
    try {
      node.drawBadges(rec);
    } catch (err) {
      left = Infinity;
    } finally {
      measuring = false;
    }
    const used = left < right ? right - left + BADGE_GAP : 0;
    return node.width - used - BADGE_GAP;
  }
  let used = 0;
  for (const b of node.badges) {
    if (b === ours) continue;
    const badge = typeof b === "function" ? b() : b;
    if (badge?.getWidth) used += badge.getWidth(ctx) + BADGE_GAP;
  }
  return node.width - used - BADGE_GAP;
}

/** Our chip in a Vue node's DOM, or null. */
export function vueChip(nodeId) {
  return document.querySelector(`[data-node-id="${CSS.escape(String(nodeId))}"] [${BADGE_ATTR}]`);
}

/**
 * Room (CSS px) for our chip's text in the Vue node's badge row, and a text-width function in the
 * chip's font. Before our chip is first laid out, the node's width less a guess for the other chips.
 */
export function vueRoom(node) {
  const chip = vueChip(node.id);
  const ctx = ctx2d();
  if (!chip) {
    ctx.font = "12px Inter, sans-serif";
    return { room: Math.max(24, node.width - VUE_ROW_GUESS), width: (t) => ctx.measureText(t).width, laidOut: false };
  }
  const group = chip.parentElement;
  const row = group?.parentElement;
  const cs = getComputedStyle(chip);
  const font = `${cs.fontWeight} ${cs.fontSize} ${cs.fontFamily}`;
  const px = (s, k) => parseFloat(s[k]) || 0;
  const rs = getComputedStyle(row);
  const gap = px(rs, "columnGap");
  let others = 0;
  for (const c of row.children) if (c !== group) others += c.offsetWidth + gap;
  others += group.offsetWidth - chip.offsetWidth; // other extensions' chips in our group
  const inner = row.clientWidth - px(rs, "paddingLeft") - px(rs, "paddingRight");
  const room = inner - others - px(cs, "paddingLeft") - px(cs, "paddingRight") - 1;
  return {
    room: Math.max(24, room),
    width: (t) => {
      ctx.font = font;
      return ctx.measureText(t).width;
    },
    laidOut: true,
  };
}

// The one frontend internal used: the sidebar tab object we registered is kept by the frontend in a
// reactive store (Vue), so a property of the stored object is reactive state. Our badge providers
// read it while the Vue badge row is computed; `bump()` writes it, which re-runs the row of every
// node that has our provider. Feature-detected (`__v_isReactive`); without it bump does nothing
// (the classic canvas redraws anyway). tests/test_frontend.py reads the badge from the Vue node's
// DOM, so a frontend that stops keeping the tab reactive fails there.
let tickHolder = null;

/** Find the stored (reactive) copy of our sidebar tab `tabId`; call after registering it. */
export function watchTick(tabId) {
  const store = app.extensionManager;
  const tabs = store?.getSidebarTabs?.() ?? store?.sidebarTab?.sidebarTabs;
  const tab = Array.isArray(tabs) ? tabs.find((t) => t?.id === tabId) : null;
  tickHolder = tab?.__v_isReactive ? tab : null;
  if (tickHolder && tickHolder.memorykitRevision === undefined) tickHolder.memorykitRevision = 0;
}

/** Read the tick (inside a badge provider, so the Vue row depends on it). */
export function readTick() {
  return tickHolder ? tickHolder.memorykitRevision : 0;
}

/** Make every Vue node's badge row re-read our providers. */
export function bump() {
  if (tickHolder) tickHolder.memorykitRevision += 1;
}
