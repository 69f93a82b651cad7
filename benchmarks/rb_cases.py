"""The GPU runbook's cases (run by :mod:`benchmarks.rb_worker`), written against the pack's
public integration functions (what the nodes call) and ComfyUI's own loading path
(``load_models_gpu``), so they measure what a user gets.

VRAM cap (the same for every capped case): before loading, a filler allocation leaves free
25 % of the weights plus the activations of one resident forward (resident peak − weights),
so core (legacy and dynamic VRAM) and MemoryKit all see the same free memory. Peaks are
reported as ``peak_vram_bytes`` (torch allocator, filler excluded) and ``peak_device_bytes``
(``cudaMemGetInfo`` sampled, above the level after the filler: comfy-aimdo's memory too).

On a CPU (``DEVICE=cpu`` dry run) every case runs its code path on the tiny model; those
that mean nothing there (plan entry ``gpu_only``) are then reported as ``skipped: needs
cuda`` with their CPU figures, and those that cannot run at all raise :class:`NeedsCuda`.
"""
from __future__ import annotations

import gc
import importlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import measure
from . import model as bm

CAP_WEIGHTS_FRAC = 0.25
FP8_REL_TOL = 0.25  # fp8 e4m3 vs bf16 on random weights (design.md: core 0.17, diffusers 0.11)
FP8_LORA_DYN_VS_FULL_TOL = 0.05


class NeedsCuda(Exception):
    """The case ran what it could; the rest needs a CUDA device (or dynamic VRAM)."""

    def __init__(self, reason: str, partial: dict | None = None):
        super().__init__(reason)
        self.partial = partial or {}


@dataclass
class Ctx:
    device: torch.device
    dtype: torch.dtype
    tiny: bool
    depth: int
    single: int
    res: dict  # "main" / "big" → pixels
    iters: int
    scratch: Path
    results: Path
    dyn: dict
    rows: dict = field(default_factory=dict)
    cache: dict = field(default_factory=dict)
    filler: object = None

    @classmethod
    def make(cls, device: str, tiny: bool, scratch: Path, results: Path, dyn: dict) -> "Ctx":
        dev = torch.device(device)
        gpu = dev.type == "cuda"
        scratch.mkdir(parents=True, exist_ok=True)
        return cls(dev, torch.bfloat16 if gpu else torch.float32, tiny, 1 if tiny else 8, 1 if tiny else 16,
                   {"main": 64, "big": 128} if tiny else {"main": 1024, "big": 2048}, 1 if tiny else 3,
                   scratch, results, dyn)

    def earlier_row(self, name: str) -> dict | None:
        if name in self.rows:
            return self.rows[name]
        try:
            import json
            for r in json.loads(self.results.read_text()).get("results", []):
                if r.get("case") == name:
                    return r
        except (OSError, ValueError):
            pass
        return None


def _ci():
    return importlib.import_module("memorykit_tech.comfy_integration")


def _tech(name):
    return importlib.import_module(f"memorykit_tech.{name}")


def build(ctx: Ctx, **kw):
    return bm.build(ctx.depth, ctx.single, ctx.dtype, ctx.device, tiny=ctx.tiny, **kw)


def inputs(ctx: Ctx, res: int):
    return bm.inputs(res, ctx.dtype, ctx.device, tiny=ctx.tiny)


def cleanup(ctx: Ctx) -> None:
    """After every case: ComfyUI unloads everything, the filler goes, caches are emptied."""
    try:
        import comfy.model_management as mm
        mm.unload_all_models()
        mm.soft_empty_cache()
    except Exception:
        pass
    ctx.filler = None
    gc.collect()
    measure.free(ctx.device)


# -- reference and cap -----------------------------------------------------------------------

def _ref_path(ctx: Ctx, res: int) -> Path:
    return ctx.scratch / f"ref_{'tiny' if ctx.tiny else 'full'}_{ctx.device.type}_{res}.pt"


def reference(ctx: Ctx, res: int) -> dict:
    """Resident output, s/forward, peak and weight bytes at ``res`` (from the scratch folder,
    computed and saved there when missing: a worker started later reads it)."""
    p = _ref_path(ctx, res)
    if p.is_file():
        return torch.load(p)
    resident(ctx, res)
    return torch.load(p)


