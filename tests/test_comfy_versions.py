"""What differs between the supported ComfyUI versions (0.3.75, 0.33.0), tested on whichever
one this suite runs against: the memory path each loaded model is on, and a MODEL from the
Sharded Checkpoint Loader through the nodes that take over weight placement (Group Offload,
Balanced Device Map), which on 0.33 opt out of dynamic VRAM without a second copy.

On ``--cpu`` ComfyUI 0.33 uses the plain ModelPatcher (``ModelPatcherDynamic.__new__`` returns
one for a CPU load device, and a dynamic patcher cannot be built without CUDA: comfy-aimdo's
host buffers need its native library), so the dynamic-VRAM opt-out itself is checked by the GPU
runbook; here the same code path runs on the standard patcher.
"""
from __future__ import annotations

import pytest
import torch

from harness.fp8_checks import rel


@pytest.fixture(scope="module")
def sharded_unet(comfy, fixture_models):
    from comfyui_memorykit.memorykit import comfy_integration as ci
    model, info = ci.load_sharded_diffusion_model(fixture_models["sd15_unet_sharded"], progress=lambda d, t: None)
    return model


def _args():
    gen = torch.Generator().manual_seed(11)
    return ((torch.randn(1, 4, 16, 16, generator=gen), torch.tensor([400.0])),
            {"c_crossattn": torch.randn(1, 77, 768, generator=gen)})


def _forward(patcher):
    import comfy.model_management as mm
    args, kwargs = _args()
    with torch.inference_mode():
        mm.load_models_gpu([patcher])
        return patcher.model.apply_model(*args, **kwargs).float()


def test_sharded_model_registers_core_reload_factory(sharded_unet):
    """Core rebuilds a model from its loader (multi-GPU clones, non-dynamic delegates) through
    ``cached_patcher_init``; 0.3.75 has no such attribute."""
    import comfy.model_management as mm
    if not hasattr(sharded_unet, "cached_patcher_init"):
        pytest.skip("this ComfyUI has no cached_patcher_init (before 0.33)")
    fn, args = sharded_unet.cached_patcher_init
    again = fn(*args, disable_dynamic=True)
    assert again.model is not sharded_unet.model
    ref = _forward(sharded_unet)
    assert torch.equal(_forward(again), ref)
    mm.unload_all_models()


def test_opt_out_keeps_the_loaded_module(sharded_unet):
    """The patcher Group Offload / Balanced Device Map manage shares the loaded module: nothing is
    read from disk again (a reload would raise here: the factory is replaced by one that fails)."""
    from comfyui_memorykit.memorykit import comfy_integration as ci

    def no_reload(*a, **k):
        raise AssertionError("the model was loaded again from disk")

    saved = getattr(sharded_unet, "cached_patcher_init", None)
    if saved is not None:
        sharded_unet.cached_patcher_init = (no_reload, ())
    try:
        n = ci.opt_out_of_dynamic_vram(sharded_unet, "Group Offload")
    finally:
        if saved is not None:
            sharded_unet.cached_patcher_init = saved
    assert n is not sharded_unet and n.model is sharded_unet.model and not ci.is_dynamic(n)


def test_sharded_model_through_group_offload_and_device_map_equals_plain(sharded_unet, tmp_path):
    import comfy.model_management as mm
    from comfyui_memorykit.memorykit import comfy_integration as ci
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    ref = _forward(sharded_unet)
    assert ci.loaded_models()[0]["memory_path"] == "fully loaded"
    settings = ci.GroupOffloadSettings(GroupOffloadOptions(offload_to="disk"), vram_budget_bytes=8 << 20,
                                       disk_folder=str(tmp_path))
    offloaded, _ = ci.prepare_group_offload(sharded_unet, settings)
    assert offloaded.model is sharded_unet.model
    assert torch.equal(_forward(offloaded), ref)
    paths = {m["name"]: m["memory_path"] for m in ci.loaded_models()}
    assert paths["BaseModel"] == "MemoryKit group offload", paths
    mm.unload_all_models()
    mapped, rep, _ = ci.device_map_model(sharded_unet, "balanced", "cpu=8MiB, disk", str(tmp_path))
    assert mapped.model is sharded_unet.model and "disk" in rep["device_map"].values()
    out = _forward(mapped)
    assert rel(out, ref) == 0.0
    paths = {m["name"]: m["memory_path"] for m in ci.loaded_models()}
    assert paths["BaseModel"] == "MemoryKit device map", paths
    mm.unload_all_models()
    assert torch.equal(_forward(sharded_unet), ref)
    mm.unload_all_models()


def test_memory_report_text_names_the_memory_path(comfy, sharded_unet):
    import comfy.model_management as mm
    from comfyui_memorykit.memorykit import comfy_integration as ci, report
    _forward(sharded_unet)
    text = report.format_report(report.build_report("t", ci.loaded_models()))
    assert "BaseModel" in text and "fully loaded" in text
    mm.unload_all_models()
