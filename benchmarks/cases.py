"""Benchmark cases. Each case builds its own copy of the model, prepares it, and returns the
callable to time plus what it streams.

A case is ``Case(name, group, prepare, gpu_only)``: ``prepare(ctx)`` returns a ``Prepared``
(``fn`` to call with the forward inputs, ``streamed_bytes`` per forward (weights moved
host→device per forward; 0 when resident), ``cleanup``). ``gpu_only`` holds the reason a case
cannot run on a CPU, or None.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from . import model as bm

CUDA_STREAMS = "needs CUDA: streams/prefetch and VRAM budgets have no meaning on a CPU"


@dataclass
class Ctx:
    depth: int
    single: int
    dtype: torch.dtype
    device: torch.device
    tmpdir: str
    tiny: bool = False  # the runbook dry run's narrow model (benchmarks.model.TINY): checks the harness only


@dataclass
class Prepared:
    fn: Callable
    streamed_bytes: int = 0
    extra: dict = field(default_factory=dict)
    cleanup: Callable = lambda: None


@dataclass
class Case:
    name: str
    group: str  # "baseline" (ComfyUI core / plain diffusers) or "memorykit"
    prepare: Callable[[Ctx], Prepared]
    gpu_only: str | None = None


def _build(ctx: Ctx, **kw):
    return bm.build(ctx.depth, ctx.single, ctx.dtype, ctx.device, tiny=ctx.tiny, **kw)


def resident(ctx: Ctx) -> Prepared:
    m = _build(ctx)
    dm = m.diffusion_model.to(ctx.device)
    return Prepared(dm, 0, {"weights_bytes": bm.param_bytes(dm)})


def comfy_lowvram(frac: float):
    def prepare(ctx: Ctx) -> Prepared:
        import comfy.model_patcher
        m = _build(ctx)
        nbytes = bm.param_bytes(m.diffusion_model)
        p = comfy.model_patcher.ModelPatcher(m, load_device=ctx.device, offload_device=torch.device("cpu"))
        p.load(ctx.device, lowvram_model_memory=int(nbytes * frac))
        loaded = p.loaded_size()
        return Prepared(m.diffusion_model, max(0, nbytes - loaded), {"resident_bytes": loaded},
                        cleanup=lambda: p.detach())
    return prepare


def comfy_fp8(ctx: Ctx) -> Prepared:
    import comfy.model_patcher
    m = _build(ctx, weight_dtype=torch.float8_e4m3fn, manual_cast=ctx.dtype)
    p = comfy.model_patcher.ModelPatcher(m, load_device=ctx.device, offload_device=torch.device("cpu"))
    p.load(ctx.device, full_load=True)
    return Prepared(m.diffusion_model, 0, {"weights_bytes": bm.param_bytes(m.diffusion_model)},
                    cleanup=lambda: p.detach())


def diffusers_group_offload(**kw):
    def prepare(ctx: Ctx) -> Prepared:
        from diffusers.hooks import apply_group_offloading
        m = _build(ctx)
        dm = m.diffusion_model
        nbytes = bm.param_bytes(dm)
        apply_group_offloading(dm, onload_device=ctx.device, offload_device=torch.device("cpu"), **kw)
        return Prepared(dm, nbytes)
    return prepare


BASELINE = [
    Case("resident", "baseline", resident),
    Case("comfy_lowvram_25pct", "baseline", comfy_lowvram(0.25), CUDA_STREAMS),
    Case("comfy_fp8_e4m3fn_manual_cast", "baseline", comfy_fp8),
    Case("diffusers_block_stream", "baseline",
         diffusers_group_offload(offload_type="block_level", num_blocks_per_group=1, use_stream=True), CUDA_STREAMS),
    Case("diffusers_leaf_stream", "baseline", diffusers_group_offload(offload_type="leaf_level", use_stream=True),
         CUDA_STREAMS),
    Case("diffusers_block_nostream", "baseline",
         diffusers_group_offload(offload_type="block_level", num_blocks_per_group=1), CUDA_STREAMS),
]


def all_cases() -> list[Case]:
    """Baseline cases, then MemoryKit's (from memorykit_cases; empty until techniques land)."""
    from .memorykit_cases import MEMORYKIT
    return BASELINE + MEMORYKIT
