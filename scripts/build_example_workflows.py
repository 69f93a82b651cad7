"""Write ``example_workflows/*.json`` (UI format) from the API-format definitions below.

Run after changing a definition: ``.venv/bin/python scripts/build_example_workflows.py``.
It starts a real ComfyUI (with the pack) to read ``/object_info``, so every widget value is
stored in the order the editor expects. The JSON files are committed; this script is how
they are made.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from harness import workflow  # noqa: E402
from harness.server import ComfyServer  # noqa: E402

from example_notes import NOTES  # noqa: E402  (scripts/ is sys.path[0] when run as a script)

NEG = "blurry, low quality"
# The real model files the workflows name (a user downloads them, see MODEL_URLS); the tests and
# the demo map them to generated stand-ins (tests/harness/examples.py, MODEL_FILES).
SD15_CKPT = "v1-5-pruned-emaonly-fp16.safetensors"
SD15_VAE = "vae-ft-mse-840000-ema-pruned.safetensors"
WAN21_UNET = "wan2.1_t2v_1.3B_fp16.safetensors"
# Wan 2.1 14B in Comfy-Org's fp8_scaled form (14.3 GB): the model Group Offload is for on an 8-16 GB card.
WAN21_14B_UNET = "wan2.1_t2v_14B_fp8_scaled.safetensors"
WAN_VAE = "wan_2.1_vae.safetensors"
# Sharded folders a user makes once with Save Sharded (or any folder of safetensors shards +
# model.safetensors.index.json, e.g. a Hugging Face repository's text_encoder/ folder).
SD15_UNET_SHARDED = "sd15_unet_sharded"
SD15_CLIP_SHARDED = "sd15_clip_l_sharded"


def sd15_txt2img(extra_model_nodes=None, decode=None) -> dict:
    """SD1.5 text-to-image at 256², 4 steps, with a Memory Report after sampling and after decoding."""
    p = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": SD15_CKPT}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a lighthouse at dawn, oil painting", "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": NEG, "clip": ["1", 1]}},
        "4": {"class_type": "EmptyLatentImage", "inputs": {"width": 256, "height": 256, "batch_size": 1}},
        "5": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "seed": 42, "steps": 4, "cfg": 5.0,
                                                  "sampler_name": "euler", "scheduler": "normal", "positive": ["2", 0],
                                                  "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}},
        "6": {"class_type": "MemoryKitMemoryReport", "inputs": {"value": ["5", 0], "label": "after sampling", "reset_peak": True}},
        "7": {"class_type": "VAEDecode", "inputs": {"samples": ["6", 0], "vae": ["1", 2]}},
        "8": {"class_type": "MemoryKitMemoryReport", "inputs": {"value": ["7", 0], "label": "after VAE decode", "reset_peak": True}},
        "9": {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": "MemoryKit/sd15"}},
    }
    return p


def _shift(model: list, shift: float = 8.0) -> dict:
    return {"class_type": "ModelSamplingSD3", "inputs": {"model": model, "shift": shift}}


def wan21_t2v() -> dict:
    """Wan 2.1 text-to-video, 9 frames at 128×128, 4 steps, Memory Reports, animated WEBP."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": WAN21_UNET, "weight_dtype": "default"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "type": "wan", "device": "default"}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red fox running through snow", "clip": ["2", 0]}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"text": NEG, "clip": ["2", 0]}},
        "5": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 128, "height": 128, "length": 9, "batch_size": 1}},
        "6": {"class_type": "KSampler", "inputs": {"model": ["20", 0], "seed": 7, "steps": 4, "cfg": 4.0,
                                                  "sampler_name": "euler", "scheduler": "simple", "positive": ["3", 0],
                                                  "negative": ["4", 0], "latent_image": ["5", 0], "denoise": 1.0}},
        "7": {"class_type": "MemoryKitMemoryReport", "inputs": {"value": ["6", 0], "label": "after sampling", "reset_peak": True}},
        "8": {"class_type": "VAELoader", "inputs": {"vae_name": WAN_VAE}},
        "9": {"class_type": "VAEDecode", "inputs": {"samples": ["7", 0], "vae": ["8", 0]}},
        "10": {"class_type": "MemoryKitMemoryReport", "inputs": {"value": ["9", 0], "label": "after VAE decode", "reset_peak": True}},
        "11": {"class_type": "SaveAnimatedWEBP", "inputs": {"images": ["10", 0], "filename_prefix": "MemoryKit/wan21",
                                                           "fps": 16.0, "lossless": False, "quality": 80, "method": "default"}},
        # The sampling shift Comfy's own Wan templates set (ModelSamplingSD3, shift 8) before the sampler.
        "20": _shift(["1", 0]),
    }


