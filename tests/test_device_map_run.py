"""Balanced Device Map, in-process execution on CPU with ``cpu`` + ``disk`` maps (Wan fixture).

Checks bit-exact equality with the plain model (a forward on the bare module, and ComfyUI's
sampler on the ModelPatcher), that unloading puts every weight back exactly (values, device,
dtype) with no hook or offload file left, LoRA-style weight patches in either order, and a
clean state after a failed load and after an interrupted run.
"""
from __future__ import annotations

import gc
import hashlib
import json
import os

import pytest
import torch

# For the Wan fixture (4.2 MiB): embeddings on cpu, blocks and head on disk (the test checks both are used).
WAN_MAP = "cpu=4MiB, disk"


@pytest.fixture(scope="module")
def wan(comfy, fixture_models):
    import comfy.sd
    return comfy.sd.load_diffusion_model(str(fixture_models["wan"]))


@pytest.fixture(scope="module")
def node(comfy):
    from comfyui_memorykit.nodes.device_map import BalancedDeviceMap
    return BalancedDeviceMap


@pytest.fixture(scope="module")
def conds():
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(1, 16, 4096, generator=g) * 0.5, {}]], [[torch.randn(1, 16, 4096, generator=g) * 0.5, {}]]


def sample(model, conds, steps=2, callback=None):
    import comfy.sample
    latent = torch.zeros(1, 16, 2, 8, 8)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        return comfy.sample.sample(model, noise, steps, 4.0, "euler", "simple", conds[0], conds[1], latent,
                                   callback=callback, disable_pbar=True, seed=5)


def snapshot(module) -> dict:
    return {n: (t.device, t.dtype, t.detach().clone()) for n, t in
            list(module.named_parameters()) + list(module.named_buffers())}


def assert_restored(module, snap: dict):
    now = snapshot(module)
    assert now.keys() == snap.keys()
    for n, (dev, dt, val) in snap.items():
        assert now[n][0] == dev and now[n][1] == dt, n
        assert torch.equal(now[n][2], val), n
    assert not any(hasattr(m, "_hf_hook") or hasattr(m, "_old_forward") for m in module.modules())
    # accelerate's hook removal leaves `forward` bound to each hooked module; a layer built from
    # one (FP8 Layerwise Cast copies its attributes) would then run the original (issue 14, item 7)
    assert not [n for n, m in module.named_modules() if "forward" in m.__dict__]
    assert "hf_device_map" not in module.__dict__ and "to" not in module.__dict__


def applied(patcher):
    from comfyui_memorykit.memorykit import comfy_integration
    return comfy_integration.device_map_patcher._applied(patcher.model)


def test_dispatch_on_a_plain_module_equals_and_undoes(comfy, wan, tmp_path):
    from comfyui_memorykit.memorykit import device_dispatch, device_map
    module = wan.model.diffusion_model
    snap = snapshot(module)
    mm = device_map.parse_max_memory(WAN_MAP)
    plan, _ = device_map.plan_device_map(module, mm.budgets, "sequential", device_map.block_classes(module))
    assert set(plan.values()) == {"cpu", "disk"}
    g = torch.Generator().manual_seed(3)
    x, t, ctx = torch.randn(1, 16, 2, 8, 8, generator=g), torch.tensor([700.0]), torch.randn(1, 12, 4096, generator=g)
    with torch.inference_mode():
        ref = module(x, t, ctx, transformer_options={})
        handle = device_dispatch.dispatch_device_map(module, plan, str(tmp_path), skip_keys=["transformer_options"])
        try:
            root_hook = module._hf_hook  # inputs to the main device, output back to the input's device
            assert root_hook.execution_device == "cpu" and root_hook.io_same_device
            assert root_hook.skip_keys == ["transformer_options"]
            folders = os.listdir(tmp_path)
            assert len(folders) == 1 and os.listdir(tmp_path / folders[0])  # offloaded weight files
            disk_param = next(n for n, p in module.named_parameters() if n.startswith("blocks."))
            assert module.get_parameter(disk_param).device.type == "meta"
            out = module(x, t, ctx, transformer_options={})
        finally:
            handle.remove()
        handle.remove()  # idempotent
    assert torch.equal(out, ref)
    assert os.listdir(tmp_path) == []
    assert_restored(module, snap)


