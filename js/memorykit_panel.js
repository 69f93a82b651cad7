// ComfyUI-MemoryKit: the "MemoryKit" sidebar panel (the reports of the last runs, newest first) and the hover
// card (one node's full report when the pointer is over its badge). Plain DOM, no framework.
import { badgeFigures, figureText, reportLines } from "./memorykit_format.js";

export const PANEL_ID = "memorykit-reports";

const STYLE = `
.memorykit-panel { padding: 8px 10px; font-size: 13px; overflow-y: auto; height: 100%; box-sizing: border-box; }
.memorykit-panel h3 { margin: 4px 0 8px; font-size: 14px; }
.memorykit-panel .mk-empty { opacity: .7; }
.memorykit-entry { border: 1px solid var(--border-color, #444); border-radius: 6px; margin: 0 0 8px; padding: 6px 8px; }
.memorykit-entry.mk-stale { opacity: .55; }
.memorykit-entry .mk-title { font-weight: 600; cursor: pointer; }
.memorykit-entry.mk-cached .mk-title::after { content: " (cached)"; font-weight: 400; opacity: .75; }
.memorykit-panel .mk-run { margin: 10px 0 6px; font-size: 12px; opacity: .8; }
.memorykit-entry .mk-figs { display: flex; flex-wrap: wrap; gap: 4px; margin: 4px 0; min-width: 0; }
.memorykit-entry .mk-fig { background: #14505a; color: #dff7f7; border-radius: 4px; padding: 1px 6px; font-size: 12px;
  max-width: 100%; white-space: normal; overflow-wrap: anywhere; box-sizing: border-box; }
.memorykit-entry pre, .memorykit-hover pre { margin: 4px 0 0; white-space: pre-wrap; overflow-wrap: anywhere;
  font-size: 11.5px; line-height: 1.35; max-width: 100%; }
.memorykit-hover { position: fixed; z-index: 10000; max-width: 560px; pointer-events: none; background: #101418;
  color: #e6f1f1; border: 1px solid #2b6f78; border-radius: 6px; padding: 6px 9px; box-shadow: 0 4px 14px #0008; }
`;

function ensureStyle() {
  if (document.getElementById("memorykit-style")) return;
  const el = document.createElement("style");
  el.id = "memorykit-style";
  el.textContent = STYLE;
  document.head.appendChild(el);
}

function el(tag, attrs = {}, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

/**
 * Sidebar panel listing the reports of the last runs, newest run first, newest report first.
 * `getEntries()` returns [{started, entries: [{id, title, report, text, stale, cached}]}] (newest
 * run first); `onPick(id)` selects a node.
 */
export class ReportPanel {
  constructor(getEntries, onPick) {
    this.getEntries = getEntries;
    this.onPick = onPick;
    this.root = null;
  }

  /** The sidebar tab definition for `app.extensionManager.registerSidebarTab`. */
  tab() {
    return {
      id: PANEL_ID,
      icon: "pi pi-chart-bar",
      title: "MemoryKit",
      tooltip: "MemoryKit: memory reports of the last run",
      label: "Memory",
      type: "custom",
      render: (container) => {
        ensureStyle();
        this.root = el("div", { class: "memorykit-panel", "data-testid": "memorykit-panel" });
        container.replaceChildren(this.root);
        this.refresh();
      },
      destroy: () => {
        this.root = null;
      },
    };
  }

  refresh() {
    if (!this.root) return;
    const runs = this.getEntries().filter((r) => r.entries.length);
    const body = [el("h3", {}, "MemoryKit — reports, newest first")];
    if (!runs.length) {
      body.push(el("div", { class: "mk-empty" },
        "No report yet. Queue a workflow with MemoryKit nodes (Memory Report, Free Memory, ...)."));
    }
    runs.forEach((run, i) => {
      const when = new Date(run.started).toLocaleTimeString();
      body.push(el("div", { class: "mk-run" }, i === 0 ? `Last run (${when})` : `Earlier run (${when})`));
      for (const e of run.entries) {
        const cls = "memorykit-entry" + (e.stale ? " mk-stale" : "") + (e.cached ? " mk-cached" : "");
        const box = el("div", { class: cls, "data-node-id": String(e.id), "data-run": String(i) });
        const title = el("div", { class: "mk-title", title: "Select this node" }, `#${e.id} ${e.title}`);
        title.addEventListener("click", () => this.onPick(e.id));
        const figs = el("div", { class: "mk-figs" });
        for (const f of badgeFigures(e.report)) figs.appendChild(el("span", { class: "mk-fig" }, figureText(f)));
        box.append(title, figs, el("pre", {}, reportLines(e.report, e.text).join("\n")));
        body.push(box);
      }
    });
    this.root.replaceChildren(...body);
  }

  /** Scroll the panel to one node's entry (when the panel is open). */
  reveal(id) {
    const box = this.root?.querySelector(`[data-run="0"][data-node-id="${CSS.escape(String(id))}"]`);
    box?.scrollIntoView({ block: "nearest" });
  }
}

/** A floating card showing one node's full report near the pointer. */
export class HoverCard {
  constructor() {
    this.el = null;
    this.nodeId = null;
  }

  show(clientX, clientY, nodeId, title, report, text) {
    ensureStyle();
    if (!this.el) {
      this.el = el("div", { class: "memorykit-hover", "data-testid": "memorykit-hover" });
      document.body.appendChild(this.el);
    }
    if (this.nodeId !== nodeId || this.el.style.display === "none") {
      this.el.replaceChildren(el("b", {}, title), el("pre", {}, reportLines(report, text).join("\n")));
      this.nodeId = nodeId;
    }
    this.el.style.display = "block";
    const r = this.el.getBoundingClientRect();
    const x = Math.min(clientX + 14, window.innerWidth - r.width - 8);
    const y = clientY + 16 + r.height > window.innerHeight ? Math.max(8, clientY - r.height - 12) : clientY + 16;
    this.el.style.left = `${Math.max(8, x)}px`;
    this.el.style.top = `${y}px`;
  }

  hide() {
    if (this.el) this.el.style.display = "none";
    this.nodeId = null;
  }
}
