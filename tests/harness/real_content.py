"""Real content for Tiled VAE: trained TAEF2 weights and real Wan 2.1 latents (the
``realweights`` folder beside the repository, as ``../shared/comfyui`` is for scripts/setup.sh;
``$MEMORYKIT_REALWEIGHTS`` overrides it) and real photographs bundled with scikit-image.

:func:`taef2_figures` measures TAEF2 on one photograph — untiled vs the photo, Tiled VAE vs
untiled and core's VAE Decode/Encode (Tiled) vs untiled at the same tiles, as PSNR in dB — for
``tests/test_tiled_vae_real.py`` (floors) and ``benchmarks/real_content.py`` (results file and the
docs' picture).
"""
from __future__ import annotations

import copy
import math
import os
import time
from pathlib import Path

import torch

from . import paths

REAL = Path(os.environ.get("MEMORYKIT_REALWEIGHTS") or paths.REPO.parent / "shared" / "realweights").resolve()
TAEF2_FILES = ("taef2_encoder.safetensors", "taef2_decoder.safetensors")
WAN_LATENTS = "test_latents_wan.safetensors"

# name → (scikit-image photo, (height, width)): centre-cropped to the size, or upscaled (bicubic)
# where the photo is smaller (the 1024² astronaut: skimage bundles no 1024² photograph)
PHOTOS = {"astronaut 512²": ("astronaut", (512, 512)), "coffee 384×576": ("coffee", (384, 576)),
          "astronaut 1024²": ("astronaut", (1024, 1024))}


def missing(latents: bool = True) -> str | None:
    """Why the real content cannot be used here (None when it can): TAEF2's two files (``.safetensors``,
    or the author's ``.pth``, which core's VAE Loader reads too), the Wan latents unless ``latents``
    is False, and scikit-image (the photographs)."""
    absent = [f for f in TAEF2_FILES if not any((REAL / Path(f).with_suffix(ext)).is_file()
                                                for ext in (".safetensors", ".pth"))]
    absent += [WAN_LATENTS] if latents and not (REAL / WAN_LATENTS).is_file() else []
    if absent:
        return (f"no real weights at {REAL} ({', '.join(absent)} missing; set MEMORYKIT_REALWEIGHTS to a folder "
                "holding them; TAEF2 comes from madebyollin/taesd on GitHub)")
    try:
        import skimage.data  # noqa: F401
    except ImportError:
        return "scikit-image is not installed (requirements-dev.txt): it bundles the photographs"
    return None


def has_taef2() -> str | None:
    """Why this ComfyUI has no TAEF2 (None when its VAE Loader lists ``taef2``)."""
    import comfy.taesd.taesd as taesd
    if not hasattr(taesd, "DecoderFlux2"):
        return "this ComfyUI has no TAEF2 (comfy.taesd.taesd has no DecoderFlux2; ComfyUI 0.33 has)"
    return None


def load_taef2():
    """TAEF2 as a user loads it: the pair in a ``vae_approx`` folder, ``taef2`` picked in core's
    VAE Loader (the realweights folder is added as a ``vae_approx`` folder for the call)."""
    import folder_paths
    import nodes
    folder_paths.add_model_folder_path("vae_approx", str(REAL))
    try:
        folder_paths.filename_list_cache.clear()
        listed = nodes.VAELoader.vae_list(nodes.VAELoader)
        assert "taef2" in listed, f"core's VAE Loader does not list taef2: {listed}"
        return nodes.VAELoader().load_vae("taef2")[0]
    finally:
        folder_paths.folder_names_and_paths["vae_approx"][0].remove(str(REAL))
        folder_paths.filename_list_cache.clear()


def photo(name: str) -> torch.Tensor:
    """The photograph ``name`` of :data:`PHOTOS` as a ComfyUI IMAGE ``[1, H, W, 3]`` in [0, 1]."""
    import skimage.data
    src, (h, w) = PHOTOS[name]
    x = torch.from_numpy(getattr(skimage.data, src)()).float().div(255.0)[None]
    if x.shape[1] < h or x.shape[2] < w:
        x = torch.nn.functional.interpolate(x.movedim(-1, 1), size=(h, w), mode="bicubic").movedim(1, -1).clamp(0, 1)
    top, left = (x.shape[1] - h) // 2, (x.shape[2] - w) // 2
    return x[:, top:top + h, left:left + w].contiguous()


