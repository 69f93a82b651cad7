"""The GPU runbook's plan: every case in the order it runs, which worker process runs it, and
how long it may take (seconds on the H200, the basis of the time budget). No torch import:
the driver (:mod:`benchmarks.runbook`) reads this before any worker starts.

Worker processes ("group"):
- ``legacy``: ComfyUI 0.33 with dynamic VRAM off (``--disable-dynamic-vram``: core's legacy
  ModelPatcher and lowvram path), or whatever tree ``COMFYUI_PATH`` names (0.3.75 in CI).
- ``dynamic``: the same tree with comfy-aimdo set up as ComfyUI's ``main.py`` does it, so
  ``ModelPatcherDynamic`` is the core patcher (dynamic VRAM).
- ``anchor``: design.md's anchor script (diffusers + core), its JSON lines become rows.

Most important first: when the budget runs out, what is left is the least needed. Consecutive
cases of one group run in one worker process (a segment); a worker that dies is restarted for
the rest of its segment.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlannedCase:
    name: str
    group: str
    est_s: float  # seconds on the GPU machine, model build included
    cpu_est_s: float = 2.0  # seconds of the DEVICE=cpu dry run (tiny model, 2 cores)
    gpu_only: str = ""  # why CPU figures mean nothing: then the dry run reports 'skipped: needs cuda'


CAP = "a VRAM cap and CUDA-stream prefetch"


RING_SETTINGS = ["block1_stream", "block2_stream", "leaf_stream", "block1_nostream", "block1_stream_lowmem",
                 "block1_stream_diffusers", "block1_stream_lowmem_diffusers"]

PLAN: list[PlannedCase] = [
    PlannedCase("env", "legacy", 4, 1),
    *[PlannedCase(f"ring_{s}", "legacy", 4, 1) for s in RING_SETTINGS],
    PlannedCase("resident_1024", "legacy", 8),
    PlannedCase("comfy_lowvram_cap25_1024", "legacy", 12, gpu_only=CAP),
    PlannedCase("mk_offload_ring_cap25_1024", "legacy", 14, gpu_only=CAP),
    PlannedCase("mk_offload_fp8_cap25_1024", "legacy", 16, gpu_only=CAP),
    PlannedCase("core_dynamic_cap25_1024", "dynamic", 16),
    PlannedCase("fp8_dynamic_cap25_1024", "dynamic", 18),
    PlannedCase("optout_group_offload_dynamic", "dynamic", 16),
    PlannedCase("optout_device_map_dynamic", "dynamic", 16),
    PlannedCase("fp8_lora_dynamic_vs_full", "dynamic", 24),
    PlannedCase("dynamic_budgets", "dynamic", 6),
    PlannedCase("vae_untiled_2048", "legacy", 8, 3),
    PlannedCase("vae_core_tiled_2048_512_64", "legacy", 8, 3),
    PlannedCase("vae_mk_tiled_2048_512_64", "legacy", 8, 3),
    PlannedCase("mk_device_map_cuda0_cpu_1024", "legacy", 14, gpu_only=CAP),
    PlannedCase("comfy_fp8_resident_1024", "legacy", 10),
    PlannedCase("mk_fp8_resident_1024", "legacy", 12),
    PlannedCase("mk_fp8_matmul_resident_1024", "legacy", 12, gpu_only="a GPU with float8 matmul (compute capability ≥ 8.9)"),
    PlannedCase("resident_2048", "legacy", 10),
    PlannedCase("mk_offload_ring_cap25_2048", "legacy", 16, gpu_only=CAP),
    PlannedCase("mk_offload_diffusers_cap25_1024", "legacy", 14, gpu_only=CAP),
    PlannedCase("diffusers_block_stream_1024", "legacy", 14, gpu_only=CAP),
    PlannedCase("compile_offload_recompiles_1024", "legacy", 40, 10, gpu_only=CAP),
    PlannedCase("anchor_flux", "anchor", 150, 1),
]

# Seconds a worker needs to start (imports of torch and ComfyUI) before its first case.
WORKER_START_S = {"cuda": 20.0, "cpu": 15.0}


def by_name() -> dict[str, PlannedCase]:
    return {c.name: c for c in PLAN}