def wan21_device_map() -> dict:
    """Wan 2.1 t2v with a Balanced Device Map between the loader and the sampler: ``balanced`` over
    ``auto`` budgets (every GPU's free memory, then CPU RAM), what a user with the real model wants.
    The demo and tests run it on the tiny model with a cpu + disk map instead
    (``tests/harness/examples.py`` :data:`TINY_DEVICE_MAP`)."""
    p = wan21_t2v()
    p["12"] = {"class_type": "MemoryKitBalancedDeviceMap", "inputs": {
        "model": ["1", 0], "strategy": "balanced", "max_memory": "auto", "offload_folder": "",
        "custom_device_map": ""}}
    p["20"]["inputs"]["model"] = ["12", 0]
    p["11"]["inputs"]["filename_prefix"] = "MemoryKit/wan21_device_map"
    return p


def free_memory_sd15() -> dict:
    """SD1.5 at 256², 4 steps; Free Memory between sampling and decoding, with a Memory Report on
    each side of it (the first lists the UNet, the second lists no model)."""
    p = sd15_txt2img()
    p["7"] = {"class_type": "MemoryKitFreeMemory", "inputs": {"value": ["6", 0], "unload_models": True, "empty_cache": True}}
    p["8"] = {"class_type": "MemoryKitMemoryReport", "inputs": {"value": ["7", 0], "label": "after Free Memory", "reset_peak": True}}
    p["9"] = {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["1", 2]}}
    p["10"] = {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": "MemoryKit/free_memory"}}
    return p


def sharded_sd15_txt2img() -> dict:
    """SD1.5 text-to-image at 256², 4 steps, with the UNet and the CLIP-L each loaded from
    safetensors shards + index (Sharded Checkpoint Loader / Sharded Text Encoder Loader)."""
    return {
        "1": {"class_type": "MemoryKitShardedCheckpointLoader",
              "inputs": {"model_name": SD15_UNET_SHARDED, "weight_dtype": "default"}},
        "2": {"class_type": "MemoryKitShardedTextEncoderLoader",
              "inputs": {"text_encoder_name": SD15_CLIP_SHARDED, "type": "stable_diffusion", "device": "default"}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "a lighthouse at dawn, oil painting", "clip": ["2", 0]}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"text": NEG, "clip": ["2", 0]}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 256, "height": 256, "batch_size": 1}},
        "6": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "seed": 42, "steps": 4, "cfg": 5.0,
                                                  "sampler_name": "euler", "scheduler": "normal", "positive": ["3", 0],
                                                  "negative": ["4", 0], "latent_image": ["5", 0], "denoise": 1.0}},
        "7": {"class_type": "VAELoader", "inputs": {"vae_name": SD15_VAE}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["6", 0], "vae": ["7", 0]}},
        "9": {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": "MemoryKit/sharded_sd15"}},
    }


def fp8_sd15() -> dict:
    """SD1.5 text-to-image with the UNet stored in float8 (FP8 Layerwise Cast before the sampler)."""
    p = sd15_txt2img()
    p["10"] = {"class_type": "MemoryKitFp8LayerwiseCast",
               "inputs": {"model": ["1", 0], "storage_dtype": "float8_e4m3fn", "compute_dtype": "auto",
                          "fp8_matmul": False, "scaling": "per-tensor", "skip_preset": "auto", "extra_skip_patterns": "",
                          "lora_mode": "unmerged"}}
    p["5"]["inputs"]["model"] = ["10", 0]
    p["9"]["inputs"]["filename_prefix"] = "MemoryKit/sd15_fp8"
    return p