def psnr(a: torch.Tensor, ref: torch.Tensor, peak: float | None = None) -> float:
    """PSNR of ``a`` against ``ref`` in dB; ``peak`` 1.0 for images, the reference's range
    (max − min) for latents when None."""
    ref = ref.float()
    peak = float(ref.max() - ref.min()) if peak is None else peak
    mse = float((a.float() - ref).pow(2).mean())
    return math.inf if mse == 0 else 10 * math.log10(peak ** 2 / mse)


def core_vae(vae):
    """``vae`` for core's VAE Decode/Encode (Tiled): a shallow copy carrying the model's own
    spatial factor where core's VAE object has another (TAEF2: 16, not 8), so core's tiling is
    compared at its best; ``vae`` itself elsewhere. The VAE handed in is not changed."""
    from comfyui_memorykit.memorykit.comfy_integration.vae_factors import spatial_factor
    up, down = spatial_factor(vae, "decode"), spatial_factor(vae, "encode")
    if (up, down) == (vae.spacial_compression_decode(), vae.spacial_compression_encode()):
        return vae
    fixed = copy.copy(vae)
    fixed.upscale_ratio, fixed.downscale_ratio = up, down
    return fixed


def taef2_figures(vae, image: torch.Tensor, tile: int, overlap: int, encode: bool = True,
                  core_as_is: bool = False, with_core: bool = True) -> dict:
    """TAEF2 on ``image`` at ``tile``/``overlap`` px: PSNR (dB) of untiled encode → decode vs the
    photo; decode (of the untiled latent) and encode, Tiled VAE and core's tiled nodes (with the
    true ratio, :func:`core_vae`) vs untiled — images against peak 1, latents against the untiled
    latent's range; seconds of each. ``core_as_is``: also core's VAE Decode (Tiled) with core's
    own VAE object (its error, or its PSNR); ``encode`` False: the tiled encodes are skipped
    (their figures are None); ``with_core`` False: core's tiled decode is skipped too (its figure
    is None; it is most of a large image's time). Returns the figures and, under ``"images"``, the
    photo, untiled, ours and core's decodes (``[H, W, 3]``) for the picture."""
    import nodes
    from comfyui_memorykit.memorykit import comfy_integration as ci
    opts = ci.TiledVAEOptions(tile_px=tile, overlap_px=overlap)
    fixed = core_vae(vae)
    secs = {}

    def timed(key, fn):
        t0 = time.perf_counter()
        out = fn()
        secs[key] = round(time.perf_counter() - t0, 2)
        return out
    with torch.inference_mode():
        z = timed("encode untiled", lambda: vae.encode(image))
        ref = timed("decode untiled", lambda: vae.decode(z))
        ours, info = timed("decode ours", lambda: ci.tiled_vae_decode(vae, z, opts))
        core = (timed("decode core", lambda: nodes.VAEDecodeTiled().decode(fixed, {"samples": z}, tile, overlap)[0])
                if with_core else ref)
        z_ours, enc_info, z_core = z, {"tiles_per_item": None}, z
        if encode:
            z_ours, enc_info = timed("encode ours", lambda: ci.tiled_vae_encode(vae, image, opts))
            z_core = timed("encode core", lambda: nodes.VAEEncodeTiled().encode(fixed, image, tile, overlap)[0]["samples"])
        as_is = None
        if core_as_is:
            try:
                got = nodes.VAEDecodeTiled().decode(vae, {"samples": z}, tile, overlap)[0]
                as_is = (f"{tuple(got.shape[1:3])} px, {psnr(got, ref):.1f} dB" if got.shape == ref.shape
                         else f"{tuple(got.shape[1:3])} px instead of {tuple(ref.shape[1:3])}")
            except Exception as e:  # noqa: BLE001 - what core does is the figure
                as_is = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    assert ours.shape == ref.shape == core.shape and z_ours.shape == z.shape == z_core.shape
    fig = {"size": list(image.shape[1:3]), "tile": tile, "overlap": overlap,
           "untiled_vs_photo_db": round(psnr(ref, image), 2),
           "decode_ours_db": round(psnr(ours, ref), 2),
           "decode_core_db": round(psnr(core, ref), 2) if with_core else None,
           "encode_ours_db": round(psnr(z_ours, z), 2) if encode else None,
           "encode_core_db": round(psnr(z_core, z), 2) if encode else None,
           "tiles": info["tiles_per_item"], "encode_tiles": enc_info["tiles_per_item"],
           "core_ratio_note": info.get("core_ratio_note"), "seconds": secs}
    if core_as_is:
        fig["core_as_is_decode"] = as_is
    fig["images"] = {"photo": image[0], "untiled": ref[0], "ours": ours[0], "core": core[0]}
    return fig
