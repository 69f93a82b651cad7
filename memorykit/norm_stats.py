"""Shared GroupNorm statistics for tiled VAE passes (plain torch, no ComfyUI).

Why: a GroupNorm normalises with the mean/variance of *its input tensor*. Run on a tile, it
uses the tile's statistics instead of the whole image's, so each tile comes out with its own
brightness/colour offset — the visible colour shift of naive tiled VAEs. Fix: estimate the
whole image's statistics once and make every tile's GroupNorm use them.

How (the "fast mode" of pkuliyi2015/multidiffusion-upscaler-for-automatic1111's Tiled VAE,
also in shiimizu/ComfyUI-TiledDiffusion): downsample the whole input to about one tile's size
(nearest-exact, then restore each channel's mean/std so the value distribution is kept), run
it once through the model while forward pre-hooks record every GroupNorm's per-group
mean/variance, then run the tiles with forward hooks that replace each GroupNorm's output by
the normalisation with the recorded statistics. The pre-pass costs about one tile. Hooks are
PyTorch's own (``register_forward_pre_hook`` / ``register_forward_hook``) and are removed when
the context manager exits, also on error or interrupt; the module is otherwise untouched.
"""
from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn


class SharedGroupNormStats:
    """Record GroupNorm statistics in one forward, replay them in later forwards.

    ``module``: any ``nn.Module``; every ``nn.GroupNorm`` inside it (subclasses included, e.g.
    ComfyUI's ``ops.GroupNorm``) takes part. Statistics are kept per module *and per call*
    (a module run twice in one forward gets two entries); each replayed forward must call the
    modules in the same order and number as the recorded one — :meth:`begin_forward` resets
    the call counters. Statistics: float32 tensors of shape ``(batch, num_groups)``.
    """

    def __init__(self, module: nn.Module):
        self.norms = [m for m in module.modules() if isinstance(m, nn.GroupNorm)]
        self.stats: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.norms]
        self._calls = [0] * len(self.norms)

    @property
    def available(self) -> bool:
        """True when the module has at least one GroupNorm."""
        return bool(self.norms)

    @property
    def recorded_calls(self) -> int:
        return sum(len(s) for s in self.stats)

    def begin_forward(self) -> None:
        """Start a new replayed forward (call counters back to 0)."""
        self._calls = [0] * len(self.norms)

    @contextlib.contextmanager
    def recording(self):
        """Within the block, every GroupNorm call appends its input's statistics."""
        self.stats = [[] for _ in self.norms]
        handles = [m.register_forward_pre_hook(partial(self._record, i)) for i, m in enumerate(self.norms)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    @contextlib.contextmanager
    def replaying(self, restart_on: nn.Module | None = None):
        """Within the block, every GroupNorm normalises with the recorded statistics.

        ``restart_on``: a module whose every forward starts a new replayed forward
        (:meth:`begin_forward`) — a decoder run in time chunks (:mod:`memorykit.time_carry`) whose
        statistics were recorded on the whole length in one forward: every chunk replays them."""
        handles = [m.register_forward_hook(partial(self._replay, i)) for i, m in enumerate(self.norms)]
        if restart_on is not None:
            handles.append(restart_on.register_forward_pre_hook(lambda m, args: self.begin_forward()))
        self.begin_forward()
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    # -- hooks --------------------------------------------------------------------------------
    def _record(self, i: int, module: nn.GroupNorm, args):
        x = args[0]
        var, mean = _var_mean_f32(x.detach().reshape(x.shape[0], module.num_groups, -1), dim=-1)
        self.stats[i].append((mean.squeeze(-1), var.squeeze(-1)))

    def _replay(self, i: int, module: nn.GroupNorm, args, output):
        k = self._calls[i]
        self._calls[i] += 1
        if k >= len(self.stats[i]):
            raise RuntimeError(
                f"shared GroupNorm statistics: GroupNorm #{i} ran {k + 1} times in this forward but "
                f"{len(self.stats[i])} times in the statistics pre-pass; the model calls its norms "
                "differently per input size. Turn shared_norm_stats off for this VAE.")
        mean, var = self.stats[i][k]
        x = args[0]
        # Write into the GroupNorm's own output when nothing can need it (no autograd): the
        # replay then costs no memory beyond the plain forward. Out of place, the replaced
        # output and the new one are both alive: one extra activation per norm, which the
        # tile's memory budget would not see.
        reuse = (isinstance(output, torch.Tensor) and output.shape == x.shape and output.dtype == x.dtype
                 and output.device == x.device and output.data_ptr() != x.data_ptr()
                 and not (torch.is_grad_enabled() and (output.requires_grad or x.requires_grad)))
        return group_norm_with_stats(x, module, mean, var, out=output if reuse else None)


def group_norm_with_stats(x: torch.Tensor, norm: nn.GroupNorm, mean: torch.Tensor, var: torch.Tensor,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """GroupNorm of ``x`` (``[B, C, ...]``) with given per-group ``mean``/``var`` (``[B or 1, G]``).

    Computes ``x·a + b`` with per-channel ``a = w/sqrt(var+eps)``, ``b = bias - mean·a`` folded
    in float32 and applied in ``x``'s dtype with one ``addcmul``: one output-sized allocation,
    none when ``out`` (``x``'s shape and dtype, not aliasing ``x``) is given to write into.
    """
    b_, c = x.shape[0], x.shape[1]
    g = norm.num_groups
    rstd = torch.rsqrt(var.to(x.device) + norm.eps)                    # [B, G]
    a = rstd.repeat_interleave(c // g, dim=1)                          # [B, C]
    shift = (-mean.to(x.device) * rstd).repeat_interleave(c // g, dim=1)
    if norm.weight is not None:
        w = norm.weight.detach().to(device=x.device, dtype=torch.float32)
        a, shift = a * w, shift * w
    if norm.bias is not None:
        shift = shift + norm.bias.detach().to(device=x.device, dtype=torch.float32)
    if a.shape[0] != b_:
        a, shift = a.expand(b_, -1), shift.expand(b_, -1)
    view = (b_, c) + (1,) * (x.ndim - 2)
    return torch.addcmul(shift.to(x.dtype).reshape(view), x, a.to(x.dtype).reshape(view), out=out)


def _var_mean_f32(x: torch.Tensor, dim, chunk_dim: int = 1, chunk: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.var_mean(x, dim, correction=0)`` computed in float32 without a float32 copy of
    all of a half-precision ``x`` (converted ``chunk`` slices of ``chunk_dim`` at a time)."""
    if x.dtype == torch.float32:
        return torch.var_mean(x, dim=dim, correction=0, keepdim=True)
    parts = [torch.var_mean(c.float(), dim=dim, correction=0, keepdim=True) for c in x.split(chunk, chunk_dim)]
    return torch.cat([p[0] for p in parts], chunk_dim), torch.cat([p[1] for p in parts], chunk_dim)


def channel_stats(x: torch.Tensor, per_sample: bool = False) -> tuple[torch.Tensor, ...]:
    """Per-channel (``per_sample``: per sample and channel) ``(std, mean, min, max)`` of ``x``
    (``[B, C, *dims]``) in float32, shaped to broadcast against ``x``."""
    dims = ([] if per_sample else [0]) + list(range(2, x.ndim))
    var, mean = _var_mean_f32(x, dim=dims)
    return var.sqrt(), mean, x.amin(dim=dims, keepdim=True).float(), x.amax(dim=dims, keepdim=True).float()


def downsample_for_stats(x: torch.Tensor, size: tuple[int, ...], per_sample: bool = False,
                         stats: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """``x`` (``[B, C, *dims]``) resized to ``size`` (one entry per dim) for the statistics pre-pass.

    Nearest-exact resampling (keeps the values' distribution, unlike averaging, which shrinks
    the variance of noisy latents), then each channel's mean and std are set back to the
    original's and values clamped to the original's range (Kahsolt's distribution-shift fix in
    pkuliyi2015's Tiled VAE). ``per_sample``: statistics per sample and channel (else per
    channel over the batch); ``stats``: :func:`channel_stats` of ``x`` if already known (saves
    a pass over a large ``x``). Computed in float32; returns ``x``'s dtype.
    """
    if tuple(x.shape[2:]) == tuple(size):
        return x
    std_old, mean_old, lo, hi = stats if stats is not None else channel_stats(x, per_sample)
    small = F.interpolate(x, size=tuple(size), mode="nearest-exact").float()
    std_new, mean_new, _, _ = channel_stats(small, per_sample)
    small = (small - mean_new) / std_new.clamp_min(1e-6) * std_old.to(small.device) + mean_old.to(small.device)
    small = torch.minimum(torch.maximum(small, lo.to(small.device)), hi.to(small.device))
    return small.to(x.dtype)
