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

NEG = "blurry, low quality"


def sd15_txt2img(extra_model_nodes=None, decode=None) -> dict:
    """SD1.5 text-to-image at 256², 4 steps, with a Memory Report after sampling and after decoding."""
    p = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "mk_sd15_tiny.safetensors"}},
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


def wan21_t2v() -> dict:
    """Wan 2.1 text-to-video, 9 frames at 128×128, 4 steps, Memory Reports, animated WEBP."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "mk_wan21_tiny.safetensors", "weight_dtype": "default"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "type": "wan"}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red fox running through snow", "clip": ["2", 0]}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"text": NEG, "clip": ["2", 0]}},
        "5": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 128, "height": 128, "length": 9, "batch_size": 1}},
        "6": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "seed": 7, "steps": 4, "cfg": 4.0,
                                                  "sampler_name": "euler", "scheduler": "simple", "positive": ["3", 0],
                                                  "negative": ["4", 0], "latent_image": ["5", 0], "denoise": 1.0}},
        "7": {"class_type": "MemoryKitMemoryReport", "inputs": {"value": ["6", 0], "label": "after sampling", "reset_peak": True}},
        "8": {"class_type": "VAELoader", "inputs": {"vae_name": "mk_wan21_vae_tiny.safetensors"}},
        "9": {"class_type": "VAEDecode", "inputs": {"samples": ["7", 0], "vae": ["8", 0]}},
        "10": {"class_type": "MemoryKitMemoryReport", "inputs": {"value": ["9", 0], "label": "after VAE decode", "reset_peak": True}},
        "11": {"class_type": "SaveAnimatedWEBP", "inputs": {"images": ["10", 0], "filename_prefix": "MemoryKit/wan21",
                                                           "fps": 16.0, "lossless": False, "quality": 80, "method": "default"}},
    }


def _tiled_decode(samples: list, vae: list, tile: int, overlap: int) -> dict:
    return {"class_type": "MemoryKitTiledVAEDecode",
            "inputs": {"samples": samples, "vae": vae, "tile_size": tile, "overlap": overlap, "temporal_size": 64,
                       "temporal_overlap": 8, "memory_budget_gb": 0.0, "shared_norm_stats": True,
                       "global_context": True}}


def tiled_vae_sd15() -> dict:
    """SD1.5 txt2img at 256² ending in Tiled VAE Decode with small (128 px) tiles: 3×3 tiles."""
    p = sd15_txt2img()
    p["7"] = _tiled_decode(["6", 0], ["1", 2], 128, 32)
    p["9"]["inputs"]["filename_prefix"] = "MemoryKit/sd15_tiled_vae"
    return p


def tiled_vae_wan21_t2v() -> dict:
    """Wan 2.1 t2v, 9 frames at 128², decoded by Tiled VAE Decode with 64 px tiles (time stays whole)."""
    p = wan21_t2v()
    p["9"] = _tiled_decode(["7", 0], ["8", 0], 64, 16)
    p["11"]["inputs"]["filename_prefix"] = "MemoryKit/wan21_tiled_vae"
    return p


WORKFLOWS = {
    "memory_report_sd15": sd15_txt2img,
    "memory_report_wan21_t2v": wan21_t2v,
    "tiled_vae_sd15": tiled_vae_sd15,
    "tiled_vae_wan21_t2v": tiled_vae_wan21_t2v,
}


def main() -> None:
    out_dir = REPO / "example_workflows"
    out_dir.mkdir(exist_ok=True)
    with ComfyServer() as srv:
        oi = srv.object_info()
    for name, make in WORKFLOWS.items():
        api = make()
        ui = workflow.api_to_ui(api, oi)
        back = workflow.strip_meta(workflow.ui_to_api(ui, oi))
        if back != api:
            raise SystemExit(f"{name}: UI→API round trip differs:\n{back}\n{api}")
        (out_dir / f"{name}.json").write_text(json.dumps(ui, indent=1) + "\n")
        print("wrote", out_dir / f"{name}.json")


if __name__ == "__main__":
    main()
