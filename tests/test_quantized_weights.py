"""Quantized checkpoints (Comfy-Org's ``*_fp8_scaled``: legacy ``scaled_fp8`` and per-layer
``comfy_quant`` "mixed", e4m3 and e5m2) loaded by core's Load Diffusion Model, through Group
Offload, Balanced Device Map, FP8 Layerwise Cast and LoRA, in-process on CPU.

ComfyUI 0.33 loads them as core's ``QuantizedTensor`` layers: the placements stream / place the
stored bytes (fp8 data + scales, :mod:`memorykit.stored_parts`) and the output equals the plain
loaded model bit for bit. ComfyUI 0.3.75 loads the legacy file with scaled_fp8 ops holding plain
float8 tensors: the same checks, the same exactness. One sampling step per case.
"""
from __future__ import annotations

import os

import pytest
import torch

from harness import quant_models



def both_tiers(dm) -> str:
    """A Device Map ``max_memory`` whose cpu budget holds about half of the blocks (as the plan
    counts them: quantized layers at full precision): the rest goes to disk."""
    from comfyui_memorykit.memorykit import comfy_integration as ci

    def size(x):
        return sum(t.numel() * t.element_size() for t in list(x.parameters()) + list(x.buffers()))
    blocks = [qn for _, items in ci.comfy_block_lists(dm) for qn, _ in items]
    return f"cpu={size(dm) - sum(size(dm.get_submodule(b)) for b in blocks) // 2}, disk"


def _is_033() -> bool:
    import comfy.quant_ops as qo
    return hasattr(qo, "QUANT_ALGOS") and "float8_e5m2" in getattr(qo, "QUANT_ALGOS", {})


@pytest.fixture(scope="module")
def quant(comfy):
    """``quant(layout)``: the SD1.5-shaped UNet file in that layout, loaded by core's
    ``load_diffusion_model`` (one loaded model at a time), and its plain 1-step sample."""
    import comfy.sd
    cache = {}

    def get(layout):
        if layout == "mixed" and not _is_033():
            pytest.skip("ComfyUI 0.3.75 reads per-layer formats from the file's metadata, not comfy_quant keys")
        if layout not in cache:
            cache.clear()
            unload()
            path = quant_models.ensure_sd15(layout)
            with torch.inference_mode():  # as the server runs Load Diffusion Model
                m = comfy.sd.load_diffusion_model(str(path))
            cache[layout] = (m, sample(m))
        return cache[layout]

    yield get
    cache.clear()
    unload()


def unload():
    """ComfyUI unloads every model, inside inference mode as the server's prompts do (core's
    quantized layers loaded in inference mode cannot be loaded again after an unload outside it,
    with or without MemoryKit)."""
    import comfy.model_management as mm
    with torch.inference_mode():
        mm.unload_all_models()


def sample(model, lora=None):
    import comfy.sample
    g = torch.Generator().manual_seed(3)
    pos, neg = [[torch.randn(1, 77, 768, generator=g), {}]], [[torch.randn(1, 77, 768, generator=g), {}]]
    latent = torch.zeros(1, 4, 8, 8)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        return comfy.sample.sample(model, noise, 1, 4.0, "euler", "simple", pos, neg, latent,
                                   disable_pbar=True, seed=5)


def snapshot(module) -> dict:
    """name → (type, stored parts as (dtype, device, values))."""
    from comfyui_memorykit.memorykit import stored_parts
    return {n: (type(t), [(p.dtype, p.device, p.detach().clone()) for p in stored_parts.parts(t)])
            for n, t in list(module.named_parameters()) + list(module.named_buffers())}


def assert_restored(module, snap: dict) -> None:
    now = snapshot(module)
    assert now.keys() == snap.keys()
    for n, (kind, ps) in snap.items():
        assert now[n][0] is kind, n
        assert len(now[n][1]) == len(ps), n
        for (d0, v0, x0), (d1, v1, x1) in zip(ps, now[n][1]):
            assert d0 == d1 and v0 == v1 and torch.equal(x0, x1), n
    assert not any(m._forward_pre_hooks or m._forward_hooks or hasattr(m, "_hf_hook") for m in module.modules())


