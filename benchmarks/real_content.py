"""The docs' "real weights, real photos" figures and picture, from tests/test_tiled_vae_real.py's
outputs.

    MEMORYKIT_REAL_OUT=/tmp/real_out COMFYUI_PATH=... python -m pytest -c tests/pytest.ini \\
        tests/test_tiled_vae_real.py          # ComfyUI 0.33+, the realweights folder beside the repo
    python -m benchmarks.real_content /tmp/real_out

writes ``benchmarks/results/real_content.json`` (every case's figures: PSNR in dB of Tiled VAE and
core's VAE Decode/Encode (Tiled) against the untiled result, CPU seconds) and
``docs/images/tiled_vae_real.png``: the 512² photograph, TAEF2's untiled decode, Tiled VAE
Decode's and core's tiled decode (true 16× ratio) at 256/64 px, and below each tiled decode its
difference from the untiled one, amplified (×AMPLIFY). Pillow only (a ComfyUI requirement).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from PIL import Image, ImageDraw

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "real_content.json"
PICTURE = REPO / "docs" / "images" / "tiled_vae_real.png"
PANEL, LABEL, AMPLIFY = 224, 22, 8


def _panel(x: torch.Tensor) -> Image.Image:
    a = (x.float().clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    return Image.fromarray(a).resize((PANEL, PANEL * a.shape[0] // a.shape[1]), Image.LANCZOS)


def picture(fig: dict, path: Path) -> None:
    im = fig["images"]
    diff = lambda k: (im[k].float() - im["untiled"].float()).abs().mul(AMPLIFY)  # noqa: E731
    top = [("photo", im["photo"]), ("untiled (VAE Decode)", im["untiled"]),
           (f"Tiled VAE Decode {fig['decode_ours_db']:.1f} dB", im["ours"]),
           (f"core tiled (16x) {fig['decode_core_db']:.1f} dB", im["core"])]
    photo_diff = (im["untiled"].float() - im["photo"].float()).abs().mul(AMPLIFY)
    bottom = [(None, None), (f"|untiled - photo| x{AMPLIFY}", photo_diff), (f"|ours - untiled| x{AMPLIFY}", diff("ours")),
              (f"|core - untiled| x{AMPLIFY}", diff("core"))]
    h = _panel(im["photo"]).height
    out = Image.new("RGB", (4 * PANEL, 2 * (h + LABEL)), "white")
    d = ImageDraw.Draw(out)
    for row, cells in enumerate((top, bottom)):
        for col, (label, x) in enumerate(cells):
            if x is None:
                continue
            y0 = row * (h + LABEL)
            d.text((col * PANEL + 4, y0 + 4), label, fill="black")
            out.paste(_panel(x), (col * PANEL, y0 + LABEL))
    d.text((4, h + LABEL + 4), f"TAEF2 (trained), {fig['size'][0]}x{fig['size'][1]} px,", fill="black")
    d.text((4, h + LABEL + 20), f"tiles {fig['tile']} px, overlap {fig['overlap']} px", fill="black")
    d.text((4, h + LABEL + 36), f"untiled vs photo {fig['untiled_vs_photo_db']:.1f} dB", fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    out.quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


def table(rows: list[dict]) -> str:
    """The docs' table (markdown) of the TAEF2 rows and the Wan row."""
    db = lambda x: "—" if x is None else f"{x:.1f}"  # noqa: E731
    out = ["| content | size, tile/overlap px | untiled vs photo | decode: ours / core's (dB) | encode: ours / core's (dB) | CPU s |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        if "decode_ours_db" in r:
            out.append(f"| TAEF2, {r['name'].split(' ')[0]} photo | {r['size'][0]}×{r['size'][1]}, {r['tile']}/{r['overlap']} "
                       f"| {db(r['untiled_vs_photo_db'])} | {db(r['decode_ours_db'])} / {db(r['decode_core_db'])} "
                       f"| {db(r['encode_ours_db'])} / {db(r['encode_core_db'])} | {r['cpu_seconds']:.0f} |")
        else:
            out.append(f"| Wan 2.1 real latents, zoo decoder | latent {'×'.join(map(str, r['latent'][2:]))}, "
                       f"{r['tile']}/{r['overlap']} | — | {db(r['ours_db'])} / {db(r['core_db'])} (error {r['ours_rel']:.3f} / "
                       f"{r['core_rel']:.3f}; flicker {r['flicker']:.2f} / {r['flicker_core']:.2f}) | — | {r['cpu_seconds']:.0f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    src = Path(argv[0] if argv else "/tmp/real_out")
    cases = [torch.load(p, weights_only=False) for p in sorted(src.glob("*.pt"))]
    if not cases:
        print(f"no case outputs in {src}: run tests/test_tiled_vae_real.py with MEMORYKIT_REAL_OUT={src}")
        return 1
    first = next((c for c in cases if c.get("core_as_is_decode")), None)
    if first is not None:
        picture(first, PICTURE)
    rows = [{k: v for k, v in c.items() if k != "images"} for c in cases]
    RESULTS.write_text(json.dumps({"source": "tests/test_tiled_vae_real.py (ComfyUI 0.33.0, CPU)", "cases": rows},
                                  indent=1, ensure_ascii=False) + "\n")
    print(table(rows))
    print(f"wrote {RESULTS.relative_to(REPO)}" + (f" and {PICTURE.relative_to(REPO)}" if first else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
