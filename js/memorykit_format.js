// ComfyUI-MemoryKit: turn a node's `memorykit_report` (its UI output) into badge figures and
// report lines. Pure functions, no DOM, no ComfyUI: every MemoryKit node reports the same base
// shape (see memorykit/report.py: label, time, host, cuda, models) plus its technique's own
// top-level fields (e.g. streamed_bytes_per_step, resident_bytes, fp8_bytes_saved,
// device_map_summary); numbers, strings and {device: bytes} maps among those are shown as-is.

const KIB = 1024;
const MIB = 1024 * KIB;
const GIB = 1024 * MIB;

// Base fields every report carries; the badge shows them in its own way (or not at all).
const BASE_FIELDS = new Set(["label", "time", "host", "cuda", "models"]);

// Technique fields shown first on the badge, in this order, when a report has them.
const PREFERRED = [
  "streamed_bytes_per_step",
  "resident_bytes",
  "offloaded_bytes",
  "fp8_bytes_saved",
  "device_map_summary",
];

// Short badge labels for known fields; any other field gets a label made from its key.
const LABELS = {
  streamed_bytes_per_step: "streamed/step",
  resident_bytes: "resident",
  offloaded_bytes: "offloaded",
  fp8_bytes_saved: "fp8 saved",
  device_map_summary: "map",
  unloaded_bytes: "unloaded",
  freed_vram_bytes: "VRAM freed",
  released_cache_bytes: "cache released",
};

/** Bytes → "512 B", "12.0 KiB", "345.6 MiB", "1.23 GiB" (binary units, 2**30 bytes per GiB). */
export function formatBytes(n) {
  if (typeof n !== "number" || !isFinite(n)) return String(n);
  const a = Math.abs(n);
  if (a >= GIB) return `${(n / GIB).toFixed(2)} GiB`;
  if (a >= MIB) return `${(n / MIB).toFixed(1)} MiB`;
  if (a >= KIB) return `${(n / KIB).toFixed(1)} KiB`;
  return `${n} B`;
}

/** Whether a report field holds bytes, judged by its key (`*_bytes`, `*_bytes_*`). */
export function isBytesKey(key) {
  return /(^|_)bytes($|_)/.test(key);
}

/** A number for display: bytes by key, seconds for `*_seconds`/`*_s`, else up to 3 decimals. */
export function formatValue(key, v) {
  if (typeof v !== "number") return String(v);
  if (isBytesKey(key)) return formatBytes(v);
  if (/(_seconds|_s)$/.test(key)) return `${v.toFixed(3)} s`;
  return Number.isInteger(v) ? String(v) : String(Number(v.toFixed(3)));
}

/** Label for a report key: the known short label, else the key without `_bytes`, spaced. */
export function labelFor(key) {
  if (LABELS[key]) return LABELS[key];
  return key.replace(/_bytes(?=_|$)/, "").replace(/_/g, " ").trim();
}

function formatMap(obj) {
  // {device: bytes} (a device map summary) → "cuda:0 1.20 GiB, cpu 3.40 GiB"
  return Object.entries(obj)
    .map(([k, v]) => `${k} ${typeof v === "number" ? formatBytes(v) : String(v)}`)
    .join(", ");
}

function isPlainMap(v) {
  return v && typeof v === "object" && !Array.isArray(v)
    && Object.values(v).every((x) => typeof x === "number" || typeof x === "string");
}

/**
 * Figures of one report for its badge, in display order: [{key, label, text}]. Reports from
 * this pack carry `badge` (the node's headline figures, made in memorykit/badge.py), used as
 * they are. Older reports: peak VRAM (max over CUDA devices), every technique field that is a
 * non-zero number, a short string or a flat {name: number|string} map, then the peak RAM.
 */
export function badgeFigures(rep) {
  if (!rep || typeof rep !== "object") return [];
  if (Array.isArray(rep.badge)) {
    return rep.badge.filter((t) => typeof t === "string" && t).map((t, i) => ({ key: `badge${i}`, label: "", text: t }));
  }
  const out = [];
  const cuda = Array.isArray(rep.cuda) ? rep.cuda : [];
  if (cuda.length) {
    const peak = Math.max(...cuda.map((d) => d.peak_allocated_bytes || 0));
    const label = cuda.length > 1 ? `VRAM peak (max of ${cuda.length})` : "VRAM peak";
    out.push({ key: "vram_peak", label, text: formatBytes(peak) });
  }
  const keys = Object.keys(rep).filter((k) => !BASE_FIELDS.has(k));
  keys.sort((a, b) => {
    const ia = PREFERRED.indexOf(a), ib = PREFERRED.indexOf(b);
    return (ia < 0 ? PREFERRED.length : ia) - (ib < 0 ? PREFERRED.length : ib);
  });
  for (const key of keys) {
    const v = rep[key];
    if (typeof v === "number" && v === 0) continue;
    if (typeof v === "number") out.push({ key, label: labelFor(key), text: formatValue(key, v) });
    else if (typeof v === "string" && v.length > 0 && v.length <= 60) out.push({ key, label: labelFor(key), text: v });
    else if (isPlainMap(v) && Object.keys(v).length > 0) out.push({ key, label: labelFor(key), text: formatMap(v) });
  }
  if (rep.host && typeof rep.host.rss_peak_bytes === "number") {
    out.push({ key: "ram_peak", label: "RAM peak", text: formatBytes(rep.host.rss_peak_bytes) });
  }
  return out;
}