def stored_bytes(module) -> int:
    from comfyui_memorykit.memorykit import stored_parts
    return sum(stored_parts.stored_nbytes(t) for t in list(module.parameters()) + list(module.buffers()))


def n_quantized(module) -> int:
    from comfyui_memorykit.memorykit import stored_parts
    return sum(not stored_parts.is_plain(t) for t in module.parameters())


def test_stored_parts_decompose_and_rebuild_core_quantized_tensors(quant):
    from comfyui_memorykit.memorykit import stored_parts
    if not _is_033():
        pytest.skip("ComfyUI 0.3.75 loads fp8_scaled files as plain float8 tensors (nothing to decompose)")
    m, _ = quant("mixed")
    dm = m.model.diffusion_model
    ws = [t for t in dm.parameters() if not stored_parts.is_plain(t)]
    assert ws and {p.dtype for w in ws for p in stored_parts.parts(w)} == \
        {torch.float8_e4m3fn, torch.float8_e5m2, torch.float32}
    w = ws[0]
    ps = stored_parts.parts(w)
    assert stored_parts.stored_nbytes(w) == w.numel() + 4  # fp8 data + one float32 scale, not the bf16/f32 size
    r = stored_parts.rebuild(w, [p.clone() for p in ps])
    assert type(r) is type(w) and torch.equal(r.dequantize(), w.dequantize())
    saved = ps[0].data
    try:  # a part's .data changes the weight in place (what the event ring does)
        ps[0].data = torch.zeros_like(saved)
        assert torch.count_nonzero(w.dequantize()) == 0
    finally:
        ps[0].data = saved
    assert torch.equal(r.dequantize(), w.dequantize())


