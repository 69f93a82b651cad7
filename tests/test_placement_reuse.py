"""The reuse rule Group Offload and Balanced Device Map share (``comfy_integration.placement``),
in-process with ComfyUI's real model management on CPU (Wan fixture; Group Offload to disk,
device map cpu + disk): garbage collection of a clone never undoes another patcher's
placement; a placement handed over to another clone outlives the patcher that applied it;
object patches of the clone being loaded are applied when the placement is reused."""
from __future__ import annotations

import gc
import os

import pytest
import torch


@pytest.fixture()
def wan(comfy, fixture_models, tmp_path):
    import comfy.model_management as mm
    import comfy.sd
    mm.unload_all_models()
    plain = comfy.sd.load_diffusion_model(str(fixture_models["wan"]))
    g = torch.Generator().manual_seed(5)
    args = (torch.randn(1, 16, 2, 8, 8, generator=g), torch.tensor([300.0]), torch.randn(1, 8, 4096, generator=g))

    def forward(patcher):
        with torch.no_grad():
            return patcher.model.diffusion_model(*args)

    ref = forward(plain)
    yield plain, forward, ref, tmp_path
    mm.unload_all_models()
    gc.collect()
    assert os.listdir(tmp_path) == []


def _group_offload(plain, folder):
    from comfyui_memorykit.memorykit import comfy_integration as ci
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    settings = ci.GroupOffloadSettings(GroupOffloadOptions(offload_to="disk"), vram_budget_bytes=3 << 20,
                                       disk_folder=str(folder))
    return ci.prepare_group_offload(plain, settings)[0]


def _device_map(plain, folder):
    from comfyui_memorykit.memorykit import comfy_integration as ci
    return ci.device_map_model(plain, "balanced", "cpu=3MiB, disk", str(folder))[0]


PLACEMENTS = {"group_offload": _group_offload, "device_map": _device_map}


def _applied(patcher):
    from comfyui_memorykit.memorykit.comfy_integration import placement
    return placement.applied(patcher.model)


def _listed(patcher) -> bool:
    import comfy.model_management as mm
    return any(lm.model is patcher for lm in mm.current_loaded_models)


@pytest.mark.parametrize("kind", sorted(PLACEMENTS))
def test_garbage_collected_clone_leaves_the_owners_placement(wan, kind):
    """Item 6: apply with n, then ``t = n.clone(); del t``: the placement stays while ComfyUI lists n."""
    import comfy.model_management as mm
    plain, forward, ref, folder = wan
    n = PLACEMENTS[kind](plain, folder)
    mm.load_models_gpu([n])
    applied = _applied(n)
    assert applied is not None and _listed(n)
    t = n.clone()
    del t
    gc.collect()
    assert _applied(n) is applied, "collecting a clone undid the placement of the loaded patcher"
    assert _listed(n)
    assert torch.equal(forward(n), ref)
    mm.load_models_gpu([n])  # the next sampling: nothing re-applied
    assert _applied(n) is applied and len(os.listdir(folder)) == 1


@pytest.mark.parametrize("kind", sorted(PLACEMENTS))
def test_placement_handed_over_outlives_the_patcher_that_applied_it(wan, kind):
    """A clone with the same settings, patches and device reuses the placement and owns it: the
    collection of the patcher that applied it (here a downstream clone, e.g. a dropped
    branch) no longer undoes it; the new owner's unload does."""
    import comfy.model_management as mm
    plain, forward, ref, folder = wan
    n = PLACEMENTS[kind](plain, folder)
    child = n.clone()
    mm.load_models_gpu([child])
    applied = _applied(n)
    mm.load_models_gpu([n])
    assert _applied(n) is applied and _listed(n) and not _listed(child)
    del child
    gc.collect()
    assert _applied(n) is applied, "the collection of the patcher that applied it undid the placement n reuses"
    assert torch.equal(forward(n), ref)
    mm.unload_all_models()
    assert _applied(n) is None and os.listdir(folder) == []
    assert torch.equal(forward(plain), ref)


@pytest.mark.parametrize("kind", sorted(PLACEMENTS))
def test_reused_placement_applies_the_object_patches_of_the_clone(wan, kind):
    """Item 5 (in-process): the loaded clone's object patches are in the model, whichever clone
    loaded before; the placement itself is reused."""
    import comfy.model_management as mm
    plain, _, _, folder = wan
    original = plain.model.model_sampling
    n = PLACEMENTS[kind](plain, folder)
    a, b = n.clone(), n.clone()
    marker_a, marker_b = torch.nn.Identity(), torch.nn.Identity()
    a.add_object_patch("model_sampling", marker_a)
    b.add_object_patch("model_sampling", marker_b)
    mm.load_models_gpu([a])
    applied = _applied(a)
    assert plain.model.model_sampling is marker_a
    for patcher, want in ((b, marker_b), (n, original), (a, marker_a)):
        mm.load_models_gpu([patcher])
        assert _applied(patcher) is applied
        assert plain.model.model_sampling is want
    mm.unload_all_models()
    assert plain.model.model_sampling is original
