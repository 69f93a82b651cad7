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
    return bm.build(ctx.depth, ctx.single, ctx.dtype, ctx.device)


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
    """Balanced Device Map, sequential: the first blocks on the main device (cpu in CI, cuda:0
    on a GPU within ``cpu_budget`` bytes for the GPU), the rest on cpu or disk."""
    def prepare(ctx: Ctx) -> Prepared:
        dmap, disp = _tech("device_map"), _tech("device_dispatch")
        dm = _build(ctx).diffusion_model
        total = bm.param_bytes(dm)
        if ctx.device.type == "cuda":
            budgets = {0: int(total * 0.25), "cpu": 10 * total}
        else:
            budgets = {"cpu": int(total * float(cpu_budget))}
        plan, _ = dmap.plan_device_map(dm, budgets, "sequential", dmap.block_classes(dm), allow_disk=disk)
        h = disp.dispatch_device_map(dm, plan, offload_folder=ctx.tmpdir,
                                     main_device=0 if ctx.device.type == "cuda" else "cpu")
        per_dev = dmap.bytes_per_device(dm, plan)
        streamed = sum(v for k, v in per_dev.items() if not str(k).startswith("cuda")) if ctx.device.type == "cuda" else 0
        return Prepared(dm, streamed, {"bytes_per_device": per_dev}, cleanup=h.remove)
    return prepare


MEMORYKIT: list[Case] = [
    Case("mk_fp8_e4m3_per_tensor", "memorykit", fp8("auto")),
    Case("mk_fp8_e4m3_per_tensor_fp8_modulation", "memorykit", fp8("auto_fp8_modulation")),
    Case("mk_device_map_cpu_disk_50pct", "memorykit", device_map("0.5", True)),
]