def test_dispatch_error_leaves_nothing_behind(comfy, wan, tmp_path):
    from comfyui_memorykit.memorykit import device_dispatch
    if torch.cuda.device_count() > 7:
        pytest.skip("machine has a cuda:7")
    module = wan.model.diffusion_model
    snap = snapshot(module)
    with pytest.raises(RuntimeError, match="cuda:7"):
        bad = {"patch_embedding": 7, "text_embedding": "disk", "time_embedding": "cpu", "time_projection": "cpu",
               "blocks": "disk", "head": "cpu"}
        device_dispatch.dispatch_device_map(module, bad, str(tmp_path))
    assert os.listdir(tmp_path) == []
    assert_restored(module, snap)


def test_sampling_equals_plain_and_unload_restores(node, wan, conds, tmp_path):
    import comfy.model_management as mm
    module = wan.model.diffusion_model
    snap = snapshot(module)
    ref = sample(wan, conds)
    clone = node.execute(wan, "sequential", WAN_MAP, str(tmp_path), "").result[0]
    out = sample(clone, conds)
    assert torch.equal(out, ref)
    st = applied(wan)
    assert st is not None and len(os.listdir(tmp_path)) == 1
    assert module.hf_device_map  # accelerate's record of the placement
    # the plain model (same nn.Module) loaded next: the map is reset first
    assert torch.equal(sample(wan, conds), ref)
    assert applied(wan) is None and os.listdir(tmp_path) == []
    assert_restored(module, snap)
    # mapped again, then ComfyUI unloads everything (as POST /free does)
    assert torch.equal(sample(clone, conds), ref)
    assert applied(wan) is not None
    mm.unload_all_models()
    assert applied(wan) is None and os.listdir(tmp_path) == []
    assert_restored(module, snap)
    # loaded, then the clone is dropped (its node output left the cache): ModelPatcher.__del__ detaches it
    sample(clone, conds)
    del clone
    gc.collect()
    assert applied(wan) is None and os.listdir(tmp_path) == []
    assert torch.equal(sample(wan, conds), ref)
    assert_restored(module, snap)
    mm.unload_all_models()


def test_weight_patches_in_either_order(node, wan, conds, tmp_path):
    """LoRA-style patches (ComfyUI's ModelPatcher.add_patches) before or after the node."""
    import comfy.model_management as mm
    snap = snapshot(wan.model.diffusion_model)
    g = torch.Generator().manual_seed(9)
    keys = ["diffusion_model.blocks.0.self_attn.q.weight", "diffusion_model.text_embedding.0.weight",
            "diffusion_model.head.head.weight"]
    sd = wan.model.state_dict()
    patches = {k: (torch.randn(sd[k].shape, generator=g) * 0.05,) for k in keys}

    def patched(m):
        m = m.clone()
        assert len(m.add_patches(patches, 1.0)) == len(keys)
        return m

    ref = sample(patched(wan), conds)
    assert not torch.equal(ref, sample(wan, conds))  # the patches matter
    before = node.execute(patched(wan), "sequential", WAN_MAP, str(tmp_path), "").result[0]
    after = patched(node.execute(wan, "sequential", WAN_MAP, str(tmp_path), "").result[0])
    assert torch.equal(sample(before, conds), ref)
    assert torch.equal(sample(after, conds), ref)
    mm.unload_all_models()
    assert_restored(wan.model.diffusion_model, snap)
    assert os.listdir(tmp_path) == []


def test_missing_device_fails_at_load_then_plain_runs(node, wan, conds, tmp_path):
    import comfy.model_management as mm
    if torch.cuda.device_count() > 7:
        pytest.skip("machine has a cuda:7")
    snap = snapshot(wan.model.diffusion_model)
    ref = sample(wan, conds)
    custom = {"patch_embedding": "cuda:7", "text_embedding": "cpu", "time_embedding": "cpu",
              "time_projection": "cpu", "blocks": "disk", "head": "cpu"}
    out = node.execute(wan, "balanced", "auto", str(tmp_path), json.dumps(custom))
    assert out.ui["memorykit_report"][0]["missing_devices"] == ["cuda:7"]
    with pytest.raises(RuntimeError, match="cuda:7"):
        sample(out.result[0], conds)
    assert applied(wan) is None and os.listdir(tmp_path) == []
    assert_restored(wan.model.diffusion_model, snap)
    assert torch.equal(sample(wan, conds), ref)
    mm.unload_all_models()


