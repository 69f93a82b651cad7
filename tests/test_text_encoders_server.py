"""Text-encoder nodes through the server: a workflow's CLIPLoader → MemoryKit text-encoder node
→ CLIPTextEncode → KSampler gives the same latent as the plain workflow (Group Offload (Text
Encoder) to disk; Text Encoder Device is checked in-process in test_text_encoders.py) (the SD1.5-shaped
checkpoint's diffusion model and its full-size CLIP-L fixture, one sampling step), and the
nodes' badges state the streaming cost per prompt."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from harness import paths

# The nodes' in-process paths run on both cores (test_text_encoders.py); the HTTP round trip
# is the same on both, so it runs on one (suite time).
pytestmark = pytest.mark.skipif("0.33" in str(paths.comfyui_path()), reason="server round trip runs on 0.3.75 only")


def _latent(server, result, node_id: str) -> torch.Tensor:
    f = result.outputs[node_id]["tensors"][0]
    return load_file(str(server.base / "output" / f.get("subfolder", "") / f["filename"]))["value"]


def _branch(p: dict, base: int, clip: list, prefix: str) -> str:
    """Nodes base..base+3: CLIPTextEncode (positive, negative) → KSampler → save; returns the save id."""
    ids = [str(base + i) for i in range(4)]
    p[ids[0]] = {"class_type": "CLIPTextEncode", "inputs": {"text": "a lighthouse at dawn", "clip": clip}}
    p[ids[1]] = {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": clip}}
    p[ids[2]] = {"class_type": "KSampler", "inputs": {"model": ["1", 0], "seed": 3, "steps": 1, "cfg": 5.0,
                                                     "sampler_name": "euler", "scheduler": "normal",
                                                     "positive": [ids[0], 0], "negative": [ids[1], 0],
                                                     "latent_image": ["3", 0], "denoise": 1.0}}
    p[ids[3]] = {"class_type": "MemoryKitTestSaveTensor", "inputs": {"value": [ids[2], 0], "filename_prefix": prefix}}
    return ids[3]


def test_text_encoder_nodes_give_the_plain_latent(server, fixture_models):
    p = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": fixture_models["sd15"].name}},
         "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": fixture_models["sd15_clip_l"].name,
                                                     "type": "stable_diffusion"}},
         "3": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
         "4": {"class_type": "MemoryKitTextEncoderGroupOffload", "inputs": {
             "clip": ["2", 0], "offload_type": "block_level", "num_blocks_per_group": 1, "vram_budget_gb": 0.0,
             "use_stream": True, "record_stream": False, "low_cpu_mem_usage": False, "offload_to": "disk",
             "disk_folder": ""}}}
    plain = _branch(p, 10, ["2", 0], "te_plain")
    offl = _branch(p, 20, ["4", 0], "te_offload")
    res = server.run(p)
    assert res.status == "success", res.error
    ref = _latent(server, res, plain)
    assert torch.isfinite(ref).all() and ref.std() > 0
    assert torch.equal(_latent(server, res, offl), ref)
    rep = res.outputs["4"]["memorykit_report"][0]["text_encoder"]
    assert rep["technique"] == "group_offload" and rep["streamed_bytes_per_prompt"] > 0
    assert "per prompt" in res.outputs["4"]["text"][0]


def test_bad_device_is_a_clear_error(server, fixture_models):
    p = {"2": {"class_type": "CLIPLoader", "inputs": {"clip_name": fixture_models["sd15_clip_l"].name,
                                                     "type": "stable_diffusion"}},
         "5": {"class_type": "MemoryKitTextEncoderDevice", "inputs": {"clip": ["2", 0], "device": "cuda:7"}},
         "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "x", "clip": ["5", 0]}},
         "7": {"class_type": "MemoryKitTestSaveTensor", "inputs": {"value": ["6", 0], "filename_prefix": "te_bad"}}}
    res = server.run(p)
    assert res.status == "error"
    msg = res.error["exception_message"]
    assert "device" in msg and "cuda:7" in msg
