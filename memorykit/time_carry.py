"""Exact time chunking of causal video decoders: a carried time cache (plain torch, no ComfyUI).

Why: a causal video decoder's output frame ``t`` depends on latent frames ``≤ t`` only, but each
causal 3-D convolution pads the *start of its input* (by repeating the first frame or with
zeros) — cut time into independent chunks and every chunk's first frames see that padding
instead of the previous chunk, and a time upsampler that treats the first latent frame as an
image frame (``k·(l−1)+1`` frames from ``l``) does so again at every chunk. Wan's decoder
avoids this with its own ``feat_cache``; :class:`TimeCarry` gives any decoder built only of
frame-local layers, causal time convolutions and causal time upsamplers the same, from the
outside:

- each **link** module (a causal conv, a causal upsampler) gets, on every chunk after the
  first, the last ``context`` input frames of the previous chunk prepended to its input
  (PyTorch forward pre-hook); it pads and runs as it always does, and the output frames that
  belong to the prepended frames (``expansion·n − first_drop`` for ``n`` prepended frames) are
  cut from its output (forward hook). The padding then only ever reaches cut frames, so every
  kept frame saw exactly the frames the untiled forward gives it: the result equals the whole
  forward (to float rounding), whatever the padding mode, as long as every other layer is
  frame-local (per-frame norms, 1×1 convs, pointwise ops).
- the first chunk runs untouched (the module's own first-frame padding, as untiled).

Memory: one chunk's activations plus ``context`` frames per link. Hooks are removed when
:meth:`TimeCarry.run` returns or raises (interrupts included); the modules are not changed.
Same idea as Wan's ``feat_cache`` (comfy/ldm/wan/vae.py, ``CACHE_T = 2``) and the
``conv_carry`` chunks of ComfyUI 0.33's HunyuanVideo decoder.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Link:
    """One module that needs the previous chunk's frames.

    ``context``: input frames it reads before each frame (``(kernel_t − 1)·dilation`` for a
    causal conv of time stride 1). ``expansion``: output frames per input frame (1 for a conv,
    ``k`` for a ×k time upsampler). ``first_drop``: output frames the module drops at the
    start of its input (``k − 1`` for a depth-to-space upsampler that keeps only the last of
    the first frame's ``k``; 0 for a conv). A causal conv of time stride 2 and kernel 3 padded
    2 frames before (HunyuanVideo's ``Downsample``) is context 1: its first output reads the
    padding and the prepended frame and is cut, the next ones are the whole input's — where
    every chunk boundary of its input minus 1 is even (the caller's chunk sizes, see
    :meth:`TimeCarry.run` ``first``)."""

    module: nn.Module
    context: int
    expansion: int = 1
    first_drop: int = 0


class TimeCarry:
    """Run ``fn`` (a decoder over ``[B, C, T, ...]``) chunk by chunk along dim 2, exactly.

    ``links``: every module of the decoder that mixes frames (see :class:`Link`); the caller
    guarantees all other layers are frame-local. Raises ValueError for a link with
    ``context < 1`` or ``expansion < 1``."""

    def __init__(self, links: list[Link]):
        for lk in links:
            if lk.context < 1 or lk.expansion < 1 or not 0 <= lk.first_drop < lk.expansion + lk.context:
                raise ValueError(f"bad time link {lk}")
        self.links = list(links)
        self._first = True
        self._cache: list[torch.Tensor | None] = [None] * len(self.links)
        self._added: list[int] = [0] * len(self.links)

    def _pre(self, i: int, module, args):
        x = args[0]
        lk = self.links[i]
        self._added[i] = 0
        if not self._first:
            c = self._cache[i]
            if c is None:
                raise RuntimeError(f"time carry: {type(module).__name__} ran in this chunk but not in the first")
            self._added[i] = c.shape[2]
            x = torch.cat([c.to(x.dtype), x], dim=2)
        self._cache[i] = x[:, :, -lk.context:].clone()
        return (x,) + tuple(args[1:])

    def _post(self, i: int, module, args, out):
        n = self._added[i]
        if n == 0:
            return out
        lk = self.links[i]
        return out[:, :, lk.expansion * n - lk.first_drop:]

    def run(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, chunk: int,
            on_chunk: Callable[[], None] | None = None, first: int | None = None) -> torch.Tensor:
        """``fn(x)`` computed ``chunk`` frames of dim 2 at a time, outputs concatenated on dim 2.

        ``chunk`` ≥ 1 (frames of dim 2); ``first``: frames of the first chunk when not ``chunk``
        (an encoder of causal time compression k: ``1 + k·(m − 1)`` frames, then ``k·m``). With
        one chunk ``fn(x)`` runs unhooked (bit-exact). ``on_chunk`` runs after each chunk (an
        exception there aborts; hooks are removed)."""
        first = chunk if first is None else first
        if chunk < 1 or first < 1:
            raise ValueError(f"time chunk must be at least 1 frame, got {chunk} (first {first})")
        if x.shape[2] <= first:
            return fn(x)
        handles = []
        self._first, self._cache, self._added = True, [None] * len(self.links), [0] * len(self.links)
        try:
            for i, lk in enumerate(self.links):
                handles.append(lk.module.register_forward_pre_hook(lambda m, a, i=i: self._pre(i, m, a)))
                # prepend: the cut runs before any other hook on the module (a global head's
                # replacement then gets, and gives, the chunk's own frames)
                handles.append(lk.module.register_forward_hook(lambda m, a, o, i=i: self._post(i, m, a, o), prepend=True))
            outs = []
            for s, e in zip([0] + list(range(first, x.shape[2], chunk)), range(first, x.shape[2] + chunk, chunk)):
                outs.append(fn(x[:, :, s:e]))
                self._first = False
                if on_chunk is not None:
                    on_chunk()
            return torch.cat(outs, dim=2)
        finally:
            for h in handles:
                h.remove()
            self._cache = [None] * len(self.links)
