"""The zoo's GGUF format axis: zoo architectures city96/ComfyUI-GGUF knows (a representative
subset of transformers the SD1.5 GGUF tests do not cover; ``MEMORYKIT_GGUF_ZOO=all``: all), stored as
GGUF Q8_0 and loaded by that pack's loader, ops and patcher (``harness.gguf_models.zoo_gguf``);
Group Offload to disk and Balanced Device Map (cpu + disk) against the plain GGUF model, bit for
bit, through ``BaseModel.apply_model``. One built model per architecture, one forward per case.
"""
from __future__ import annotations

import os

import pytest
import torch

from harness import gguf_models, gguf_pack, zoo

pytestmark = pytest.mark.skipif(
    gguf_pack.available() is not None and not os.environ.get("REQUIRE_COMFYUI_033"),
    reason=f"GGUF models cannot be tested here: {gguf_pack.available()}")

# MEMORYKIT_GGUF_ZOO=all: every zoo architecture city96's loader knows (gguf_models.ZOO_ARCHS)
ARCHS = (list(gguf_models.ZOO_ARCHS) if os.environ.get("MEMORYKIT_GGUF_ZOO") == "all"
         else ["flux", "wan21", "qwen_image", "lumina2", "cosmos_predict2"])


class _ZooGGUF:
    def __init__(self, name: str, folder):
        import comfy.model_management as mm
        self.name = name
        self.patcher = gguf_models.zoo_gguf(name, folder)
        self.args = zoo.inputs(name, self.patcher.model)
        mm.load_models_gpu([self.patcher])
        self.reference = self.forward(self.patcher)
        mm.unload_all_models()
        assert torch.isfinite(self.reference).all()
        dm = self.patcher.model.diffusion_model
        self.types = {n: (type(p).__name__, p.data.numel() * p.element_size()) for n, p in dm.named_parameters()}
        assert any(getattr(getattr(p, "tensor_type", None), "name", "") == "Q8_0" for p in dm.parameters())

    def forward(self, patcher) -> torch.Tensor:
        return zoo.forward(patcher, self.name, self.args)

    def loaded_forward(self, patcher) -> torch.Tensor:
        import comfy.model_management as mm
        try:
            mm.load_models_gpu([patcher])
            return self.forward(patcher)
        finally:
            mm.unload_all_models()

    def assert_restored(self):
        dm = self.patcher.model.diffusion_model
        assert {n: (type(p).__name__, p.data.numel() * p.element_size())
                for n, p in dm.named_parameters()} == self.types
        for n, m in dm.named_modules():
            assert not m._forward_pre_hooks and not m._forward_hooks, n


@pytest.fixture(scope="module", params=ARCHS)
def arch(request, comfy, tmp_path_factory):
    why = zoo.available(request.param)
    if why:
        pytest.skip(why)
    import comfy.model_management as mm
    mm.unload_all_models()
    yield _ZooGGUF(request.param, tmp_path_factory.mktemp(f"gguf_{request.param}"))
    mm.unload_all_models()


def test_gguf_disk_offload_is_bit_exact(arch, tmp_path):
    from comfyui_memorykit.memorykit import comfy_integration as ci
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    settings = ci.GroupOffloadSettings(GroupOffloadOptions(offload_type="block_level", offload_to="disk"),
                                       disk_folder=str(tmp_path))
    n, _ = ci.prepare_group_offload(arch.patcher, settings)
    out = arch.loaded_forward(n)
    assert os.listdir(tmp_path) == []
    arch.assert_restored()
    assert torch.equal(out, arch.reference), f"{arch.name}: max abs {(out - arch.reference).abs().max()}"


def test_gguf_device_map_is_bit_exact(arch, tmp_path):
    from comfyui_memorykit.memorykit import comfy_integration as ci
    dm = arch.patcher.model.diffusion_model
    def nbytes(m):  # as stored (a GGUF layer's state_dict holds placeholders, see its ggml_save_to_state_dict)
        return sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
    total = nbytes(dm)
    in_blocks = sum(nbytes(b) for _, items in ci.comfy_block_lists(dm) for _, b in items)
    clone, rep, _ = ci.device_map_model(arch.patcher, "balanced", f"cpu={total - in_blocks // 2}, disk", str(tmp_path))
    assert set(rep["bytes_per_device"]) == {"cpu", "disk"}
    out = arch.loaded_forward(clone)
    assert os.listdir(tmp_path) == []
    arch.assert_restored()
    assert torch.equal(out, arch.reference), f"{arch.name}: max abs {(out - arch.reference).abs().max()}"


def test_gguf_memory_plan_counts_stored_bytes_and_offers_no_fp8(arch):
    """Memory Plan on the zoo's GGUF Q8_0 models: the stored (quantized) bytes, no fp8 offered
    (FP8 Layerwise Cast and Save Sharded refuse GGUF with a message: tests/test_gguf.py). No forward."""
    from comfyui_memorykit.memorykit.comfy_integration import memory_plan_io as mpio
    dm = arch.patcher.model.diffusion_model
    stored = sum(t.numel() * t.element_size() for t in list(dm.parameters()) + list(dm.buffers()))
    figs = mpio.model_figures(arch.patcher, list(arch.args[0].shape))
    assert figs.weight_bytes == stored
    assert figs.fp8_block_bytes is None, "no fp8 is offered for weights that are already quantized"
