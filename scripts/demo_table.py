"""The demo's table: per workflow the plain and MemoryKit runs side by side, the peak that shows
the technique, what it saved and how far the output is from the plain one; printed, and written
as Markdown for ``docs/demo.md`` (``scripts/demo.py --markdown``)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

# What a CPU shows (printed under the table and written into docs/demo.md).
CPU_NOTES = [
    "On a CPU-only machine RAM does the work VRAM does on a GPU, so the peaks are the ComfyUI "
    "server's resident memory (RSS); on a GPU the demo reads VRAM from the Memory Report nodes.",
    "The loaders put the whole model in RAM before any technique takes over (on a GPU machine that "
    "copy is in RAM, not VRAM), so rows that sample are measured from the first sampling step to the "
    "end (peak S); rows that do not sample, or whose technique is a loader, over the whole run "
    "(peak W).",
    "FP8 Layerwise Cast on a CPU-only machine keeps the loader's full-precision copy in RAM (ComfyUI "
    "restores the model from it and other branches use it), so the fp8 weights are added to RAM, not "
    "swapped: its figure is the weight bytes the sampler reads, which on a GPU are the bytes in VRAM.",
]


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}".replace("-0.00", "0.00")


def _frames(path: Path) -> list[np.ndarray]:
    from PIL import Image, ImageSequence
    with Image.open(path) as im:
        return [np.asarray(f.convert("RGB"), dtype=np.float64) for f in ImageSequence.Iterator(im)]


def output_error(plain_dir: Path, mk_dir: Path) -> str:
    """Relative L2 error of the MemoryKit outputs vs the plain ones (images/frames, 8-bit), over
    the files both runs wrote (matched by sorted name); 'bit-exact' when equal; '-' when none."""
    exts = {".png", ".webp", ".gif"}
    pf = sorted(p for p in plain_dir.glob("*") if p.suffix in exts) if plain_dir.is_dir() else []
    mf = sorted(p for p in mk_dir.glob("*") if p.suffix in exts) if mk_dir.is_dir() else []
    if not pf or len(pf) != len(mf):
        return "-"
    num = den = 0.0
    for a, b in zip(mf, pf):
        fa, fb = _frames(a), _frames(b)
        if len(fa) != len(fb) or any(x.shape != y.shape for x, y in zip(fa, fb)):
            return "shape differs"
        for x, y in zip(fa, fb):
            num += float(((x - y) ** 2).sum())
            den += float((y ** 2).sum())
    if num == 0:
        return "bit-exact"
    return f"{(num / max(den, 1e-12)) ** 0.5:.3f}"


def row_cells(row: dict) -> dict:
    """The table's cells of one row (strings)."""
    p, m = row["plain"], row["memorykit"]
    kind = row["peak_kind"]
    key = "peak_sampling_bytes" if kind == "S" else "peak_rss_bytes"
    pp, pm = p.get(key), m.get(key)
    return {"workflow": row["name"], "plain s": f"{p['seconds']:.1f}", "MK s": f"{m['seconds']:.1f}",
            "peak": kind, "plain GiB": gib(pp), "MK GiB": gib(pm),
            "MK/plain": f"{pm / pp:.2f}×" if pp and pm else "-",
            "saved GiB": gib(pp - pm) if pp and pm else "-", "error vs plain": row.get("error", "-")}


COLUMNS = ["workflow", "plain s", "MK s", "peak", "plain GiB", "MK GiB", "MK/plain", "saved GiB", "error vs plain"]


def text_table(rows: list[dict]) -> list[str]:
    widths = {"workflow": 37}
    out = [" ".join(c.ljust(widths.get(c, 0)) if c == "workflow" else c.rjust(max(len(c), 9)) for c in COLUMNS)]
    out.append("-" * len(out[0]))
    for row in rows:
        cells = row_cells(row)
        out.append(" ".join(cells[c].ljust(37) if c == "workflow" else cells[c].rjust(max(len(c), 9))
                            for c in COLUMNS))
        for f in row["figures"] + row.get("notes", []):
            out.append(f"    {f}")
    return out


def markdown(rows: list[dict], header: list[str], footer: list[str]) -> str:
    """``docs/demo.md``: the header lines, the table, each row's node figures, the footer lines."""
    lines = ["# The demo: each example workflow beside its plain version", "",
             "<!-- Written by `python scripts/demo.py --markdown docs/demo.md`; do not edit by hand. -->", ""]
    lines += header + [""]
    lines.append("| " + " | ".join(COLUMNS) + " |")
    lines.append("|" + "|".join("---" if c == "workflow" else "---:" for c in COLUMNS) + "|")
    for row in rows:
        cells = row_cells(row)
        lines.append("| " + " | ".join(f"`{cells[c]}`" if c == "workflow" else cells[c] for c in COLUMNS) + " |")
    lines += ["", "What each MemoryKit node reported (its badge), and what the demo set:", ""]
    for row in rows:
        items = row["figures"] + row.get("notes", [])
        if items:
            lines.append(f"- `{row['name']}`: " + "; ".join(items))
    lines += [""] + footer
    return "\n".join(lines) + "\n"
