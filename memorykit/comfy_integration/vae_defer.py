"""Which VAEs Tiled VAE Decode/Encode does not tile from outside, and running VAE Decode/Encode
itself for them (the report says so: ``deferred_to_core``, ``deferred_why``)."""
from __future__ import annotations

import time

import torch

from . import compat


def deferral(vae, direction: str) -> str | None:
    """Why ``vae`` is not tiled from outside in ``direction`` (then :func:`run_deferred` runs VAE
    Decode/Encode itself), or None:

    - core's ``handles_tiling`` (MiniMax-H3's and SeedVR2's video VAEs tile inside the model;
      their own tiling is what their authors tuned, tiling again from outside only adds seams);
    - LTX 2.4's diffusion decoder (``na_diffusion_decoder.CausalDiffusionVAE``, decode only):
      one denoising step from noise drawn with seed 0 in the shape of the call's output, so a
      tile gets other noise than its region of the whole frame — tiled decodes disagree with
      the untiled one by more than its own variation (zoo, 0.33.0: ours 1.21, core's VAE Decode
      (Tiled) 1.26; seed 0 vs seed 1 untiled: 1.29; the tile's stage-1..4 context alone 0.004).
      Its encoder is LTX-Video's and tiles;
    - a video VAE whose frame mapping is neither n ↦ k·(n−1)+1 nor n ↦ k·n (so tiles in time cannot
      be placed) and whose model runs time frame by frame itself (``compat.core_model_carries_time``):
      MiniMax-H3's light VAE (a TAEHV, 5 latent frames ↔ 17 frames). Other VAEs with such a
      mapping are refused by ``tiled_vae_io.vae_shape``."""
    if getattr(vae, "handles_tiling", False):
        return "the VAE's own tiling (handles_tiling)"
    m = vae.first_stage_model
    if getattr(vae, "latent_dim", 2) == 3 and not _placeable_time(vae) and compat.core_model_carries_time(m):
        up = vae.upscale_ratio[0]
        return (f"{type(m).__name__} maps latent frames to {[up(n) for n in (1, 2, 3)]} frames (1..3 latent frames), "
                "which tiles in time cannot follow, and runs time frame by frame itself: VAE Decode/Encode runs it")
    if direction == "decode" and type(m).__name__ == "CausalDiffusionVAE" and type(m).__module__.endswith("na_diffusion_decoder"):
        return ("VAE Decode: LTX 2.4's diffusion decoder draws its noise for the whole frame; "
                "a tile would get other noise (tiled decodes differ from VAE Decode by more than the image varies)")
    return None


def _placeable_time(vae) -> bool:
    """True when the VAE maps n latent frames to k·(n−1)+1 or k·n frames (what tiles in time follow)."""
    k = int(vae.upscale_index_formula[0]) if vae.upscale_index_formula else vae.temporal_compression_decode()
    up = vae.upscale_ratio[0]
    return all(up(n) == k * (n - 1) + 1 for n in (1, 2, 3)) or all(up(n) == k * n for n in (1, 2, 3))


def run_deferred(vae, direction: str, x: torch.Tensor, why: str = "the VAE's own tiling (handles_tiling)") -> tuple[torch.Tensor, dict]:
    """VAE Decode/Encode itself, for a VAE that is not tiled from outside (:func:`deferral` says
    why: ``why``, the info dict's ``time`` and ``deferred_why``). The info dict says so
    (``deferred_to_core``)."""
    t0 = time.perf_counter()
    out = vae.decode(x) if direction == "decode" else vae.encode(x)
    if direction == "decode" and out.ndim == 5:
        out = out.reshape((-1,) + tuple(out.shape[-3:]))
    info = {"direction": direction, "vae": type(vae.first_stage_model).__name__, "deferred_to_core": True,
            "input_shape": list(x.shape), "output_shape": list(out.shape), "items": int(x.shape[0]),
            "tiles_per_item": 1, "global_context": "off", "shared_norm_stats": False,
            "time": why, "deferred_why": why, "seconds": round(time.perf_counter() - t0, 3)}
    return out, info
