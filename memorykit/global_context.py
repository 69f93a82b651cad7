"""Global low-resolution context for tiled VAEs (plain torch, no ComfyUI).

A VAE decoder starts at the latent resolution with a "middle" block (ResNet blocks around a
self-attention over *all* latent positions) and only then upsamples; an encoder ends with the
same kind of block. Attention is global: run on a tile it attends to the tile only, and no
overlap fixes that. But at the latent resolution the block is cheap (SD at 2048²: 256² latent
positions × 512 channels, ≈ 64 MiB per activation in bf16 — a small fraction of one 512² tile's
working memory at full resolution). So:

- :class:`GlobalHead` (decode): run the decoder once on the whole latent up to the end of the
  middle block and keep that output (on the output device); every tile's forward then gets
  the crop of it for its own latent region instead of computing the middle block on the tile.
  The capture run hands the rest of the decoder a 1×1 crop, so the upsampling part costs
  nothing there.
- :class:`GlobalTail` (encode): each tile runs the encoder's downsampling part only (the tail
  gets a 1×1 crop); its input to the middle block is blended into one latent-resolution
  feature map with the tiles' weights; one last run feeds that map to the middle block and
  the output layers (the downsampling part runs on a one-latent-pixel dummy input).

Both work through forward (pre-)hooks on one module named by the caller (the split point),
removed when each context manager exits. A module called once per latent frame (Wan's causal
time chunks) gets one entry per call, matched by call order.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from .norm_stats import channel_stats, downsample_for_stats


def _crop(t: torch.Tensor, hs: slice, ws: slice) -> torch.Tensor:
    return t[..., hs, ws]


class _Calls:
    def __init__(self):
        self.k = 0

    def next(self) -> int:
        k, self.k = self.k, self.k + 1
        return k


class _Captured(Exception):
    """Raised by a ``stop`` head's hook once its output is kept: ends the capture run."""


class GlobalContextMismatch(RuntimeError):
    """The model ran the head/tail module differently on the whole input than on a tile (another
    number of calls, or calls of other lengths outside the last two dims — e.g. a decoder that
    splits a large activation in time, as 0.33's LTX-Video does past its chunk size): the captured
    context does not fit the tile. The caller runs the tiles without global context instead."""


