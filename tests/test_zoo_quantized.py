"""The zoo's format axis: architectures of the model zoo as core loads their fp8_scaled
checkpoints (legacy ``scaled_fp8`` and per-layer ``comfy_quant`` "mixed", e4m3 + e5m2 + layers
left in bf16; :func:`harness.quant_models.build_zoo_quantized`), through Group Offload (disk,
block_level) and Balanced Device Map (cpu + disk), bit-exact against the plain quantized model.

A representative subset, not the whole zoo: the architectures Comfy-Org ships fp8_scaled files
for (Wan 2.1/2.2, Flux, Qwen-Image), which also cover the three block layouts (one block list,
two block lists, a wrapper module); the rest of the zoo goes through the same code (the stored
parts of :mod:`memorykit.stored_parts`) and the whole zoo in both layouts would add minutes to
a suite whose budget is nearly used. One forward per case. ComfyUI 0.33 only (0.3.75 holds
fp8_scaled weights as plain float8 tensors, which the plain zoo already covers).
"""
from __future__ import annotations

import os

import pytest
import torch
from harness import quant_models, zoo

ARCHS = ["wan21", "flux", "qwen_image"]


class QArch:
    def __init__(self, name: str, layout: str):
        self.name, self.layout = name, layout
        self.patcher = quant_models.build_zoo_quantized(name, layout)
        self.dm = self.patcher.model.diffusion_model
        self.args = zoo.inputs(name, self.patcher.model)
        self.reference = self.forward(self.patcher)

    def forward(self, patcher) -> torch.Tensor:
        import comfy.model_management as mm
        with torch.inference_mode():
            try:
                mm.load_models_gpu([patcher])
                return zoo.forward(patcher, self.name, self.args)
            finally:
                mm.unload_all_models()


@pytest.fixture(scope="module", params=[(a, lay) for a in ARCHS for lay in ("legacy", "mixed")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def qarch(request, comfy):
    import comfy.quant_ops as qo
    if "float8_e5m2" not in getattr(qo, "QUANT_ALGOS", {}):
        pytest.skip("ComfyUI 0.3.75 loads fp8_scaled files as plain float8 tensors (covered by the plain zoo)")
    why = zoo.available(request.param[0])
    if why:
        pytest.skip(why)
    a = QArch(*request.param)
    from comfyui_memorykit.memorykit import stored_parts
    assert any(not stored_parts.is_plain(t) for t in a.dm.parameters()), "no quantized layer was built"
    return a


def test_group_offload_disk_on_quantized_zoo_is_bit_exact(qarch, tmp_path):
    from comfyui_memorykit.memorykit import comfy_integration as ci
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    settings = ci.GroupOffloadSettings(GroupOffloadOptions(offload_to="disk"), disk_folder=str(tmp_path))
    n, _ = ci.prepare_group_offload(qarch.patcher, settings)
    out = qarch.forward(n)
    assert os.listdir(tmp_path) == []
    assert torch.equal(out, qarch.reference), f"{qarch.name} {qarch.layout}"


def test_device_map_on_quantized_zoo_is_bit_exact(qarch, tmp_path):
    from comfyui_memorykit.memorykit import comfy_integration as ci

    def size(m):  # as the plan counts (full-precision sizes of quantized layers, see docs)
        return sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
    blocks = [qn for _, items in ci.comfy_block_lists(qarch.dm) for qn, _ in items]
    cpu = size(qarch.dm) - sum(size(qarch.dm.get_submodule(b)) for b in blocks) // 2  # both devices used
    clone, rep, _ = ci.device_map_model(qarch.patcher, "balanced", f"cpu={cpu}, disk", str(tmp_path))
    assert set(rep["bytes_per_device"]) == {"cpu", "disk"}, rep["bytes_per_device"]
    out = qarch.forward(clone)
    assert os.listdir(tmp_path) == []
    assert torch.equal(out, qarch.reference), f"{qarch.name} {qarch.layout}: {rep['bytes_per_device']}"