def test_weight_parts_decompose_into_several_parts_and_back(quant):
    """The one decomposition rule (what the device map hands accelerate) on a core quantized layer:
    its weight becomes plain Parameters of the stored parts, the layer computes bit for bit as
    before, restore brings back the same state; a weight of an unknown kind after it raises and
    leaves the whole layer as it was."""
    from comfyui_memorykit.memorykit import stored_parts, weight_parts
    if not _is_033():
        pytest.skip("ComfyUI 0.3.75 loads fp8_scaled files as plain float8 tensors (nothing to decompose)")
    m, _ = quant("mixed")
    layer = next(x for x in m.model.diffusion_model.modules()
                 if x._parameters.get("weight") is not None and not stored_parts.is_plain(x._parameters["weight"])
                 and x._parameters["weight"].dim() == 2)
    snap, nbytes = snapshot(layer), stored_bytes(layer)
    x = torch.randn(2, layer.weight.shape[1], generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = layer(x)
        parts = weight_parts.decompose(layer, several=True)
        try:
            assert parts and all(stored_parts.is_plain(t) for t in layer.parameters())
            assert sum(t.numel() * t.element_size() for t in layer.parameters()) == nbytes
            assert layer.weight.device.type == "meta" and torch.equal(layer(x), ref)
        finally:
            parts.restore()
    assert_restored(layer, snap)
    assert "forward" not in layer.__dict__

    class Unknown(torch.Tensor):
        pass
    odd = torch.zeros(1).as_subclass(Unknown)
    layer._parameters["zz_unknown"] = odd
    try:
        with pytest.raises(stored_parts.UnsupportedWeight), torch.inference_mode():
            weight_parts.decompose(layer, several=True)
        assert layer._parameters["zz_unknown"] is odd
    finally:
        del layer._parameters["zz_unknown"]
    assert_restored(layer, snap)
    assert "forward" not in layer.__dict__ and "weight" not in layer.__dict__


@pytest.mark.parametrize("layout,offload_type", [("legacy", "block_level"), ("mixed", "leaf_level")])
def test_group_offload_from_disk_streams_the_stored_bytes(quant, layout, offload_type, tmp_path):
    from comfyui_memorykit.memorykit import comfy_integration as ci
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    m, ref = quant(layout)
    dm = m.model.diffusion_model
    snap = snapshot(dm)
    settings = ci.GroupOffloadSettings(GroupOffloadOptions(offload_type=offload_type, offload_to="disk"),
                                       vram_budget_bytes=8 << 20, disk_folder=str(tmp_path))
    n, _ = ci.prepare_group_offload(m, settings)
    assert torch.equal(sample(n), ref)
    st = ci.offload_patcher._offload_state(n.model)
    from comfyui_memorykit.memorykit.offload import offload_figures
    figures = offload_figures(st.handle)
    streamed = figures["streamed_bytes"]
    # the stored bytes stream: fp8 data and scales, never a dequantised copy
    assert 0 < streamed and streamed + figures["resident_bytes"] == stored_bytes(dm)
    assert 0 < figures["copied_bytes_last_forward"] <= figures["ring_bytes"] + streamed
    if _is_033():
        assert n_quantized(dm) > 0  # still core's QuantizedTensor layers while streamed
    unload()
    assert os.listdir(tmp_path) == []
    assert_restored(dm, snap)
    assert torch.equal(sample(m), ref)


def test_group_offload_event_ring_from_ram(quant):
    """The cpu target's event ring (RAM → onload device), technique level: on a CPU machine the
    node passes the model through, so the ring runs with the CPU as onload device."""
    from comfyui_memorykit.memorykit import offload
    from comfyui_memorykit.memorykit.comfy_integration import comfy_block_lists
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    m, _ = quant("legacy")
    dm = m.model.diffusion_model
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(1, 4, 8, 8, generator=g), torch.tensor([500.0]))
    kw = {"context": torch.randn(1, 77, 768, generator=g)}
    with torch.inference_mode():  # as ComfyUI applies and samples
        ref = dm(*args, **kw)
        snap = snapshot(dm)
        h = offload.apply_group_offload(dm, "cpu", "cpu", options=GroupOffloadOptions(), budget_bytes=8 << 20,
                                        block_lists=comfy_block_lists(dm))
        try:
            out = dm(*args, **kw)
            fig = offload.offload_figures(h)
        finally:
            offload.remove_group_offload(h)
    assert torch.equal(out, ref)
    assert fig["streamed_bytes"] > 0 and fig["scheduler"] == "memorykit"
    assert_restored(dm, snap)


@pytest.mark.parametrize("layout", ["legacy", "mixed"])
def test_device_map_with_disk_places_the_stored_bytes(quant, layout, tmp_path):
    """Balanced Device Map (cpu + disk): what it writes to disk is the stored bytes of the layers
    mapped there (fp8 data and scales, not a copy widened to full precision); bit-exact; restored."""
    from comfyui_memorykit.memorykit.comfy_integration import placement
    from comfyui_memorykit.nodes.device_map import BalancedDeviceMap
    m, ref = quant(layout)
    dm = m.model.diffusion_model
    snap = snapshot(dm)
    clone = BalancedDeviceMap.execute(m, "sequential", both_tiers(dm), str(tmp_path), "").result[0]
    dmap = clone.get_attachment(placement.DEVICE_MAP_ATTACHMENT).device_map
    on = {d: sum(stored_bytes(dm.get_submodule(k)) if k else 0 for k, v in dmap.items() if v == d) for d in ("cpu", "disk")}
    full = sum(t.numel() * t.element_size() for k, v in dmap.items() if v == "disk" and k
               for t in dm.get_submodule(k).parameters())  # the disk entries at full precision
    assert on["cpu"] > 0 and on["disk"] > 0, dmap
    out = sample(clone)
    written = placement.applied(m.model).handle.disk_bytes
    print(f"[figures] device map {layout}: max abs diff {(out - ref).abs().max().item()}, disk written {written} B "
          f"= stored {on['disk']} B (full precision {full} B; cpu stored {on['cpu']} B; whole model stored {stored_bytes(dm)} B)")
    assert torch.equal(out, ref)
    assert written == on["disk"]
    assert len(os.listdir(tmp_path)) == 1
    unload()
    assert os.listdir(tmp_path) == []
    assert_restored(dm, snap)
    assert torch.equal(sample(m), ref)


