"""Tiled VAE benchmark: untiled decode vs ComfyUI core's tiled decode vs MemoryKit's Tiled VAE
Decode, side by side on one SD-KL VAE (random finite weights, ComfyUI's own classes).

    python -m benchmarks.vae_bench --res 2048 --tile 512 --overlap 64     # GPU (runbook)
    python -m benchmarks.vae_bench --res 256 --tile 128 --overlap 32      # CPU
    python -m benchmarks.vae_bench --zoo wan21 --res 128 --tile 64 --overlap 16 --frames 3 --iters 2
                                   # any tiny VAE of tests/harness/vae_zoo.py (CPU speed vs core)

Per case: seconds per decode, ratio to untiled, peak VRAM (CUDA), relative L2 error vs
untiled. Issue 5's targets: decode with 512/64 tiles ≤ 1.6× untiled (core: 4.3× on the H200
anchor), error ≤ 1/4 of core's, peak under the budget given. Prints JSON lines and a table.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from harness import comfy_env, models, paths, vae_zoo  # noqa: E402


def build_vae(device: torch.device, tiny: bool = False):
    """ComfyUI VAE object around an SD-KL AutoencoderKL with random weights (std 0.02); ``tiny``:
    a Wan 2.1 VAE with dim 16 (3.6 M params, the runbook's CPU dry run: an SD VAE decoder takes
    minutes there)."""
    import comfy.sd
    if tiny:
        from comfy.ldm.wan.vae import WanVAE
        m = WanVAE(dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                   temperal_downsample=[False, True, True], dropout=0.0)
        return comfy.sd.VAE(sd=models.randomize_(m, models.SEED + 4).state_dict())
    from comfy.ldm.models.autoencoder import AutoencoderKL
    ddconfig = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3,
                "ch": 128, "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
    ae = models.randomize_(AutoencoderKL(ddconfig=ddconfig, embed_dim=4), models.SEED + 2)
    return comfy.sd.VAE(sd=ae.state_dict())


def decoders(vae, res: int, tile: int, overlap: int, budget_gb: float = 0.0, frames: int = 1) -> dict:
    """name → zero-argument decode of one ``res``² image's latent (video VAEs: ``frames`` latent
    frames): untiled, core tiled (VAE Decode (Tiled) at the same tiles), ours."""
    tio = importlib.import_module("memorykit_tech.comfy_integration.tiled_vae_io")
    g = torch.Generator().manual_seed(0)
    s = int(vae.spacial_compression_decode())
    if getattr(vae, "latent_dim", 2) == 3:  # video VAE (the dry run's Wan VAE): 1 latent frame by default
        lat = torch.randn(1, vae.latent_channels, frames, res // s, res // s, generator=g)
    else:
        lat = torch.randn(1, vae.latent_channels, res // s, res // s, generator=g)
    t, o = tile // s, overlap // s
    opts = tio.TiledVAEOptions(tile_px=tile, overlap_px=overlap, memory_budget_gb=budget_gb)
    return {"untiled": lambda: vae.decode(lat),
            f"core_tiled_{tile}_{overlap}": lambda: vae.decode_tiled(lat, tile_x=t, tile_y=t, overlap=o),
            f"memorykit_tiled_{tile}_{overlap}": lambda: tio.tiled_vae_decode(vae, lat, opts)[0]}


def timed(fn, device, iters):
    """Seconds per call of ``fn`` (after one warm-up call), its output (fp32, CPU) and the peak
    allocated VRAM; under ``torch.inference_mode`` as ComfyUI runs nodes (no autograd state)."""
    with torch.inference_mode():
        return _timed(fn, device, iters)


def _timed(fn, device, iters):
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()  # warm-up; timed itself when iters is 0 (the dry run)
    if iters:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / max(1, iters)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return dt, out.float().cpu(), peak


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--res", type=int, default=2048)
    ap.add_argument("--tile", type=int, default=512)
    ap.add_argument("--overlap", type=int, default=64)
    ap.add_argument("--iters", type=int, default=1)
    ap.add_argument("--budget-gb", type=float, default=0.0)
    ap.add_argument("--out", help="JSON output")
    ap.add_argument("--zoo", choices=sorted(vae_zoo.ZOO), help="a tiny VAE of the test zoo instead of the SD VAE")
    ap.add_argument("--frames", type=int, default=1, help="latent frames (video VAEs)")
    args = ap.parse_args(argv)
    comfy_env.setup_comfy()
    paths.technique_package()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vae = vae_zoo.build(args.zoo) if args.zoo else build_vae(device)
    cases = list(decoders(vae, args.res, args.tile, args.overlap, args.budget_gb, args.frames).items())
    rows, ref, t_ref = [], None, None
    for name, fn in cases:
        dt, out, peak = timed(fn, device, args.iters)
        if ref is None:
            ref, t_ref = out, dt
        err = float((out.reshape(ref.shape) - ref).norm() / ref.norm())
        rows.append({"case": name, "res": args.res, "s_per_decode": round(dt, 4), "ratio_to_untiled": round(dt / t_ref, 3),
                     "peak_vram_bytes": peak, "rel_err_vs_untiled": round(err, 5)})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'case':<28} {'s/decode':>9} {'×untiled':>9} {'peak GiB':>9} {'err':>8}")
    for r in rows:
        pk = "-" if r["peak_vram_bytes"] is None else f"{r['peak_vram_bytes'] / 2**30:.2f}"
        print(f"{r['case']:<28} {r['s_per_decode']:>9.3f} {r['ratio_to_untiled']:>9.2f} {pk:>9} {r['rel_err_vs_untiled']:>8.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": str(device), "torch": torch.__version__, "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
