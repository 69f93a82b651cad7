"""The GPU runbook's dynamic-VRAM cases (ComfyUI 0.33's ``ModelPatcherDynamic``; run in the
``dynamic`` worker, see :mod:`benchmarks.rb_plan`): core's own streaming at the VRAM cap, FP8
Layerwise Cast and its LoRA on a dynamic model, the opt-out of Group Offload / Balanced Device
Map, and Group Offload's auto budget under dynamic VRAM."""
from __future__ import annotations

import torch

from . import measure
from .rb_ctx import (
    CAP_WEIGHTS_FRAC,
    FP8_LORA_DYN_VS_FULL_TOL,
    FP8_REL_TOL,
    Ctx,
    apply_cap,
    build,
    ci_module,
    inputs,
    is_dynamic,
    load,
    make_patcher,
    require_dynamic,
    tech_module,
    timed,
)

# -- dynamic VRAM (issue 13 item 5) ----------------------------------------------------------

def core_dynamic_cap(ctx: Ctx, res: int) -> dict:
    p = make_patcher(ctx, build(ctx), core=True)
    partial = {"patcher": type(p).__name__, "is_dynamic": is_dynamic(p)}
    require_dynamic(ctx, partial)
    cap = apply_cap(ctx, res)
    load(p, ctx, res)
    row = timed(ctx, p.model.diffusion_model, res, None, profile_h2d=True, filler_bytes=cap.get("filler_bytes", 0))
    return {**row, **cap, **partial, "weights_bytes": p.model_size()}


def fp8_dynamic_cap(ctx: Ctx, res: int) -> dict:
    ci = ci_module()
    p = make_patcher(ctx, build(ctx), core=True)
    n, info = ci.fp8_layerwise_cast(p)
    partial = {"patcher": type(n).__name__, "is_dynamic": is_dynamic(n),
               "fp8_weight_bytes": info.get("weight_bytes_after"), "bf16_weight_bytes": info.get("weight_bytes_before")}
    require_dynamic(ctx, partial)
    cap = apply_cap(ctx, res)
    load(n, ctx, res)
    row = timed(ctx, n.model.diffusion_model, res, None, profile_h2d=True, filler_bytes=cap.get("filler_bytes", 0))
    bf16 = ctx.earlier_row(f"core_dynamic_cap25_{res}") or {}
    ref_bytes = bf16.get("h2d_bytes_per_forward") or partial["bf16_weight_bytes"]
    ratio = None if not (row["h2d_bytes_per_forward"] is not None and ref_bytes) else row["h2d_bytes_per_forward"] / ref_bytes
    return {**row, **cap, **partial, "h2d_ratio_to_bf16": None if ratio is None else round(ratio, 4),
            "h2d_ratio_basis": "core_dynamic bf16 bytes copied" if bf16.get("h2d_bytes_per_forward") else "bf16 weights",
            "check_streams_float8": ratio is not None and ratio <= 0.55,
            "within_fp8_tolerance": row.get("rel_err_vs_resident", 0) <= FP8_REL_TOL}


def _lora_sd(patcher, seed: int = 5, rank: int = 4, std: float = 0.02) -> dict:
    """A rank-``rank`` LoRA on every 2-D Linear weight of the double/single blocks, in the
    ``diffusion_model.<key>.lora_up/down.weight`` form core's key map accepts."""
    import comfy.lora
    key_map = comfy.lora.model_lora_keys_unet(patcher.model, {})
    sd = patcher.model.state_dict()
    g = torch.Generator().manual_seed(seed)
    out = {}
    for lk, target in key_map.items():
        if not (isinstance(lk, str) and lk.startswith("diffusion_model.") and isinstance(target, str)):
            continue
        w = sd.get(target)
        if w is None or w.ndim != 2 or "blocks" not in target:
            continue
        out[f"{lk}.lora_up.weight"] = torch.randn(w.shape[0], rank, generator=g) * std
        out[f"{lk}.lora_down.weight"] = torch.randn(rank, w.shape[1], generator=g) * std
    return out