def quantized_parts(module) -> dict:
    """name → stored parts of every quantized weight (0.33) / float8 weight (0.3.75)."""
    from comfyui_memorykit.memorykit import stored_parts
    return {n: [p.detach().clone() for p in stored_parts.parts(t)] for n, t in module.named_parameters()
            if not stored_parts.is_plain(t) or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)}


@pytest.mark.parametrize("layout", ["legacy", "mixed"])
def test_fp8_cast_keeps_quantized_layers_as_stored_and_says_so(quant, layout, tmp_path):
    """FP8 Layerwise Cast on an fp8_scaled model: the layers already quantised are left as they
    are (no second quantisation) and listed as kept; then Group Offload on top (the order that
    crashed the server) runs exactly as the FP8 model alone."""
    from comfyui_memorykit.memorykit import comfy_integration as ci
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    m, ref = quant(layout)
    dm = m.model.diffusion_model
    before = quantized_parts(dm)
    assert before
    with torch.inference_mode():
        f, info = ci.fp8_layerwise_cast(m)
    kept = {k["name"]: k["reason"] for k in info["kept_layers"]}
    q_layers = {n.rsplit(".", 1)[0] for n in before}
    assert q_layers <= set(kept), "an already quantised layer was planned for casting"
    assert any("already" in kept[n] for n in q_layers)  # others may be kept by a skip pattern first
    out = sample(f)
    assert (out - ref).norm() / ref.norm() < 0.1  # the rest cast to float8: fp8 tolerance
    unload()
    after = quantized_parts(dm)
    assert after.keys() == before.keys()
    assert all(all(torch.equal(a, b) for a, b in zip(after[k], before[k])) for k in before)
    settings = ci.GroupOffloadSettings(GroupOffloadOptions(offload_to="disk"), vram_budget_bytes=8 << 20,
                                       disk_folder=str(tmp_path))
    g, _ = ci.prepare_group_offload(f, settings)
    assert torch.equal(sample(g), out)
    unload()
    assert os.listdir(tmp_path) == []


def _lora(m):
    import nodes
    from harness import loras
    loras.ensure_sd15_lora()
    with torch.inference_mode():
        return nodes.LoraLoaderModelOnly().load_lora_model_only(m, loras.LORA_NAME, 1.0)[0]


_WITH_LORA: dict = {}


@pytest.mark.parametrize("node", ["group_offload", "device_map"])
def test_lora_before_and_after_a_placement_equals_the_quantized_model_with_lora(quant, node, tmp_path):
    """Core's LoraLoader on the fp8_scaled model, before and after Group Offload / Device Map:
    equal to the plain fp8_scaled model with the same LoRA (core patches its quantized weights)."""
    from comfyui_memorykit.memorykit import comfy_integration as ci
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    from comfyui_memorykit.nodes.device_map import BalancedDeviceMap
    m, ref = quant("legacy")

    def place(x):
        if node == "device_map":
            return BalancedDeviceMap.execute(x, "sequential", both_tiers(m.model.diffusion_model), str(tmp_path),
                                             "").result[0]
        s = ci.GroupOffloadSettings(GroupOffloadOptions(offload_to="disk"), vram_budget_bytes=8 << 20,
                                    disk_folder=str(tmp_path))
        return ci.prepare_group_offload(x, s)[0]

    key = id(m)  # the plain model with the LoRA: once for both nodes
    with_lora = _WITH_LORA[key] if key in _WITH_LORA else _WITH_LORA.setdefault(key, sample(_lora(m)))
    assert not torch.equal(with_lora, ref)
    assert torch.equal(sample(place(_lora(m))), with_lora)
    assert torch.equal(sample(_lora(place(m))), with_lora)
    unload()
    assert os.listdir(tmp_path) == []
    assert torch.equal(sample(m), ref)
