"""Which module of each core VAE gets Tiled VAE's global context, and what that pass costs.

:func:`decode_heads` / :func:`encode_tails` list, best first, the modules of a ComfyUI VAE's
decoder / encoder whose output (head) or input (tail) is computed once on the whole latent
(:mod:`memorykit.global_context`), with their resolution relative to the latent grid and a name
for the report; :func:`head_bytes` / :func:`tail_bytes` give the peak working memory of that pass,
against which ``tiled_vae_io`` picks the first that fits the budget.
"""
from __future__ import annotations

import sys

import comfy.model_management as mm
import torch

from .. import tiled_vae as tv
from .compat import decoder_gives_pre_end


def _latent_patch(model) -> int:
    """Latent pixels per side that one latent unit of the VAE holds inside the model: 2 for Flux
    2's VAE (its 32-channel 8× latent is folded 2×2 into 128 channels, ``bn`` / ``ps``), else 1."""
    return int(getattr(model, "ps", [1])[0]) if getattr(model, "bn", None) is not None else 1


def decode_heads(model) -> list[tuple]:
    """Split points of decoders known to work with a global head, deepest first:
    ``(module, scale vs latent grid, name[, stop])`` (``stop``: see ``GlobalHead``). Empty for
    other VAEs (plain tiling)."""
    import comfy.ldm.wan.vae as wan21
    import comfy.ldm.wan.vae2_2 as wan22
    from comfy.ldm.modules.diffusionmodules.model import Decoder
    mage = _mage_heads(model)
    if mage:
        return mage
    dec = getattr(model, "decoder", None)
    if type(dec) is Decoder and not decoder_gives_pre_end(dec):
        top, r = dec.num_resolutions - 1, _latent_patch(model)
        heads = [(dec.up[top].upsample, 2 * r, f"decoder.up.{top}.upsample")] if top > 0 else []
        return heads + [(dec.mid.block_2, r, "decoder.mid.block_2")]
    if type(dec) is wan21.Decoder3d:
        ups = [i for i, m in enumerate(dec.upsamples) if isinstance(m, wan21.Resample) and m.mode.startswith("upsample")]
        heads = [(dec.upsamples[ups[0]], 2, f"decoder.upsamples.{ups[0]}")] if ups else []
        return heads + [(dec.middle[-1], 1, f"decoder.middle.{len(dec.middle) - 1}")]
    hyi = _hunyuan_image_heads(dec)
    if hyi:
        return hyi
    ltx = _ltx_heads(dec)
    if ltx:
        return ltx
    hy15 = sys.modules.get("comfy.ldm.hunyuan_video.vae_refiner")
    if hy15 is not None and type(dec) is getattr(hy15, "Decoder", None):
        # HunyuanVideo 1.5 (its own causal chunks: one head output per chunk): zoo decode 0.042 of
        # core's error after the first upsampler (0.33.0; 0.077 with the seam blended over the whole
        # overlap), 0.29 without
        up0 = getattr(dec.up[0], "upsample", None) if len(dec.up) else None
        heads = [(up0, 2, "decoder.up.0.upsample")] if up0 is not None else []
        return heads + [(dec.mid.block_2, 1, "decoder.mid.block_2")]
    from comfy.ldm.genmo.vae import model as mochi
    if type(dec) is mochi.Decoder and len(dec.blocks) > 1:
        # Mochi (its time chunks carried by Tiled VAE: one head output per chunk): zoo decode 0.40
        # of core's error after the first upsampling block, 0.52 after the first block, 0.69 without
        b = dec.blocks[1]
        heads = ([(b, 2, "decoder.blocks.1")] if isinstance(b, mochi.CausalUpsampleBlock)
                 and b.spatial_expansion == 2 else [])
        return heads + [(dec.blocks[0], 1, "decoder.blocks.0")]
    if type(dec) is wan22.Decoder3d:  # Wan 2.2: zoo decode 0.041 of core's error (middle only 0.11, none 0.52)
        ups = [i for i, m in enumerate(dec.upsamples) if any(isinstance(r, wan22.Resample) for r in m.upsamples)]
        heads = [(dec.upsamples[ups[0]], 2, f"decoder.upsamples.{ups[0]}")] if ups else []
        return heads + [(dec.middle[-1], 1, f"decoder.middle.{len(dec.middle) - 1}")]
    return []


def _mage_heads(model) -> list[tuple]:
    """Mage-VAE (``comfy.ldm.mage_flow.vae.MageVAE``, 0.33+): its conditioning decoder
    (``decoder_model.y_embedder.decoder``, the CoD decoder: convolutions, GroupNorms and attention
    in windows of 32 latent pixels, all at the latent resolution), whose output conditions the
    one-step pixel denoiser. A ``stop`` head: ``MageVAE.decode`` sizes the denoiser's input from
    the latent, so the capture run cannot go on with a 1×1 stand-in. Zoo decode (0.33.0): 0.008
    of core's error (0.0044 vs 0.540); without it 1.06 (0.572, feather 1.0)."""
    mod = sys.modules.get("comfy.ldm.mage_flow.vae")
    if mod is None or type(model) is not getattr(mod, "MageVAE", None):
        return []
    cod = model.decoder_model.y_embedder.decoder
    return [(cod, 1, "decoder_model.y_embedder.decoder", True)]