def test_interrupted_run_then_next_run_is_correct(node, wan, conds, tmp_path):
    import comfy.model_management as mm
    snap = snapshot(wan.model.diffusion_model)
    ref = sample(wan, conds, steps=3)
    clone = node.execute(wan, "sequential", WAN_MAP, str(tmp_path), "").result[0]

    def interrupt(step, *args):
        raise mm.InterruptProcessingException()

    with pytest.raises(mm.InterruptProcessingException):
        sample(clone, conds, steps=3, callback=interrupt)
    assert torch.equal(sample(clone, conds, steps=3), ref)
    mm.unload_all_models()
    assert applied(wan) is None and os.listdir(tmp_path) == []
    assert_restored(wan.model.diffusion_model, snap)


def _digests(module) -> dict:
    """tensor name → (device, dtype, sha256 of the raw bytes): an exact fingerprint without a copy."""
    out = {}
    for n, t in module.state_dict().items():
        raw = t.detach().contiguous().view(torch.uint8).numpy() if t.numel() else b""
        out[n] = (t.device, t.dtype, hashlib.sha256(raw).hexdigest())
    return out


def test_flux_forward_with_a_disk_map_equals_plain(comfy, fixture_models, tmp_path):
    """Flux-shaped fixture (hidden 3072, 2.2 GB fp32): single block on disk, the rest in RAM;
    one forward through ComfyUI's BaseModel.apply_model, bit-exact, weights back afterwards."""
    import comfy.sd
    from comfyui_memorykit.memorykit import device_dispatch, device_map
    patcher = comfy.sd.load_diffusion_model(str(fixture_models["flux"]))
    module = patcher.model.diffusion_model
    custom = {n: ("disk" if n == "single_blocks" else "cpu") for n, c in module.named_children() if len(c.state_dict())}
    plan = device_map.validate_device_map(module, custom)
    before = _digests(module)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 16, 16, 16, generator=g)
    kw = dict(c_crossattn=torch.randn(1, 8, 4096, generator=g) * 0.5, y=torch.randn(1, 768, generator=g),
              guidance=torch.tensor([3.5]))
    sigma = torch.tensor([0.7])
    with torch.inference_mode():
        ref = patcher.model.apply_model(x, sigma, **kw)
        handle = device_dispatch.dispatch_device_map(module, plan, str(tmp_path), skip_keys=["transformer_options"])
        try:
            assert module.single_blocks[0].linear1.weight.device.type == "meta"
            out = patcher.model.apply_model(x, sigma, **kw)
        finally:
            handle.remove()
    assert torch.equal(out, ref)
    assert os.listdir(tmp_path) == []
    assert _digests(module) == before
    assert not any(hasattr(m, "_hf_hook") for m in module.modules())


def test_disk_weights_round_trip_in_every_dtype(comfy, tmp_path):
    """The disk files are written by device_dispatch in accelerate's format and read back by
    accelerate: bf16 and fp8 tensors included, forward equal, values restored exactly."""
    from comfyui_memorykit.memorykit import device_dispatch
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).to(torch.bfloat16)
    module[0].register_buffer("fp8", torch.randn(3, 5).to(torch.float8_e4m3fn))
    module[0].register_buffer("scalar", torch.tensor(2.5))
    snap = snapshot(module)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    ref = module(x)
    handle = device_dispatch.dispatch_device_map(module, {"0": "disk", "1": "cpu"},
                                                 str(tmp_path))
    try:
        assert module[0].weight.device.type == "meta"
        assert torch.equal(module(x), ref)
    finally:
        handle.remove()
    assert_restored(module, snap)
    assert os.listdir(tmp_path) == []


def test_full_offload_folder_is_an_error_and_leaves_nothing(comfy, wan, tmp_path):
    """Issue 14, item 3, below the node: too little room is refused before writing, and a write
    that fails anyway (the disk filled meanwhile) is a RuntimeError, never SIGBUS."""
    from harness.tmpfs import small_tmpfs

    from comfyui_memorykit.memorykit import device_dispatch
    module = wan.model.diffusion_model
    snap = snapshot(module)
    with small_tmpfs(tmp_path / "tmpfs", "1m") as mnt:
        with pytest.raises(RuntimeError, match="offload_folder .* free"):
            device_dispatch.dispatch_device_map(module, {"": "disk"}, str(mnt))
        assert os.listdir(mnt) == []
        assert_restored(module, snap)
        with pytest.raises(OSError):  # the writer itself: ENOSPC is an error
            device_dispatch._pack_to_disk(str(mnt), module.state_dict())
