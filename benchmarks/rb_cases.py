"""The GPU runbook's cases (run by :mod:`benchmarks.rb_worker`), written against the pack's
public integration functions (what the nodes call) and ComfyUI's own loading path
(``load_models_gpu``), so they measure what a user gets. The shared steps and the VRAM cap
are in :mod:`benchmarks.rb_ctx`; the dynamic-VRAM cases in :mod:`benchmarks.rb_cases_dynamic`.

On a CPU (``DEVICE=cpu`` dry run) every case runs its code path on the tiny model; those
that mean nothing there (plan entry ``gpu_only``) are then reported as ``skipped: needs
cuda`` with their CPU figures, and those that cannot run at all raise :class:`NeedsCuda`.
"""
from __future__ import annotations

import importlib
import time

import torch

from . import measure
from . import model as bm
from . import rb_cases_dynamic as dyn
from .rb_ctx import (
    CAP_WEIGHTS_FRAC,
    FP8_REL_TOL,
    Ctx,
    NeedsCuda,
    apply_cap,
    build,
    ci_module,
    inputs,
    load,
    make_patcher,
    mark_device_base,
    resident,
    tech_module,
    timed,
)

# -- cases -----------------------------------------------------------------------------------

def env(ctx: Ctx) -> dict:
    import platform

    from comfyui_version import __version__ as comfy_version
    bw = measure.h2d_bandwidth(ctx.device, 1 << 30 if not ctx.tiny else 1 << 24)
    ctx.cache["bw"] = bw
    (ctx.scratch / "bw.txt").write_text(str(bw or ""))
    mods = {}
    for m in ("comfy_aimdo", "comfy_kitchen", "diffusers", "accelerate", "transformers"):
        try:
            mods[m] = getattr(importlib.import_module(m), "__version__", "present")
        except Exception as e:
            mods[m] = f"missing ({type(e).__name__})"
    return {"device_name": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else platform.machine(),
            "torch": torch.__version__, "comfyui": comfy_version, "python": platform.python_version(),
            "h2d_pinned_bytes_per_s": bw, "packages": mods, "tiny": ctx.tiny, "depth": ctx.depth,
            "single": ctx.single, "dtype": str(ctx.dtype), "iters": ctx.iters,
            "cap": f"filler leaves {CAP_WEIGHTS_FRAC:.0%} of weights + one resident forward's activations free"}


def ring(ctx: Ctx, setting: str) -> dict:
    from . import ring_check
    if "ring" not in ctx.cache:
        depth, single, res = (1, 2, 64) if ctx.tiny else (2, 4, 512)
        ctx.cache["ring"] = ring_check.prepare(ctx.device, depth, single, res, tiny=ctx.tiny)
    dm, ref, inp = ctx.cache["ring"]
    r = ring_check.run_setting(dm, ref, inp, ctx.device, setting)
    if r.get("not_on_cpu"):
        raise NeedsCuda("low_cpu_mem_usage only changes page-locking", r)
    return r


def comfy_lowvram_cap(ctx: Ctx, res: int) -> dict:
    p = make_patcher(ctx, build(ctx))
    cap = apply_cap(ctx, res)
    load(p, ctx, res)
    loaded = p.loaded_size()
    row = timed(ctx, p.model.diffusion_model, res, max(0, p.model_size() - loaded), profile_h2d=True,
                filler_bytes=cap.get("filler_bytes", 0))
    return {**row, **cap, "resident_bytes": loaded, "patcher": type(p).__name__}


def mk_offload_cap(ctx: Ctx, res: int, fp8: bool = False, scheduler: str = "memorykit") -> dict:
    ci, plan = ci_module(), tech_module("offload_plan")
    p = make_patcher(ctx, build(ctx))
    extra = {}
    if fp8:
        p, info = ci.fp8_layerwise_cast(p)
        extra["fp8_weight_bytes"] = info.get("weight_bytes_after")
    cap = apply_cap(ctx, res)
    opts = plan.GroupOffloadOptions(offload_type="block_level", num_blocks_per_group=1,
                                    use_stream=ctx.device.type == "cuda", scheduler=scheduler)
    n, info = ci.prepare_group_offload(p, ci.GroupOffloadSettings(options=opts))
    load(n, ctx, res)
    state = ci.group_offload_state_info(n.model) or {}
    fig = state.get("figures") or {}
    row = timed(ctx, n.model.diffusion_model, res, fig.get("h2d_bytes_per_forward"), profile_h2d=True,
                filler_bytes=cap.get("filler_bytes", 0))
    keep = ("scheduler", "resident_bytes", "streamed_bytes", "buffer_bytes", "footprint_bytes", "pinned_host_bytes",
            "groups", "budget_bytes", "ring_bytes", "h2d_bytes_per_forward", "copied_bytes_last_forward")
    return {**row, **cap, **extra, "node_status": info.get("status"), "offload_applied": bool(state),
            "offload": {k: fig.get(k) for k in keep if k in fig}}


