"""Group Offload and Balanced Device Map share one reuse rule (issue 14, items 5, 7, 8), through a
real ComfyUI server with the Wan fixture on CPU (Group Offload to disk, device maps cpu + disk).

- object patches of a downstream clone (ModelSamplingDiscrete) are applied although the
  placement is reused: every branch equals the plain model with the same patches;
- with nothing changed, queueing again reuses the device map (one offload folder, not one per queue);
- FP8 Layerwise Cast of the same file after a device-map run is really float8 (differs from the
  plain model, equals the same cast made before the device map) and computes in bf16.
"""
from __future__ import annotations

import os

import torch
from safetensors.torch import load_file

WAN = "mk_wan21_tiny.safetensors"


def _base(seed: int = 11) -> dict:
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": WAN, "weight_dtype": "default"}},
        "2": {"class_type": "MemoryKitTestWanTextEncode", "inputs": {"text": "a red fox in snow", "tokens": 16}},
        "3": {"class_type": "MemoryKitTestWanTextEncode", "inputs": {"text": "blurry", "tokens": 16}},
        "4": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 5,
                                                                  "batch_size": 1}},
    }


def _prompt(models: dict, branches: dict, seed: int = 11, tag: str = "pl") -> dict:
    """``models``: extra nodes (id → node); ``branches``: name → model reference sampled and saved."""
    p = _base()
    p.update(models)
    for name, model in branches.items():
        p[f"ks_{name}"] = {"class_type": "KSampler", "inputs": {
            "model": model, "seed": seed, "steps": 3, "cfg": 4.0, "sampler_name": "euler", "scheduler": "simple",
            "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}}
        p[f"save_{name}"] = {"class_type": "MemoryKitTestSaveTensor",
                             "inputs": {"value": [f"ks_{name}", 0], "filename_prefix": f"{tag}_{name}"}}
    return p


def _latents(server, res) -> dict[str, torch.Tensor]:
    assert res.status == "success", res.error
    out = {}
    for nid, ui in res.outputs.items():
        if nid.startswith("save_"):
            out[nid[len("save_"):]] = load_file(server.base / "output" / ui["tensors"][0]["filename"])["value"]
    return out


def _go(model, folder) -> dict:
    return {"class_type": "MemoryKitGroupOffload", "inputs": {
        "model": model, "offload_type": "block_level", "num_blocks_per_group": 1, "vram_budget_gb": 0.0,
        "use_stream": True, "record_stream": False, "low_cpu_mem_usage": False, "offload_to": "disk",
        "disk_folder": str(folder)}}


def _dm(model, folder, max_memory="cpu=3MiB, disk") -> dict:
    return {"class_type": "MemoryKitBalancedDeviceMap", "inputs": {
        "model": model, "strategy": "balanced", "max_memory": max_memory, "offload_folder": str(folder),
        "custom_device_map": ""}}


def _msd(model, sampling="v_prediction", zsnr=True) -> dict:
    return {"class_type": "ModelSamplingDiscrete", "inputs": {"model": model, "sampling": sampling, "zsnr": zsnr}}


def _fp8(model, **kw) -> dict:
    inputs = {"model": model, "storage_dtype": "float8_e4m3fn", "compute_dtype": "auto", "fp8_matmul": False,
              "scaling": "per-tensor", "skip_preset": "auto", "extra_skip_patterns": ""}
    inputs.update(kw)
    return {"class_type": "MemoryKitFp8LayerwiseCast", "inputs": inputs}


_WAKE = {"1": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
         "2": {"class_type": "MemoryKitTestSaveTensor", "inputs": {"value": ["1", 0], "filename_prefix": "pl_wake"}}}


def _unload(server) -> None:
    server.free(unload_models=True, free_memory=True)
    res = server.run(_WAKE)  # ComfyUI handles /free when its queue wakes up: a trivial prompt wakes it
    assert res.status == "success", res.error


def test_object_patches_of_downstream_clones_apply_under_group_offload_and_device_map(server, tmp_path):
    """Item 5: two clones share settings, patch uuid and device; the second has its own object
    patches (ModelSamplingDiscrete). Each branch equals the plain model with the same patches."""
    _unload(server)
    plain = _latents(server, server.run(_prompt(
        {"m_v": _msd(["1", 0]), "m_lcm": _msd(["1", 0], "lcm", False)},
        {"plain": ["1", 0], "v": ["m_v", 0], "lcm": ["m_lcm", 0]}, tag="pl5ref")))
    assert not torch.equal(plain["v"], plain["plain"]) and not torch.equal(plain["lcm"], plain["v"])
    _unload(server)
    for kind, node in (("go", _go), ("dm", _dm)):
        res = server.run(_prompt(
            {"p": node(["1", 0], tmp_path), "p_v": _msd(["p", 0]), "p_lcm": _msd(["p", 0], "lcm", False)},
            {"plain": ["p", 0], "v": ["p_v", 0], "lcm": ["p_lcm", 0]}, tag=f"pl5{kind}"))
        got = _latents(server, res)
        for name in ("plain", "v", "lcm"):
            assert torch.equal(got[name], plain[name]), f"{kind}: branch {name} differs from the plain model"
        _unload(server)
    assert os.listdir(tmp_path) == []


def test_device_map_is_reused_when_nothing_changed(server, tmp_path):
    """Item 8: three queues differing only in the seed sample the same device-mapped clone: the
    map is dispatched once (one offload folder for all three), and each run equals the plain model."""
    _unload(server)
    folders, got, ref = [], [], []
    for seed in (1, 2, 3):
        got.append(_latents(server, server.run(_prompt({"dm": _dm(["1", 0], tmp_path)}, {"x": ["dm", 0]},
                                                       seed=seed, tag="pl8")))["x"])
        folders.append(sorted(os.listdir(tmp_path)))
    assert folders[0] == folders[1] == folders[2] and len(folders[0]) == 1, folders
    _unload(server)
    assert os.listdir(tmp_path) == []
    for seed in (1, 2, 3):
        ref.append(_latents(server, server.run(_prompt({}, {"x": ["1", 0]}, seed=seed, tag="pl8ref")))["x"])
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_fp8_after_a_device_map_run_is_float8(server, tmp_path):
    """Item 7: UNETLoader → FP8 → KSampler; UNETLoader → Balanced Device Map (cpu=3MiB, disk) →
    KSampler; then FP8 Layerwise Cast of the same model must still cast (and compute in bf16)."""
    _unload(server)
    plain = _latents(server, server.run(_prompt({}, {"x": ["1", 0]}, tag="pl7plain")))["x"]
    before = _latents(server, server.run(_prompt({"f": _fp8(["1", 0], scaling="per-output-channel")},
                                                 {"x": ["f", 0]}, tag="pl7before")))["x"]
    assert not torch.equal(before, plain)
    _unload(server)
    assert _latents(server, server.run(_prompt({"f": _fp8(["1", 0])}, {"x": ["f", 0]}, tag="pl7a")))["x"] is not None
    mapped = _latents(server, server.run(_prompt({"dm": _dm(["1", 0], tmp_path)}, {"x": ["dm", 0]}, tag="pl7dm")))
    assert torch.equal(mapped["x"], plain)
    # New FP8 nodes (other options than the cached one) read the model the device map ran on.
    after = _latents(server, server.run(_prompt({"f": _fp8(["1", 0], scaling="per-output-channel")},
                                                {"x": ["f", 0]}, tag="pl7after")))["x"]
    assert not torch.equal(after, plain), "FP8 Layerwise Cast silently did nothing after the device map"
    assert torch.equal(after, before)
    bf16 = server.run(_prompt({"f": _fp8(["1", 0], compute_dtype="bfloat16")}, {"x": ["f", 0]}, tag="pl7bf16"))
    assert not torch.equal(_latents(server, bf16)["x"], plain)
    _unload(server)
    assert os.listdir(tmp_path) == []
