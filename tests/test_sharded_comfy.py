"""Sharded Checkpoint Loader / Sharded Text Encoder Loader / Save Sharded inside a real ComfyUI.

Equivalence, run through the server: each sharded model's outputs equal the single-file
model's exactly (raw tensors via MemoryKitTestSaveTensor):
- the Flux-shaped fixture in diffusers names, 3 shards, vs the same weights in one
  ComfyUI-format file (UNETLoader), one sampling step;
- a model written by Save Sharded vs the model it was saved from (SD1.5-shaped UNet);
- the SD1.5 checkpoint's CLIP-L as 3 shards vs the same tensors in one file (CLIPLoader).
Errors reach the UI as ``execution_error`` with a message naming the file, and the server
keeps working. In-process: weight_dtype matches core's UNETLoader for every choice.
"""
from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness import paths

NEG = "blurry"


def _saved(server, result, node_id: str) -> dict[str, torch.Tensor]:
    f = result.outputs[node_id]["tensors"][0]
    return load_file(str(server.base / "output" / f.get("subfolder", "") / f["filename"]))


def _ok(result):
    assert result.status == "success", result.error
    return result


def _error_message(result) -> str:
    assert result.status == "error", f"expected an error, got {result.status}"
    return result.error["exception_message"]


def _sample(model: list, positive: list, negative: list, latent: dict, prefix: str, steps: int = 1,
            cfg: float = 1.0, scheduler: str = "simple") -> dict:
    """Nodes 10..12: latent → KSampler → MemoryKitTestSaveTensor (node "12")."""
    return {
        "10": latent,
        "11": {"class_type": "KSampler", "inputs": {"model": model, "seed": 3, "steps": steps, "cfg": cfg,
                                                   "sampler_name": "euler", "scheduler": scheduler,
                                                   "positive": positive, "negative": negative,
                                                   "latent_image": ["10", 0], "denoise": 1.0}},
        "12": {"class_type": "MemoryKitTestSaveTensor", "inputs": {"value": ["11", 0], "filename_prefix": prefix}},
    }


# -- Flux-shaped fixture: diffusers names in 3 shards ≡ one ComfyUI-format file --------------------

def _flux_prompt(loader: dict, prefix: str) -> dict:
    p = {"1": loader,
         "2": {"class_type": "MemoryKitTestFluxTextEncode", "inputs": {"text": "a lighthouse", "tokens": 8, "guidance": 3.5}},
         "3": {"class_type": "MemoryKitTestFluxTextEncode", "inputs": {"text": NEG, "tokens": 8, "guidance": 3.5}}}
    p.update(_sample(["1", 0], ["2", 0], ["3", 0], {"class_type": "EmptySD3LatentImage",
                                                      "inputs": {"width": 128, "height": 128, "batch_size": 1}}, prefix))
    return p


def test_sharded_flux_diffusers_names_equal_single_file(server, fixture_models):
    single = _ok(server.run(_flux_prompt({"class_type": "UNETLoader", "inputs": {
        "unet_name": fixture_models["flux"].name, "weight_dtype": "default"}}, "flux_single")))
    ref = _saved(server, single, "12")["value"]
    server.free()
    res = _ok(server.run(_flux_prompt({"class_type": "MemoryKitShardedCheckpointLoader", "inputs": {
        "model_name": fixture_models["flux_sharded"].name, "weight_dtype": "default"}}, "flux_sharded")))
    out = _saved(server, res, "12")["value"]
    server.free()
    assert out.shape == ref.shape == (1, 16, 16, 16)
    assert torch.isfinite(ref).all() and ref.std() > 0
    assert torch.equal(out, ref), f"max abs diff {(out - ref).abs().max()}"
    rep = res.outputs["1"]["memorykit_report"][0]
    assert rep["sharded"]["shards"] == 3 and rep["sharded"]["tensors"] == 66
    assert rep["sharded"]["total_bytes"] == json.loads(next(fixture_models["flux_sharded"].glob(
        "*.index.json")).read_text())["metadata"]["total_size"]
    assert "Loaded 3 shards" in res.outputs["1"]["text"][0] and "RAM:" in res.outputs["1"]["text"][0]