def compile_offload_recompiles(ctx: Ctx, res: int) -> dict:
    """Group Offload (event ring, CUDA streams) under ``torch.compile`` (dynamo with a counting
    eager backend): load, forward, unload, for more cycles than dynamo's recompile limit
    (issue 14 item 15: "after an unload, Group Offload + compile recompiles and hits the
    recompile limit"; not reproduced on the CPU, where ``tests/test_compile.py`` guards it).
    Figures: graphs compiled in the first cycle and after it, graph breaks, relative L2 of
    the last compiled output vs the first."""
    import comfy.model_management as mm
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters
    ci, plan = ci_module(), tech_module("offload_plan")
    p = make_patcher(ctx, build(ctx))
    cap = apply_cap(ctx, res)
    opts = plan.GroupOffloadOptions(offload_type="block_level", num_blocks_per_group=1,
                                    use_stream=ctx.device.type == "cuda")
    n, _ = ci.prepare_group_offload(p, ci.GroupOffloadSettings(options=opts))
    torch._dynamo.reset()
    counters.clear()
    cc = CompileCounter()
    cfg = torch._dynamo.config
    limit = getattr(cfg, "recompile_limit", None) or cfg.cache_size_limit
    inp = inputs(ctx, res)
    graphs, outs, applied = [], [], []
    compiled = None
    try:
        for _ in range(limit + 2):
            load(n, ctx, res)
            applied.append(bool(ci.group_offload_state_info(n.model)))
            if compiled is None:
                compiled = torch.compile(n.model.diffusion_model, backend=cc)
            with torch.no_grad():
                outs.append(compiled(*inp).float().cpu())
            graphs.append(cc.frame_count)
            mm.unload_all_models()
    finally:
        torch._dynamo.reset()
    return {**cap, "cycles": len(graphs), "recompile_limit": limit, "offload_applied_every_cycle": all(applied),
            "graphs_first_cycle": graphs[0], "graphs_after_first_cycle": graphs[-1] - graphs[0],
            "graph_breaks": sum(counters["graph_break"].values()),
            "rel_err_last_vs_first": measure.rel_l2(outs[-1], outs[0])}


def device_map_cuda0_cpu(ctx: Ctx, res: int) -> dict:
    ci = ci_module()
    p = make_patcher(ctx, build(ctx))
    w = p.model_size()
    if ctx.device.type == "cuda":
        mm_text = f"cuda:0={max(1, int(CAP_WEIGHTS_FRAC * w))}, cpu={4 * w}"
    else:
        mm_text = f"cpu={4 * w}"
    n, rep, _ = ci.device_map_model(p, "sequential", mm_text)
    mark_device_base(ctx)
    load(n, ctx, res)
    per_dev = rep["bytes_per_device"]
    streamed = sum(v for k, v in per_dev.items() if not str(k).startswith(("cuda", "0")))
    row = timed(ctx, n.model.diffusion_model, res, streamed if ctx.device.type == "cuda" else 0, profile_h2d=True)
    return {**row, "max_memory": mm_text, "bytes_per_device": {str(k): v for k, v in per_dev.items()}}


def comfy_fp8_resident(ctx: Ctx, res: int) -> dict:
    m = build(ctx, weight_dtype=torch.float8_e4m3fn, manual_cast=ctx.dtype)
    p = make_patcher(ctx, m)
    mark_device_base(ctx)
    p.load(ctx.device, full_load=True)
    row = timed(ctx, m.diffusion_model, res, 0)
    row["weights_bytes"] = bm.param_bytes(m.diffusion_model)
    row["within_fp8_tolerance"] = row.get("rel_err_vs_resident", 0) <= FP8_REL_TOL
    return row


def mk_fp8_resident(ctx: Ctx, res: int, fp8_matmul: bool = False) -> dict:
    """FP8 Layerwise Cast resident on the device (``fp8_matmul``: core's float8 matmul where this
    ComfyUI and GPU have it, else the row says why): time vs ``resident_<res>``, error, bytes."""
    ci = ci_module()
    p = make_patcher(ctx, build(ctx))
    if fp8_matmul:
        try:
            n, info = ci.fp8_layerwise_cast(p, "float8_e4m3fn", "auto", "per-tensor", "auto", "", True)
        except ValueError as e:  # no float8 matmul on this device / ComfyUI: not a failure of the run
            return {"skipped": str(e)}
        return _fp8_resident_row(ctx, res, n, info) | {"fp8_matmul_path": info.get("path")}
    n, info = ci.fp8_layerwise_cast(p)
    return _fp8_resident_row(ctx, res, n, info)


def _fp8_resident_row(ctx: Ctx, res: int, n, info: dict) -> dict:
    mark_device_base(ctx)
    load(n, ctx, res)
    row = timed(ctx, n.model.diffusion_model, res, 0)
    row.update({"weights_bytes": info.get("weight_bytes_after"), "cast_layers": info.get("cast_layers"),
                "within_fp8_tolerance": row.get("rel_err_vs_resident", 0) <= FP8_REL_TOL})
    ref = ctx.earlier_row(f"resident_{res}")
    if ref and ref.get("s_per_forward"):
        row["time_ratio_to_bf16"] = round(row["s_per_forward"] / ref["s_per_forward"], 3)
    return row