def fp8_lora_dynamic_vs_full(ctx: Ctx, res: int) -> dict:
    import comfy.model_management as mm
    import comfy.sd
    ci = ci_module()
    p = make_patcher(ctx, build(ctx), core=True)
    n, _ = ci.fp8_layerwise_cast(p)
    lora = _lora_sd(p)
    lm = comfy.sd.load_lora_for_models(n, None, lora, 1.0, 0.0)[0]
    partial = {"lora_tensors": len(lora), "patcher": type(lm).__name__, "is_dynamic": is_dynamic(lm)}
    if not ctx.dyn.get("dynamic_vram"):  # code path on a plain patcher, fully loaded
        mm.load_models_gpu([lm])
        with torch.no_grad():
            lm.model.diffusion_model(*inputs(ctx, res))
    require_dynamic(ctx, partial)
    cap = apply_cap(ctx, res)
    load(lm, ctx, res)
    with torch.no_grad():
        dyn = lm.model.diffusion_model(*inputs(ctx, res)).float().cpu()
    partial_loaded = lm.loaded_size()
    mm.unload_all_models()
    ctx.filler = None
    measure.free(ctx.device)
    mm.load_models_gpu([lm])
    with torch.no_grad():
        full = lm.model.diffusion_model(*inputs(ctx, res)).float().cpu()
    err = measure.rel_l2(dyn, full)
    return {**partial, **cap, "res": res, "loaded_bytes_capped": partial_loaded, "loaded_bytes_full": lm.loaded_size(),
            "rel_err_dynamic_vs_full": err, "tolerance": FP8_LORA_DYN_VS_FULL_TOL,
            "check_lora_equal": err <= FP8_LORA_DYN_VS_FULL_TOL}


def optout(ctx: Ctx, res: int, which: str) -> dict:
    ci, plan = ci_module(), tech_module("offload_plan")
    rss0 = measure.rss_bytes()
    p = make_patcher(ctx, build(ctx), core=True)
    w = p.model_size()
    original = p.model
    if which == "group_offload":
        opts = plan.GroupOffloadOptions(use_stream=ctx.device.type == "cuda")
        n, info = ci.prepare_group_offload(p, ci.GroupOffloadSettings(options=opts))
        status = info.get("status")
    else:
        cuda = f"cuda:0={max(1, int(CAP_WEIGHTS_FRAC * w))}, " if ctx.device.type == "cuda" else ""
        n, _, _ = ci.device_map_model(p, "sequential", f"{cuda}cpu={4 * w}")
        status = "device map planned"
    partial = {"input_dynamic": is_dynamic(p), "output_dynamic": is_dynamic(n), "patcher": type(n).__name__,
               "same_module": n.model is original, "node_status": status, "weights_bytes": w}
    require_dynamic(ctx, partial)
    cap = apply_cap(ctx, res)
    load(n, ctx, res)
    row = timed(ctx, n.model.diffusion_model, res, None, profile_h2d=True, filler_bytes=cap.get("filler_bytes", 0))
    rss_growth = row["rss_bytes"] - rss0
    return {**row, **cap, **partial, "rss_growth_bytes": rss_growth,
            "rss_growth_to_one_copy": round(rss_growth / w, 3),
            "check_no_second_copy": bool(partial["same_module"] and not partial["output_dynamic"]
                                         and rss_growth <= 1.1 * w),
            "check_exact": row.get("rel_err_vs_resident") == 0.0}


def dynamic_budgets(ctx: Ctx, res: int) -> dict:
    import comfy.model_management as mm
    ci, plan = ci_module(), tech_module("offload_plan")
    p = make_patcher(ctx, build(ctx), core=True)
    partial = {"is_dynamic": is_dynamic(p)}
    require_dynamic(ctx, partial)
    cap = apply_cap(ctx, res)
    dev = ctx.device
    free_cuda = torch.cuda.mem_get_info(dev)[0]
    patcher_free = p.get_free_memory(dev) if hasattr(p, "get_free_memory") else None
    _, info = ci.prepare_group_offload(p, ci.GroupOffloadSettings(options=plan.GroupOffloadOptions(use_stream=True)))
    go_budget = (info.get("plan") or {}).get("budget_bytes")
    ok = go_budget is not None and 0 < go_budget <= 1.05 * max(patcher_free or 0, free_cuda)
    return {**partial, **cap, "cuda_free_bytes": free_cuda, "mm_free_bytes": mm.get_free_memory(dev),
            "patcher_free_bytes": patcher_free, "group_offload_auto_budget_bytes": go_budget,
            "minimum_inference_memory": mm.minimum_inference_memory(), "check_budget_sensible": bool(ok)}