def cap_free_bytes(ctx: Ctx, res: int) -> int | None:
    """Free device bytes every capped case gets: 25 % of the weights + one forward's activations."""
    if ctx.device.type != "cuda":
        return None
    r = reference(ctx, res)
    act = max(0, r["peak"] - r["weights"])
    return int(CAP_WEIGHTS_FRAC * r["weights"] + act)


def mark_device_base(ctx: Ctx) -> None:
    """Device memory in use now: ``peak_device_bytes`` of the next :func:`timed` counts from here
    (call it before the weights are loaded, after the filler)."""
    if ctx.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(ctx.device)
        ctx.cache["dev_base"] = total - free


def apply_cap(ctx: Ctx, res: int) -> dict:
    free = cap_free_bytes(ctx, res)
    if free is None:
        return {"cap_free_bytes": None}
    ctx.filler, n = measure.vram_filler(ctx.device, free)
    mark_device_base(ctx)
    return {"cap_free_bytes": free, "filler_bytes": n}


def timed(ctx: Ctx, fn, res: int, streamed_bytes: int | None = None, profile_h2d: bool = False,
          filler_bytes: int = 0) -> dict:
    """Time ``fn(*inputs)``; the row's figures (see module doc)."""
    inp = inputs(ctx, res)
    with measure.DevicePeak(ctx.device, base=ctx.cache.pop("dev_base", None)) as dp:
        s, out, peak = measure.time_forward(fn, inp, ctx.device, ctx.iters)
    h2d = None
    if profile_h2d:
        with torch.no_grad():
            h2d = measure.h2d_bytes(lambda: fn(*inp), ctx.device)
    row = {"res": res, "s_per_forward": round(s, 5), "peak_vram_bytes": None if peak is None else peak - filler_bytes,
           "peak_device_bytes": dp.peak, "pinned_host_bytes": measure.pinned_host_bytes() if ctx.device.type == "cuda" else None,
           "rss_bytes": measure.rss_bytes(), "h2d_bytes_per_forward": h2d}
    p = _ref_path(ctx, res)
    if p.is_file():
        ref = torch.load(p)
        row["ratio_to_resident"] = round(s / ref["s"], 3)
        row["rel_err_vs_resident"] = measure.rel_l2(out, ref["out"])
        bw = ctx.cache.get("bw")
        moved = h2d if h2d is not None else streamed_bytes
        if bw and moved is not None:
            floor = max(ref["s"], moved / bw)
            row.update({"floor_s": round(floor, 5), "ratio_to_floor": round(s / floor, 3)})
    ctx.cache["last_out"] = out
    return row


def _load(patcher, ctx: Ctx, res: int) -> None:
    """Load the way sampling does: ``load_models_gpu`` with one forward's activations asked for."""
    import comfy.model_management as mm
    act = 0
    if ctx.device.type == "cuda":
        r = reference(ctx, res)
        act = max(0, r["peak"] - r["weights"])
    mm.load_models_gpu([patcher], memory_required=act, minimum_memory_required=act)


def _patcher(ctx: Ctx, model, core: bool = False):
    """A patcher as a core loader makes it (``core``: ComfyUI's CoreModelPatcher, dynamic under
    dynamic VRAM) or the legacy ModelPatcher."""
    import comfy.model_patcher as mp
    cls = getattr(mp, "CoreModelPatcher", mp.ModelPatcher) if core else mp.ModelPatcher
    return cls(model, load_device=ctx.device, offload_device=torch.device("cpu"))


def _is_dynamic(p) -> bool:
    f = getattr(p, "is_dynamic", None)
    return bool(callable(f) and f())


def _require_dynamic(ctx: Ctx, partial: dict) -> None:
    if not ctx.dyn.get("dynamic_vram"):
        raise NeedsCuda(f"dynamic VRAM off ({ctx.dyn.get('reason', 'legacy worker')})", partial)


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