def _group_offload(model, offload_to: str = "cpu") -> dict:
    """Group Offload node, block_level, with the node's defaults: blocks kept in RAM (``cpu``), or
    on ``disk`` where the template is about RAM too small for the model."""
    return {"class_type": "MemoryKitGroupOffload",
            "inputs": {"model": model, "offload_type": "block_level", "num_blocks_per_group": 1,
                       "vram_budget_gb": 0.0, "use_stream": True, "record_stream": False,
                       "low_cpu_mem_usage": False, "offload_to": offload_to, "disk_folder": "",
                       "scheduler": "memorykit"}}


def group_offload_wan21_t2v() -> dict:
    """Wan 2.1 14B (fp8_scaled, 14.3 GB: more than an 8-16 GB card holds) text-to-video through
    Group Offload, its blocks kept in RAM and streamed to the GPU."""
    p = wan21_t2v()
    p["1"]["inputs"]["unet_name"] = WAN21_14B_UNET
    p["12"] = _group_offload(["1", 0])
    p["20"]["inputs"]["model"] = ["12", 0]
    p["11"]["inputs"]["filename_prefix"] = "MemoryKit/group_offload_wan21"
    return p


def combined_sd15() -> dict:
    """Every technique in one graph: sharded UNet + CLIP-L → FP8 Layerwise Cast → Group Offload
    (RAM) → KSampler → Tiled VAE Decode → Memory Report → Save."""
    p = sharded_sd15_txt2img()
    p["10"] = {"class_type": "MemoryKitFp8LayerwiseCast",
               "inputs": {"model": ["1", 0], "storage_dtype": "float8_e4m3fn", "compute_dtype": "auto",
                          "fp8_matmul": False, "scaling": "per-tensor", "skip_preset": "auto", "extra_skip_patterns": "",
                          "lora_mode": "unmerged"}}
    p["11"] = _group_offload(["10", 0])
    p["6"]["inputs"]["model"] = ["11", 0]
    p["8"] = _tiled_decode(["6", 0], ["7", 0], 512, 64)
    p["12"] = {"class_type": "MemoryKitMemoryReport", "inputs": {"value": ["8", 0], "label": "after decode", "reset_peak": True}}
    p["9"]["inputs"]["images"] = ["12", 0]
    p["9"]["inputs"]["filename_prefix"] = "MemoryKit/combined_sd15"
    return p


def _tiled_decode(samples: list, vae: list, tile: int, overlap: int, budget_gb: float = 0.0) -> dict:
    return {"class_type": "MemoryKitTiledVAEDecode",
            "inputs": {"samples": samples, "vae": vae, "tile_size": tile, "overlap": overlap, "temporal_size": 64,
                       "temporal_overlap": 8, "memory_budget_gb": budget_gb, "shared_norm_stats": True,
                       "global_context": True}}


def tiled_vae_sd15() -> dict:
    """SD1.5 txt2img ending in Tiled VAE Decode: 512 px tiles, 64 px overlap, at most 2 GiB
    (VAE + one tile; an 8 GB card's share left after the UNet), the node's defaults otherwise."""
    p = sd15_txt2img()
    p["7"] = _tiled_decode(["6", 0], ["1", 2], 512, 64, 2.0)
    p["9"]["inputs"]["filename_prefix"] = "MemoryKit/sd15_tiled_vae"
    return p


def tiled_vae_wan21_t2v() -> dict:
    """Wan 2.1 t2v decoded by Tiled VAE Decode: 256 px tiles (Wan's VAE costs far more per pixel
    than an image VAE), 64 px overlap, at most 2 GiB; time stays whole."""
    p = wan21_t2v()
    p["9"] = _tiled_decode(["7", 0], ["8", 0], 256, 64, 2.0)
    p["11"]["inputs"]["filename_prefix"] = "MemoryKit/wan21_tiled_vae"
    return p


