"""How each video VAE's time axis is handled by Tiled VAE (ComfyUI side of ``memorykit.time_carry``).

Three ways, in order of preference (``time_mode``):

- ``"core"``: the VAE's own classes carry a causal time cache (Wan's ``feat_cache``,
  HunyuanVideo 1.5's chunks; 0.33+'s HunyuanVideo and LTX-Video chunks,
  :func:`compat.core_carries_time`; CogVideoX's chunks and TAEHV's frame-by-frame memory blocks,
  :func:`compat.core_model_carries_time`): time
  is never cut, each spatial tile runs the whole length and the model bounds the memory.
- ``"carry"``: the pack carries the cache (:class:`memorykit.time_carry.TimeCarry` on the VAE's
  own modules, hooks for one call): Mochi's decoder — causal ``PConv3d`` (replicate padding)
  and ``DepthToSpaceTime`` upsamplers, every other layer frame-local (per-frame GroupNorm,
  1×1 convs); no attention. Time is not cut by the plan; each tile's decode runs in chunks of
  ``temporal_size`` frames, exact.
- ``"tiles"``: independent temporal tiles, blended (everything else: layers that see all
  frames — Mochi's encoder attends over time; on 0.3.75 LTX-Video's decoder convolves
  non-causally and HunyuanVideo's GroupNorms and mid-block attention span all frames — so a
  carried cache from outside cannot be exact there).
"""
from __future__ import annotations

import torch

from ..time_carry import Link, TimeCarry
from .compat import core_carries_time, core_model_carries_time


def _is_wan(model) -> bool:
    import comfy.ldm.wan.vae as wan21
    import comfy.ldm.wan.vae2_2 as wan22
    return isinstance(model, (wan21.WanVAE, wan22.WanVAE))


def mochi_decoder_links(decoder) -> list[Link] | None:
    """:class:`Link` list for Mochi's (``comfy.ldm.genmo.vae.model``) ``Decoder``: every causal
    ``PConv3d`` with a time kernel > 1 (context ``kernel_t − 1``; time stride 1) and every
    ``DepthToSpaceTime`` with ``temporal_expansion`` k > 1 (×k, drops k − 1 first frames).
    None for anything else, or when the decoder has attention or a non-causal/strided time conv."""
    from comfy.ldm.genmo.vae import model as mv
    if type(decoder) is not mv.Decoder:
        return None
    links = []
    for m in decoder.modules():
        if isinstance(m, (mv.Attention, mv.AttentionBlock)):
            return None
        if isinstance(m, mv.PConv3d):
            kt, st, dt = m.kernel_size[0], m.stride[0], m.dilation[0]
            if kt > 1:
                if not m.causal or st != 1:
                    return None
                links.append(Link(m, (kt - 1) * dt))
        elif isinstance(m, mv.DepthToSpaceTime) and m.temporal_expansion > 1:
            links.append(Link(m, 1, m.temporal_expansion, m.temporal_expansion - 1))
    return links


def time_mode(vae, direction: str) -> str:
    """``"core"``, ``"carry"`` or ``"tiles"`` for ``vae`` (a ``comfy.sd.VAE`` with 3-D latents) in
    ``direction`` (``"decode"``/``"encode"``); see the module docstring."""
    model = vae.first_stage_model
    if _is_wan(model) or core_model_carries_time(model):
        return "core"
    coder = getattr(model, "decoder" if direction == "decode" else "encoder", None)
    if core_carries_time(coder):
        return "core"
    if direction == "decode" and mochi_decoder_links(coder):
        return "carry"
    return "tiles"


def carried_decode(vae, fn, chunk_frames: int, on_chunk=None):
    """``fn`` (latent ``[1, C, T, h, w]`` → pixels) wrapped to decode ``chunk_frames`` latent
    frames at a time with the carried cache of :func:`mochi_decoder_links` (exact)."""
    carry = TimeCarry(mochi_decoder_links(vae.first_stage_model.decoder))

    def run(z: torch.Tensor) -> torch.Tensor:
        return carry.run(fn, z, max(1, int(chunk_frames)), on_chunk)
    return run
