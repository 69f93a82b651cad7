"""GGUF models (city96/ComfyUI-GGUF's ``UnetLoaderGGUF``, ``GGMLTensor`` weights under its
``GGUFModelPatcher``) through the pack's nodes, in-process with ComfyUI's real model management.

The SD1.5-shaped test UNet as Q8_0, Q4_K and F16 GGUF files (``harness.gguf_models``):
- Group Offload (disk, block_level and leaf_level) and Balanced Device Map stream / place the
  raw GGUF bytes (bytes streamed per forward = bytes stored) and the output equals the plain
  GGUF model's bit for bit; unloading gives back the GGUF weights as they were;
- LoRA (core's loader) before and after each placement equals the plain GGUF model with it;
- FP8 Layerwise Cast passes a GGUF model through unchanged (saying why); Save Sharded refuses with a message; Memory Plan counts stored bytes
  and offers no fp8 for it.
"""
from __future__ import annotations

import os

import pytest
import torch

from harness import gguf_models, gguf_pack

pytestmark = pytest.mark.skipif(
    gguf_pack.available() is not None and not os.environ.get("REQUIRE_COMFYUI_033"),
    reason=f"GGUF models cannot be tested here: {gguf_pack.available()}")


def _inputs():
    g = torch.Generator().manual_seed(1234)
    return (torch.randn(1, 4, 8, 8, generator=g), torch.tensor([500.0])), {"context": torch.randn(1, 77, 768, generator=g)}


class _GGUF:
    """One GGUF UNet loaded by ``UnetLoaderGGUF`` and its plain output (loaded by ComfyUI)."""

    def __init__(self, nodes_mod, quant: str):
        import comfy.model_management as mm
        self.quant = quant
        self.patcher = nodes_mod.UnetLoaderGGUF().load_unet(gguf_models.path_for(quant).name)[0]
        self.args, self.kwargs = _inputs()
        mm.load_models_gpu([self.patcher])
        self.reference = self.forward(self.patcher)
        self.types = self.weight_types()
        self.snapshot = {n: p.data.clone() for n, p in self.patcher.model.diffusion_model.named_parameters()}
        mm.unload_all_models()

    def forward(self, patcher) -> torch.Tensor:
        with torch.no_grad():
            return patcher.model.diffusion_model(*self.args, **self.kwargs)

    def weight_types(self) -> dict:
        """name → (tensor class, GGUF type, bytes): what must come back after a placement."""
        return {n: (type(p).__name__, str(getattr(p, "tensor_type", None)), p.data.numel() * p.element_size())
                for n, p in self.patcher.model.diffusion_model.named_parameters()}

    def stored_bytes(self) -> int:
        dm = self.patcher.model.diffusion_model
        return sum(t.numel() * t.element_size() for t in list(dm.parameters()) + list(dm.buffers()))


@pytest.fixture(scope="module")
def gguf(comfy):
    """``gguf(quant)``: the loaded :class:`_GGUF` (one at a time in memory)."""
    import comfy.model_management as mm
    gguf_models.ensure_gguf_models()
    nodes_mod = gguf_pack.load_in_process()
    cache: dict[str, _GGUF] = {}

    def get(quant: str) -> _GGUF:
        if quant not in cache:
            cache.clear()
            cache[quant] = _GGUF(nodes_mod, quant)
        return cache[quant]

    yield get
    cache.clear()
    mm.unload_all_models()


@pytest.fixture(scope="module")
def lora_sd(comfy):
    import comfy.utils
    from harness.lora import ensure_sd15_lora
    return comfy.utils.load_torch_file(str(ensure_sd15_lora()), safe_load=True)


def _with_lora(patcher, lora_sd):
    import comfy.sd
    return comfy.sd.load_lora_for_models(patcher, None, lora_sd, 1.0, 0)[0]


def _group_offload(model, folder, offload_type="block_level"):
    from comfyui_memorykit.memorykit import comfy_integration as ci
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    s = ci.GroupOffloadSettings(GroupOffloadOptions(offload_to="disk", offload_type=offload_type),
                                vram_budget_bytes=8 << 20, disk_folder=str(folder))
    return ci.prepare_group_offload(model, s)[0]


def _device_map(model, folder):
    from comfyui_memorykit.memorykit.comfy_integration import device_map_patcher as dmp
    return dmp.device_map_model(model, "balanced", "cpu=10MiB, disk", str(folder))[0]


