"""A failed node never damages the loaded model (the failure rule of ``placement.PlacementPatcher``):
in-process with ComfyUI's real model management on CPU (Wan fixture). Each node is made to fail
while its placement is loaded or unloaded — a core ON_LOAD callback that raises, the disk folder
removed after the node ran, the ``placement.fault_hook`` test hook once everything is applied or
half-way through the undo — or mid-apply (FP8 Layerwise Cast interrupted after it released a
placement). Then, on the same loaded model, the plain model, Group Offload, Balanced Device Map and
FP8 Layerwise Cast run: placements bit-exact vs plain, FP8 exact vs FP8 on the untouched model;
no placement, hook or file is left behind."""
from __future__ import annotations

import gc
import os
import shutil

import pytest
import torch


class _Fault(RuntimeError):
    pass


@pytest.fixture(scope="module")
def wan_refs(comfy, fixture_models):
    import comfy.model_management as mm
    import comfy.sd

    from comfyui_memorykit.memorykit import comfy_integration as ci
    mm.unload_all_models()
    plain = comfy.sd.load_diffusion_model(str(fixture_models["wan"]))
    g = torch.Generator().manual_seed(5)
    args = (torch.randn(1, 16, 2, 8, 8, generator=g), torch.tensor([300.0]), torch.randn(1, 8, 4096, generator=g))

    def forward(patcher):
        mm.load_models_gpu([patcher])
        with torch.no_grad():
            return patcher.model.diffusion_model(*args)

    ref = forward(plain)
    fp8_ref = forward(ci.fp8_layerwise_cast(plain)[0])
    mm.unload_all_models()
    yield plain, forward, ref, fp8_ref
    mm.unload_all_models()
    gc.collect()


@pytest.fixture()
def wan(wan_refs, tmp_path):
    from comfyui_memorykit.memorykit.comfy_integration import placement
    yield wan_refs, tmp_path
    placement.fault_hook = None
    import comfy.model_management as mm
    mm.unload_all_models()
    gc.collect()


def _group_offload(plain, folder):
    from comfyui_memorykit.memorykit import comfy_integration as ci
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    settings = ci.GroupOffloadSettings(GroupOffloadOptions(offload_to="disk"), vram_budget_bytes=3 << 20,
                                       disk_folder=str(folder))
    return ci.prepare_group_offload(plain, settings)[0]


def _device_map(plain, folder):
    from comfyui_memorykit.memorykit import comfy_integration as ci
    return ci.device_map_model(plain, "balanced", "cpu=3MiB, disk", str(folder))[0]


def _memory_plan(plain, folder):
    """Memory Plan's apply with its "stream from disk" candidate picked (the plan for this CPU)."""
    from comfyui_memorykit.memorykit import memory_plan as mp
    from comfyui_memorykit.memorykit.comfy_integration import memory_plan_io as io
    plan = mp.make_plan(io.measure_machine(plain, str(folder)), io.model_figures(plain, [1, 16, 2, 8, 8]))
    plan.pick = next(c for c in plan.candidates if c.offload_to == "disk")
    return io.apply_plan(plain, plan, str(folder))[0]


NODES = {"group_offload": _group_offload, "device_map": _device_map, "memory_plan": _memory_plan}


def _raise_once(stage_wanted):
    calls = []

    def hook(stage):
        if stage == stage_wanted and not calls:
            calls.append(stage)
            raise _Fault(f"injected at {stage}")
    return hook, calls


def _check_model_is_whole(plain, forward, ref, fp8_ref, folder, others):
    """The model ComfyUI holds is as it was: no placement, every weight real and on the CPU, and
    the plain model, FP8 and the placements ``others`` run on it exactly; nothing left in ``folder``."""
    import comfy.model_management as mm

    from comfyui_memorykit.memorykit import comfy_integration as ci
    from comfyui_memorykit.memorykit.comfy_integration import placement
    assert placement.applied(plain.model) is None
    dm = plain.model.diffusion_model
    assert all(t.device.type == "cpu" for t in list(dm.parameters()) + list(dm.buffers()))
    assert not any("_hf_hook" in m.__dict__ or "_diffusers_hook" in m.__dict__ for m in dm.modules())
    assert os.listdir(folder) == [], "a failed placement left files behind"
    assert torch.equal(forward(plain), ref), "the plain model changed after the failure"
    assert torch.equal(forward(ci.fp8_layerwise_cast(plain)[0]), fp8_ref), "FP8 after the failure differs"
    for name in others:  # a placement applied from scratch on the same model
        assert torch.equal(forward(NODES[name](plain, folder)), ref), f"{name} after the failure differs from plain"
        mm.unload_all_models()
        assert os.listdir(folder) == []


