"""The GPU runbook's context and shared steps (used by :mod:`benchmarks.rb_cases` and
:mod:`benchmarks.rb_cases_dynamic`): the run's settings (:class:`Ctx`), building the model and
its inputs, the resident reference, the VRAM cap, loading through ComfyUI and timing a forward.

VRAM cap (the same for every capped case): before loading, a filler allocation leaves free
25 % of the weights plus the activations of one resident forward (resident peak − weights),
so core (legacy and dynamic VRAM) and MemoryKit all see the same free memory. Peaks are
reported as ``peak_vram_bytes`` (torch allocator, filler excluded) and ``peak_device_bytes``
(``cudaMemGetInfo`` sampled, above the level after the filler: comfy-aimdo's memory too).
"""
from __future__ import annotations

import gc
import importlib
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


def ci_module():
    return importlib.import_module("memorykit_tech.comfy_integration")


def tech_module(name):
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

def ref_path(ctx: Ctx, res: int) -> Path:
    return ctx.scratch / f"ref_{'tiny' if ctx.tiny else 'full'}_{ctx.device.type}_{res}.pt"


def resident(ctx: Ctx, res: int) -> dict:
    """The resident reference case: the whole model on the device, its output, time and peak
    saved for the other cases (:func:`reference`)."""
    m = build(ctx)
    measure.free(ctx.device)
    mark_device_base(ctx)
    dm = m.diffusion_model.to(ctx.device)
    w = bm.param_bytes(dm)
    row = timed(ctx, dm, res, streamed_bytes=0)
    out = ctx.cache.pop("last_out")
    torch.save({"out": out.cpu(), "s": row["s_per_forward"], "weights": w,
                "peak": row["peak_vram_bytes"] or 0}, ref_path(ctx, res))
    row.update({"weights_bytes": w, "ratio_to_resident": 1.0, "rel_err_vs_resident": 0.0})
    return row


def reference(ctx: Ctx, res: int) -> dict:
    """Resident output, s/forward, peak and weight bytes at ``res`` (from the scratch folder,
    computed and saved there when missing: a worker started later reads it)."""
    p = ref_path(ctx, res)
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
    p = ref_path(ctx, res)
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


def load(patcher, ctx: Ctx, res: int) -> None:
    """Load the way sampling does: ``load_models_gpu`` with one forward's activations asked for."""
    import comfy.model_management as mm
    act = 0
    if ctx.device.type == "cuda":
        r = reference(ctx, res)
        act = max(0, r["peak"] - r["weights"])
    mm.load_models_gpu([patcher], memory_required=act, minimum_memory_required=act)


def make_patcher(ctx: Ctx, model, core: bool = False):
    """A patcher as a core loader makes it (``core``: ComfyUI's CoreModelPatcher, dynamic under
    dynamic VRAM) or the legacy ModelPatcher."""
    import comfy.model_patcher as mp
    cls = getattr(mp, "CoreModelPatcher", mp.ModelPatcher) if core else mp.ModelPatcher
    return cls(model, load_device=ctx.device, offload_device=torch.device("cpu"))


def is_dynamic(p) -> bool:
    f = getattr(p, "is_dynamic", None)
    return bool(callable(f) and f())


def require_dynamic(ctx: Ctx, partial: dict) -> None:
    if not ctx.dyn.get("dynamic_vram"):
        raise NeedsCuda(f"dynamic VRAM off ({ctx.dyn.get('reason', 'legacy worker')})", partial)
