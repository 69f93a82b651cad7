"""Tiled VAE decode/encode: plan, one blended pass, shared GroupNorm statistics, memory budget.

Plain torch; knows nothing of ComfyUI. The caller gives a tile function (``decode`` or
``encode`` of its VAE on one tile), the input tensor and a :class:`VAEShape`; see
``memorykit/comfy_integration.py`` ("Tiled VAE") for the ComfyUI side and ``tiling.py`` /
``norm_stats.py`` for the two building blocks.

Units: pixels and frames for user-facing sizes (``tile_px``, ``overlap_px``, ``temporal_size``,
``temporal_overlap``), latent-grid units inside plans, bytes for memory.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .global_context import GlobalHead, GlobalTail
from .norm_stats import SharedGroupNormStats, downsample_for_stats
from .peak_memory import peak_bytes
from .tiling import AxisMap, TilePlan, plan_tiles

# Fraction of each overlap over which neighbouring tiles cross-fade; the rest of the overlap is
# border context that is dropped (3/8 of it on each side). On the generated SD and Wan VAEs
# (random weights) 0.25 and 0 gave the lowest error vs untiled, 0.5 about 5-30 % more, 1.0
# (ComfyUI core's choice: the ramp spans the whole overlap) about twice as much.
DEFAULT_FEATHER = 0.25


@dataclass(frozen=True)
class VAEShape:
    """What tiling needs to know of a VAE.

    ``latent_channels``; ``spatial_factor`` (8 for SD, Wan); ``time_factor`` (None for image
    VAEs, 4 for Wan); ``causal_time``: ``l`` latent frames ↔ ``k·(l-1)+1`` frames;
    ``time_cache``: the VAE itself runs time in chunks with a causal feature cache (Wan), so
    time is never cut — each spatial tile runs the full length and stays exact in time.
    """

    latent_channels: int
    spatial_factor: int
    time_factor: int | None = None
    causal_time: bool = False
    time_cache: bool = False

    @property
    def video(self) -> bool:
        return self.time_factor is not None


def amaps_for(vae: VAEShape, direction: str) -> list[AxisMap]:
    """Axis maps for ``direction`` ``"decode"`` or ``"encode"``: ``[time,] height, width``."""
    mk = AxisMap.up if direction == "decode" else AxisMap.down
    maps = [mk(vae.spatial_factor), mk(vae.spatial_factor)]
    if vae.video:
        maps.insert(0, mk(vae.time_factor, causal=vae.causal_time))
    return maps


# The smallest spatial tile, in latent units: a one-unit tile has no neighbour, and a decoder with
# reflect padding (LTX-Video's, the default of core's) cannot run on it ("Padding size should be
# less than the corresponding input dimension"). tile_size's floor is this × the compression.
MIN_TILE_UNITS = 2


def check_tile_args(tile_px: int, overlap_px: int, temporal_size: int = 1, temporal_overlap: int = 0) -> None:
    """Raise ValueError (saying what to change) for tile ≤ 0, overlap < 0 or overlap ≥ tile."""
    if tile_px <= 0:
        raise ValueError(f"tile_size must be a positive number of pixels, got {tile_px}")
    if overlap_px < 0:
        raise ValueError(f"overlap must be >= 0 pixels, got {overlap_px}")
    if overlap_px >= tile_px:
        raise ValueError(f"overlap ({overlap_px} px) must be smaller than tile_size ({tile_px} px)")
    if temporal_size <= 0:
        raise ValueError(f"temporal_size must be a positive number of frames, got {temporal_size}")
    if temporal_overlap < 0 or temporal_overlap >= temporal_size:
        raise ValueError(f"temporal_overlap ({temporal_overlap} frames) must be >= 0 and smaller than "
                         f"temporal_size ({temporal_size} frames)")


def make_plan(vae: VAEShape, direction: str, in_dims: tuple[int, ...], tile_px: int, overlap_px: int,
              temporal_size: int = 64, temporal_overlap: int = 8, feather: float = DEFAULT_FEATHER) -> TilePlan:
    """Tile plan for one sample whose tiled dims (``[T,] H, W`` in input units: latent units for
    decode, pixels/frames for encode) are ``in_dims``.

    Spatial tile and overlap are ``tile_px // spatial_factor`` and ``overlap_px // spatial_factor``
    latent units. Time (video): not cut when ``vae.time_cache``; else temporal tiles of
    ``temporal_size`` frames overlapping by ``temporal_overlap`` frames (in latent frames).
    Raises ValueError for bad sizes (see :func:`check_tile_args`), a tile smaller than
    :data:`MIN_TILE_UNITS` latent units (naming the floor of ``tile_size``), or an input smaller
    than one latent unit.
    """
    check_tile_args(tile_px, overlap_px, temporal_size, temporal_overlap)
    s = vae.spatial_factor
    tile, overlap = tile_px // s, overlap_px // s
    if tile < MIN_TILE_UNITS:
        floor = MIN_TILE_UNITS * s
        raise ValueError(f"tile_size ({tile_px} px) is below the smallest tile this VAE can {direction}: {floor} px "
                         f"({MIN_TILE_UNITS} latent px at its {s}x compression; a tile of one latent px has no "
                         f"neighbour for the convolutions' padding): give tile_size {floor} or more")
    if overlap >= tile:
        raise ValueError(f"overlap ({overlap_px} px = {overlap} latent px) must be smaller than tile_size "
                         f"({tile_px} px = {tile} latent px)")
    amaps = amaps_for(vae, direction)
    grid = [m.grid_size(n) for m, n in zip(amaps, in_dims)]
    if any(g < 1 for g in grid):
        raise ValueError(f"input of size {tuple(in_dims)} is smaller than one latent unit "
                         f"(compression {s} px{'' if not vae.video else f', {vae.time_factor} frames'})")
    tiles, overlaps = [tile, tile], [overlap, overlap]
    if vae.video:
        k = vae.time_factor
        if vae.time_cache:
            tt, ot = grid[0], 0
        else:
            tt = max(1, (temporal_size - 1) // k + 1 if vae.causal_time else temporal_size // k)
            ot = min(temporal_overlap // k, tt - 1)
        tiles.insert(0, tt)
        overlaps.insert(0, ot)
    return plan_tiles(grid, tiles, overlaps, amaps, feather)


@dataclass(frozen=True)
class TimeChunks:
    """The tile function runs each tile in time chunks (a carried causal cache,
    :mod:`memorykit.time_carry`) of a model whose global context must still see the whole length
    (HunyuanVideo's decoder and encoder on ComfyUI 0.3.75: a mid-block attention and GroupNorms
    over all frames).

    ``whole_fn``: the same function in ONE forward over the whole length (the global-head capture
    and the statistics pre-pass run it); ``module``: the module that runs once per chunk (each of
    its forwards replays the whole length's GroupNorm statistics); ``frames``: input frames per
    chunk (dim 2); ``stats_share``: share (≤ 1) of one tile's area the statistics pre-pass
    runs at — it runs the whole length, not one chunk, so the caller lowers it where one tile's
    area over the whole length would not fit its memory budget (:func:`_stats_probe`; zoo,
    HunyuanVideo 0.3.75: 0.24 of core's error at 1, 0.35 at 2/3)."""

    whole_fn: Callable[[torch.Tensor], torch.Tensor]
    module: nn.Module
    frames: int
    stats_share: float = 1.0


def _stats_probe(x: torch.Tensor, plan: TilePlan, area_share: float = 1.0) -> tuple[torch.Tensor, tuple[int, int]]:
    """Input of the statistics pre-pass and its latent (height, width): ``x`` (one sample)
    restricted to the first tile on a time axis and downsampled so that its larger spatial
    side spans one tile — times ``sqrt(area_share)`` (≤ 1; :class:`TimeChunks`)."""
    spatial = range(len(plan.axes) - 2, len(plan.axes))
    f = min(1.0, max(plan.axes[d].length for d in spatial) / max(plan.axes[d].size for d in spatial))
    f *= min(1.0, max(0.0, area_share)) ** 0.5
    size, grid_hw, index = [], [], [slice(None), slice(None)]
    for d, a in enumerate(plan.axes):
        if d in spatial:
            g = max(1, round(a.size * f))
            grid_hw.append(g)
            size.append(a.amap.in_span(0, g)[1])
            index.append(slice(None))
        else:
            s, n = a.amap.in_span(a.starts[0], a.length)
            size.append(n)
            index.append(slice(s, s + n))
    return downsample_for_stats(x[tuple(index)], tuple(size)), tuple(grid_hw)


def _first_unit(x: torch.Tensor) -> torch.Tensor:
    """One latent pixel of ``x``: with a global head the tile's own input is not needed (the
    head's output is replaced by the crop), so the head's layers run on 1×1 instead."""
    return x[..., :1, :1]


def _spatial_weights(plan: TilePlan, idx: tuple[int, ...]) -> torch.Tensor:
    """``[h, w]`` blend weights of tile ``idx`` on the latent grid (encode: output = grid)."""
    a, b = plan.axes[-2], plan.axes[-1]
    return a.weights(idx[-2])[:, None] * b.weights(idx[-1])[None, :]


def run_tiled(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], plan: TilePlan, *,
              norm_stats: SharedGroupNormStats | None = None, head_module: nn.Module | None = None, head_scale: int = 1,
              head_store_device=None, head_stop: bool = False,
              tail_module: nn.Module | None = None, tail_scale: int = 1, tail_dummy: Callable[[torch.Tensor], torch.Tensor] | None = None,
              chunks: TimeChunks | None = None,
              on_step: Callable[[], None] | None = None, output_device=None) -> torch.Tensor:
    """Apply ``fn`` tile by tile and blend: one pass, each tile run once.

    ``x``: ``[B, C, *dims]`` with ``len(plan.axes)`` tiled dims, height and width last (input
    units; units beyond ``plan.in_shape`` are ignored). ``fn``: ``[1, C, *tile_in] →
    [1, C_out, *tile_out]`` (any device/dtype). Batch items run one at a time ("VAE slicing").
    With more than one tile, per item and in this order:

    - ``head_module`` (decode, see :class:`GlobalHead`): one run of ``fn`` on the whole item
      keeps that module's output (on ``head_store_device``, default ``output_device``); each
      tile gets its crop. ``head_scale``: its resolution vs the latent grid. Requires time not
      to be tiled. ``head_stop``: see :class:`GlobalHead` ``stop`` (tiles then run on their
      own input).
    - ``norm_stats``: a statistics pre-pass on a downsampled copy (see ``norm_stats.py``);
      every tile then normalises with those statistics.
    - the tiles, blended with the plan's weights;
    - ``chunks`` (see :class:`TimeChunks`): the head capture and the statistics pre-pass run
      ``chunks.whole_fn`` (the whole length in one forward; the pre-pass's probe at
      ``chunks.stats_share`` of a tile's area); in a tile, each chunk's head output is the
      captured output's crop for the tile's region and the chunk's own frames (a time cursor),
      and each chunk replays the statistics; a ``tail_module`` collects each chunk's frames at a
      time cursor and its final pass runs ``whole_fn``. A one-tile plan longer than one chunk takes this
      path too (its chunks need the whole length's context as well).
    - ``tail_module`` (encode, see :class:`GlobalTail`): tiles only collect that module's
      input; a last run of ``fn(tail_dummy(item))`` computes the output from the whole map.

    ``on_step`` runs after every pass (progress, interruption: an exception there aborts,
    hooks are removed). Returns ``[B, C_out, *plan.out_shape]`` float32 on ``output_device``
    (default ``x.device``). A one-tile plan (within one chunk) returns ``fn``'s output (as
    float32): bit-exact with untiled. Raises RuntimeError when ``fn`` returns a tile of the wrong size.
    """
    nd = len(plan.axes)
    if x.ndim != nd + 2:
        raise ValueError(f"input has {x.ndim} dims, the plan tiles {nd} (expected [B, C, {nd} dims])")
    need = plan.in_shape
    if any(have < n for have, n in zip(x.shape[2:], need)):
        raise ValueError(f"input dims {tuple(x.shape[2:])} are smaller than the plan needs {need}")
    if (head_module is not None or tail_module is not None) and nd == 3 and len(plan.axes[0].starts) > 1:
        raise ValueError("global context needs the whole time axis in every tile")
    if chunks is not None and (nd != 3 or len(plan.axes[0].starts) > 1):
        raise ValueError("time chunks need a video plan with the whole time axis in every tile")
    x = x[(slice(None), slice(None)) + tuple(slice(0, n) for n in need)]
    output_device = x.device if output_device is None else torch.device(output_device)
    use_stats = norm_stats is not None and norm_stats.available
    step = on_step or (lambda: None)
    out = None

    def put(b, outs, y, w):
        nonlocal out
        want = tuple(s.stop - s.start for s in outs)
        if tuple(y.shape[2:]) != want or y.shape[0] != 1:
            raise RuntimeError(f"the VAE returned a tile of shape {tuple(y.shape)}, expected [1, C, {want}]")
        if out is None:
            out = torch.zeros((x.shape[0], y.shape[1]) + plan.out_shape, dtype=torch.float32, device=output_device)
        y = y.to(device=output_device, dtype=torch.float32)
        view = out[(slice(b, b + 1), slice(None)) + outs]
        if w is None:
            view.copy_(y)
        else:
            view.addcmul_(y, w.to(output_device))

    whole = tuple(slice(0, n) for n in plan.out_shape)
    chunked = chunks is not None and x.shape[2] > chunks.frames
    once = chunks.whole_fn if chunked else fn  # the head capture and the statistics pre-pass
    for b in range(x.shape[0]):
        xb = x[b:b + 1]
        if plan.num_tiles == 1 and not chunked:
            put(b, whole, fn(xb), None)
            step()
            continue
        head = tail = None
        if head_module is not None:
            head = GlobalHead(head_module, store_device=head_store_device or output_device, scale=head_scale,
                              stop=head_stop)
            head.capture(lambda xb=xb: once(xb), plan.grid_shape[-2:])
            step()
        if tail_module is not None:
            tail = GlobalTail(tail_module, plan.grid_shape[-2:], store_device=output_device, scale=tail_scale)
        if use_stats:
            probe, probe_hw = _stats_probe(xb, plan, chunks.stats_share if chunked else 1.0)
            ctx = head.resized(probe_hw) if head else tail.skipping() if tail else contextlib.nullcontext()
            with norm_stats.recording(), ctx:
                once(_first_unit(probe) if head and not head_stop else probe)
            del probe
            step()
        with (norm_stats.replaying(chunks.module if chunked else None) if use_stats else contextlib.nullcontext()):
            for idx, grid, ins, outs in plan.tiles():
                if use_stats:
                    norm_stats.begin_forward()
                if head:
                    ctx = head.cropping(grid[-2], grid[-1], time_cursor=chunked)
                elif tail:
                    ctx = tail.collecting(grid[-2], grid[-1], _spatial_weights(plan, idx), time_cursor=chunked)
                else:
                    ctx = contextlib.nullcontext()
                xt = xb[(slice(None), slice(None)) + ins]
                with ctx:
                    y = fn(_first_unit(xt) if head and not head_stop else xt)
                if not tail:
                    put(b, outs, y, plan.weights(idx))
                del y
                step()
        if tail:
            with tail.finishing():
                put(b, whole, once(tail_dummy(xb)), None)
            del tail
            step()
    return out


def steps_for(plan: TilePlan, batch: int, shared_stats: bool, head: bool = False, tail: bool = False,
              chunked: bool = False) -> int:
    """Number of ``on_step`` calls :func:`run_tiled` makes (for a progress bar); ``chunked``: its
    ``chunks`` are given and the input is longer than one chunk."""
    if plan.num_tiles == 1 and not chunked:
        return batch
    return batch * (plan.num_tiles + int(shared_stats) + int(head) + int(tail))


# -- memory budget -------------------------------------------------------------------------------

@dataclass(frozen=True)
class TileCost:
    """Working memory of one tile: ``fixed_bytes + per_unit_bytes · units`` where ``units`` is the
    tile's latent pixels (height × width; a video tile's frames are folded into the cost).
    ``source``: ``"measured"`` (peak of probe tiles, :func:`measure_tile_cost`) or
    ``"modelled"`` (the VAE's own estimate)."""

    fixed_bytes: float
    per_unit_bytes: float
    source: str

    def bytes_for(self, units: int) -> float:
        return self.fixed_bytes + self.per_unit_bytes * units


def measure_tile_cost(fn: Callable[[torch.Tensor], torch.Tensor], make_probe: Callable[[int], torch.Tensor],
                      device: torch.device, sides: tuple[int, int] = (16, 32),
                      context: Callable[[], contextlib.AbstractContextManager] | None = None) -> TileCost:
    """Measure a tile's working memory on ``device``: run ``fn(make_probe(side))`` for two square
    probe tiles (``side`` latent units), each inside ``context()`` when given (e.g. the GroupNorm
    replay hooks the real tiles run under), and fit a line through their peaks (bytes above what
    was allocated before the call, see :func:`memorykit.peak_memory.peak_bytes`: CUDA's peak
    counter, which this resets, elsewhere the live tensor bytes of a dispatch mode).
    The per-unit cost is at least a quarter of the larger probe's average, so a small probe
    dominated by fixed costs cannot make large tiles look free.
    """
    peaks = []
    for side in sides:
        probe = make_probe(side)
        with context() if context is not None else contextlib.nullcontext():
            peaks.append(peak_bytes(lambda: fn(probe), device))
        del probe
    u0, u1 = (s * s for s in sides)
    per = max((peaks[1] - peaks[0]) / (u1 - u0), peaks[1] / u1 / 4)
    fixed = max(0.0, peaks[1] - per * u1)
    return TileCost(fixed, per, "measured")


def fit_tile(grid_hw: tuple[int, int], cost: TileCost, budget_bytes: float,
             max_tile: int, min_tile: int = 1) -> int | None:
    """Largest square spatial tile (latent units, ``min_tile..max_tile``) whose ``cost`` fits
    ``budget_bytes`` (bytes); a tile larger than the image counts only the image's units.
    None when not even ``min_tile`` fits."""
    lo, hi = max(1, min_tile), max(1, max_tile)
    for t in range(hi, lo - 1, -1):
        if cost.bytes_for(min(t, grid_hw[0]) * min(t, grid_hw[1])) <= budget_bytes:
            return t
    return None


def format_info(info: dict) -> str:
    """One-screen summary of the info dict the ComfyUI integration returns (figures in GiB)."""
    if info.get("deferred_to_core"):
        why = info.get("deferred_why", "the VAE's own tiling (handles_tiling)")
        return (f"Tiled VAE {info['direction']}: {info['vae']} not tiled from outside, ran VAE "
                f"{info['direction'].capitalize()} itself ({why}); {info['seconds']} s")
    p = info["plan"]
    gib = 2 ** 30
    lines = [
        (f"Tiled VAE {info['direction']}: {info['items']} item(s) × {info['tiles_per_item']} tile(s) "
         f"({' × '.join(map(str, p['tiles_per_axis']))}), tiles {'×'.join(map(str, info['tile_px']))} px "
         f"(limit {info['tile_limit_px']}), overlap {info['overlap_px']} px"),
        f"latent grid {p['grid_shape']}, tile {p['tile_shape']} latent units; time: {info['time']}",
        (f"shared GroupNorm stats: {'on' if info['shared_norm_stats'] else 'off'}; "
         f"global context: {info['global_context']}"),
        (f"budget {info['memory_budget_bytes'] / gib:.2f} GiB ({info['budget_source']}), tile ≈ "
         f"{info['tile_bytes_estimate'] / gib:.3f} GiB ({info['cost_source']}); {info['seconds']} s"),
    ]
    if info.get("core_ratio_note"):
        lines.append(info["core_ratio_note"])
    return "\n".join(lines)
