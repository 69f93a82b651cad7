"""Whole-workflow Memory Plans for full-size Flux 2 [dev] and Wan 2.2 14B on given machines.

Every component is built from core's own classes on the meta device (no memory, no weights):
- Flux 2 [dev]: the diffusion model (:data:`meta_models.PLANNING` ``flux2_dev``, 8 double + 48
  single blocks at width 6144) at 1024² (latent 128 × 64 × 64), its text encoder Mistral Small 3
  24B (``comfy.text_encoders.flux.flux2_te``), the VAE (given: 0.31 GiB, Comfy-Org's
  ``flux2-vae.safetensors``).
- Wan 2.2 14B t2v: two experts of Wan 2.1 14B's shape (``wan_14b``; high noise, then low noise,
  half the steps each) at 832×480, 81 frames (latent 16 × 21 × 60 × 104), UMT5-XXL
  (``comfy.text_encoders.wan.te``), the Wan 2.1 VAE (given: 0.24 GiB, ``wan_2.1_vae.safetensors``).

All bf16 (the weights' published dtype), and again loaded from fp8 files (``*_fp8``), planned with given figures (PCIe 4.0, NVMe, 200 GiB of
disk). ``scripts/memory_plan_workflows.py`` writes the grid to
``benchmarks/results/memory_plan_workflows.md``; ``tests/test_memory_plan_workflow.py`` checks it.
"""
from __future__ import annotations

import re

import torch

from . import comfy_env, meta_models

VRAM_GB, RAM_GB, DISK_GB = (8, 12, 16, 24), (16, 32, 64), 200
# Published file sizes of the VAEs (Comfy-Org's repackaged files), bytes.
VAE_BYTES = {"flux2": 336_215_008, "wan": 253_815_318}
WORKFLOWS = ("flux2_dev", "wan22_14b", "flux2_dev_fp8", "wan22_14b_fp8")
SHORT = {"as loaded": "resident", "fp8 resident": "fp8 resident", "stream from RAM": "RAM stream",
         "fp8 + stream from RAM": "fp8 + RAM stream", "stream from disk": "disk stream",
         "core dynamic VRAM": "core", "fp8 + core dynamic VRAM": "fp8 + core"}


def _te_module(kind: str):
    comfy_env.setup_comfy()
    if kind == "flux2":
        import comfy.text_encoders.flux as f
        cls = f.flux2_te(dtype_llama=torch.bfloat16)
    else:
        import comfy.text_encoders.wan as w
        cls = w.te(dtype_t5=torch.bfloat16)
    return cls(device=torch.device("meta"), dtype=torch.bfloat16)


def as_fp8_file(c):
    """A component as loaded from an fp8 file (Comfy-Org's ``*_fp8_scaled`` / fp8mixed files): the
    weights FP8 Layerwise Cast would make are what is loaded, so no further fp8 is offered."""
    import dataclasses
    f = c.figures
    if f.fp8_block_bytes is None:
        return c
    return dataclasses.replace(c, figures=dataclasses.replace(
        f, block_bytes=f.fp8_block_bytes, other_bytes=f.fp8_other_bytes, fp8_block_bytes=None, fp8_other_bytes=0,
        fp8_copy_bytes=None, dtype="float8_e4m3fn"))


def components(workflow: str) -> list:
    """The workflow's :class:`memorykit.memory_plan_workflow.Component` list (text encoder,
    diffusion model(s), VAE), figures read from the meta-device modules; ``*_fp8``: the same
    loaded from fp8 files (:func:`as_fp8_file`)."""
    if workflow.endswith("_fp8"):
        return [as_fp8_file(c) for c in components(workflow[:-len("_fp8")])]
    from comfyui_memorykit.memorykit import memory_plan as mp
    from comfyui_memorykit.memorykit import memory_plan_workflow as wf
    from comfyui_memorykit.memorykit.comfy_integration import memory_plan_io as io
    if workflow == "flux2_dev":
        te = wf.encoder_figures(_te_module("flux2"), "Mistral Small 3 24B", "bfloat16")
        dm = io.model_figures(meta_models.meta_patcher("flux2_dev"), [1, 128, 64, 64])
        vae = mp.ModelFigures((), VAE_BYTES["flux2"], label="Flux 2 VAE")
        return [wf.Component("text encoder", "text encoder", te), wf.Component("diffusion model", "diffusion model", dm),
                wf.Component("VAE", "VAE", vae)]
    te = wf.encoder_figures(_te_module("wan"), "UMT5-XXL", "bfloat16")
    dm = io.model_figures(meta_models.meta_patcher("wan_14b"), [1, 16, 21, 60, 104])
    vae = mp.ModelFigures((), VAE_BYTES["wan"], label="Wan 2.1 VAE")
    return [wf.Component("text encoder", "text encoder", te),
            wf.Component("diffusion model", "diffusion model (high noise)", dm, 0.5),
            wf.Component("diffusion model", "diffusion model 2 (low noise)", dm, 0.5),
            wf.Component("VAE", "VAE", vae)]