def wan22_two_experts() -> dict:
    """Wan 2.2 text-to-video with its two 14B experts (high noise, then low noise), each through
    Group Offload to disk, so neither expert has to fit in RAM or VRAM whole: two KSampler
    (Advanced) passes split the steps between them. Model files as ComfyUI's Wan 2.2 template
    names them; 9 frames at 128² and 4 steps so the demo runs on a CPU (use 81 frames at 832×480
    and 20 steps with the real models)."""
    p = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors",
                                                    "weight_dtype": "default"}},
        "2": {"class_type": "UNETLoader", "inputs": {"unet_name": "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors",
                                                    "weight_dtype": "default"}},
        "3": _group_offload(["1", 0], "disk"),
        "4": _group_offload(["2", 0], "disk"),
        "20": _shift(["3", 0]),
        "21": _shift(["4", 0]),
        "5": {"class_type": "CLIPLoader", "inputs": {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "type": "wan", "device": "default"}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red fox running through snow", "clip": ["5", 0]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": NEG, "clip": ["5", 0]}},
        "8": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 128, "height": 128, "length": 9, "batch_size": 1}},
        "9": {"class_type": "KSamplerAdvanced", "inputs": {
            "model": ["20", 0], "add_noise": "enable", "noise_seed": 7, "steps": 4, "cfg": 4.0, "sampler_name": "euler",
            "scheduler": "simple", "positive": ["6", 0], "negative": ["7", 0], "latent_image": ["8", 0],
            "start_at_step": 0, "end_at_step": 2, "return_with_leftover_noise": "enable"}},
        "10": {"class_type": "KSamplerAdvanced", "inputs": {
            "model": ["21", 0], "add_noise": "disable", "noise_seed": 7, "steps": 4, "cfg": 4.0, "sampler_name": "euler",
            "scheduler": "simple", "positive": ["6", 0], "negative": ["7", 0], "latent_image": ["9", 0],
            "start_at_step": 2, "end_at_step": 10000, "return_with_leftover_noise": "disable"}},
        "11": {"class_type": "MemoryKitMemoryReport", "inputs": {"value": ["10", 0], "label": "after both experts", "reset_peak": True}},
        "12": {"class_type": "VAELoader", "inputs": {"vae_name": "wan_2.1_vae.safetensors"}},
        "13": {"class_type": "VAEDecode", "inputs": {"samples": ["11", 0], "vae": ["12", 0]}},
        "14": {"class_type": "SaveAnimatedWEBP", "inputs": {"images": ["13", 0], "filename_prefix": "MemoryKit/wan22_two_experts",
                                                           "fps": 16.0, "lossless": False, "quality": 80, "method": "default"}},
    }
    return p



def _memory_plan(model, vae, latent, plan_for="this machine", vram_gb=12.0, ram_gb=32.0, width=1024,
                 height=1024, frames=81) -> dict:
    return {"class_type": "MemoryKitMemoryPlan", "inputs": {
        "model": model, "plan_for": plan_for, "allow_fp8": True, "prefer": "speed", "vram_gb": vram_gb,
        "ram_gb": ram_gb, "disk_gb": 100.0, "width": width, "height": height, "frames": frames,
        **({"vae": vae} if vae else {}), "latent": latent}}


def memory_plan_sd15() -> dict:
    """SD1.5 text-to-image at 256², 4 steps, the UNet and the VAE through Memory Plan for a
    12 GB card with 32 GB RAM (given figures): the plan picks fp8/offload for the UNet and the
    VAE's tiles; VAE Decode uses them."""
    p = sd15_txt2img()
    p["10"] = _memory_plan(["1", 0], ["1", 2], ["4", 0], "given figures", 12.0, 32.0)
    p["5"]["inputs"]["model"] = ["10", 0]
    p["7"]["inputs"]["vae"] = ["10", 1]
    p["9"]["inputs"]["filename_prefix"] = "MemoryKit/memory_plan_sd15"
    return p


