"""Tiled VAE Decode / Encode on ComfyUI's VAE object (``comfy.sd.VAE`` → :mod:`memorykit.tiled_vae`)."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import comfy.model_management as mm
import torch

from .. import tiled_vae as tv
from ..global_context import GlobalContextMismatch
from ..norm_stats import SharedGroupNormStats
from ..units import size_text
from . import vae_context
from .compat import patcher_free_memory
from .vae_blend import blend_rule
from .vae_defer import deferral, run_deferred
from .vae_factors import core_ratio_note, crop_to_factor, spatial_factor
from .vae_time import carried_decode, carried_encode, time_mode


@dataclass
class TiledVAEOptions:
    """Node options. Sizes in pixels/frames; ``memory_budget_gb`` in GiB (0 = free memory)."""

    tile_px: int = 512
    overlap_px: int = 64
    temporal_size: int = 64
    temporal_overlap: int = 8
    memory_budget_gb: float = 0.0
    shared_norm_stats: bool = True
    global_context: bool = True
    feather: float | None = None  # None: the VAE's own rule (see blend_rule)


def input_channels(vae) -> int:
    """Image channels the VAE encodes (3, or 4 for RGBA VAEs: core's ``output_channels``)."""
    return int(getattr(vae, "output_channels", 3) or 3)


def vae_shape(vae, direction: str = "decode") -> tv.VAEShape:
    """Geometry of a ``comfy.sd.VAE`` for tiling in ``direction`` (``"decode"``/``"encode"``):
    ``time_cache`` is set where time is never cut (a causal time cache carried by the VAE or by
    the pack, :func:`vae_time.time_mode`). Raises ValueError for VAEs this node does not tile
    (1-D audio latents, latents with an extra 1-D channel, unknown time mappings)."""
    vae.throw_exception_if_invalid()
    if vae.latent_dim not in (2, 3) or vae.extra_1d_channel is not None:
        raise ValueError(f"Tiled VAE handles image and video VAEs; {type(vae.first_stage_model).__name__} has "
                         f"{vae.latent_dim}-D latents: use ComfyUI's VAE Decode/Encode for it")
    spatial = spatial_factor(vae, direction)  # the model's own where core's ratio is wrong (TAEF2)
    if vae.latent_dim == 2:
        return tv.VAEShape(int(vae.latent_channels), spatial)
    k = int(vae.upscale_index_formula[0]) if vae.upscale_index_formula else vae.temporal_compression_decode()
    up = vae.upscale_ratio[0]
    if all(up(n) == k * (n - 1) + 1 for n in (1, 2, 3)):
        causal = True
    elif all(up(n) == k * n for n in (1, 2, 3)):
        causal = False
    else:
        raise ValueError(f"{type(vae.first_stage_model).__name__}: unsupported time mapping "
                         f"({[up(n) for n in (1, 2, 3)]} frames for 1..3 latent frames): Tiled VAE cannot "
                         "cut this VAE's video into tiles; use ComfyUI's VAE Decode/Encode (Tiled) for it")
    return tv.VAEShape(int(vae.latent_channels), spatial, k, causal, time_mode(vae, direction) != "tiles")


# Sides (latent pixels) of the two probe tiles the tile cost is measured with, by "the VAE runs
# on a GPU": 8 and 16 on a CPU, where each probe of a full-size VAE costs seconds (the cost is
# linear in the tile's pixels either way).
PROBE_SIDES = {True: (16, 32), False: (8, 16)}


class NeedsWholeLengthContext(RuntimeError):
    """A decode/encode in carried time chunks (:class:`memorykit.tiled_vae.TimeChunks`) got no
    global head/tail (global_context off, none within the budget, or one that did not fit the
    tiles): its chunks' mid-block attention would see only the chunk (zoo, HunyuanVideo decode on
    0.3.75: 2.34, twice core's error), so the caller cuts time into tiles instead."""


def _run(vae, direction: str, x: torch.Tensor, fn, opts: TiledVAEOptions, cost_model, tail_dummy=None, chunks=None,
         time_tiles: bool = False):
    """Shared body of :func:`tiled_vae_decode` / :func:`tiled_vae_encode` (``x`` channel-first;
    ``chunks``: :class:`memorykit.tiled_vae.TimeChunks` where ``fn`` runs time in chunks that need
    the whole length's context — the head is then chosen even for one spatial tile, and
    :class:`NeedsWholeLengthContext` raised without one; ``time_tiles``: cut time into tiles even
    where :func:`vae_time.time_mode` would not).

    Order: validate and plan (errors before any work) → load the VAE through ComfyUI's memory
    manager asking for the memory of ONE tile → tile cost → largest tile within the budget → run.

    The tile cost is measured (two probe tiles, under the GroupNorm replay hooks the real tiles
    run under) on CUDA and wherever ``memory_budget_gb`` is set; on the CPU with the budget at
    0 (0.9 × free RAM, rarely binding) the VAE's own model is used and the probes are skipped.
    """
    import comfy.utils
    shape = vae_shape(vae, direction)
    if time_tiles:
        shape = dataclasses.replace(shape, time_cache=False)
    dims = tuple(x.shape[2:])
    # Temporal fields only matter where time is cut (video VAEs without a causal cache).
    temporal = (opts.temporal_size, opts.temporal_overlap) if shape.video and not shape.time_cache else (1, 0)
    plan = tv.make_plan(shape, direction, dims, opts.tile_px, opts.overlap_px, *temporal)
    time_cut = shape.video and len(plan.axes[0].starts) > 1
    rule_feather, rule_stats = blend_rule(vae, shape, time_cut, direction=direction)
    args = (*temporal, rule_feather if opts.feather is None else opts.feather)
    plan = tv.make_plan(shape, direction, dims, opts.tile_px, opts.overlap_px, *args)
    s = shape.spatial_factor
    on_gpu = torch.device(vae.device).type != "cpu"
    weights = vae.model_size() if on_gpu else 0
    if opts.memory_budget_gb > 0 and opts.memory_budget_gb * 2 ** 30 <= weights:
        raise ValueError(f"memory_budget_gb {opts.memory_budget_gb} GiB does not even hold the VAE's weights "
                         f"({size_text(weights)}); raise it or set 0 (use the free memory)")
    modelled = tv.TileCost(0.0, cost_model(plan.tile_shape[0] if shape.video else 1, s), "modelled")
    units = lambda p: p.tile_shape[-1] * p.tile_shape[-2]
    # Ask the memory manager for one tile (capped: a huge tile_size must not push the VAE itself
    # into lowvram mode; the tile is fitted to what is free afterwards).
    ask = min(modelled.bytes_for(units(plan)), 0.5 * mm.get_total_memory(vae.device))
    if opts.memory_budget_gb > 0:
        ask = min(ask, opts.memory_budget_gb * 2 ** 30 - weights)
    mm.load_models_gpu([vae.patcher], memory_required=ask, force_full_load=vae.disable_offload)
    if opts.memory_budget_gb > 0:
        budget, budget_source = opts.memory_budget_gb * 2 ** 30 - weights, "memory_budget_gb"
    else:
        budget, budget_source = 0.9 * patcher_free_memory(vae.patcher, vae.device), "free memory"
    lead = tuple(a.amap.in_span(0, a.length)[1] for a in plan.axes[:-2])  # a tile's frames (input units)
    ch, k = (shape.latent_channels, 1) if direction == "decode" else (input_channels(vae), s)
    probe = lambda t: torch.rand((1, ch) + lead + (t * k, t * k))
    norm = SharedGroupNormStats(vae.first_stage_model) if opts.shared_norm_stats and rule_stats else None
    measure = torch.device(vae.device).type == "cuda" or opts.memory_budget_gb > 0
    probe_sides = PROBE_SIDES[on_gpu] if measure else None
    cost = modelled
    if probe_sides is not None:
        replay = None
        if norm is not None and norm.available:
            with norm.recording():  # statistics for the replay hooks the probes run under
                fn(probe(2))
            replay = norm.replaying
        cost = tv.measure_tile_cost(fn, probe, vae.device, sides=probe_sides, context=replay)
    grid_hw = plan.grid_shape[-2:]
    min_tile = max(tv.MIN_TILE_UNITS, opts.overlap_px // s + 1)
    t = tv.fit_tile(grid_hw, cost, budget, max(1, opts.tile_px // s), min_tile)
    if t is None:
        raise ValueError(f"memory budget ({size_text(budget)} besides the VAE's weights, from {budget_source}) is "
                         f"too small for the smallest tile ({min_tile * s} px, about "
                         f"{size_text(cost.bytes_for(min_tile ** 2))}): raise memory_budget_gb or lower overlap")
    tile_px = t * s if t * s < opts.tile_px and t < max(grid_hw) else opts.tile_px
    if tile_px != opts.tile_px:
        plan = tv.make_plan(shape, direction, dims, tile_px, opts.overlap_px, *args)
    head = tail = None
    chunked = chunks is not None and x.shape[2] > chunks.frames
    if opts.global_context and (plan.num_tiles > 1 or chunked) and not (shape.video and len(plan.axes[0].starts) > 1):
        if direction == "decode":
            once = chunks.whole_fn if chunked else fn  # the head's pass runs the whole length in one forward
            for h in vae_context.decode_heads(vae.first_stage_model):
                if vae_context.head_bytes(vae, once, h[0], h[1], plan, probe, probe_sides, len(h) > 3 and h[3]) <= budget:
                    head = h
                    break
        else:
            for c in vae_context.encode_tails(vae.first_stage_model):
                if vae_context.tail_bytes(vae, c[0], c[1], plan) <= budget:
                    tail = c
                    break
    if chunked and head is None and tail is None:
        raise NeedsWholeLengthContext("global context off" if not opts.global_context else "none within the budget")
    if chunked and norm is not None:  # the statistics pre-pass runs the whole length: shrink it to the budget
        pre = cost.bytes_for(units(plan)) * (x.shape[2] / chunks.frames if cost.source == "measured" else 1.0)
        chunks = dataclasses.replace(chunks, stats_share=min(1.0, budget / pre) if pre > 0 else 1.0)

    def replan():  # the blend chosen without a global context
        return tv.make_plan(shape, direction, dims, tile_px, opts.overlap_px, *temporal,
                            blend_rule(vae, shape, time_cut, context=False, direction=direction)[0])

    if head is None and tail is None and opts.feather is None and plan.num_tiles > 1:
        plan = replan()
    # Keep the head's output on the GPU while the tiles run when it fits next to a tile (saves a
    # device→host→device round trip of a whole-latent activation); else on the output device.
    head_store = vae.output_device
    if head is not None:
        ch = max((p.shape[0] for p in head[0].parameters() if p.ndim >= 2), default=512)
        frames = plan.tile_shape[0] if shape.video else 1
        store = ch * grid_hw[0] * grid_hw[1] * head[1] ** 2 * frames * mm.dtype_size(vae.vae_dtype)
        if on_gpu and store + cost.bytes_for(units(plan)) <= budget:
            head_store = vae.device
    pbar = comfy.utils.ProgressBar(tv.steps_for(plan, x.shape[0], bool(norm and norm.available), bool(head), bool(tail),
                                                chunked))

    def on_step():
        pbar.update(1)
        mm.throw_exception_if_processing_interrupted()

    t0 = time.perf_counter()
    context_off = ""
    try:
        out = tv.run_tiled(x, fn, plan, norm_stats=norm, head_module=head[0] if head else None,
                           head_scale=head[1] if head else 1, head_store_device=head_store,
                           head_stop=bool(head and len(head) > 3 and head[3]),
                           tail_module=tail[0] if tail else None,
                           tail_scale=tail[1] if tail else 1,
                           tail_dummy=tail_dummy, chunks=chunks, on_step=on_step, output_device=vae.output_device)
    except GlobalContextMismatch as e:  # the context does not fit the tiles: tile without it (correct, less exact)
        if chunked:
            raise NeedsWholeLengthContext(f"{(head or tail)[2]} {e}") from e
        context_off = f"off: {(head or tail)[2]} {e}"
        head = tail = None
        if opts.feather is None:
            plan = replan()
        pbar = comfy.utils.ProgressBar(tv.steps_for(plan, x.shape[0], bool(norm and norm.available), chunked=chunked))
        out = tv.run_tiled(x, fn, plan, norm_stats=norm, chunks=chunks, on_step=on_step, output_device=vae.output_device)
    info = {
        "direction": direction, "vae": type(vae.first_stage_model).__name__,
        "input_shape": list(x.shape), "output_shape": list(out.shape), "items": int(x.shape[0]),
        "tile_px": [n * s for n in plan.tile_shape[-2:]], "tile_limit_px": min(t, max(grid_hw)) * s,
        "overlap_px": opts.overlap_px,
        "plan": plan.describe(), "tiles_per_item": plan.num_tiles,
        "time": _time_info(vae, direction, shape, plan, opts),
        "shared_norm_stats": bool(norm and norm.available and (plan.num_tiles > 1 or chunked)),
        "global_context": (head[2] if head else tail[2] if tail else context_off or "off"),
        "global_context_kept_on": str(head_store) if head else None,
        "memory_budget_bytes": int(max(0, budget)), "budget_source": budget_source,
        "tile_bytes_estimate": int(cost.bytes_for(units(plan))), "cost_source": cost.source,
        "tile_cost_bytes": {"fixed": int(cost.fixed_bytes), "per_latent_pixel": int(cost.per_unit_bytes)},
        "seconds": round(time.perf_counter() - t0, 3),
    }
    note = core_ratio_note(vae, direction)
    if note:
        info["core_ratio_note"] = note
    return out, info


def _time_info(vae, direction: str, shape: tv.VAEShape, plan, opts: TiledVAEOptions) -> str:
    if not shape.video:
        return "none"
    mode = time_mode(vae, direction) if shape.time_cache else "tiles"
    if mode == "core":
        return "whole length per tile (causal cache carried by the VAE)"
    if mode == "carry":
        return f"whole length per tile, chunks of {carry_chunk(shape, opts)} latent frames (causal cache carried by Tiled VAE)"
    return f"tiles of {plan.tile_shape[0]} latent frames"


def carry_chunk(shape: tv.VAEShape, opts: TiledVAEOptions) -> int:
    """Latent frames per chunk of a carried decode: as many as ``temporal_size`` frames hold."""
    k = shape.time_factor
    return max(1, (opts.temporal_size - 1) // k + 1 if shape.causal_time else opts.temporal_size // k)


def planned_options(vae, opts: TiledVAEOptions) -> TiledVAEOptions:
    """``opts`` with the tile capped at the one Memory Plan chose for ``vae`` (a VAE from its VAE
    output carries ``memorykit_tile_px``), unless a ``memory_budget_gb`` of the node's own decides."""
    planned = getattr(vae, "memorykit_tile_px", None)
    if not planned or opts.memory_budget_gb or planned >= opts.tile_px:
        return opts
    overlap = min(opts.overlap_px, getattr(vae, "memorykit_overlap_px", planned // 4), planned // 2)
    return dataclasses.replace(opts, tile_px=int(planned), overlap_px=int(overlap))


def tiled_vae_decode(vae, samples: torch.Tensor, opts: TiledVAEOptions) -> tuple[torch.Tensor, dict]:
    """Decode a LATENT tensor (``[B, C, H, W]``, video ``[B, C, T, H, W]``) tile by tile.

    Returns (IMAGE ``[N, H·s, W·s, 3]`` float32 on ComfyUI's intermediate device — video frames
    of all items concatenated as VAEDecode does — and the plan/info dict). Raises ValueError
    before any decoding on a latent that does not fit the VAE or on bad sizes. A VAE that tiles
    itself (``handles_tiling``) or cannot be tiled from outside decodes with VAE Decode (see
    :func:`deferral`).
    """
    vae.throw_exception_if_invalid()
    why = deferral(vae, "decode")
    if why:
        return run_deferred(vae, "decode", samples, why)
    opts = planned_options(vae, opts)
    shape = vae_shape(vae, "decode")
    want = 5 if shape.video else 4
    if samples.ndim != want:
        raise ValueError(f"LATENT has shape {tuple(samples.shape)}; this VAE ({type(vae.first_stage_model).__name__}) "
                         f"decodes {'[B, C, T, H, W] video' if shape.video else '[B, C, H, W] image'} latents")
    if samples.shape[1] != shape.latent_channels:
        raise ValueError(f"LATENT has {samples.shape[1]} channels but this VAE ({type(vae.first_stage_model).__name__}) "
                         f"expects {shape.latent_channels}: is it the VAE of the model that made the latent?")
    model, dtype, device, out_dev = vae.first_stage_model, vae.vae_dtype, vae.device, vae.output_device

    def fn(z):
        return model.decode(z.to(dtype).to(device)).to(out_dev).float()

    chunks = None
    if shape.video and time_mode(vae, "decode") == "carry":
        tv.check_tile_args(opts.tile_px, opts.overlap_px, opts.temporal_size, 0)  # time is not cut: overlap ignored
        fn, chunks = carried_decode(vae, fn, carry_chunk(shape, opts), mm.throw_exception_if_processing_interrupted)

    def cost_model(frames, s):
        dims = (1, shape.latent_channels) + ((frames,) if shape.video else ()) + (16, 16)
        return vae.memory_used_decode(dims, dtype) / 256.0

    try:
        out, info = _run(vae, "decode", samples, fn, opts, cost_model, chunks=chunks)
    except NeedsWholeLengthContext as e:
        out, info = _run(vae, "decode", samples, chunks.whole_fn, opts, cost_model, time_tiles=True)
        info["time"] += f" (carried chunks need the global head: {e})"
    images = vae.process_output(out).movedim(1, -1)
    if images.ndim == 5:
        images = images.reshape((-1,) + tuple(images.shape[-3:]))
    return images, info


def tiled_vae_encode(vae, pixels: torch.Tensor, opts: TiledVAEOptions) -> tuple[torch.Tensor, dict]:
    """Encode an IMAGE (``[B, H, W, C≥3]``; for a video VAE the batch is the frames) tile by tile.

    Pixels are centre-cropped to a multiple of the VAE's compression as VAEEncode does.
    Returns (LATENT samples, info dict). Raises ValueError before any encoding on bad input. A
    VAE that tiles itself (``handles_tiling``) encodes with VAE Encode (see :func:`deferral`).
    """
    vae.throw_exception_if_invalid()
    why = deferral(vae, "encode")
    if why:
        return run_deferred(vae, "encode", pixels, why)
    opts = planned_options(vae, opts)
    shape = vae_shape(vae, "encode")
    if pixels.ndim != 4 or pixels.shape[-1] < 3:
        raise ValueError(f"pixels: IMAGE has shape {tuple(pixels.shape)}; expected [batch, height, width, "
                         "channels] with 3 (RGB) or 4 (RGBA) channels: connect an IMAGE output (Load Image, VAE Decode)")
    s = shape.spatial_factor
    if pixels.shape[1] < s or pixels.shape[2] < s:
        raise ValueError(f"pixels: IMAGE of {pixels.shape[2]}x{pixels.shape[1]} px is smaller than one latent "
                         f"pixel ({s}x{s} px): upscale or pad it to at least {s}x{s} px")
    # The VAE's own input channels (RGBA VAEs take 4: alpha passes through); extra channels are
    # dropped, fewer are padded by core where it can (0.33's vae_encode_crop_pixels).
    # Where core's ratio is not the model's (TAEF2), crop to the model's first.
    px = pixels[..., :input_channels(vae)]
    x = vae.vae_encode_crop_pixels(crop_to_factor(px, s) if core_ratio_note(vae, "encode") else px).movedim(-1, 1)
    if shape.video:
        x = x.unsqueeze(2) if vae.not_video else x.movedim(1, 0).unsqueeze(0)
    model, dtype, device, out_dev = vae.first_stage_model, vae.vae_dtype, vae.device, vae.output_device

    def fn(px):
        return model.encode(vae.process_input(px).to(dtype).to(device)).to(out_dev).float()

    def cost_model(frames, s_):
        lead = (shape.time_factor * (frames - 1) + 1,) if shape.video else ()
        return vae.memory_used_encode((1, input_channels(vae)) + lead + (16 * s_, 16 * s_), dtype) / 256.0

    dummy = lambda xb: xb[..., :s, :s]  # noqa: E731
    if not (shape.video and time_mode(vae, "encode") == "carry"):
        return _run(vae, "encode", x, fn, opts, cost_model, tail_dummy=dummy)
    tv.check_tile_args(opts.tile_px, opts.overlap_px, opts.temporal_size, 0)  # time is not cut: overlap ignored
    run, chunks = carried_encode(vae, fn, carry_chunk(shape, opts), mm.throw_exception_if_processing_interrupted)
    try:
        return _run(vae, "encode", x, run, opts, cost_model, tail_dummy=dummy, chunks=chunks)
    except NeedsWholeLengthContext as e:
        out, info = _run(vae, "encode", x, fn, opts, cost_model, tail_dummy=dummy, time_tiles=True)
        info["time"] += f" (carried chunks need the global tail: {e})"
        return out, info