def _hunyuan_image_heads(dec) -> list[tuple]:
    """HunyuanImage 2.1's 2-D decoder (``comfy.ldm.hunyuan_video.vae.Decoder``: conv_in, middle
    block with attention over all latent positions, then the stages ``up[0..]`` lowest
    resolution first, each but the last ending in a 2× ``PixelUnshuffle2D``): after the first
    stage's upsampler (scale 2), else the middle block. Zoo decode (0.33.0 and 0.3.75): 0.27 of
    core's error (0.099 vs 0.369); without it 0.76 (0.279, feather 1.0)."""
    import comfy.ldm.hunyuan_video.vae as hyi
    if type(dec) is not hyi.Decoder:
        return []
    up0 = getattr(dec.up[0], "upsample", None) if len(dec.up) else None
    return ([(up0, 2, "decoder.up.0.upsample")] if up0 is not None else []) + [(dec.mid.block_2, 1, "decoder.mid.block_2")]


def _hunyuan_image_tails(enc) -> list[tuple]:
    """HunyuanImage 2.1's 2-D encoder (``comfy.ldm.hunyuan_video.vae.Encoder``): the input of its
    last ``PixelShuffle2D`` downsampler (scale 2), else of the middle block (scale 1). Zoo encode
    (both cores): 0.33 of core's error (0.233 vs 0.705); without it 0.83 (0.586)."""
    import comfy.ldm.hunyuan_video.vae as hyi
    if type(enc) is not hyi.Encoder:
        return []
    downs = [i for i, st in enumerate(enc.down) if hasattr(st, "downsample")]
    tails = [(enc.down[downs[-1]].downsample, 2, f"encoder.down.{downs[-1]}.downsample")] if downs else []
    return tails + [(enc.mid.block_1, 1, "encoder.mid.block_1")]


def _ltx_heads(dec) -> list[tuple]:
    """LTX-Video's decoder: the output of its first ``DepthToSpaceUpsample`` with a spatial
    stride of 2 (scale 2), else of the block before it (scale 1); ``stop`` heads, since 0.33's
    decoder writes into an output buffer sized from its input (zoo, 0.33: 0.105 of core's error
    at the first — 0.135 blended over the whole overlap —, 0.28 at the second, 0.44 without)."""
    from comfy.ldm.lightricks.vae import causal_video_autoencoder as cva
    if type(dec) is not cva.Decoder:
        return []
    for i, b in enumerate(dec.up_blocks):
        if isinstance(b, cva.DepthToSpaceUpsample):
            st = tuple(b.stride) if isinstance(b.stride, (tuple, list)) else (b.stride,) * 3
            if st[1:] == (2, 2):
                heads = [(b, 2, f"decoder.up_blocks.{i}", True)]
                return heads + ([(dec.up_blocks[i - 1], 1, f"decoder.up_blocks.{i - 1}", True)] if i > 0 else [])
            if st[1:] != (1, 1):
                return []
    return []


