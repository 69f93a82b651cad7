"""FP8 Layerwise Cast through a real ComfyUI server (SD1.5 fixture, 4 KSampler steps at 128²).

One prompt holds five branches on one Load Checkpoint: FP8, LoRA → FP8, FP8 → LoRA, LoRA
alone, and a plain branch that (by a data dependency) samples after the FP8 branch. A second prompt runs
the plain model alone. Raw latents are compared (MemoryKitTestSaveTensor).
"""
from __future__ import annotations

import pytest
import torch
from harness import loras


def _sampler(model, latent, seed=11):
    return {"class_type": "KSampler", "inputs": {"model": model, "seed": seed, "steps": 4, "cfg": 5.0,
                                                 "sampler_name": "euler", "scheduler": "normal",
                                                 "positive": ["2", 0], "negative": ["3", 0],
                                                 "latent_image": latent, "denoise": 1.0}}


def _base() -> dict:
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "mk_sd15_tiny.safetensors"}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a lighthouse at dawn", "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["1", 1]}},
        "4": {"class_type": "EmptyLatentImage", "inputs": {"width": 128, "height": 128, "batch_size": 1}},
    }


def _fp8(model, **kw) -> dict:
    inputs = {"model": model, "storage_dtype": "float8_e4m3fn", "compute_dtype": "auto", "fp8_matmul": False, "scaling": "per-tensor",
              "skip_preset": "auto", "extra_skip_patterns": ""}
    inputs.update(kw)
    return {"class_type": "MemoryKitFp8LayerwiseCast", "inputs": inputs}


def _lora(model) -> dict:
    return {"class_type": "LoraLoaderModelOnly",
            "inputs": {"model": model, "lora_name": loras.LORA_NAME, "strength_model": 1.0}}


def _save(samples, prefix) -> dict:
    return {"class_type": "MemoryKitTestSaveTensor", "inputs": {"value": samples, "filename_prefix": prefix}}


def _tensors(server, result) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    out = {}
    for ui in result.outputs.values():
        for f in ui.get("tensors", []) or []:
            prefix = f["filename"].rsplit("_", 1)[0]
            out[prefix] = load_file(str(server.base / "output" / f["filename"]))["value"]
    return out


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def lora_file(fixture_models):
    return loras.ensure_sd15_lora()


def test_fp8_branches_lora_orders_and_plain_branch(server, lora_file):
    p = _base()
    p.update({
        "10": _fp8(["1", 0]), "11": _sampler(["10", 0], ["4", 0]), "12": _save(["11", 0], "mk_fp8_fp8"),
        "20": _lora(["1", 0]), "21": _fp8(["20", 0]), "22": _sampler(["21", 0], ["4", 0]),
        "23": _save(["22", 0], "mk_fp8_lora_before"),
        "31": _lora(["10", 0]), "32": _sampler(["31", 0], ["4", 0]), "33": _save(["32", 0], "mk_fp8_lora_after"),
        # Plain branch: its empty latent is the FP8 branch's result × 0, so it samples after it.
        "40": {"class_type": "LatentMultiply", "inputs": {"samples": ["11", 0], "multiplier": 0.0}},
        "41": _sampler(["1", 0], ["40", 0]), "42": _save(["41", 0], "mk_fp8_plain_branch"),
        "50": _sampler(["20", 0], ["4", 0]), "51": _save(["50", 0], "mk_fp8_lora_plain"),
    })
    res = server.run(p, timeout=900)
    assert res.status == "success", res.error
    t = _tensors(server, res)

    # The plain model alone, in a later prompt (a Memory Report in between makes ComfyUI run
    # it again instead of reusing a cached result).
    q = _base()
    q.update({"60": {"class_type": "MemoryKitMemoryReport", "inputs": {"value": ["1", 0], "label": "", "reset_peak": False}},
              "61": _sampler(["60", 0], ["4", 0]), "62": _save(["61", 0], "mk_fp8_plain_alone")})
    res2 = server.run(q, timeout=900)
    assert res2.status == "success", res2.error
    t.update(_tensors(server, res2))

    # The input MODEL is unchanged: the plain branch after the FP8 branch equals a plain run.
    assert torch.equal(t["mk_fp8_plain_branch"], t["mk_fp8_plain_alone"])
    # LoRA before or after the node: the same model, bit for bit.
    assert torch.equal(t["mk_fp8_lora_before"], t["mk_fp8_lora_after"])
    err = rel(t["mk_fp8_fp8"], t["mk_fp8_plain_alone"])
    err_lora = rel(t["mk_fp8_lora_after"], t["mk_fp8_lora_plain"])
    print(f"\nSD1.5 4-step latent, fp8 e4m3 per-tensor vs plain: {err:.4f}; with LoRA: {err_lora:.4f}")
    assert 0 < err <= 0.20 and 0 < err_lora <= 0.20

    rep = res.outputs["10"]["memorykit_report"][0]
    info = rep["fp8"]
    assert {"host", "cuda", "models", "label"} <= set(rep)
    assert info["family"] == "unet" and info["storage_dtype"] == "float8_e4m3fn"
    assert 0 < info["weight_bytes_after"] < info["weight_bytes_before"]
    assert {k["name"] for k in info["kept_layers"]} >= {"time_embed.0", "input_blocks.0.0", "out.2"}
    assert "layers cast" in res.outputs["10"]["text"][0]


def test_bad_pattern_is_reported_and_server_keeps_running(server):
    p = _base()
    p.update({"10": _fp8(["1", 0], extra_skip_patterns="input_blocks\\.(1"),
              "11": _sampler(["10", 0], ["4", 0]), "12": _save(["11", 0], "mk_fp8_bad")})
    res = server.run(p)
    assert res.status == "error"
    assert "invalid skip pattern 'input_blocks\\\\.(1'" in res.error["exception_message"]
    assert res.error["node_type"] == "MemoryKitFp8LayerwiseCast"
    ok = server.run({"1": _base()["1"], "2": {"class_type": "MemoryKitMemoryReport",
                                              "inputs": {"value": ["1", 0], "label": "alive", "reset_peak": False}}})
    assert ok.status == "success", ok.error