# -- CLIP-L: 3 shards ≡ one file --------------------------------------------------------------------

def test_sharded_clip_l_equals_single_file(server, fixture_models):
    text = "a lighthouse at dawn, oil painting"
    p = {
        "1": {"class_type": "CLIPLoader", "inputs": {"clip_name": fixture_models["sd15_clip_l"].name,
                                                    "type": "stable_diffusion"}},
        "2": {"class_type": "MemoryKitShardedTextEncoderLoader", "inputs": {
            "text_encoder_name": fixture_models["sd15_clip_l_sharded"].name, "type": "stable_diffusion"}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": text, "clip": ["1", 0]}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"text": text, "clip": ["2", 0]}},
        "5": {"class_type": "MemoryKitTestSaveTensor", "inputs": {"value": ["3", 0], "filename_prefix": "clip_single"}},
        "6": {"class_type": "MemoryKitTestSaveTensor", "inputs": {"value": ["4", 0], "filename_prefix": "clip_sharded"}},
    }
    res = _ok(server.run(p))
    ref, out = _saved(server, res, "5"), _saved(server, res, "6")
    assert ref["value"].shape == (1, 77, 768) and ref["pooled_output"].shape == (1, 768)
    assert torch.isfinite(ref["value"]).all() and ref["value"].std() > 0
    assert torch.equal(out["value"], ref["value"]) and torch.equal(out["pooled_output"], ref["pooled_output"])
    assert res.outputs["2"]["memorykit_report"][0]["sharded"]["shards"] == 3


# -- Save Sharded → Sharded Checkpoint Loader ≡ the model saved ---------------------------------------

def _sd15_prompt(model: list, prefix: str) -> dict:
    p = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "mk_sd15_tiny.safetensors"}},
         "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a lighthouse", "clip": ["1", 1]}},
         "3": {"class_type": "CLIPTextEncode", "inputs": {"text": NEG, "clip": ["1", 1]}}}
    p.update(_sample(model, ["2", 0], ["3", 0], {"class_type": "EmptyLatentImage", "inputs": {
        "width": 64, "height": 64, "batch_size": 1}}, prefix, steps=2, cfg=5.0, scheduler="normal"))
    return p


def _save_node(model: list, name: str, size: str = "40MB", overwrite: bool = False) -> dict:
    return {"class_type": "MemoryKitSaveSharded", "inputs": {"model": model, "name": name, "max_shard_size": size,
                                                            "overwrite": overwrite}}


@pytest.fixture
def saved_name(server):
    """A unique folder name under the server's models/diffusion_models, removed afterwards."""
    name = f"mk_test_saved_{uuid.uuid4().hex[:8]}"
    yield name
    root = server.base / "models" / "diffusion_models"
    shutil.rmtree(root / name, ignore_errors=True)
    for left in root.glob(f".{name}.*"):
        shutil.rmtree(left, ignore_errors=True)