def _assert_restored(g: _GGUF, folder):
    """The GGUF weights back as loaded (GGMLTensor, type, the same bytes), nothing left behind."""
    assert g.weight_types() == g.types
    for n, p in g.patcher.model.diffusion_model.named_parameters():
        assert p.device.type == "cpu" and torch.equal(p.data, g.snapshot[n]), n
    for m in g.patcher.model.diffusion_model.modules():
        assert "_memorykit_weight_parts" not in m.__dict__ and "forward" not in m.__dict__
        assert not m._forward_pre_hooks and not m._forward_hooks
    assert os.listdir(folder) == []


@pytest.mark.parametrize("quant,offload_type", [("q8_0", "block_level"), ("q4_k", "leaf_level"), ("f16", "block_level")])
def test_group_offload_streams_the_gguf_bytes(gguf, tmp_path, quant, offload_type):
    import comfy.model_management as mm
    from comfyui_memorykit.memorykit import comfy_integration as ci
    g = gguf(quant)
    n = _group_offload(g.patcher, tmp_path, offload_type)
    assert isinstance(n, ci.GroupOffloadModelPatcher) and type(n).__name__ == "GroupOffloadGGUFModelPatcher"
    assert type(n.clone()) is type(n), "a clone (e.g. a LoRA loader after the node) keeps the offload"
    mm.load_models_gpu([n])
    st = ci.offload_patcher._offload_state(n.model)
    assert torch.equal(g.forward(n), g.reference)
    fig = st.handle.ring.figures()
    # what streams is what is stored: the GGUF bytes of the streamed blocks, packed (never dequantised)
    assert fig["streamed_bytes"] >= st.handle.plan.streamed_bytes > 0.9 * g.stored_bytes() - (8 << 20)
    assert any("GGUF weights streamed as stored" in x for x in st.notes)
    mm.unload_all_models()
    _assert_restored(g, tmp_path)


def test_ram_event_ring_streams_the_gguf_bytes(gguf, tmp_path):
    """The RAM target's ring (what a GPU streams from; on the CPU its copies are memcpys) on the
    decomposed GGUF weights: what Group Offload does on a GPU with offload_to=cpu."""
    from comfyui_memorykit.memorykit import comfy_integration as ci
    from comfyui_memorykit.memorykit import offload, weight_parts
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    g = gguf("q8_0")
    dm = g.patcher.model.diffusion_model
    parts = weight_parts.decompose(dm)
    assert parts.kinds == {"GGUF": sum(1 for t in g.types.values() if t[0] == "GGMLTensor")}
    opts = GroupOffloadOptions(offload_to="cpu", exclude_kwargs=("transformer_options",))
    h = offload.apply_group_offload(dm, "cpu", "cpu", options=opts, budget_bytes=8 << 20,
                                    block_lists=ci.comfy_block_lists(dm))
    try:
        assert torch.equal(g.forward(g.patcher), g.reference)
        assert h.ring.figures()["streamed_bytes"] >= h.plan.streamed_bytes > g.stored_bytes() - (8 << 20)
    finally:
        offload.remove_group_offload(h)
        parts.restore()
    _assert_restored(g, tmp_path)


@pytest.mark.parametrize("quant", ["q8_0", "q4_k"])  # F16: Group Offload's case (the same decomposition)
def test_device_map_places_the_gguf_bytes(gguf, tmp_path, quant):
    import comfy.model_management as mm
    g = gguf(quant)
    n = _device_map(g.patcher, tmp_path)
    assert type(n).__name__ == "DeviceMapGGUFModelPatcher" and type(n.clone()) is type(n)
    mm.load_models_gpu([n])
    assert torch.equal(g.forward(n), g.reference)
    mm.unload_all_models()
    _assert_restored(g, tmp_path)


