"""Which blend each ComfyUI VAE gets in Tiled VAE: feather (share of the overlap cross-faded) and
whether shared GroupNorm statistics are used — chosen by the VAE's structure, each choice with the
zoo figure that justifies it (:func:`blend_rule`)."""
from __future__ import annotations

from .. import tiled_vae as tv


def _frame_spanning_groupnorm(vae) -> bool:
    """HunyuanVideo's VAE (``comfy.ldm...diffusionmodules.model`` Encoder/Decoder with 3-D
    convs): plain GroupNorms over all frames of their input, as image VAEs."""
    from comfy.ldm.modules.diffusionmodules.model import Decoder, Encoder
    m = vae.first_stage_model
    return type(getattr(m, "decoder", None)) is Decoder and type(getattr(m, "encoder", None)) is Encoder


def blend_rule(vae, shape: tv.VAEShape, time_cut: bool = True, context: bool = True,
               direction: str = "decode") -> tuple[float, bool]:
    """(feather, shared GroupNorm statistics allowed) for this VAE — chosen by its structure;
    ``context``: a global head/tail will run (the choice is made again without it when none fits
    or it does not fit the tiles).

    Image VAEs and Wan 2.1/2.2 (time never cut, the cache carried by the VAE): feather 0.25
    (seam in the middle of the overlap; SD/Wan figures in ``memorykit/tiled_vae.py``), shared
    statistics on. HunyuanVideo with time uncut (its own causal chunks on 0.33+, Tiled VAE's
    carried chunks on 0.3.75, or temporal tiles longer than the video): the same; with the global
    head/tail 0.24 of core's error decoding (0.33.0 zoo: 0.287 vs core 1.185; 0.282 vs 1.185 on
    0.3.75), encoding 0.36 (0.342 vs 0.955; 0.299 vs 0.968 on 0.3.75; feather 1.0: 0.371; without
    statistics 0.81; decode without statistics 0.58 on 0.3.75).

    HunyuanVideo 1.5 and LTX-Video with time uncut and a global context: feather 0.25, no shared
    statistics (RMS / pixel norms) — the context removes the far-reaching part, and the seam is
    best in the middle of the overlap (zoo, 0.33.0, ratio to core at feather 1.0 → 0.25: LTX-Video
    decode 0.135 → 0.105, encode 0.154 → 0.112, spatial tiles only 0.214 → 0.167 / 0.284 → 0.208;
    HunyuanVideo 1.5 decode 0.077 → 0.042, encode 0.103 → 0.061). Without the context: feather 1.0
    (LTX-Video time uncut 0.44 of core's error at 1.0, 0.47 at 0.25; HunyuanVideo 1.5 0.29 vs 0.31).

    Video VAEs where time is cut into temporal tiles, and the others (Mochi, Cosmos: pixel and
    per-frame norms): cross-fade over the whole overlap (feather 1.0, as core's ramp) and no
    shared statistics. With temporal tiles each tile's GroupNorms see other frames than the
    statistics pre-pass (one downsampled first temporal tile), so shared statistics hurt;
    Mochi's GroupNorms are per frame (the hooks would pool frames); Mochi decode with its head is
    no better at 0.25 (0.408 vs 0.399 at 1.0). Measured on the zoo (0.33.0, CPU,
    tests/test_vae_zoo.py sizes, temporal tiles; ours with stats/feather 0.25 → chosen, core):
    HunyuanVideo decode 1.41 → 1.12 (core 1.18); Mochi decode 0.81 → 0.76 (core 0.80), encode
    0.86 → 0.79 (core 0.81); LTX-Video encode 0.751 → 0.731 (core 0.748); Cosmos decode 0.187 →
    0.162 (core 0.285), spatial-only encode 0.051 → 0.048 (core 0.057); issue 25: Mochi
    spatial-only decode 0.51 with stats, 0.27 without (core 0.29), Cosmos spatial-only encode
    0.105 at feather 0.25, core 0.076.

    HunyuanImage 2.1 (``hunyuan_video.vae`` 2-D Encoder/Decoder, 32×): feather 0.25 with its
    global head/tail, 1.0 without (0.33.0 zoo, ours/core at 0.25 → 1.0: with context decode
    0.099 → 0.098, encode 0.233 → 0.247; without decode 0.316 → 0.279, encode 0.652 → 0.586;
    core 0.369 / 0.705). CogVideoX (time never cut: its own chunks, ``vae_time``): feather 1.0
    and shared statistics — its GroupNorms run per chunk of frames, the same chunks in the
    statistics pre-pass (same length) as in every tile (0.33.0 zoo, decode 0.343 → 0.204 with
    statistics, 0.209 at 0.25; encode 0.932 → 0.863, 0.957 at 0.25; core 0.836 / 1.050).
    TAESD and TAEHV (no norms): the defaults, within 3 % of the other feather either way.
    Mage-VAE: no shared statistics (its GroupNorms sit in the conditioning decoder, whose
    windowed attention sees another image in the downsampled pre-pass), feather 0.25 with its
    global head, decoding without it 1.0 (0.33.0 zoo decode: with the head 0.0044 at 0.25, 0.0070 at 1.0;
    without it 0.872 with statistics at 0.25, 0.610 without, 0.572 at 1.0 — core 0.540: the one
    case here worse than core's, see docs/tiled-vae.md; encode 0.031 at 0.25, 0.049 at 1.0, core 0.072).
    """
    from .vae_time import _is_wan
    if not shape.video:
        if _mage(vae):
            return (1.0 if direction == "decode" and not context else tv.DEFAULT_FEATHER), False
        return (1.0 if not context and _hunyuan_image(vae) else tv.DEFAULT_FEATHER), True
    if not time_cut and (_is_wan(vae.first_stage_model) or _frame_spanning_groupnorm(vae)):
        return tv.DEFAULT_FEATHER, True
    if not time_cut and _cogvideox(vae):
        return 1.0, True
    if not time_cut and context and _seam_centred_with_context(vae):
        return tv.DEFAULT_FEATHER, False
    return 1.0, False


def _hunyuan_image(vae) -> bool:
    """HunyuanImage 2.1's VAE (``comfy.ldm.hunyuan_video.vae`` Decoder; see :func:`blend_rule`)."""
    import comfy.ldm.hunyuan_video.vae as hyi
    return type(getattr(vae.first_stage_model, "decoder", None)) is hyi.Decoder


def _mage(vae) -> bool:
    """Mage-VAE (``comfy.ldm.mage_flow.vae.MageVAE``, 0.33+; see :func:`blend_rule`)."""
    m = vae.first_stage_model
    return type(m).__name__ == "MageVAE" and type(m).__module__.endswith("mage_flow.vae")


def _cogvideox(vae) -> bool:
    """CogVideoX's VAE (``comfy.ldm.cogvideo.vae``, 0.33+; see :func:`blend_rule`)."""
    m = vae.first_stage_model
    return type(m).__name__ == "AutoencoderKLCogVideoX" and type(m).__module__.endswith("cogvideo.vae")


def _seam_centred_with_context(vae) -> bool:
    """HunyuanVideo 1.5's and LTX-Video's VAEs (see :func:`blend_rule`)."""
    import sys
    from comfy.ldm.lightricks.vae import causal_video_autoencoder as cva
    m = vae.first_stage_model
    hy15 = sys.modules.get("comfy.ldm.hunyuan_video.vae_refiner")
    kinds = (cva.Decoder, cva.Encoder) + ((hy15.Decoder, hy15.Encoder) if hy15 is not None else ())
    return type(getattr(m, "decoder", None)) in kinds
