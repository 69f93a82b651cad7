"""Group Offload's ModelPatcher integration, in-process with ComfyUI's real model management
(``load_models_gpu``, ``unload_all_models``): what ComfyUI sees while the offload is applied and
that every way ComfyUI lets go of the model undoes it (CPU: disk offload, Wan model)."""
from __future__ import annotations

import gc
import os

import pytest
import torch


@pytest.fixture()
def wan(comfy, fixture_models, tmp_path):
    import comfy.model_management as mm
    import comfy.sd
    from comfyui_memorykit.memorykit import comfy_integration as ci
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    mm.unload_all_models()
    plain = comfy.sd.load_diffusion_model(str(fixture_models["wan"]))
    g = torch.Generator().manual_seed(5)
    args = (torch.randn(1, 16, 2, 8, 8, generator=g), torch.tensor([300.0]), torch.randn(1, 8, 4096, generator=g))

    def forward(patcher):
        with torch.no_grad():
            return patcher.model.diffusion_model(*args)

    # A RAM budget (the CPU is the onload device) that keeps some blocks resident and streams others.
    # (6.5 MiB: the event ring, which streams from disk, holds two groups.)
    settings = ci.GroupOffloadSettings(GroupOffloadOptions(offload_to="disk"), vram_budget_bytes=13 << 19,
                                       disk_folder=str(tmp_path))
    ref = forward(plain)
    yield plain, settings, forward, ref, tmp_path
    mm.unload_all_models()


def _state(patcher):
    from comfyui_memorykit.memorykit import comfy_integration as ci
    return ci.offload_patcher._offload_state(patcher.model)


def _assert_undone(plain, folder, fixture_models, unloaded=True):
    from safetensors import safe_open
    assert _state(plain) is None and os.listdir(folder) == []
    if unloaded:
        assert plain.model.model_loaded_weight_memory == 0 and plain.model.current_weight_patches_uuid is None
    with safe_open(str(fixture_models["wan"]), framework="pt") as f:
        for k, v in plain.model.diffusion_model.state_dict().items():
            assert torch.equal(v, f.get_tensor(k)), k
    for m in plain.model.modules():
        assert "forward" not in m.__dict__ and "_diffusers_hook" not in m.__dict__


def test_comfy_sees_the_footprint_and_unloading_undoes_the_offload(wan, fixture_models):
    import comfy.model_management as mm
    from comfyui_memorykit.memorykit import comfy_integration as ci
    plain, settings, forward, ref, folder = wan
    n, info = ci.prepare_group_offload(plain, settings)
    assert type(n) is ci.GroupOffloadModelPatcher and n is not plain and type(plain) is not ci.GroupOffloadModelPatcher
    assert _state(plain) is None, "the node must not change anything before sampling loads the model"
    mm.load_models_gpu([n])
    st = _state(n)
    plan = st.handle.plan
    assert plan.resident_blocks and plan.streamed_blocks
    assert n.loaded_size() == plan.footprint_bytes < n.model_size()
    lm = next(x for x in mm.current_loaded_models if x.model is n)
    assert lm.model_offloaded_memory() == n.model_size() - plan.footprint_bytes
    assert torch.equal(forward(n), ref)
    mm.load_models_gpu([n])  # loaded again (the next sampling): nothing is re-applied
    assert _state(n) is st
    assert len(os.listdir(folder)) == 1
    mm.unload_all_models()
    _assert_undone(plain, folder, fixture_models)
    assert torch.equal(forward(plain), ref)


def test_loading_the_plain_model_undoes_the_offload(wan, fixture_models):
    import comfy.model_management as mm
    from comfyui_memorykit.memorykit import comfy_integration as ci
    plain, settings, forward, ref, folder = wan
    n, _ = ci.prepare_group_offload(plain, settings)
    mm.load_models_gpu([n])
    assert _state(n) is not None
    mm.load_models_gpu([plain])  # the same weights, other patcher: ComfyUI detaches the offloaded clone
    _assert_undone(plain, folder, fixture_models, unloaded=False)
    assert plain.loaded_size() == plain.model_size()  # loaded the plain way
    assert torch.equal(forward(plain), ref)


def test_garbage_collected_patcher_undoes_its_offload(wan, fixture_models):
    import comfy.model_management as mm
    from comfyui_memorykit.memorykit import comfy_integration as ci
    plain, settings, forward, ref, folder = wan
    n, _ = ci.prepare_group_offload(plain, settings)
    mm.load_models_gpu([n])
    assert _state(plain) is not None
    del n  # e.g. the node's cached output was dropped while the model was loaded
    gc.collect()
    _assert_undone(plain, folder, fixture_models)
    assert torch.equal(forward(plain), ref)


def test_lora_clone_after_the_node_reapplies_with_its_patches(wan, fixture_models):
    import comfy.model_management as mm
    from comfyui_memorykit.memorykit import comfy_integration as ci
    plain, settings, forward, ref, folder = wan
    n, _ = ci.prepare_group_offload(plain, settings)
    key = "diffusion_model.blocks.0.ffn.0.weight"
    w = plain.model.diffusion_model.blocks[0].ffn[0].weight
    delta = torch.full_like(w, 0.01)
    lora = n.clone()
    assert type(lora) is ci.GroupOffloadModelPatcher
    assert lora.add_patches({key: ("diff", (delta,))}) == [key]
    plain_lora = plain.clone()
    plain_lora.add_patches({key: ("diff", (delta,))})
    mm.load_models_gpu([plain_lora])
    expected = forward(plain_lora)
    assert not torch.equal(expected, ref)
    mm.load_models_gpu([lora])
    assert _state(lora).patches_uuid == lora.patches_uuid
    assert torch.equal(forward(lora), expected)
    mm.load_models_gpu([n])  # back to the clone without the patch: re-applied from unpatched weights
    assert torch.equal(forward(n), ref)
    mm.unload_all_models()
    _assert_undone(plain, folder, fixture_models)
