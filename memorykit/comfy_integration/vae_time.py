"""How each video VAE's time axis is handled by Tiled VAE (ComfyUI side of ``memorykit.time_carry``).

Three ways, in order of preference (``time_mode``):

- ``"core"``: the VAE's own classes carry a causal time cache (Wan's ``feat_cache``,
  HunyuanVideo 1.5's chunks; 0.33+'s HunyuanVideo and LTX-Video chunks,
  :func:`compat.core_carries_time`; CogVideoX's chunks and TAEHV's frame-by-frame memory blocks,
  :func:`compat.core_model_carries_time`): time
  is never cut, each spatial tile runs the whole length and the model bounds the memory.
- ``"carry"``: the pack carries the cache (:class:`memorykit.time_carry.TimeCarry` on the VAE's
  own modules, hooks for one call). Time is not cut by the plan; each tile's decode runs in
  chunks of ``temporal_size`` frames:

  - Mochi's decoder — causal ``PConv3d`` (replicate padding) and ``DepthToSpaceTime``
    upsamplers, every other layer frame-local (per-frame GroupNorm, 1×1 convs); no attention:
    exact as it is.
  - HunyuanVideo's decoder and encoder on 0.3.75 (one forward over the whole length in core) —
    causal ``VideoConv3d``, time-doubling ``Upsample``, time-strided ``Downsample``; their
    mid-block attention and GroupNorms span all frames, so the chunks are exact given the whole
    length's global head (captured in one forward, each chunk gets its own frames of it) or
    global tail (each chunk's frames collected into one map, the final pass runs the whole
    length) and GroupNorm statistics (recorded in one forward, replayed in every chunk):
    :class:`memorykit.tiled_vae.TimeChunks`. Zoo (0.3.75): decode 0.24 of core's tiled error,
    encode 0.31, as with time uncut; independent temporal tiles were 0.95 and 0.99.
- ``"tiles"``: independent temporal tiles, blended (everything else: layers that see all
  frames and no whole-length context to stand in for them — Mochi's encoder attends over time;
  on 0.3.75 LTX-Video's decoder convolves non-causally).
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


def hunyuan_decoder_links(decoder) -> list[Link] | None:
    """:class:`Link` list for HunyuanVideo's decoder as 0.3.75 builds it (``comfy.ldm.modules.
    diffusionmodules.model.Decoder`` with 3-D convs and no ``carried`` time cache of its own;
    0.33+ carries time itself, :func:`compat.core_carries_time`):

    - every causal ``VideoConv3d`` with a time kernel ``kt`` > 1 (``replicate`` padding of
      ``kt − 1`` frames before, none after; time stride and dilation 1): context ``kt − 1``;
    - every ``Upsample`` that doubles time (its first input frame becomes one frame, each other
      two, then its own causal conv): ×2, drops 1 first frame, context ``1 + ⌈(kt − 1)/2⌉``
      input frames (2 for ``kt`` = 3), so that its conv's ``kt − 1`` frames of context are real
      doubled frames; that inner conv is then not a link of its own (its input already holds the
      context).

    Exact only for the layers *after the mid block*: its attention and every GroupNorm span all
    frames, so a chunked decode needs the global head (captured on the whole length in one
    forward, at or after the mid block) and the whole length's GroupNorm statistics — see
    ``tiled_vae_io``. None for anything else (another decoder, attention past the mid block, a
    strided, dilated or non-causal time conv, a time scale other than ×2)."""
    from comfy.ldm.modules.diffusionmodules import model as sdm
    if type(decoder) is not sdm.Decoder or getattr(decoder, "carried", False) or not isinstance(decoder.conv_in, sdm.VideoConv3d):
        return None
    if any(len(up.attn) for up in decoder.up):
        return None

    links, inner = [], set()
    for m in decoder.modules():
        if isinstance(m, sdm.Upsample):
            sf = m.scale_factor if isinstance(m.scale_factor, (tuple, list)) else (m.scale_factor,) * 3
            if sf[0] <= 1.0:
                continue
            if sf[0] != 2.0:
                return None
            c = 0
            if m.with_conv:
                if not isinstance(m.conv, sdm.VideoConv3d):
                    return None
                c = _conv_context(m.conv)
                if c is None:
                    return None
                inner.add(m.conv)
            links.append(Link(m, 1 + (c + 1) // 2, 2, 1))
        elif isinstance(m, sdm.VideoConv3d) and m not in inner and not _add_conv_link(m, links):
            return None
    return links


def hunyuan_encoder_links(encoder) -> list[Link] | None:
    """:class:`Link` list for HunyuanVideo's encoder as 0.3.75 builds it (as
    :func:`hunyuan_decoder_links`): every causal ``VideoConv3d`` with a time kernel > 1 (context
    ``kt − 1``) and every ``Downsample`` (its forward pads 2 frames before, replicate, then its
    3×3×3 conv): time stride 1 → context 2; time stride 2 → context 1 (its first output, which
    reads the padding, cut; exact with chunks of ``1 + k·(m − 1)`` then ``k·m`` frames,
    :func:`carried_encode`, which keep every boundary on the stride's grid). Its
    mid-block attention and GroupNorms span all frames: exact with the global tail (before the
    last downsampler or the middle block: the final pass runs the whole length) and the whole
    length's statistics. None for anything else (attention before the mid block, other kernels
    or strides)."""
    from comfy.ldm.modules.diffusionmodules import model as sdm
    if type(encoder) is not sdm.Encoder or getattr(encoder, "carried", False) or not isinstance(encoder.conv_in, sdm.VideoConv3d):
        return None
    if any(len(d.attn) for d in encoder.down):
        return None
    links, inner = [], set()
    for m in encoder.modules():
        if isinstance(m, sdm.Downsample):
            conv = getattr(m, "conv", None)
            if not m.with_conv or not isinstance(conv, sdm.VideoConv3d) or conv.padding != 0:
                return None
            kt, st = conv.conv.kernel_size[0], conv.conv.stride[0]
            if kt != 3 or st not in (1, 2) or conv.conv.dilation[0] != 1 or tuple(conv.conv.padding)[0] != 0:
                return None
            inner.add(conv)
            links.append(Link(m, 2) if st == 1 else Link(m, 1))  # stride 2: see Link
        elif isinstance(m, sdm.VideoConv3d) and m not in inner and not _add_conv_link(m, links):
            return None
    return links


def _add_conv_link(m, links: list[Link]) -> bool:
    """Append the :class:`Link` of causal ``VideoConv3d`` ``m`` (none for a time kernel of 1);
    False where ``m`` is not causal with time stride and dilation 1 (no carry possible)."""
    c = _conv_context(m)
    if c is None:
        return False
    if c > 0:
        links.append(Link(m, c))
    return True


def _conv_context(m) -> int | None:
    """Frames a causal ``VideoConv3d`` reads before each frame (``kt − 1``; 0 for ``kt`` = 1);
    None where it is not causal with time stride and dilation 1."""
    conv = m.conv
    kt, st, dt = conv.kernel_size[0], conv.stride[0], conv.dilation[0]
    if kt == 1:
        return 0
    pad = m.padding
    if st != 1 or dt != 1 or pad == 0 or tuple(pad[4:]) != (kt - 1, 0) or tuple(conv.padding)[0] != 0:
        return None
    return kt - 1


def time_mode(vae, direction: str) -> str:
    """``"core"``, ``"carry"`` or ``"tiles"`` for ``vae`` (a ``comfy.sd.VAE`` with 3-D latents) in
    ``direction`` (``"decode"``/``"encode"``); see the module docstring."""
    model = vae.first_stage_model
    if _is_wan(model) or core_model_carries_time(model):
        return "core"
    coder = getattr(model, "decoder" if direction == "decode" else "encoder", None)
    if core_carries_time(coder):
        return "core"
    if direction == "decode" and (mochi_decoder_links(coder) or hunyuan_decoder_links(coder)):
        return "carry"
    if direction == "encode" and hunyuan_encoder_links(coder):
        return "carry"
    return "tiles"


def carried_decode(vae, fn, chunk_frames: int, on_chunk=None) -> tuple:
    """``fn`` (latent ``[1, C, T, h, w]`` → pixels) wrapped to decode ``chunk_frames`` latent
    frames at a time with the carried cache of :func:`mochi_decoder_links` or
    :func:`hunyuan_decoder_links`. Returns ``(run, chunks)``: ``chunks`` is the
    :class:`memorykit.tiled_vae.TimeChunks` for HunyuanVideo (its mid-block attention and
    GroupNorms span all frames: the global head and the statistics pre-pass run ``fn`` on the
    whole length once, each chunk replays them), None for Mochi (every layer but the links is
    frame-local: ``run`` alone is exact)."""
    from ..tiled_vae import TimeChunks
    dec = vae.first_stage_model.decoder
    chunk = max(1, int(chunk_frames))
    links = mochi_decoder_links(dec)
    chunks = None
    if not links:
        links = hunyuan_decoder_links(dec)
        chunks = TimeChunks(fn, dec, chunk)
    carry = TimeCarry(links)

    def run(z: torch.Tensor) -> torch.Tensor:
        return carry.run(fn, z, chunk, on_chunk)
    return run, chunks


def carried_encode(vae, fn, chunk_latents: int, on_chunk=None) -> tuple:
    """``fn`` (pixels ``[1, C, F, H, W]`` → latent) wrapped to encode ``chunk_latents`` latent
    frames' worth at a time (``1 + k·(m − 1)`` frames, then ``k·m``; ``k`` the time compression)
    with the carried cache of :func:`hunyuan_encoder_links`. Returns ``(run, chunks)`` as
    :func:`carried_decode` (the global tail's final pass and the statistics pre-pass run the
    whole length once)."""
    from ..tiled_vae import TimeChunks
    enc = vae.first_stage_model.encoder
    k, m = int(vae.temporal_compression_decode() or 1), max(1, int(chunk_latents))
    first, chunk = 1 + k * (m - 1), k * m
    carry = TimeCarry(hunyuan_encoder_links(enc))

    def run(px: torch.Tensor) -> torch.Tensor:
        return carry.run(fn, px, chunk, on_chunk, first=first)
    return run, TimeChunks(fn, enc, first)
