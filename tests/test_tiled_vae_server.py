"""Tiled VAE Decode/Encode through a real ComfyUI server: equal to VAE Decode/Encode when one
tile covers the image, a report on the UI, bad input refused clearly with nothing saved."""
from __future__ import annotations

import pytest
import torch
from harness.server import PromptRejected

TILING = {"temporal_size": 64, "temporal_overlap": 8, "memory_budget_gb": 0.0,
          "shared_norm_stats": True, "global_context": True}


def _tiled(kind: str, src: list, vae: list, tile: int, overlap: int) -> dict:
    key = "samples" if kind == "Decode" else "pixels"
    return {"class_type": f"MemoryKitTiledVAE{kind}",
            "inputs": {key: src, "vae": vae, "tile_size": tile, "overlap": overlap, **TILING}}


def _save(src: list, name: str) -> dict:
    return {"class_type": "MemoryKitTestSaveTensor", "inputs": {"value": src, "filename_prefix": f"tvae_{name}"}}


def sd15_prompt() -> dict:
    """SD1.5 txt2img 160×128, 2 steps; core VAE Decode vs Tiled VAE Decode (whole / 64 px tiles),
    then Tiled VAE Encode of the tiled image vs core VAE Encode."""
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "mk_sd15_tiny.safetensors"}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red barn", "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["1", 1]}},
        "4": {"class_type": "EmptyLatentImage", "inputs": {"width": 160, "height": 128, "batch_size": 1}},
        "5": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "seed": 3, "steps": 2, "cfg": 4.0,
                                                  "sampler_name": "euler", "scheduler": "normal", "positive": ["2", 0],
                                                  "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}},
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}},
        "7": _tiled("Decode", ["5", 0], ["1", 2], 512, 64),
        "8": _tiled("Decode", ["5", 0], ["1", 2], 64, 16),
        "9": _tiled("Encode", ["8", 0], ["1", 2], 64, 16),
        "10": {"class_type": "VAEEncode", "inputs": {"pixels": ["8", 0], "vae": ["1", 2]}},
        "11": _save(["6", 0], "core"), "12": _save(["7", 0], "whole"), "13": _save(["8", 0], "tiled"),
        "14": _save(["9", 0], "enc_tiled"), "15": _save(["10", 0], "enc_core"),
    }


def _tensor(server, res, node_id):
    from safetensors.torch import load_file
    f = res.outputs[node_id]["tensors"][0]
    return load_file(str(server.base / "output" / f["subfolder"] / f["filename"]))["value"]


def test_tiled_nodes_in_a_workflow(server, object_info, fixture_models):
    res = server.run(sd15_prompt())
    assert res.status == "success", res.error
    core, whole, tiled = (_tensor(server, res, n) for n in ("11", "12", "13"))
    assert torch.equal(whole, core)  # one tile covers the image: exactly VAE Decode
    assert tiled.shape == core.shape == (1, 128, 160, 3)
    err = ((tiled - core).norm() / (core - core.mean()).norm()).item()
    assert err < 0.5, err  # 64 px tiles on a random-weight VAE: close, not equal
    enc_t, enc_c = _tensor(server, res, "14"), _tensor(server, res, "15")
    assert enc_t.shape == enc_c.shape == (1, 4, 16, 20)
    rep = res.outputs["8"]["memorykit_report"][0]
    assert rep["tiled_vae"]["tiles_per_item"] == 9 and rep["tiled_vae"]["direction"] == "decode"
    assert rep["tiled_vae"]["global_context"] != "off" and rep["tiled_vae"]["shared_norm_stats"]
    assert rep["host"]["rss_peak_bytes"] >= rep["host"]["rss_bytes"] > 0
    assert "Tiled VAE decode" in res.outputs["8"]["text"][0]
    assert res.outputs["9"]["memorykit_report"][0]["tiled_vae"]["direction"] == "encode"
    assert res.outputs["7"]["memorykit_report"][0]["tiled_vae"]["tiles_per_item"] == 1


def test_overlap_not_smaller_than_tile_is_an_error_and_nothing_is_saved(server, fixture_models):
    p = sd15_prompt()
    p["8"]["inputs"]["overlap"] = 64
    p = {k: v for k, v in p.items() if k in ("1", "2", "3", "4", "5", "8", "13")}
    res = server.run(p)
    assert res.status == "error"
    assert res.error["node_type"] == "MemoryKitTiledVAEDecode"
    assert "overlap" in res.error["exception_message"] and "tile_size" in res.error["exception_message"]
    assert "13" not in res.outputs
    ok = server.run({k: v for k, v in sd15_prompt().items() if k in ("1", "2", "3", "4", "5", "7", "12")})
    assert ok.status == "success", ok.error


@pytest.mark.parametrize("tile", [0, -64])
def test_zero_or_negative_tile_is_a_clear_error(server, fixture_models, tile):
    """ComfyUI 0.3.75 skips min/max checks for V3 nodes, so the node itself refuses the value
    (before anything is decoded)."""
    p = sd15_prompt()
    p["8"]["inputs"]["tile_size"] = tile
    p = {k: v for k, v in p.items() if k in ("1", "2", "3", "4", "5", "8", "13")}
    try:
        res = server.run(p)
    except PromptRejected as e:  # a ComfyUI that validates min/max rejects it up front
        assert "tile_size" in str(e.body["node_errors"]["8"])
        return
    assert res.status == "error" and res.error["node_type"] == "MemoryKitTiledVAEDecode"
    assert "tile_size" in res.error["exception_message"] and str(tile) in res.error["exception_message"]
    assert "13" not in res.outputs