def resident(ctx: Ctx, res: int) -> dict:
    m = build(ctx)
    measure.free(ctx.device)
    mark_device_base(ctx)
    dm = m.diffusion_model.to(ctx.device)
    w = bm.param_bytes(dm)
    row = timed(ctx, dm, res, streamed_bytes=0)
    out = ctx.cache.pop("last_out")
    torch.save({"out": out.cpu(), "s": row["s_per_forward"], "weights": w,
                "peak": row["peak_vram_bytes"] or 0}, _ref_path(ctx, res))
    row.update({"weights_bytes": w, "ratio_to_resident": 1.0, "rel_err_vs_resident": 0.0})
    return row


def comfy_lowvram_cap(ctx: Ctx, res: int) -> dict:
    p = _patcher(ctx, build(ctx))
    cap = apply_cap(ctx, res)
    _load(p, ctx, res)
    loaded = p.loaded_size()
    row = timed(ctx, p.model.diffusion_model, res, max(0, p.model_size() - loaded), profile_h2d=True,
                filler_bytes=cap.get("filler_bytes", 0))
    return {**row, **cap, "resident_bytes": loaded, "patcher": type(p).__name__}


def mk_offload_cap(ctx: Ctx, res: int, fp8: bool = False, scheduler: str = "memorykit") -> dict:
    ci, plan = _ci(), _tech("offload_plan")
    p = _patcher(ctx, build(ctx))
    extra = {}
    if fp8:
        p, info = ci.fp8_layerwise_cast(p)
        extra["fp8_weight_bytes"] = info.get("weight_bytes_after")
    cap = apply_cap(ctx, res)
    opts = plan.GroupOffloadOptions(offload_type="block_level", num_blocks_per_group=1,
                                    use_stream=ctx.device.type == "cuda", scheduler=scheduler)
    n, info = ci.prepare_group_offload(p, ci.GroupOffloadSettings(options=opts))
    _load(n, ctx, res)
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
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters

    import comfy.model_management as mm
    ci, plan = _ci(), _tech("offload_plan")
    p = _patcher(ctx, build(ctx))
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
            _load(n, ctx, res)
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
    ci = _ci()
    p = _patcher(ctx, build(ctx))
    w = p.model_size()
    if ctx.device.type == "cuda":
        mm_text = f"cuda:0={max(1, int(CAP_WEIGHTS_FRAC * w))}, cpu={4 * w}"
    else:
        mm_text = f"cpu={4 * w}"
    n, rep, _ = ci.device_map_model(p, "sequential", mm_text)
    mark_device_base(ctx)
    _load(n, ctx, res)
    per_dev = rep["bytes_per_device"]
    streamed = sum(v for k, v in per_dev.items() if not str(k).startswith(("cuda", "0")))
    row = timed(ctx, n.model.diffusion_model, res, streamed if ctx.device.type == "cuda" else 0, profile_h2d=True)
    return {**row, "max_memory": mm_text, "bytes_per_device": {str(k): v for k, v in per_dev.items()}}


def comfy_fp8_resident(ctx: Ctx, res: int) -> dict:
    m = build(ctx, weight_dtype=torch.float8_e4m3fn, manual_cast=ctx.dtype)
    p = _patcher(ctx, m)
    mark_device_base(ctx)
    p.load(ctx.device, full_load=True)
    row = timed(ctx, m.diffusion_model, res, 0)
    row["weights_bytes"] = bm.param_bytes(m.diffusion_model)
    row["within_fp8_tolerance"] = row.get("rel_err_vs_resident", 0) <= FP8_REL_TOL
    return row


def mk_fp8_resident(ctx: Ctx, res: int) -> dict:
    ci = _ci()
    n, info = ci.fp8_layerwise_cast(_patcher(ctx, build(ctx)))
    mark_device_base(ctx)
    _load(n, ctx, res)
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


# -- dynamic VRAM (issue 13 item 5) ----------------------------------------------------------

def core_dynamic_cap(ctx: Ctx, res: int) -> dict:
    p = _patcher(ctx, build(ctx), core=True)
    partial = {"patcher": type(p).__name__, "is_dynamic": _is_dynamic(p)}
    _require_dynamic(ctx, partial)
    cap = apply_cap(ctx, res)
    _load(p, ctx, res)
    row = timed(ctx, p.model.diffusion_model, res, None, profile_h2d=True, filler_bytes=cap.get("filler_bytes", 0))
    return {**row, **cap, **partial, "weights_bytes": p.model_size()}


