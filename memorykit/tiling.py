"""Tile planning and feathered blending for tiled VAE decode/encode (plain torch, no ComfyUI).

Coordinates. Every axis is planned on the **latent grid** (one unit = one latent pixel, or one
latent frame on a video VAE's time axis), whichever way the VAE runs. An :class:`AxisMap` turns
a span of grid units into the span the tile function reads (its input) and the span it writes
(its output): a decoder reads latent units and writes pixels (``AxisMap.up(8)``), an encoder
reads pixels and writes latent units (``AxisMap.down(8)``). Causal video VAEs (Wan, LTXV,
Hunyuan Video, ...) map ``l`` latent frames to ``k·(l-1)+1`` frames (the first latent frame is
one image frame); ``AxisMap.up(k, causal=True)`` / ``down(k, causal=True)`` model that.

Blending. Tiles along an axis are spaced evenly, each ``tile`` grid units long, neighbours
sharing at least ``overlap`` units. A tile's pixels next to its own border are the least
reliable (the convolutions there saw zero padding instead of the neighbour's content), so each
seam sits at the *centre* of the overlap and the two tiles cross-fade linearly over a band of
``feather`` output units around it; outside that band a pixel comes from one tile only. The
1-D weights of the two tiles at a seam sum to 1 and tiles form a full grid, so the product
weights of all tiles sum to exactly 1 everywhere: one pass, no normalisation buffer. (ComfyUI's
core ``tiled_scale`` instead ramps across the whole overlap, from the tile border, and averages
three full passes with different tile shapes.)
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AxisMap:
    """Map from latent-grid spans to the tile function's input and output spans on one axis.

    ``factor``: compression of the VAE on this axis (8 for SD's height/width, 4 for Wan's time).
    ``direction``: ``"up"`` (decode: grid → larger output) or ``"down"`` (encode: larger input →
    grid). ``causal``: ``l`` grid units correspond to ``factor·(l-1)+1`` input/output units
    (causal video VAEs' time axis); otherwise to ``factor·l``.
    """

    factor: int
    direction: str = "up"
    causal: bool = False

    @staticmethod
    def up(factor: int, causal: bool = False) -> AxisMap:
        return AxisMap(int(factor), "up", causal)

    @staticmethod
    def down(factor: int, causal: bool = False) -> AxisMap:
        return AxisMap(int(factor), "down", causal)

    def _scaled(self, start: int, length: int) -> tuple[int, int]:
        k = self.factor
        return k * start, (k * (length - 1) + 1) if self.causal else k * length

    def in_span(self, start: int, length: int) -> tuple[int, int]:
        """(start, length) the tile function reads for grid span (start, length)."""
        return self._scaled(start, length) if self.direction == "down" else (start, length)

    def out_span(self, start: int, length: int) -> tuple[int, int]:
        """(start, length) the tile function writes for grid span (start, length)."""
        return self._scaled(start, length) if self.direction == "up" else (start, length)

    def grid_size(self, in_size: int) -> int:
        """Grid units covered by an input of ``in_size`` units (extra input units are dropped)."""
        if self.direction == "up":
            return in_size
        if self.causal:
            return (in_size - 1) // self.factor + 1 if in_size > 0 else 0
        return in_size // self.factor


def plan_axis(n: int, tile: int, overlap: int) -> tuple[list[int], int]:
    """Tiles covering ``[0, n)``: ``(starts, length)`` in grid units.

    The fewest tiles of at most ``tile`` units that overlap by at least ``overlap`` units; then
    all made the same, smallest length that still covers ``n`` with that overlap, and spread
    evenly (so the total work is as small as possible: for n = 256, tile 64, overlap 8 that is
    5 tiles of 58, 1.28× the pixels of the image, where 5 tiles of 64 would be 1.56×).
    ``n <= tile`` gives one tile. Raises ValueError for ``n < 1``, ``tile < 1``,
    ``overlap < 0`` or ``overlap >= tile``.
    """
    if tile < 1:
        raise ValueError(f"tile must be at least 1 latent unit, got {tile}")
    if overlap < 0:
        raise ValueError(f"overlap must be >= 0, got {overlap}")
    if overlap >= tile:
        raise ValueError(f"overlap ({overlap}) must be smaller than the tile ({tile}) (latent units)")
    if n < 1:
        raise ValueError(f"axis of size {n}: nothing to tile")
    if n <= tile:
        return [0], n
    count = math.ceil((n - overlap) / (tile - overlap))
    length = min(tile, math.ceil((n + (count - 1) * overlap) / count))
    return [round(i * (n - length) / (count - 1)) for i in range(count)], length


def _ramp(x: torch.Tensor, centre: float, width: float) -> torch.Tensor:
    """0 → 1 linear ramp over ``[centre - width/2, centre + width/2]`` at pixel centres ``x + 0.5``."""
    if width <= 0:
        return (x + 0.5 >= centre).to(torch.float32)
    return ((x + 0.5 - (centre - width / 2)) / width).clamp(0.0, 1.0)


@dataclass
class AxisPlan:
    """Tiles of one axis. ``starts``/``length`` in grid units; ``amap`` maps them; ``seams`` is one
    ``(centre, width)`` pair (output units) per neighbouring pair of tiles."""

    size: int
    length: int
    starts: list[int]
    amap: AxisMap
    seams: list[tuple[float, float]] = field(default_factory=list)

    @property
    def out_size(self) -> int:
        s, n = self.amap.out_span(self.starts[-1], self.length)
        return s + n

    def weights(self, i: int) -> torch.Tensor:
        """1-D blend weights (float32, length of tile ``i``'s output span) of tile ``i``."""
        s, n = self.amap.out_span(self.starts[i], self.length)
        x = torch.arange(s, s + n, dtype=torch.float32)
        w = torch.ones(n, dtype=torch.float32)
        if i > 0:
            w = w * _ramp(x, *self.seams[i - 1])
        if i < len(self.starts) - 1:
            w = w * (1.0 - _ramp(x, *self.seams[i]))
        return w


def plan_axis_full(size: int, tile: int, overlap: int, amap: AxisMap, feather: float) -> AxisPlan:
    """Plan one axis: tile starts (see :func:`plan_axis`) and, per seam, the cross-fade band.

    ``feather``: fraction (0..1) of each overlap, in output units, over which the two tiles
    cross-fade; the band is centred in the overlap and narrowed where needed so that no pixel
    falls in two bands (band ≤ tile stride). Raises ValueError as :func:`plan_axis`.
    """
    starts, length = plan_axis(size, tile, overlap)
    plan = AxisPlan(size, length, starts, amap)
    spans = [amap.out_span(s, length) for s in starts]
    strides = [spans[i + 1][0] - spans[i][0] for i in range(len(spans) - 1)]
    for i in range(len(spans) - 1):
        lo, hi = spans[i + 1][0], spans[i][0] + spans[i][1]  # output overlap [lo, hi)
        width = min(feather * (hi - lo), min(strides))
        plan.seams.append(((lo + hi) / 2.0, float(width)))
    return plan


@dataclass
class TilePlan:
    """Tiles of a whole (one-sample) input: the Cartesian product of per-axis plans.

    ``axes``: one :class:`AxisPlan` per tiled axis, in tensor order (time first for video).
    """

    axes: list[AxisPlan]

    @property
    def num_tiles(self) -> int:
        return math.prod(len(a.starts) for a in self.axes)

    @property
    def grid_shape(self) -> tuple[int, ...]:
        return tuple(a.size for a in self.axes)

    @property
    def tile_shape(self) -> tuple[int, ...]:
        return tuple(a.length for a in self.axes)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(a.out_size for a in self.axes)

    @property
    def in_shape(self) -> tuple[int, ...]:
        """Input units the plan reads per axis (the rest of a larger input is ignored)."""
        out = []
        for a in self.axes:
            s, n = a.amap.in_span(a.starts[-1], a.length)
            out.append(s + n)
        return tuple(out)

    def tiles(self):
        """Yield ``(index, grid_slices, in_slices, out_slices)`` per tile; slices cover the tiled
        axes only (grid units, the tile function's input units, its output units)."""
        for idx in itertools.product(*(range(len(a.starts)) for a in self.axes)):
            grid, ins, outs = [], [], []
            for a, i in zip(self.axes, idx):
                grid.append(slice(a.starts[i], a.starts[i] + a.length))
                s, n = a.amap.in_span(a.starts[i], a.length)
                ins.append(slice(s, s + n))
                s, n = a.amap.out_span(a.starts[i], a.length)
                outs.append(slice(s, s + n))
            yield idx, tuple(grid), tuple(ins), tuple(outs)

    def weights(self, idx: tuple[int, ...]) -> torch.Tensor:
        """Blend weights of tile ``idx``: the outer product of the per-axis weights (float32)."""
        w = torch.ones((), dtype=torch.float32)
        for d, (a, i) in enumerate(zip(self.axes, idx)):
            shape = [1] * len(self.axes)
            shape[d] = -1
            w = w * a.weights(i).reshape(shape)
        return w

    def describe(self) -> dict:
        """JSON-serialisable summary (grid units unless named ``out_``)."""
        return {
            "grid_shape": list(self.grid_shape),
            "tile_shape": list(self.tile_shape),
            "tiles_per_axis": [len(a.starts) for a in self.axes],
            "num_tiles": self.num_tiles,
            "starts": [list(a.starts) for a in self.axes],
            "out_shape": list(self.out_shape),
            "seams": [[[round(c, 2), round(w, 2)] for c, w in a.seams] for a in self.axes],
        }


def plan_tiles(grid_shape, tile, overlap, amaps, feather: float = 0.5) -> TilePlan:
    """Plan tiles over ``grid_shape`` (grid units per axis).

    ``tile``/``overlap``: per-axis sequences (grid units); ``amaps``: per-axis :class:`AxisMap`;
    ``feather``: fraction of each overlap used for the cross-fade (0 = hard seam at the centre
    of the overlap, 1 = the whole overlap). Raises ValueError on a bad tile/overlap/feather.
    """
    if not 0.0 <= feather <= 1.0:
        raise ValueError(f"feather must be in [0, 1], got {feather}")
    if not (len(grid_shape) == len(tile) == len(overlap) == len(amaps)):
        raise ValueError("grid_shape, tile, overlap and amaps need one entry per axis")
    return TilePlan([plan_axis_full(n, t, o, m, feather) for n, t, o, m in zip(grid_shape, tile, overlap, amaps)])
