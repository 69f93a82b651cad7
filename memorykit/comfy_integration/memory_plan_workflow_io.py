"""Memory Plan for the whole workflow inside ComfyUI: the text encoder (a ``comfy.sd.CLIP``), one
or two diffusion models (Wan 2.2's high- and low-noise experts) and the VAE, planned together
(:mod:`memorykit.memory_plan_workflow`) and each given its pick with the code the individual
nodes use (:func:`.memory_plan_io.apply_plan` for a MODEL; the text-encoder techniques of
:mod:`.text_encoder` for a CLIP, where this version of the pack has them).
"""
from __future__ import annotations

import dataclasses

from .. import memory_plan as mp
from .. import memory_plan_workflow as wf
from . import memory_plan_io as io
from . import placement
from .fp8_patcher import FP8_ATTACHMENT
from .gguf_weights import gguf_counts, is_gguf_patcher


def clip_figures(clip) -> mp.ModelFigures:
    """A CLIP's text encoder as :class:`memorykit.memory_plan.ModelFigures` (one encode of
    :data:`memorykit.memory_plan_workflow.ENCODE_TOKENS` tokens; see
    :func:`memorykit.memory_plan_workflow.encoder_figures`)."""
    model = clip.cond_stage_model
    dtype = next((str(p.dtype).replace("torch.", "") for p in model.parameters() if p.is_floating_point()), "unknown")
    # no fp8 for a text encoder already through FP8 Layerwise Cast or from a GGUF file (already quantized)
    fp8 = clip.patcher.get_attachment(FP8_ATTACHMENT) is None and not (gguf_counts(model) or is_gguf_patcher(clip.patcher))
    return wf.encoder_figures(model, type(model).__name__, dtype, fp8=fp8)


def vae_figures(vae) -> mp.ModelFigures:
    return mp.ModelFigures((), int(vae.patcher.model_size()), label=type(vae.first_stage_model).__name__)


def apply_clip(clip, d: wf.Decision, machine: mp.Machine, disk_folder: str = ""):
    """Apply a text encoder's pick (fp8, then Group Offload block_level to RAM or disk) with the
    text-encoder techniques. Returns ``(CLIP, applied, note)``; ``note`` says what could not be
    applied (the CLIP is then passed on as it came)."""
    pick, out, applied = d.pick, clip, {}
    if not pick.fp8 and pick.offload_to is None:
        return out, applied, ""
    from . import text_encoder as te  # imported here: it pulls in the offload and fp8 patchers
    if pick.fp8:
        out, applied["fp8"] = te.text_encoder_fp8(out)
    if pick.offload_to is not None:
        from ..offload_plan import GroupOffloadOptions
        from .offload_patcher import GroupOffloadSettings
        opts = GroupOffloadOptions(offload_type="block_level", num_blocks_per_group=1, use_stream=True,
                                   offload_to=pick.offload_to)
        budget = pick.vram_budget_bytes if machine.source == "measured" and machine.gpu else 0
        out, applied["group_offload"] = te.text_encoder_group_offload(out, GroupOffloadSettings(
            options=opts, vram_budget_bytes=int(budget), disk_folder=disk_folder))
    return out, applied, ""


