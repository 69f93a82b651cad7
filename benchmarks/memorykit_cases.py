"""MemoryKit benchmark cases: the technique layer (``memorykit/``) applied to the benchmark
model's diffusion model, exactly as the nodes apply it at load time.

The technique package is imported by file (``harness.paths.technique_package``) so the
benchmark does not need ComfyUI's node API.
"""
from __future__ import annotations

import importlib

import torch

from harness import paths

from . import model as bm
from .cases import CUDA_STREAMS, Case, Ctx, Prepared

paths.technique_package()


def _tech(name: str):
    return importlib.import_module(f"memorykit_tech.{name}")


def _build(ctx: Ctx):
    return bm.build(ctx.depth, ctx.single, ctx.dtype, ctx.device, tiny=ctx.tiny)


def fp8(preset: str, scaling: str = "per-tensor", fp8_matmul: bool = False):
    """FP8 Layerwise Cast: e4m3 storage, compute in the benchmark dtype, resident on the device."""
    def prepare(ctx: Ctx) -> Prepared:
        f8, pats = _tech("fp8"), _tech("fp8_patterns")
        dm = _build(ctx).diffusion_model
        before = bm.param_bytes(dm)
        h = f8.apply_fp8_layerwise(dm, torch.float8_e4m3fn, ctx.dtype, scaling,
                                   pats.default_skip_patterns("flux", preset), fp8_matmul=fp8_matmul)
        dm.to(ctx.device)
        after = bm.param_bytes(dm)
        return Prepared(dm, 0, {"weights_bytes": after, "weights_ratio_to_unquantised": round(after / before, 3)})
    return prepare


def device_map(cpu_budget: str, disk: bool):
    """Balanced Device Map, sequential. On a CPU: ``cpu_budget`` (a fraction of the weights) in
    RAM, the rest on disk. On a GPU: 25 % on cuda:0, 25 % in CPU RAM, the rest on disk."""
    def prepare(ctx: Ctx) -> Prepared:
        dmap, disp = _tech("device_map"), _tech("device_dispatch")
        dm = _build(ctx).diffusion_model
        total = bm.param_bytes(dm)
        if ctx.device.type == "cuda":  # 25 % on the GPU, 25 % in CPU RAM, the rest really on disk
            budgets = {0: int(total * 0.25), "cpu": int(total * 0.25)}
        else:
            budgets = {"cpu": int(total * float(cpu_budget))}
        plan, _ = dmap.plan_device_map(dm, budgets, "sequential", dmap.block_classes(dm), allow_disk=disk)
        h = disp.dispatch_device_map(dm, plan, offload_folder=ctx.tmpdir,
                                     main_device=0 if ctx.device.type == "cuda" else "cpu")
        per_dev = dmap.bytes_per_device(dm, plan)
        streamed = sum(v for k, v in per_dev.items() if not str(k).startswith("cuda")) if ctx.device.type == "cuda" else 0
        return Prepared(dm, streamed, {"bytes_per_device": per_dev}, cleanup=h.remove)
    return prepare


def _block_lists(dm):
    """ComfyUI's block lists (TimestepEmbedSequential elements are the blocks); from the
    integration package, which needs only comfy's model code (not the node API)."""
    import importlib
    return importlib.import_module("memorykit_tech.comfy_integration.offload_patcher").comfy_block_lists(dm)


def offload(offload_type: str = "block_level", budget_frac: float | None = None, target: str = "cpu",
            with_fp8: bool = False, scheduler: str = "memorykit", group_size: int = 1):
    """Group Offload under MemoryKit's plan: on a GPU streams to cuda with CUDA-stream prefetch
    (``scheduler`` memorykit = the event ring, diffusers = its hooks); on a CPU the ring copies
    into a CPU ring (onload = cpu) and disk reads files. ``budget_frac``: VRAM budget as a
    fraction of the weights (plus buffers), None = stream all."""
    def prepare(ctx: Ctx) -> Prepared:
        off, plan = _tech("offload"), _tech("offload_plan")
        dm = _build(ctx).diffusion_model
        handles = []
        if with_fp8:
            f8, pats = _tech("fp8"), _tech("fp8_patterns")
            handles.append(f8.apply_fp8_layerwise(dm, torch.float8_e4m3fn, ctx.dtype, "per-tensor",
                                                  pats.default_skip_patterns("flux", "auto_fp8_modulation")))
        gpu = ctx.device.type == "cuda"
        opts = plan.GroupOffloadOptions(offload_type=offload_type, use_stream=gpu and target == "cpu",
                                        offload_to=target, scheduler=scheduler, num_blocks_per_group=group_size)
        lists = _block_lists(dm)
        budget = None
        if budget_frac is not None:
            p0 = plan.plan_offload(dm, opts, None, lists)
            budget = int(budget_frac * bm.param_bytes(dm)) + p0.buffer_bytes + p0.remainder_bytes
        h = off.apply_group_offload(dm, ctx.device if gpu else "cpu", "cpu", options=opts, budget_bytes=budget,
                                    block_lists=lists, disk_folder=ctx.tmpdir, disk_tag="bench")
        fig = off.offload_figures(h)

        def cleanup():
            off.remove_group_offload(h)
            for fh in handles:
                fh.restore()
        keep = ("scheduler", "resident_bytes", "streamed_bytes", "buffer_bytes", "footprint_bytes",
                "pinned_host_bytes", "groups", "ring_bytes")
        extra = {k: fig.get(k) for k in keep}
        if fig["streamed_bytes"]:  # issue target: pinned host ≤ 1.1 × the streamed weights
            extra["pinned_to_streamed"] = round(fig["pinned_host_bytes"] / fig["streamed_bytes"], 3)
        return Prepared(dm, fig["h2d_bytes_per_forward"], extra, cleanup=cleanup)
    return prepare


MEMORYKIT: list[Case] = [
    Case("mk_offload_block_budget25", "memorykit", offload("block_level", 0.25), CUDA_STREAMS),
    Case("mk_offload_block_budget25_diffusers", "memorykit", offload("block_level", 0.25, scheduler="diffusers"),
         CUDA_STREAMS),
    # On a CPU these two measure the event ring's own cost (copies into a CPU ring, hooks).
    Case("mk_offload_block_stream_all", "memorykit", offload("block_level")),
    Case("mk_offload_block2_stream_all", "memorykit", offload("block_level", group_size=2), CUDA_STREAMS),
    Case("mk_offload_leaf_stream_all", "memorykit", offload("leaf_level")),
    Case("mk_offload_fp8_block_budget25", "memorykit", offload("block_level", 0.25, with_fp8=True), CUDA_STREAMS),
    Case("mk_offload_disk_block", "memorykit", offload("block_level", target="disk")),
    Case("mk_offload_fp8_disk_block", "memorykit", offload("block_level", target="disk", with_fp8=True)),
    Case("mk_fp8_e4m3_per_tensor", "memorykit", fp8("auto")),
    Case("mk_fp8_e4m3_per_tensor_fp8_modulation", "memorykit", fp8("auto_fp8_modulation")),
    Case("mk_fp8_e4m3_fp8_matmul", "memorykit", fp8("auto_fp8_modulation", fp8_matmul=True),
         "needs CUDA sm_89+: float8 matmul (torch._scaled_mm)"),
    Case("mk_device_map_cpu_disk_50pct", "memorykit", device_map("0.5", True)),
]