OTHER = {"group_offload": "device_map", "device_map": "group_offload", "memory_plan": "device_map"}


@pytest.mark.parametrize("node,fault", [("group_offload", "load_callback"), ("device_map", "load_callback"),
                                        ("group_offload", "folder_gone"), ("device_map", "folder_gone"),
                                        ("memory_plan", "folder_gone"), ("device_map", "installed")])
def test_a_node_that_fails_while_loading_leaves_the_model_whole(wan, node, fault):
    """Fails during load (``load_models_gpu``): a core ON_LOAD callback raising (Group Offload: after
    its placement is applied; Device Map: after core's load patched the weights, before the map),
    the disk folder deleted after the node ran (found while applying), or the test hook raising once
    the placement is recorded. The error reaches the caller; the model is restored."""
    import comfy.model_management as mm
    import comfy.patcher_extension as pe

    from comfyui_memorykit.memorykit.comfy_integration import placement
    (plain, forward, ref, fp8_ref), tmp = wan
    assert torch.equal(forward(plain), ref)  # the model ComfyUI holds: loaded plainly first
    folder = tmp / "offload"
    folder.mkdir()
    n = NODES[node](plain, folder)
    if fault == "load_callback":
        def bad_callback(*_):
            raise _Fault("an ON_LOAD callback failed")
        n.add_callback(pe.CallbacksMP.ON_LOAD, bad_callback)
        expect = _Fault
    elif fault == "folder_gone":
        shutil.rmtree(folder)
        expect = RuntimeError
    else:
        placement.fault_hook, _ = _raise_once("installed")
        expect = _Fault
    with pytest.raises(expect):
        mm.load_models_gpu([n])
    placement.fault_hook = None
    folder.mkdir(exist_ok=True)
    _check_model_is_whole(plain, forward, ref, fp8_ref, folder, [OTHER[node]])


@pytest.mark.parametrize("node", ["group_offload", "device_map"])
def test_a_placement_that_fails_while_unloading_is_still_undone(wan, node):
    """The undo raises half-way (test hook, once) when ComfyUI unloads the model: the placement
    layer finishes it; the unload goes on and the model is whole."""
    import comfy.model_management as mm

    from comfyui_memorykit.memorykit.comfy_integration import placement
    (plain, forward, ref, fp8_ref), folder = wan
    n = NODES[node](plain, folder)
    assert torch.equal(forward(n), ref)
    placement.fault_hook, calls = _raise_once("undo")
    mm.unload_all_models()
    assert calls == ["undo"]
    placement.fault_hook = None
    _check_model_is_whole(plain, forward, ref, fp8_ref, folder, [node])


@pytest.mark.parametrize("node", ["device_map"])
def test_fp8_interrupted_after_releasing_a_placement_leaves_the_model_whole(wan, node):
    """FP8 Layerwise Cast fails mid-apply (Cancel: ComfyUI's interrupt flag, checked per layer)
    after it released the loaded placement to read the real weights."""
    import comfy.model_management as mm

    from comfyui_memorykit.memorykit import comfy_integration as ci
    (plain, forward, ref, fp8_ref), folder = wan
    n = NODES[node](plain, folder)
    assert torch.equal(forward(n), ref)
    mm.interrupt_current_processing(True)
    try:
        with pytest.raises(mm.InterruptProcessingException):
            ci.fp8_layerwise_cast(n)
    finally:
        mm.interrupt_current_processing(False)
    mm.unload_all_models()
    _check_model_is_whole(plain, forward, ref, fp8_ref, folder, ["group_offload"])