class GlobalHead:
    """Output of ``module`` (last two dims = latent height/width) computed on the whole input.

    ``store_device``: where captured outputs are kept (default: where they were computed);
    ``scale``: resolution of the output relative to the latent grid (1 = latent resolution,
    2 = after one 2× upsampling). ``stop``: the module runs once per forward and the capture run
    ends right after it (an exception the capture catches) instead of continuing on a 1×1 crop —
    for decoders whose later layers cannot run on a stand-in (LTX-Video's writes into an output
    buffer sized from its input); their tiles then run the head's layers on their own input.
    """

    def __init__(self, module: nn.Module, store_device=None, scale: int = 1, stop: bool = False):
        self.module = module
        self.scale = int(scale)
        self.stop = bool(stop)
        self.store_device = store_device
        self.outputs: list[torch.Tensor] = []
        self.stats: list[tuple[torch.Tensor, ...]] = []
        self.calls = _Calls()

    @contextlib.contextmanager
    def _hook(self, fn: Callable[[int, torch.Tensor], torch.Tensor]):
        self.calls = _Calls()
        h = self.module.register_forward_hook(lambda m, args, out: fn(self.calls.next(), out))
        try:
            yield self
        finally:
            h.remove()

    def capture(self, run: Callable[[], object], grid_hw: tuple[int, int]) -> None:
        """Call ``run()`` (the tile function on the whole input) once, keeping every output of
        ``module``; the rest of the forward continues on a 1×1 crop and its result is dropped.
        Raises RuntimeError when the output is not on the ``grid_hw`` latent grid."""
        self.outputs, self.stats = [], []
        grid_hw = tuple(n * self.scale for n in grid_hw)

        def keep(k, out):
            if out.numel() == 0:  # a decoder that splits its activations may run a module on an empty chunk
                raise GlobalContextMismatch(f"{type(self.module).__name__} ran on an empty chunk {tuple(out.shape)}")
            if tuple(out.shape[-2:]) != grid_hw:
                raise RuntimeError(f"global context: {type(self.module).__name__} returned {tuple(out.shape)}, "
                                   f"expected the latent grid {tuple(grid_hw)} in its last two dims")
            flat = out.detach().reshape((-1,) + tuple(out.shape[-3:]))
            self.stats.append(channel_stats(flat, per_sample=True))  # where it was computed: fast
            self.outputs.append(out.detach().to(self.store_device or out.device))
            if self.stop:
                raise _Captured()
            return out[..., :1, :1]

        with self._hook(keep):
            try:
                run()
            except _Captured:
                pass

    def resized(self, hw: tuple[int, int]):
        """Context: ``module`` returns the captured output resized (nearest-exact) to ``hw``."""
        hw = tuple(n * self.scale for n in hw)

        def give(k, out):
            k = min(k, len(self.outputs) - 1)
            g = self.outputs[k]
            lead = g.shape[:-2]
            g = downsample_for_stats(g.reshape((-1,) + tuple(g.shape[-3:])), hw, per_sample=True, stats=self.stats[k])
            return g.reshape(tuple(lead) + hw).to(device=out.device, dtype=out.dtype)
        return self._hook(give)

    def cropping(self, hs: slice, ws: slice, time_cursor: bool = False):
        """Context: ``module`` returns the captured output's crop ``[..., hs, ws]`` (one tile).

        ``time_cursor``: the tile runs in time chunks (``[B, C, T, H, W]``, a carried cache,
        :mod:`memorykit.time_carry`) while the capture ran the whole length in one forward (a
        head whose layers see all frames, e.g. a mid-block attention over time): each call takes
        the next ``T`` frames (``T`` = the frames the module returns in that chunk, consecutive
        with the carry) of the one captured output. Raises :class:`GlobalContextMismatch` when
        more than one output was captured, the chunks ask for more frames than it has, or the
        tile ends with frames left over."""
        r = self.scale
        hs, ws = slice(hs.start * r, hs.stop * r), slice(ws.start * r, ws.stop * r)
        if time_cursor:
            return self._cursor(hs, ws)

        def give(k, out):
            if k >= len(self.outputs):
                raise GlobalContextMismatch(f"{type(self.module).__name__} ran {k + 1} times in a tile, "
                                            f"{len(self.outputs)} times on the whole input")
            if tuple(self.outputs[k].shape[:-2]) != tuple(out.shape[:-2]):  # a stop head saw only part of it
                raise GlobalContextMismatch(f"{type(self.module).__name__} returned {tuple(out.shape[:-2])} (before "
                                            f"height, width) in a tile, {tuple(self.outputs[k].shape[:-2])} on the whole input")
            return _crop(self.outputs[k], hs, ws).to(device=out.device, dtype=out.dtype)
        return self._hook(give)


    @contextlib.contextmanager
    def _cursor(self, hs: slice, ws: slice):
        name = type(self.module).__name__
        if len(self.outputs) != 1 or self.outputs[0].ndim != 5:
            raise GlobalContextMismatch(f"{name}: a time cursor needs one captured [B, C, T, H, W] output, got "
                                        f"{[tuple(o.shape) for o in self.outputs]}")
        g, at = self.outputs[0], [0]

        def give(k, out):
            n = out.shape[2]
            if out.ndim != 5 or tuple(out.shape[:2]) != tuple(g.shape[:2]) or at[0] + n > g.shape[2]:
                raise GlobalContextMismatch(f"{name} returned {tuple(out.shape)} in chunk {k + 1} of a tile (frames "
                                            f"{at[0]}..{at[0] + n}); the whole input gave {tuple(g.shape)}")
            y = g[:, :, at[0]:at[0] + n, hs, ws]
            at[0] += n
            return y.to(device=out.device, dtype=out.dtype)
        with self._hook(give):
            yield self
        if at[0] != g.shape[2]:
            raise GlobalContextMismatch(f"{name}: a tile's chunks used {at[0]} of the {g.shape[2]} frames captured")