def memory_plan_workflow(model, vae=None, latent=None, plan_for: str = "this machine", vram_gb: float = 12.0,
                         ram_gb: float = 32.0, disk_gb: float = 100.0, allow_fp8: bool = True, prefer: str = "speed",
                         width: int = 1024, height: int = 1024, frames: int = 81, clip=None, model_2=None,
                         disk_folder: str = ""):
    """The Memory Plan node with a text encoder and/or a second diffusion model wired:
    ``(MODEL, VAE or None, CLIP or None, MODEL_2 or None, info)``. Raises
    :class:`memorykit.memory_plan.PlanError` (naming the component and what is short) before
    anything is applied, ValueError for a bad option or a model that a placement node placed."""
    if plan_for not in ("this machine", "given figures"):
        raise ValueError(f"plan_for must be 'this machine' or 'given figures', got {plan_for!r}")
    for field, m in (("model", model), ("model_2", model_2)):
        placed = placement.placed_by(m) if m is not None else None
        if placed:
            raise ValueError(f"{field}: this MODEL comes through {placed}, which already decides where the weights live. "
                             f"Connect Memory Plan to the loader (or LoRA loader) directly, or use {placed} alone.")
    disk_problem = None
    if plan_for == "this machine":
        machine, disk_problem = io._measure(model, disk_folder)  # no usable offload folder: no disk plans
        others = [p for p in (model_2, getattr(clip, "patcher", None), getattr(vae, "patcher", None)) if p is not None]
        machine = dataclasses.replace(machine, ram_bytes=machine.ram_bytes + sum(io._cpu_bytes(p) for p in others))
    else:
        machine = io.given_machine(vram_gb, ram_gb, disk_gb)
    shape = io.latent_shape(latent, model, width, height, frames)
    comps, _figs = [], {}
    if clip is not None:
        comps.append(wf.Component("text encoder", "text encoder", clip_figures(clip)))
    two = model_2 is not None
    comps.append(wf.Component("diffusion model", "diffusion model (high noise)" if two else "diffusion model",
                              io.model_figures(model, shape), 0.5 if two else 1.0))
    if two:
        comps.append(wf.Component("diffusion model", "diffusion model 2 (low noise)", io.model_figures(model_2, shape), 0.5))
    if vae is not None:
        comps.append(wf.Component("VAE", "VAE", vae_figures(vae)))
    opts = mp.PlanOptions(allow_fp8=allow_fp8, prefer=prefer)
    plan = io.plan_noting_disk(lambda: wf.plan_workflow(machine, comps, opts), disk_problem)
    tile_px = None
    if vae is not None:
        tile_px, sentence = io.plan_tiles(vae, machine, shape)
        plan.reasons.append(sentence)
    outs, applied = {}, {}
    for d in plan.decisions:
        if d.component.role == "diffusion model":
            key = "model_2" if d.component.name.startswith("diffusion model 2") else "model"
            src = model_2 if key == "model_2" else model
            single = mp.Plan(machine, d.component.figures, opts, [d.pick], d.pick, [])
            outs[key], applied[key] = io.apply_plan(src, single, disk_folder)
        elif d.component.role == "text encoder":
            outs["clip"], applied["clip"], note = apply_clip(clip, d, machine, disk_folder)
            if note:
                plan.reasons.append(note)
    info = {"workflow": plan.as_dict(), "machine": dataclasses.asdict(machine), "latent_shape": shape,
            "tile_px": tile_px, "reasons": list(plan.reasons), "applied": applied,
            "badge": _badge(plan, tile_px)}
    return (outs["model"], io.planned_vae(vae, tile_px) if vae is not None else None, outs.get("clip"),
            outs.get("model_2"), info)


def _badge(plan: wf.WorkflowPlan, tile_px) -> list[str]:
    """One figure per component: "TE: stream 30.02 GiB/text from disk", "DM: as loaded", "DM2: ...";
    then the tiles."""
    parts = []
    for d in plan.decisions:
        if d.component.role == "text encoder":  # streamed once per text, not per step
            parts.append("TE: " + d.pick.badge().replace("/step from", "/text from"))
        elif d.component.role == "diffusion model":
            parts.append(("DM2: " if d.component.name.startswith("diffusion model 2") else "DM: ") + d.pick.badge())
    return parts + [f"tiles {tile_px}" if tile_px else "no tiles"]


def format_workflow_plan(info: dict) -> str:
    """The report text: the machine, one line per component, the sentences."""
    m, g = info["machine"], 2 ** 30
    head = (f"Memory Plan for the workflow (latent {info['latent_shape']}) on {m['source']} figures: VRAM "
            f"{m['vram_bytes'] / g:.2f} GiB, RAM {m['ram_bytes'] / g:.2f} GiB, disk {m['disk_bytes'] / g:.1f} GiB, "
            f"host→device {m['h2d_bytes_per_s'] / 1e9:.1f} GB/s, disk read {m['disk_read_bytes_per_s'] / 1e9:.1f} GB/s")
    rows = [f"  {d['component']:<32}{d['pick']:<24} VRAM {d['peak_vram_bytes'] / g:6.2f}  RAM at rest "
            f"{d['ram_rest_bytes'] / g:6.2f}  disk {d['disk_bytes'] / g:6.2f}  {d['seconds_per_prompt']:7.1f} s/prompt"
            for d in info["workflow"]["decisions"]]
    return "\n".join([head] + rows + [f"- {r}" for r in info["reasons"]])