def memory_plan_wan22() -> dict:
    """Wan 2.2's whole workflow through one Memory Plan for a machine with 16 GB VRAM and 32 GB RAM
    (given figures): the text encoder (clip), the high-noise expert (model), the low-noise expert
    (model_2) and the VAE planned together; each sampler, the text encoders and VAE Decode take
    their component from the plan's outputs."""
    p = wan22_two_experts()
    p["3"] = _memory_plan(["1", 0], ["12", 0], ["8", 0], "given figures", 16.0, 32.0, 832, 480, 81)
    p["3"]["inputs"].update({"clip": ["5", 0], "model_2": ["2", 0]})
    del p["4"]
    p["6"]["inputs"]["clip"] = ["3", 2]
    p["7"]["inputs"]["clip"] = ["3", 2]
    p["21"]["inputs"]["model"] = ["3", 3]
    p["13"]["inputs"]["vae"] = ["3", 1]
    p["14"]["inputs"]["filename_prefix"] = "MemoryKit/memory_plan_wan22"
    return p

FLUX2_UNET = "flux2_dev_fp8mixed.safetensors"
FLUX2_TE = "mistral_3_small_flux2_fp8.safetensors"
FLUX2_VAE = "flux2-vae.safetensors"


def memory_plan_flux2_dev() -> dict:
    """Flux 2 [dev]'s whole workflow through one Memory Plan for a machine with 16 GB VRAM and 64 GB
    RAM (given figures): the text encoder (Mistral Small 3 24B, clip), the diffusion model (model)
    and the VAE planned together; the text encoder, the guider and VAE Decode take their component
    from the plan's outputs. The graph is Comfy's own Flux 2 [dev] one (FluxGuidance 4, Flux 2
    scheduler, SamplerCustomAdvanced); 256² and 4 steps so the demo runs on a CPU."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": FLUX2_UNET, "weight_dtype": "default"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": FLUX2_TE, "type": "flux2", "device": "default"}},
        "3": {"class_type": "VAELoader", "inputs": {"vae_name": FLUX2_VAE}},
        "4": {"class_type": "EmptyFlux2LatentImage", "inputs": {"width": 256, "height": 256, "batch_size": 1}},
        "5": {"class_type": "MemoryKitMemoryPlan", "inputs": {
            "model": ["1", 0], "plan_for": "given figures", "allow_fp8": True, "prefer": "speed", "vram_gb": 16.0,
            "ram_gb": 64.0, "disk_gb": 100.0, "width": 1024, "height": 1024, "frames": 1, "vae": ["3", 0],
            "latent": ["4", 0], "clip": ["2", 0]}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a lighthouse at dawn, oil painting", "clip": ["5", 2]}},
        "7": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["6", 0], "guidance": 4.0}},
        "8": {"class_type": "RandomNoise", "inputs": {"noise_seed": 42}},
        "9": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
        "10": {"class_type": "Flux2Scheduler", "inputs": {"steps": 4, "width": 256, "height": 256}},
        "11": {"class_type": "BasicGuider", "inputs": {"model": ["5", 0], "conditioning": ["7", 0]}},
        "12": {"class_type": "SamplerCustomAdvanced", "inputs": {"noise": ["8", 0], "guider": ["11", 0], "sampler": ["9", 0],
                                                                "sigmas": ["10", 0], "latent_image": ["4", 0]}},
        "13": {"class_type": "MemoryKitMemoryReport", "inputs": {"value": ["12", 0], "label": "after sampling", "reset_peak": True}},
        "14": {"class_type": "VAEDecode", "inputs": {"samples": ["13", 0], "vae": ["5", 1]}},
        "15": {"class_type": "SaveImage", "inputs": {"images": ["14", 0], "filename_prefix": "MemoryKit/memory_plan_flux2_dev"}},
    }


# Download locations of the real model files the workflows name (properties.models, as core's templates).
MODEL_URLS = {
    SD15_CKPT: ("https://huggingface.co/Comfy-Org/stable-diffusion-v1-5-archive/resolve/main/"
                "v1-5-pruned-emaonly-fp16.safetensors", "checkpoints"),
    SD15_VAE: ("https://huggingface.co/stabilityai/sd-vae-ft-mse-original/resolve/main/"
               "vae-ft-mse-840000-ema-pruned.safetensors", "vae"),
    WAN21_UNET: ("https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/"
                 "diffusion_models/wan2.1_t2v_1.3B_fp16.safetensors", "diffusion_models"),
    WAN21_14B_UNET: ("https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/"
                     "diffusion_models/wan2.1_t2v_14B_fp8_scaled.safetensors", "diffusion_models"),
    "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors": ("https://huggingface.co/Comfy-Org/Wan_2.2_ComfyUI_Repackaged/resolve/"
                                                   "main/split_files/diffusion_models/wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors",
                                                   "diffusion_models"),
    "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors": ("https://huggingface.co/Comfy-Org/Wan_2.2_ComfyUI_Repackaged/resolve/"
                                                  "main/split_files/diffusion_models/wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors",
                                                  "diffusion_models"),
    "umt5_xxl_fp8_e4m3fn_scaled.safetensors": ("https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/"
                                               "main/split_files/text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors",
                                               "text_encoders"),
    "wan_2.1_vae.safetensors": ("https://huggingface.co/Comfy-Org/Wan_2.2_ComfyUI_Repackaged/resolve/"
                                "main/split_files/vae/wan_2.1_vae.safetensors", "vae"),
    FLUX2_UNET: ("https://huggingface.co/Comfy-Org/flux2-dev/resolve/main/split_files/diffusion_models/"
                 "flux2_dev_fp8mixed.safetensors", "diffusion_models"),
    FLUX2_TE: ("https://huggingface.co/Comfy-Org/flux2-dev/resolve/main/split_files/text_encoders/"
               "mistral_3_small_flux2_fp8.safetensors", "text_encoders"),
    FLUX2_VAE: ("https://huggingface.co/Comfy-Org/flux2-dev/resolve/main/split_files/vae/flux2-vae.safetensors", "vae"),
}


def add_model_urls(ui: dict) -> dict:
    """Set ``properties.models`` ([{name, url, directory}]) on each loader naming a known file."""
    for n in ui["nodes"]:
        found = [v for v in n.get("widgets_values") or [] if isinstance(v, str) and v in MODEL_URLS]
        if found:
            n.setdefault("properties", {})["models"] = [
                {"name": v, "url": MODEL_URLS[v][0], "directory": MODEL_URLS[v][1]} for v in found]
    return ui


WORKFLOWS = {
    "memory_report_sd15": sd15_txt2img,
    "fp8_layerwise_sd15": fp8_sd15,
    "memory_report_wan21_t2v": wan21_t2v,
    "balanced_device_map_wan21_t2v": wan21_device_map,
    "free_memory_sd15": free_memory_sd15,
    "sharded_loaders_sd15": sharded_sd15_txt2img,
    "group_offload_wan21_t2v": group_offload_wan21_t2v,
    "combined_sd15": combined_sd15,
    "tiled_vae_sd15": tiled_vae_sd15,
    "tiled_vae_wan21_t2v": tiled_vae_wan21_t2v,
    "wan22_two_experts_on_32gb_ram": wan22_two_experts,
    "memory_plan_sd15_12gb": memory_plan_sd15,
    "memory_plan_wan22_16gb_vram_32gb_ram": memory_plan_wan22,
    "memory_plan_flux2_dev_16gb_vram_64gb_ram": memory_plan_flux2_dev,
}


# What each workflow shows: a Note node in the graph and the thumbnail's caption.
def add_note(ui: dict, text: str) -> dict:
    """Add a Note node (top left, above the graph) saying what the workflow shows, or set the
    text of the one there; returns ``ui``."""
    for n in ui["nodes"]:
        if n["type"] == "Note":
            n["widgets_values"] = [text]
            return ui
    nid = int(ui.get("last_node_id") or max(n["id"] for n in ui["nodes"])) + 1
    x = min(n["pos"][0] for n in ui["nodes"])
    y = min(n["pos"][1] for n in ui["nodes"])
    ui["nodes"].append({"id": nid, "type": "Note", "pos": [x, y - 170], "size": [520, 130], "flags": {},
                        "order": len(ui["nodes"]), "mode": 0, "inputs": [], "outputs": [],
                        "properties": {}, "widgets_values": [text], "color": "#432", "bgcolor": "#653"})
    ui["last_node_id"] = nid
    return ui


def write_thumbnail(path: Path, name: str, ui: dict) -> None:
    """A small JPEG card (the template browser shows ``<name>.jpg``): the workflow's MemoryKit
    nodes as boxes on the chain loader → ... → output, with its title."""
    from PIL import Image, ImageDraw, ImageFont
    img = Image.new("RGB", (512, 512), "#1b2328")
    d = ImageDraw.Draw(img)
    try:
        big = ImageFont.truetype("DejaVuSans-Bold.ttf", 30)
        small = ImageFont.truetype("DejaVuSans.ttf", 21)
    except OSError:
        big = small = ImageFont.load_default()
    d.text((28, 26), "MemoryKit", fill="#7fd4dc", font=big)
    d.text((28, 66), name.replace("_", " "), fill="#c9d6da", font=small)
    chain = [n for n in sorted(ui["nodes"], key=lambda n: (n["pos"][0], n["pos"][1])) if n["type"] != "Note"]
    titles = []
    for n in chain:
        t = n.get("title") or n["type"]
        if n["type"].startswith("MemoryKit") or any(k in n["type"] for k in ("Loader", "KSampler", "VAEDecode", "Save")):
            t = t.replace("MemoryKit", "")
            if t not in titles:
                titles.append(t)
    y = 120
    for t in titles[:8]:
        ours = any(n["type"] == "MemoryKit" + t for n in chain)
        d.rounded_rectangle([60, y, 452, y + 36], 8, fill="#14505a" if ours else "#33393d",
                            outline="#7fd4dc" if ours else "#555")
        label = "".join(" " + c if c.isupper() and i and not t[i - 1].isupper() else c for i, c in enumerate(t))
        d.text((76, y + 7), label.strip()[:30], fill="#e8f4f4", font=small)
        y += 46
        if y > 470:
            break
    img.save(path, "JPEG", quality=85)


def finish(name: str, ui: dict, out_dir: Path) -> dict:
    """Note node and thumbnail for one workflow."""
    add_note(ui, NOTES.get(name, ""))
    add_model_urls(ui)
    write_thumbnail(out_dir / f"{name}.jpg", name, ui)
    return ui


def main(only: list[str] | None = None) -> None:
    out_dir = REPO / "example_workflows"
    out_dir.mkdir(exist_ok=True)
    with ComfyServer() as srv:
        oi = srv.object_info()
    for name, make in WORKFLOWS.items():
        if only and name not in only:
            continue
        api = make()
        ui = workflow.api_to_ui(api, oi)
        back = workflow.strip_meta(workflow.ui_to_api(ui, oi))
        if back != api:
            raise SystemExit(f"{name}: UI→API round trip differs:\n{back}\n{api}")
        unset = [(n["type"], i) for n in ui["nodes"] for i, v in enumerate(n.get("widgets_values") or []) if v is None]
        if unset:  # an optional widget the definition left out: the editor would send null for it
            raise SystemExit(f"{name}: widgets left unset (node type, widget index): {unset}; set them in the definition")
        finish(name, ui, out_dir)
        (out_dir / f"{name}.json").write_text(json.dumps(ui, indent=1) + "\n")
        print("wrote", out_dir / f"{name}.json")


if __name__ == "__main__":
    if sys.argv[1:] == ["--notes-only"]:  # add notes/thumbnails to the committed files, no server
        for f in sorted((REPO / "example_workflows").glob("*.json")):
            ui = json.loads(f.read_text())
            f.write_text(json.dumps(finish(f.stem, ui, f.parent), indent=1) + "\n")
            print("updated", f)
    else:
        main(sys.argv[1:] or None)