def _legacy_scaled_fp8(sd: dict) -> dict:
    """``sd`` in Comfy-Org's legacy fp8_scaled layout: the blocks' 2-D weights float8_e4m3fn with a
    per-tensor ``scale_weight``, and the ``scaled_fp8`` marker."""
    out = dict(sd)
    for k, w in sd.items():
        if k.startswith("blocks.") and k.endswith(".weight") and w.ndim == 2:
            s = w.abs().max().float() / 448
            out[k] = (w.float() / s).to(torch.float8_e4m3fn)
            out[k[:-len("weight")] + "scale_weight"] = s.reshape(())
    out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return out


def test_placements_on_a_quantized_model_loaded_outside_inference_mode_are_exact(comfy, fixture_models, tmp_path):
    """Balanced Device Map (cpu + disk) on a legacy fp8_scaled model (0.33: core's QuantizedTensor
    layers; 0.3.75: plain float8 tensors) loaded outside inference mode, so its weights stay views
    of the file's memory at addresses off the 64-byte boundary. Once this stopped half-way and left
    weights on the meta device (the next FP8 Layerwise Cast crashed the server); then it came out one
    ulp off (the disk copies sat at another address phase, and the CPU's GEMM rounds by it). A map
    that fails once applied leaves the model whole; then the map is bit-exact, so is Group Offload
    from disk (its CPU ring copies the weights too), and afterwards the plain model and FP8
    Layerwise Cast run exactly."""
    import comfy.model_management as mm
    import comfy.sd
    import comfy.utils

    from comfyui_memorykit.memorykit import comfy_integration as ci
    from comfyui_memorykit.memorykit.comfy_integration import placement
    from comfyui_memorykit.memorykit.offload_plan import PHASE_BYTES, address_phase
    mm.unload_all_models()
    plain = comfy.sd.load_diffusion_model_state_dict(_legacy_scaled_fp8(
        comfy.utils.load_torch_file(str(fixture_models["wan"]))))
    dm = plain.model.diffusion_model
    if type(dm.blocks[0].self_attn.q.weight.data) is not torch.Tensor:  # 0.33 (0.3.75 copies the weights: aligned)
        assert any(address_phase(t) for t in dm.parameters() if t.numel() * t.element_size() >= PHASE_BYTES), \
            "every weight is 64-byte aligned: this load no longer provokes the address phase"
    g = torch.Generator().manual_seed(5)
    args = (torch.randn(1, 16, 2, 8, 8, generator=g), torch.tensor([300.0]), torch.randn(1, 8, 4096, generator=g))

    def forward(patcher):
        mm.load_models_gpu([patcher])
        with torch.no_grad():
            return patcher.model.diffusion_model(*args)

    def fp8_result():  # FP8 Layerwise Cast keeps layers already quantised: its output or its refusal
        try:
            return forward(ci.fp8_layerwise_cast(plain)[0])
        except ValueError as e:
            return str(e)

    ref = forward(plain)
    fp8_ref = fp8_result()
    size = sum(t.numel() * t.element_size() for t in dm.parameters())  # as the plan counts them
    budget = f"cpu={size - sum(t.numel() * t.element_size() for t in dm.blocks.parameters()) // 2}, disk"
    placement.fault_hook, _ = _raise_once("installed")  # fails once everything is placed (disk written)
    with pytest.raises(_Fault):
        forward(ci.device_map_model(plain, "balanced", budget, str(tmp_path))[0])
    placement.fault_hook = None
    assert placement.applied(plain.model) is None and os.listdir(tmp_path) == []
    assert torch.equal(forward(plain), ref), "the model changed after the failed device map"
    n, rep, _ = ci.device_map_model(plain, "balanced", budget, str(tmp_path))
    assert set(rep["bytes_per_device"]) == {"cpu", "disk"}, rep["bytes_per_device"]
    out = forward(n)
    assert torch.equal(out, ref), f"max abs diff {(out - ref).abs().max().item()}"
    mm.unload_all_models()
    out = forward(_group_offload(plain, tmp_path))  # its CPU event ring copies the weights too
    assert torch.equal(out, ref), f"Group Offload: max abs diff {(out - ref).abs().max().item()}"
    mm.unload_all_models()
    assert not any(t.device.type == "meta" for t in plain.model.diffusion_model.state_dict().values())
    assert torch.equal(forward(plain), ref)
    after = fp8_result()
    assert after == fp8_ref if isinstance(fp8_ref, str) else torch.equal(after, fp8_ref)
    mm.unload_all_models()
    assert os.listdir(tmp_path) == []