/** One figure as shown: "label text" (or just the text for headline figures). */
export function figureText(f) {
  return f.label ? `${f.label} ${f.text}` : f.text;
}

/**
 * The badge text, never wider than `maxWidth` px (measured by `measure(text)`): `prefix`, then
 * as many figures as fit joined by " · ", then "+N" for the rest (the full list is on hover and
 * in the panel). When not even the first figure fits it is cut with "…".
 */
export function badgeText(rep, maxWidth = Infinity, measure = (t) => t.length * 7, prefix = "") {
  const figs = badgeFigures(rep).map(figureText);
  for (let k = figs.length; k >= 1; k--) {
    const text = prefix + figs.slice(0, k).join(" · ") + (k < figs.length ? ` · +${figs.length - k}` : "");
    if (measure(text) <= maxWidth) return text;
  }
  const more = figs.length > 1 ? ` · +${figs.length - 1}` : "";
  let first = figs[0] ?? "";
  while (first.length > 1 && measure(`${prefix}${first}…${more}`) > maxWidth) first = first.slice(0, -1);
  const text = `${prefix}${first}…${more}`;
  if (measure(text) <= maxWidth) return text;
  return measure(`${prefix}…`) <= maxWidth ? `${prefix}…` : "…";
}

/** Nested report values as indented "key: value" lines (no one-line JSON). */
export function valueLines(key, v, indent = "") {
  const label = labelFor(key);
  if (v === null || v === undefined) return [`${indent}${label}: -`];
  if (typeof v === "number") return [`${indent}${label}: ${formatValue(key, v)}`];
  if (typeof v !== "object") return [`${indent}${label}: ${String(v)}`];
  if (Array.isArray(v)) {
    if (v.every((x) => x === null || typeof x !== "object")) {
      const items = v.map((x) => (typeof x === "number" ? formatValue(key, x) : String(x)));
      const one = `${indent}${label}: ${items.join(", ") || "none"}`;
      return one.length <= 100 ? [one] : [`${indent}${label}:`, ...items.map((x) => `${indent}  ${x}`)];
    }
    const lines = [`${indent}${label}:`];
    v.slice(0, 40).forEach((x, i) => lines.push(...valueLines(String(i + 1), x, indent + "  ")));
    if (v.length > 40) lines.push(`${indent}  ... and ${v.length - 40} more`);
    return lines;
  }
  const lines = [`${indent}${label}:`];
  for (const [k, x] of Object.entries(v)) lines.push(...valueLines(k, x, indent + "  "));
  return lines;
}

/**
 * The full report as lines of text. With the node's own summary (`text` output): that summary,
 * then every figure and every other field. Without it: figures, each CUDA device, process RAM,
 * the models ComfyUI held, and every other field.
 */
export function reportLines(rep, text) {
  const lines = [];
  const figs = badgeFigures(rep);
  if (text) {
    lines.push(...String(text).split("\n"), "");
    for (const f of figs) lines.push(f.label ? `${f.label}: ${f.text}` : f.text);
  } else {
    for (const f of figs) lines.push(f.label ? `${f.label}: ${f.text}` : f.text);
    for (const d of rep?.cuda || []) {
      lines.push(`${d.device}: ${formatBytes(d.allocated_bytes)} allocated, peak ${formatBytes(d.peak_allocated_bytes)}, `
        + `${formatBytes(d.reserved_bytes)} reserved of ${formatBytes(d.total_bytes)}`);
    }
    if (rep?.host) lines.push(`RAM now ${formatBytes(rep.host.rss_bytes)} (anonymous ${formatBytes(rep.host.rss_anon_bytes)})`);
    const models = Array.isArray(rep?.models) ? rep.models : [];
    lines.push(models.length ? "Models held by ComfyUI:" : "Models held by ComfyUI: none");
    for (const m of models) {
      lines.push(`  ${m.name}: ${formatBytes(m.size_bytes)}, ${formatBytes(m.loaded_bytes)} loaded on ${m.load_device}, `
        + `${formatBytes(m.on_gpu_bytes)} on GPU`);
    }
  }
  const shown = new Set(figs.map((f) => f.key));
  for (const [k, v] of Object.entries(rep || {})) {
    if (BASE_FIELDS.has(k) || shown.has(k) || k === "badge") continue;
    lines.push(...valueLines(k, v));
  }
  return lines;
}
