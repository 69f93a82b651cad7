"""PNG plot of a benchmark run: peak memory (VRAM on a GPU, RSS on a CPU) against seconds per
forward, one point per strategy at the first resolution, and the transfer floor as a line.

The floor line: streaming the weights that do not stay resident costs (W − v) / bandwidth for
v bytes kept in VRAM, and no run beats resident compute, so floor(v) = max(t_resident,
(W − v) / bw). Drawn with Pillow (already a ComfyUI requirement) to avoid a plotting dependency.
"""
from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw

W, H, PAD = 900, 600, 70


def plot(data: dict, path: Path) -> None:
    rows = [r for r in data["results"] if "s_per_forward" in r]
    if not rows:
        return
    res0 = rows[0]["res"]
    rows = [r for r in rows if r["res"] == res0]
    gpu = any(r["peak_vram_bytes"] for r in rows)
    mem = lambda r: (r["peak_vram_bytes"] if gpu else r["rss_bytes"]) / 2**30  # noqa: E731
    xs = [r["s_per_forward"] for r in rows]
    ys = [mem(r) for r in rows]
    xmax, ymax = max(xs) * 1.15, max(ys) * 1.15
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    X = lambda x: PAD + (W - 2 * PAD) * x / xmax  # noqa: E731
    Y = lambda y: H - PAD - (H - 2 * PAD) * y / ymax  # noqa: E731
    d.line([(PAD, H - PAD), (W - PAD, H - PAD)], fill="black")
    d.line([(PAD, PAD), (PAD, H - PAD)], fill="black")
    for i in range(6):
        d.text((X(xmax * i / 5) - 10, H - PAD + 8), f"{xmax * i / 5:.3g}", fill="black")
        d.text((8, Y(ymax * i / 5) - 6), f"{ymax * i / 5:.3g}", fill="black")
    d.text((W // 2 - 60, H - 30), "seconds per forward", fill="black")
    d.text((8, 20), f"peak {'VRAM' if gpu else 'RSS'} GiB  ({data['meta']['device']}, {res0}px)", fill="black")
    t_res = next((r["s_per_forward"] for r in rows if r["case"] == "resident"), None)
    bw = data["meta"].get("h2d_pinned_bytes_per_s")
    weights = next((r.get("weights_bytes") for r in rows if r["case"] == "resident"), None)
    if t_res:
        pts = []
        for i in range(101):
            v = ymax * i / 100
            t = t_res if not (bw and weights) else max(t_res, max(0.0, weights - v * 2**30) / bw)
            if t <= xmax:
                pts.append((X(t), Y(v)))
        if len(pts) > 1:
            d.line(pts, fill="gray", width=2)
        d.text((X(t_res) + 4, PAD), "floor", fill="gray")
    for r, x, y in zip(rows, xs, ys):
        color = "blue" if r["group"] == "memorykit" else "red"
        d.ellipse([X(x) - 4, Y(y) - 4, X(x) + 4, Y(y) + 4], fill=color)
        d.text((X(x) + 6, Y(y) - 6), r["case"], fill=color)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