def plan(workflow_components: list, vram_gb: float, ram_gb: float):
    """The plan (or the PlanError) for one machine."""
    from comfyui_memorykit.memorykit import memory_plan as mp
    from comfyui_memorykit.memorykit import memory_plan_workflow as wf
    from comfyui_memorykit.memorykit.comfy_integration import memory_plan_io as io
    try:
        return wf.plan_workflow(io.given_machine(vram_gb, ram_gb, DISK_GB), workflow_components)
    except mp.PlanError as e:
        return e


def cell(p) -> str:
    """A grid cell: each component's pick (text encoder / diffusion model(s)), or the error."""
    if isinstance(p, Exception):
        m = re.search(r"(VRAM|RAM|disk) short by ([\d.]+ GiB)", str(p))
        return f"error: {m.group(1)} short by {m.group(2)}" if m else "error"
    parts = [SHORT.get(d.pick.name, d.pick.name) for d in p.decisions if d.component.role != "VAE"]
    return " / ".join(parts) + f" ({p.peak_ram_bytes / 2**30:.0f} GiB RAM, {p.seconds_per_prompt:.0f} s)"


def grid(all_components: dict | None = None) -> dict:
    """{(workflow, vram, ram): plan or PlanError} for every machine of the grid."""
    all_components = all_components or {w: components(w) for w in WORKFLOWS}
    return {(w, v, r): plan(all_components[w], v, r) for w in WORKFLOWS for v in VRAM_GB for r in RAM_GB}


def markdown(all_components: dict, plans: dict) -> str:
    """The results file: the components' sizes, then one table per workflow (rows VRAM, columns
    RAM; each cell: text encoder / diffusion model(s), peak RAM, seconds per prompt)."""
    g = 2 ** 30
    out = ["# Memory Plan: whole-workflow decisions from given figures", "",
           ("Written by `scripts/memory_plan_workflows.py` (checked by `tests/test_memory_plan_workflow.py`). "
           "Components built from ComfyUI's own classes on the meta device, bf16; PCIe 4.0 (25 GB/s), "
           f"NVMe (3 GB/s), 110 TFLOP/s, {DISK_GB} GiB of disk; a prompt = 2 texts encoded + 20 steps."), ""]
    titles = {"flux2_dev": "Flux 2 [dev], 1024²", "wan22_14b": "Wan 2.2 14B t2v, two experts, 832×480, 81 frames"}
    titles |= {f"{k}_fp8": f"{t}, fp8 files (text encoder and diffusion models loaded in fp8)" for k, t in titles.items()}
    for w in WORKFLOWS:
        out += [f"## {titles[w]}", "", "| component | weights | fp8 | blocks |", "|---|---|---|---|"]
        for c in all_components[w]:
            f = c.figures
            fp8 = f"{f.fp8_bytes / g:.2f} GiB" if f.fp8_bytes else "–"
            out.append(f"| {c.name} ({f.label}) | {f.weight_bytes / g:.2f} GiB | {fp8} | {len(f.block_bytes)} |")
        names = " / ".join(c.name for c in all_components[w] if c.role != "VAE")
        out += ["", f"Cells: {names}; peak RAM; seconds per prompt.", "",
                "| VRAM | " + " | ".join(f"RAM {r} GiB" for r in RAM_GB) + " |", "|---" * (len(RAM_GB) + 1) + "|"]
        for v in VRAM_GB:
            out.append(f"| {v} GiB | " + " | ".join(cell(plans[(w, v, r)]) for r in RAM_GB) + " |")
        out.append("")
    return "\n".join(out)