class GlobalTail:
    """Input of ``module`` (last two dims = latent height/width) assembled from tiles, then the
    module and everything after it run once on the whole map.

    ``grid_hw``: latent grid (height, width) of the whole input; ``store_device``: where the
    blended map is kept (float32); ``scale``: resolution of the module's input relative to the
    latent grid (1, or 2 before the encoder's last 2× downsampling).
    """

    def __init__(self, module: nn.Module, grid_hw: tuple[int, int], store_device=None, scale: int = 1):
        self.module = module
        self.scale = int(scale)
        self.grid_hw = tuple(n * self.scale for n in grid_hw)
        self.store_device = store_device
        self.maps: list[torch.Tensor] = []
        self.calls = _Calls()

    @contextlib.contextmanager
    def _pre_hook(self, fn: Callable[[int, torch.Tensor], torch.Tensor]):
        self.calls = _Calls()
        h = self.module.register_forward_pre_hook(
            lambda m, args: (fn(self.calls.next(), args[0]),) + tuple(args[1:]))
        try:
            yield self
        finally:
            h.remove()

    def _small(self, x: torch.Tensor) -> torch.Tensor:
        # one latent pixel's worth (scale × scale: a 2× downsampling conv needs at least 2×2)
        return x[..., :self.scale, :self.scale]

    def skipping(self):
        """Context: ``module`` and everything after it run on one latent pixel (statistics pre-pass)."""
        return self._pre_hook(lambda k, x: self._small(x))

    def collecting(self, hs: slice, ws: slice, weights: torch.Tensor, time_cursor: bool = False):
        """Context for one tile at latent rows ``hs`` / columns ``ws``: ``module``'s input is
        added, times ``weights`` (``[h, w]`` float32, latent grid), into the whole map; the rest
        of the forward continues on one latent pixel's worth of it. ``time_cursor``: the tile
        runs in time chunks (``[B, C, T, H, W]``, a carried cache) and the final pass runs the
        whole length once: each call's frames go to the next frames of one map (dim 2)."""
        r = self.scale
        hs, ws = slice(hs.start * r, hs.stop * r), slice(ws.start * r, ws.stop * r)
        weights = weights.repeat_interleave(r, 0).repeat_interleave(r, 1)
        at = [0]

        def take(k, x):
            if tuple(x.shape[-2:]) != (hs.stop - hs.start, ws.stop - ws.start):
                raise RuntimeError(f"global context: input of {type(self.module).__name__} is {tuple(x.shape)}, "
                                   f"expected the tile's latent size {(hs.stop - hs.start, ws.stop - ws.start)}")
            dev = self.store_device or x.device
            if time_cursor:
                k, t0 = 0, at[0]
                at[0] += x.shape[2]
                if self.maps and self.maps[0].shape[2] < at[0]:  # the first tile's chunks grow the map
                    grow = torch.zeros(tuple(x.shape[:2]) + (at[0] - self.maps[0].shape[2],) + self.grid_hw,
                                       dtype=torch.float32, device=dev)
                    self.maps[0] = torch.cat([self.maps[0], grow], 2)
            while len(self.maps) <= k:
                self.maps.append(torch.zeros(tuple(x.shape[:-2]) + self.grid_hw, dtype=torch.float32, device=dev))
            view = self.maps[k][:, :, t0:at[0]] if time_cursor else self.maps[k]
            view[..., hs, ws].addcmul_(x.to(device=dev, dtype=torch.float32), weights.to(dev))
            return self._small(x)
        return self._pre_hook(take)

    def finishing(self):
        """Context: ``module``'s input is replaced by the assembled map — call by call, or for
        video maps (``[B, C, T, h, w]``) frame range by frame range: the k-th call in the final
        pass gets the next ``T_k`` frames of the maps joined in time. A model that splits time
        into chunks by the frame size (0.33's LTX-Video encoder: chunk length from the bytes of
        one frame) runs the module in other chunks on the small final input than on a tile; the
        chunks are consecutive in time, so the frames line up either way. Raises
        :class:`GlobalContextMismatch` when the final pass asks for more frames (or calls) than
        the tiles gave, or, on leaving, when it used fewer."""
        video = bool(self.maps) and all(m.ndim == 5 for m in self.maps) and \
            len({tuple(m.shape[:2]) for m in self.maps}) == 1
        total = sum(m.shape[2] for m in self.maps) if video else len(self.maps)
        used = _Calls()

        def frames(lo: int, hi: int) -> torch.Tensor:
            parts, start = [], 0
            for m in self.maps:
                a, b = max(lo, start), min(hi, start + m.shape[2])
                if a < b:
                    parts.append(m[:, :, a - start:b - start])
                start += m.shape[2]
            return parts[0] if len(parts) == 1 else torch.cat(parts, 2) if parts else self.maps[0][:, :, :0]

        def give(k, x):
            n = x.shape[2] if video and x.ndim == 5 else 1
            lo = used.k
            used.k += n
            if used.k > total:
                raise GlobalContextMismatch(f"{type(self.module).__name__} asked for {used.k} "
                                            f"{'frames' if video else 'calls'} in the final pass, the tiles gave {total}")
            g = frames(lo, lo + n) if video and x.ndim == 5 else self.maps[k]
            return g.to(device=x.device, dtype=x.dtype)

        @contextlib.contextmanager
        def checked():
            with self._pre_hook(give):
                yield self
            if used.k != total:
                raise GlobalContextMismatch(f"{type(self.module).__name__} used {used.k} of {total} "
                                            f"{'frames' if video else 'calls'} of the tiles' map in the final pass")
        return checked()