def fp8_dynamic_cap(ctx: Ctx, res: int) -> dict:
    ci = _ci()
    p = _patcher(ctx, build(ctx), core=True)
    n, info = ci.fp8_layerwise_cast(p)
    partial = {"patcher": type(n).__name__, "is_dynamic": _is_dynamic(n),
               "fp8_weight_bytes": info.get("weight_bytes_after"), "bf16_weight_bytes": info.get("weight_bytes_before")}
    _require_dynamic(ctx, partial)
    cap = apply_cap(ctx, res)
    _load(n, ctx, res)
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
    ci = _ci()
    p = _patcher(ctx, build(ctx), core=True)
    n, _ = ci.fp8_layerwise_cast(p)
    lora = _lora_sd(p)
    lm = comfy.sd.load_lora_for_models(n, None, lora, 1.0, 0.0)[0]
    partial = {"lora_tensors": len(lora), "patcher": type(lm).__name__, "is_dynamic": _is_dynamic(lm)}
    if not ctx.dyn.get("dynamic_vram"):  # code path on a plain patcher, fully loaded
        mm.load_models_gpu([lm])
        with torch.no_grad():
            lm.model.diffusion_model(*inputs(ctx, res))
    _require_dynamic(ctx, partial)
    cap = apply_cap(ctx, res)
    _load(lm, ctx, res)
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


def _optout(ctx: Ctx, res: int, which: str) -> dict:
    ci, plan = _ci(), _tech("offload_plan")
    rss0 = measure.rss_bytes()
    p = _patcher(ctx, build(ctx), core=True)
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
    partial = {"input_dynamic": _is_dynamic(p), "output_dynamic": _is_dynamic(n), "patcher": type(n).__name__,
               "same_module": n.model is original, "node_status": status, "weights_bytes": w}
    _require_dynamic(ctx, partial)
    cap = apply_cap(ctx, res)
    _load(n, ctx, res)
    row = timed(ctx, n.model.diffusion_model, res, None, profile_h2d=True, filler_bytes=cap.get("filler_bytes", 0))
    rss_growth = row["rss_bytes"] - rss0
    return {**row, **cap, **partial, "rss_growth_bytes": rss_growth,
            "rss_growth_to_one_copy": round(rss_growth / w, 3),
            "check_no_second_copy": bool(partial["same_module"] and not partial["output_dynamic"]
                                         and rss_growth <= 1.1 * w),
            "check_exact": row.get("rel_err_vs_resident") == 0.0}


def dynamic_budgets(ctx: Ctx, res: int) -> dict:
    import comfy.model_management as mm
    ci, plan = _ci(), _tech("offload_plan")
    p = _patcher(ctx, build(ctx), core=True)
    partial = {"is_dynamic": _is_dynamic(p)}
    _require_dynamic(ctx, partial)
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
        "diffusers_block_stream_1024": lambda: diffusers_block_stream(ctx, res),
        "vae_untiled_2048": lambda: vae(ctx, "untiled"),
        "vae_core_tiled_2048_512_64": lambda: vae(ctx, "core"),
        "vae_mk_tiled_2048_512_64": lambda: vae(ctx, "mk"),
        "core_dynamic_cap25_1024": lambda: core_dynamic_cap(ctx, res),
        "fp8_dynamic_cap25_1024": lambda: fp8_dynamic_cap(ctx, res),
        "fp8_lora_dynamic_vs_full": lambda: fp8_lora_dynamic_vs_full(ctx, res),
        "optout_group_offload_dynamic": lambda: _optout(ctx, res, "group_offload"),
        "optout_device_map_dynamic": lambda: _optout(ctx, res, "device_map"),
        "dynamic_budgets": lambda: dynamic_budgets(ctx, res),
    }
    if name not in table:
        raise KeyError(f"no case named {name!r} in benchmarks/rb_cases.py")
    t0 = time.perf_counter()
    row = table[name]()
    row.setdefault("case_s", round(time.perf_counter() - t0, 2))
    return row