def _listing(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


def test_save_sharded_then_load_equals_the_saved_model(server, saved_name):
    root = server.base / "models" / "diffusion_models"
    p = _sd15_prompt(["1", 0], "sd15_plain")
    p["20"] = _save_node(["1", 0], saved_name)
    res = _ok(server.run(p))
    ref = _saved(server, res, "12")["value"]
    folder = root / saved_name
    files = sorted(f.name for f in folder.iterdir() if f.name != ".memorykit-save.json")
    n = len(files) - 1
    assert n >= 3 and files == sorted(["model.safetensors.index.json"] + [f"model-{i:05d}-of-{n:05d}.safetensors"
                                                                           for i in range(1, n + 1)])
    assert not list(root.glob(f".{saved_name}.*")), "temporary folder left behind"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert all(k.startswith("model.diffusion_model.") for k in index["weight_map"])  # ModelSave's names
    info = res.outputs["20"]["memorykit_report"][0]["sharded"]
    assert info["shards"] == n and info["total_bytes"] == index["metadata"]["total_size"]

    loaded = {"30": {"class_type": "MemoryKitShardedCheckpointLoader",
                     "inputs": {"model_name": saved_name, "weight_dtype": "default"}}}
    res2 = _ok(server.run(_sd15_prompt(["30", 0], "sd15_resharded") | loaded))
    assert torch.equal(_saved(server, res2, "12")["value"], ref)

    # An existing folder is refused (and left as it was) unless overwrite is on.
    before = _listing(folder)
    msg = _error_message(server.run({"1": p["1"], "20": _save_node(["1", 0], saved_name, "30MB")}))
    assert "already exists" in msg and saved_name in msg
    assert _listing(folder) == before
    _ok(server.run({"1": p["1"], "20": _save_node(["1", 0], saved_name, "1GB", overwrite=True)}))
    assert sorted(f.name for f in folder.iterdir()) == [".memorykit-save.json", "model-00001-of-00001.safetensors",
                                                       "model.safetensors.index.json"]
    assert not list(root.glob(f".{saved_name}.*"))


def test_save_sharded_merges_weight_patches(server, saved_name):
    """A patched MODEL (ModelMergeAdd: weights doubled by patches) is saved with the patches
    merged, as core's ModelSave does: reloading gives the patched model's output."""
    p = _sd15_prompt(["5", 0], "sd15_patched")
    p["5"] = {"class_type": "ModelMergeAdd", "inputs": {"model1": ["1", 0], "model2": ["1", 0]}}
    p["20"] = _save_node(["5", 0], saved_name)
    ref = _saved(server, _ok(server.run(p)), "12")["value"]
    plain = _saved(server, _ok(server.run(_sd15_prompt(["1", 0], "sd15_plain2"))), "12")["value"]
    loaded = {"30": {"class_type": "MemoryKitShardedCheckpointLoader",
                     "inputs": {"model_name": saved_name, "weight_dtype": "default"}}}
    out = _saved(server, _ok(server.run(_sd15_prompt(["30", 0], "sd15_patched_reloaded") | loaded)), "12")["value"]
    assert not torch.equal(ref, plain)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("name,size,needle", [("mk_test_badsize", "5GiB", "max_shard_size '5GiB'"),
                                              ("../escape", "5GB", "'../escape'"),
                                              ("/tmp/abs", "5GB", "/tmp/abs")])
def test_save_sharded_bad_input_errors(server, name, size, needle):
    root = server.base / "models" / "diffusion_models"
    before = sorted(p.name for p in root.parent.iterdir()), sorted(p.name for p in root.iterdir())
    res = server.run({"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "mk_sd15_tiny.safetensors"}},
                      "20": _save_node(["1", 0], name, size)})
    assert needle in _error_message(res)
    assert (sorted(p.name for p in root.parent.iterdir()), sorted(p.name for p in root.iterdir())) == before


# -- bad checkpoints reach the UI as clear errors; the server keeps working ---------------------------

@pytest.fixture
def private_models(server):
    """``models/unet`` of this server's own base directory (ComfyUI also lists it as
    diffusion_models): bad checkpoints go there, not into the shared model cache."""
    d = server.base / "models" / "unet"
    d.mkdir(exist_ok=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _small_checkpoint(folder: Path, sd: dict) -> Path:
    from huggingface_hub import save_torch_state_dict
    folder.mkdir(parents=True)
    save_torch_state_dict(sd, str(folder), max_shard_size="10KB")
    return folder


def _load_prompt(name: str) -> dict:
    return {"1": {"class_type": "MemoryKitShardedCheckpointLoader", "inputs": {"model_name": name,
                                                                              "weight_dtype": "default"}},
            "2": {"class_type": "MemoryKitMemoryReport", "inputs": {"value": ["1", 0], "label": "", "reset_peak": False}}}


def test_missing_shard_is_a_clear_ui_error(server, private_models):
    folder = _small_checkpoint(private_models / "mk_bad_missing", {f"w{i}": torch.ones(40, 40) for i in range(3)})
    victim = sorted(folder.glob("*.safetensors"))[1]
    victim.unlink()
    res = server.run(_load_prompt("mk_bad_missing"))
    msg = _error_message(res)
    assert victim.name in msg and "missing" in msg
    assert res.error["node_type"] == "MemoryKitShardedCheckpointLoader"


def test_unrecognised_model_is_a_clear_ui_error(server, private_models):
    _small_checkpoint(private_models / "mk_not_a_model", {f"w{i}": torch.ones(40, 40) for i in range(3)})
    msg = _error_message(server.run(_load_prompt("mk_not_a_model")))
    assert "Could not detect the model type" in msg and "mk_not_a_model" in msg


def test_loader_lists_sharded_folders_only(object_info, fixture_models):
    names = object_info["MemoryKitShardedCheckpointLoader"]["input"]["required"]["model_name"][1]["options"]
    assert {"mk_flux_tiny_sharded", "mk_sd15_tiny_unet_sharded"} <= set(names)
    assert not any(n.endswith(".safetensors") for n in names)
    te = object_info["MemoryKitShardedTextEncoderLoader"]["input"]["required"]["text_encoder_name"][1]["options"]
    assert "mk_sd15_clip_l_sharded" in te


# -- in-process: weight_dtype exactly as core's UNETLoader ----------------------------------------

@pytest.mark.parametrize("weight_dtype", ["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"])
def test_weight_dtype_matches_core(comfy, fixture_models, weight_dtype):
    import comfy.sd
    import comfy.utils
    from comfyui_memorykit.memorykit import comfy_integration as ci
    ours, info = ci.load_sharded_diffusion_model(fixture_models["sd15_unet_sharded"], weight_dtype,
                                                 progress=lambda d, t: None)
    opts = ci.weight_dtype_options(weight_dtype)
    ref = comfy.sd.load_diffusion_model_state_dict(comfy.utils.load_torch_file(str(fixture_models["sd15"])), opts)
    assert type(ours.model) is type(ref.model) and type(ours) is type(ref)
    assert ours.model.model_config.unet_config == ref.model.model_config.unet_config
    assert ours.model.manual_cast_dtype == ref.model.manual_cast_dtype
    assert ours.model.model_config.optimizations == ref.model.model_config.optimizations
    a, b = ours.model.diffusion_model.state_dict(), ref.model.diffusion_model.state_dict()
    assert a.keys() == b.keys()
    for k in b:
        bits_a, bits_b = a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)
        assert a[k].dtype == b[k].dtype and torch.equal(bits_a, bits_b), k
    if weight_dtype != "default":
        assert any(t.dtype.itemsize == 1 for t in a.values())


def test_text_encoder_on_cpu_device(comfy, fixture_models):
    from comfyui_memorykit.memorykit import comfy_integration as ci
    clip, info = ci.load_sharded_text_encoder(fixture_models["sd15_clip_l_sharded"], "stable_diffusion", "cpu",
                                              progress=lambda d, t: None)
    assert clip.patcher.load_device == torch.device("cpu") and info["shards"] == 3


def test_unsharded_hugging_face_text_encoder_folder_equals_load_clip(comfy, tmp_path, fixture_models):
    """A text_encoder/ folder as Hugging Face ships SD1.5's (model.safetensors, no index) loads
    through the Sharded Text Encoder Loader to the weights core's Load CLIP gives for that file."""
    import comfy.sd
    from comfyui_memorykit.memorykit import comfy_integration as ci
    folder = tmp_path / "stable-diffusion-v1-5" / "text_encoder"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").symlink_to(fixture_models["sd15_clip_l"])
    ours, info = ci.load_sharded_text_encoder(folder, "stable_diffusion", "default", progress=lambda d, t: None)
    ref = comfy.sd.load_clip([str(fixture_models["sd15_clip_l"])], clip_type=comfy.sd.CLIPType.STABLE_DIFFUSION)
    assert info["shards"] == 1
    a, b = ours.cond_stage_model.state_dict(), ref.cond_stage_model.state_dict()
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in b)


def test_corrupted_shard_builds_no_model(comfy, tmp_path, fixture_models):
    """The ComfyUI path validates every shard before reading one: no progress, no model."""
    from comfyui_memorykit.memorykit import comfy_integration as ci, sharded
    folder = tmp_path / "unet"
    shutil.copytree(fixture_models["sd15_unet_sharded"], folder)
    last = sorted(folder.glob("*.safetensors"))[-1]
    last.write_bytes(last.read_bytes()[:-10])
    calls = []
    with pytest.raises(sharded.ShardedCheckpointError, match=last.name):
        ci.load_sharded_diffusion_model(folder, progress=lambda d, t: calls.append(d))
    assert calls == []