def diffusers_block_stream(ctx: Ctx, res: int) -> dict:
    from diffusers.hooks import apply_group_offloading
    dm = build(ctx).diffusion_model
    gpu = ctx.device.type == "cuda"
    mark_device_base(ctx)
    apply_group_offloading(dm, onload_device=ctx.device, offload_device=torch.device("cpu"),
                           offload_type="block_level", num_blocks_per_group=1, use_stream=gpu)
    return timed(ctx, dm, res, bm.param_bytes(dm), profile_h2d=True)


# -- VAE -------------------------------------------------------------------------------------

def vae(ctx: Ctx, which: str) -> dict:
    from . import vae_bench
    res, tile, overlap = (64, 32, 8) if ctx.tiny else (2048, 512, 64)
    if "vae" not in ctx.cache:
        ctx.cache["vae"] = vae_bench.build_vae(ctx.device, tiny=ctx.tiny)
    fns = vae_bench.decoders(ctx.cache["vae"], res, tile, overlap)
    name = {"untiled": "untiled", "core": f"core_tiled_{tile}_{overlap}", "mk": f"memorykit_tiled_{tile}_{overlap}"}[which]
    s, out, peak = vae_bench.timed(fns[name], ctx.device, 0 if ctx.tiny else 1)
    row = {"res": res, "tile": tile, "overlap": overlap, "s_per_decode": round(s, 4), "peak_vram_bytes": peak,
           "inference_mode": True, "requires_grad": bool(out.requires_grad)}
    if which == "untiled":
        ctx.cache["vae_ref"] = (out, s)
    elif "vae_ref" in ctx.cache:
        ref, t_ref = ctx.cache["vae_ref"]
        out = out.reshape(ref.shape)  # ours drops a video VAE's frame axis for one frame
        row.update({"ratio_to_untiled": round(s / t_ref, 3), "rel_err_vs_untiled": float((out - ref).norm() / ref.norm())})
    return row


def run_case(ctx: Ctx, name: str) -> dict:
    """Run one planned case by name; returns its row fields."""
    main, big = ctx.res["main"], ctx.res["big"]
    if name == "env":
        return env(ctx)
    if "bw" not in ctx.cache:  # measured by the env case: this run's scratch, else an earlier run's row
        f = ctx.scratch / "bw.txt"
        ctx.cache["bw"] = (float(f.read_text()) if f.is_file() and f.read_text().strip()
                           else (ctx.earlier_row("env") or {}).get("h2d_pinned_bytes_per_s"))
    if name.startswith("ring_"):
        return ring(ctx, name[len("ring_"):])
    res = big if name.endswith("_2048") else main
    table = {
        "resident_1024": lambda: resident(ctx, main), "resident_2048": lambda: resident(ctx, big),
        "comfy_lowvram_cap25_1024": lambda: comfy_lowvram_cap(ctx, res),
        "mk_offload_ring_cap25_1024": lambda: mk_offload_cap(ctx, res),
        "mk_offload_ring_cap25_2048": lambda: mk_offload_cap(ctx, res),
        "mk_offload_fp8_cap25_1024": lambda: mk_offload_cap(ctx, res, fp8=True),
        "mk_offload_diffusers_cap25_1024": lambda: mk_offload_cap(ctx, res, scheduler="diffusers"),
        "mk_device_map_cuda0_cpu_1024": lambda: device_map_cuda0_cpu(ctx, res),
        "compile_offload_recompiles_1024": lambda: compile_offload_recompiles(ctx, res),
        "comfy_fp8_resident_1024": lambda: comfy_fp8_resident(ctx, res),
        "mk_fp8_resident_1024": lambda: mk_fp8_resident(ctx, res),
        "mk_fp8_matmul_resident_1024": lambda: mk_fp8_resident(ctx, res, fp8_matmul=True),
        "diffusers_block_stream_1024": lambda: diffusers_block_stream(ctx, res),
        "vae_untiled_2048": lambda: vae(ctx, "untiled"),
        "vae_core_tiled_2048_512_64": lambda: vae(ctx, "core"),
        "vae_mk_tiled_2048_512_64": lambda: vae(ctx, "mk"),
        "core_dynamic_cap25_1024": lambda: dyn.core_dynamic_cap(ctx, res),
        "fp8_dynamic_cap25_1024": lambda: dyn.fp8_dynamic_cap(ctx, res),
        "fp8_lora_dynamic_vs_full": lambda: dyn.fp8_lora_dynamic_vs_full(ctx, res),
        "optout_group_offload_dynamic": lambda: dyn.optout(ctx, res, "group_offload"),
        "optout_device_map_dynamic": lambda: dyn.optout(ctx, res, "device_map"),
        "dynamic_budgets": lambda: dyn.dynamic_budgets(ctx, res),
    }
    if name not in table:
        raise KeyError(f"no case named {name!r} in benchmarks/rb_cases.py")
    t0 = time.perf_counter()
    row = table[name]()
    row.setdefault("case_s", round(time.perf_counter() - t0, 2))
    return row