def encode_tails(model) -> list[tuple[torch.nn.Module, int, str]]:
    """Split points of encoders known to work with a global tail, deepest first:
    ``(module whose input is on the latent grid × scale, scale, name)``. Empty for other VAEs."""
    import comfy.ldm.wan.vae as wan21
    import comfy.ldm.wan.vae2_2 as wan22
    from comfy.ldm.modules.diffusionmodules.model import Encoder
    enc = getattr(model, "encoder", None)
    if type(enc) is Encoder:
        top, r = enc.num_resolutions - 1, _latent_patch(model)
        tails = [(enc.down[top - 1].downsample, 2 * r, f"encoder.down.{top - 1}.downsample")] if top > 0 else []
        if enc.num_res_blocks > 0:
            return tails + [(enc.down[top].block[0], r, f"encoder.down.{top}.block.0")]
        return tails + [(enc.mid.block_1, r, "encoder.mid.block_1")]
    if type(enc) is wan21.Encoder3d:
        downs = [i for i, m in enumerate(enc.downsamples) if isinstance(m, wan21.Resample)]
        tails = [(enc.downsamples[downs[-1]], 2, f"encoder.downsamples.{downs[-1]}")] if downs else []
        i = downs[-1] + 1 if downs else len(enc.downsamples)
        if i < len(enc.downsamples):
            return tails + [(enc.downsamples[i], 1, f"encoder.downsamples.{i}")]
        return tails + [(enc.middle[0], 1, "encoder.middle.0")]
    hy15 = sys.modules.get("comfy.ldm.hunyuan_video.vae_refiner")
    if hy15 is not None and type(enc) is getattr(hy15, "Encoder", None):
        # HunyuanVideo 1.5: before its last downsampler (its own causal chunks: one map per chunk),
        # else the middle block (after the chunks are joined)
        downs = [i for i, st in enumerate(enc.down) if hasattr(st, "downsample")]
        tails = [(enc.down[downs[-1]].downsample, 2, f"encoder.down.{downs[-1]}.downsample")] if downs else []
        return tails + [(enc.mid.block_1, 1, "encoder.mid.block_1")]
    hyi = _hunyuan_image_tails(enc)
    if hyi:
        return hyi
    ltx = _ltx_tails(enc)
    if ltx:
        return ltx
    if type(enc) is wan22.Encoder3d:  # Wan 2.2: zoo encode 0.050 of core's error (middle only 0.23, none 0.40)
        downs = [i for i, m in enumerate(enc.downsamples) if any(isinstance(r, wan22.Resample) for r in m.downsamples)]
        tails = [(enc.downsamples[downs[-1]], 2, f"encoder.downsamples.{downs[-1]}")] if downs else []
        i = downs[-1] + 1 if downs else len(enc.downsamples)
        if i < len(enc.downsamples):
            return tails + [(enc.downsamples[i], 1, f"encoder.downsamples.{i}")]
        return tails + [(enc.middle[0], 1, "encoder.middle.0")]
    return []


def _ltx_tails(enc) -> list[tuple]:
    """LTX-Video's encoder: the input of its last down block with a spatial stride of 2 (scale 2),
    else of the block after it (scale 1). 0.33's encoder runs its layers in time chunks whose
    length follows the frame size — another on the final pass's small input than on a tile —
    which :meth:`GlobalTail.finishing` lines up frame by frame. Zoo encode (0.33): 0.112 of core's
    error (0.45 without)."""
    from comfy.ldm.lightricks.vae import causal_video_autoencoder as cva
    from comfy.ldm.lightricks.vae.causal_conv3d import CausalConv3d
    if type(enc) is not cva.Encoder:
        return []

    def spatial_stride(b) -> tuple:
        if isinstance(b, cva.SpaceToDepthDownsample):
            return tuple(b.stride)[1:]
        if isinstance(b, CausalConv3d):
            return tuple(b.conv.stride)[1:]
        return (1, 1)
    strides = [spatial_stride(b) for b in enc.down_blocks]
    downs = [i for i, st in enumerate(strides) if st == (2, 2)]
    if not downs or any(st not in ((1, 1), (2, 2)) for st in strides):
        return []
    i = downs[-1]
    tails = [(enc.down_blocks[i], 2, f"encoder.down_blocks.{i}")]
    if i + 1 < len(enc.down_blocks):
        return tails + [(enc.down_blocks[i + 1], 1, f"encoder.down_blocks.{i + 1}")]
    return tails + [(enc.conv_norm_out, 1, "encoder.conv_norm_out")]


def head_bytes(vae, fn, module: torch.nn.Module, scale: int, plan, probe, probe_sides: tuple[int, int] | None,
                stop: bool = False) -> float:
    """Peak working memory of the global-head pass on the whole latent (bytes): measured with
    two probe latents of ``probe_sides`` latent pixels; with None, modelled as 4 activations of
    the module's width at the latent resolution plus 3 at its own resolution (``scale``² times
    more pixels)."""
    from ..global_context import GlobalHead
    n = plan.grid_shape[-1] * plan.grid_shape[-2]
    frames = plan.tile_shape[0] if len(plan.axes) == 3 else 1
    if probe_sides is not None:
        def run(z):
            GlobalHead(module, scale=scale, stop=stop).capture(lambda: fn(z), tuple(z.shape[-2:]))
        return tv.measure_tile_cost(run, probe, vae.device, sides=probe_sides).bytes_for(n)
    ch = max((p.shape[0] for p in module.parameters() if p.ndim >= 2), default=512)
    return ch * n * frames * (4 + 3 * scale * scale) * mm.dtype_size(vae.vae_dtype)


def tail_bytes(vae, module: torch.nn.Module, scale: int, plan) -> float:
    """Modelled peak of the global-tail pass (bytes): the assembled map (the module's width at
    its resolution) in the working dtype, plus 3 activations of that size and 4 at the latent
    resolution (the middle block)."""
    n = plan.grid_shape[-1] * plan.grid_shape[-2] * (plan.tile_shape[0] if len(plan.axes) == 3 else 1)
    ch = max((p.shape[1] for p in module.parameters() if p.ndim >= 2), default=512)
    return ch * n * (4 + 4 * scale * scale) * mm.dtype_size(vae.vae_dtype)