@pytest.mark.parametrize("node", ["group_offload", "device_map"])
def test_lora_before_and_after_the_node_equals_the_plain_gguf_lora(gguf, lora_sd, tmp_path, node):
    import comfy.model_management as mm
    g = gguf("q8_0")
    place = _group_offload if node == "group_offload" else _device_map
    plain_lora = _with_lora(g.patcher, lora_sd)
    mm.load_models_gpu([plain_lora])
    expected = g.forward(plain_lora)
    mm.unload_all_models()
    assert not torch.equal(expected, g.reference)
    for model in (place(_with_lora(g.patcher, lora_sd), tmp_path), _with_lora(place(g.patcher, tmp_path), lora_sd)):
        mm.load_models_gpu([model])
        assert torch.equal(g.forward(model), expected)
        mm.unload_all_models()
        _assert_restored(g, tmp_path)


def test_fp8_passes_gguf_through_and_save_sharded_refuses_with_a_message(gguf):
    from comfyui_memorykit.memorykit import comfy_integration as ci
    g = gguf("q8_0")
    out, info = ci.fp8_layerwise_cast(g.patcher)
    assert out is g.patcher and info["cast_layers"] == 0
    assert "GGUF file" in info["passed_through"] and "passed through unchanged" in ci.format_fp8_info(info)
    with pytest.raises(ValueError, match="model: this MODEL comes from a GGUF file"):
        ci.save_model_sharded(g.patcher, "mk_gguf_save_refused")
    assert g.weight_types() == g.types


def test_memory_plan_counts_the_stored_gguf_bytes(gguf, tmp_path):
    from comfyui_memorykit.memorykit.comfy_integration import memory_plan_io as mpio
    g = gguf("q8_0")
    figs = mpio.model_figures(g.patcher, [1, 4, 8, 8])
    assert sum(figs.block_bytes) + figs.other_bytes == g.stored_bytes()
    assert figs.fp8_block_bytes is None, "no fp8 is offered for weights that are already quantized"
    _out, _vae, info = mpio.memory_plan(g.patcher, plan_for="given figures", vram_gb=2, ram_gb=0.04, disk_gb=10,
                                        width=64, height=64, disk_folder=str(tmp_path))
    assert "fp8" not in info["applied"] and info["model"]["weight_bytes"] == g.stored_bytes()


def test_server_gguf_through_group_offload_and_device_map(server, fixture_models, tmp_path):
    """Through the HTTP API as a user wires it: UnetLoaderGGUF → Group Offload (disk) / Balanced
    Device Map (cpu + disk) → KSampler: the raw latents equal the plain GGUF model's."""
    from safetensors.torch import load_file
    gguf_models.ensure_gguf_models()
    p = {"1": {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": gguf_models.path_for("q8_0").name}},
         "2": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "mk_sd15_tiny.safetensors"}},
         "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "a lighthouse at dawn", "clip": ["2", 1]}},
         "4": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["2", 1]}},
         "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
         "10": {"class_type": "MemoryKitGroupOffload", "inputs": {
             "model": ["1", 0], "offload_type": "block_level", "num_blocks_per_group": 1, "vram_budget_gb": 0.0,
             "use_stream": True, "record_stream": False, "low_cpu_mem_usage": False, "offload_to": "disk",
             "disk_folder": str(tmp_path)}},
         "20": {"class_type": "MemoryKitBalancedDeviceMap", "inputs": {
             "model": ["1", 0], "strategy": "balanced", "max_memory": "cpu=10MiB, disk",
             "offload_folder": str(tmp_path), "custom_device_map": ""}}}
    for name, model in (("plain", ["1", 0]), ("offload", ["10", 0]), ("devicemap", ["20", 0])):
        p[f"s_{name}"] = {"class_type": "KSampler", "inputs": {
            "model": model, "seed": 11, "steps": 1, "cfg": 4.0, "sampler_name": "euler", "scheduler": "normal",
            "positive": ["3", 0], "negative": ["4", 0], "latent_image": ["5", 0], "denoise": 1.0}}
        p[f"save_{name}"] = {"class_type": "MemoryKitTestSaveTensor",
                             "inputs": {"value": [f"s_{name}", 0], "filename_prefix": f"gguf_{name}"}}
    res = server.run(p)
    assert res.status == "success", res.error
    out = {}
    for name in ("plain", "offload", "devicemap"):
        f = res.outputs[f"save_{name}"]["tensors"][0]
        out[name] = load_file(str(server.base / "output" / f["subfolder"] / f["filename"]))["value"]
    assert torch.equal(out["offload"], out["plain"]) and torch.equal(out["devicemap"], out["plain"])
    server.free(wait=True)
    assert os.listdir(tmp_path) == []
