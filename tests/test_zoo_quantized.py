"""The zoo's format axis: architectures of the model zoo as core loads their fp8_scaled
checkpoints (legacy ``scaled_fp8`` and per-layer ``comfy_quant`` "mixed", e4m3 + e5m2 + layers
left in bf16; :func:`harness.quant_models.build_zoo_quantized`), through Group Offload (disk,
block_level) and Balanced Device Map (cpu + disk), bit-exact against the plain quantized model;
FP8 Layerwise Cast (every layer it would cast is already stored quantized or left in bf16 by the
file: the model passes through unchanged and the text says why), Memory Plan (counts the stored
bytes, offers no fp8) and Save Sharded (the shards, loaded back, compute the plain quantized
model's output bit for bit).

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


def _stored(dm) -> tuple[int, dict]:
    from comfyui_memorykit.memorykit import stored_parts
    parts = {n: [p.detach().clone() for p in stored_parts.parts(t)] for n, t in dm.named_parameters()}
    return sum(stored_parts.stored_nbytes(t) for t in list(dm.parameters()) + list(dm.buffers())), parts


def test_fp8_cast_on_quantized_zoo_passes_the_model_through_as_stored(qarch):
    """Nothing left to cast (the quantized layers and a mixed file's bf16 layers are left as stored):
    the input MODEL passes through unchanged, the text says why, no second quantization, the
    loaded model untouched. No forward."""
    from comfyui_memorykit.memorykit import comfy_integration as ci
    from comfyui_memorykit.memorykit import fp8, stored_parts
    total, before = _stored(qarch.dm)
    plan = fp8.plan_layers(qarch.dm, fp8.default_skip_patterns(fp8.detect_family(qarch.dm), "auto"))
    quantized = {n.rsplit(".", 1)[0] for n, t in qarch.dm.named_parameters() if not stored_parts.is_plain(t)}
    assert quantized <= set(plan.kept) and not plan.cast
    if qarch.layout == "mixed":  # every third block Linear left in bf16 by the file, listed as kept
        assert any("by the checkpoint's per-layer format" in r for r in plan.kept.values())
    out, info = ci.fp8_layerwise_cast(qarch.patcher)
    assert out is qarch.patcher and info["cast_layers"] == 0
    text = ci.format_fp8_info(info)
    assert "passed through unchanged" in text and "already stored quantized" in text and "left as stored" in text
    assert info["weight_bytes_before"] == info["weight_bytes_after"] == qarch.patcher.model_size()
    after = _stored(qarch.dm)
    assert after[0] == total and all(all(map(torch.equal, after[1][n], ps)) for n, ps in before.items())
    assert not qarch.patcher.object_patches


def test_memory_plan_counts_stored_bytes_and_offers_no_fp8_on_quantized_zoo(qarch, tmp_path):
    from comfyui_memorykit.memorykit.comfy_integration import memory_plan_io as mpio
    total, _ = _stored(qarch.dm)
    x = qarch.args[0]
    figs = mpio.model_figures(qarch.patcher, list(x.shape))
    assert figs.weight_bytes == total, "Memory Plan counts the stored (fp8 + scale) bytes"
    assert figs.fp8_block_bytes is None, "no fp8 offered for a model that is already fp8"
    out, _vae, info = mpio.memory_plan(qarch.patcher, latent={"samples": x}, plan_for="given figures", vram_gb=2,
                                       ram_gb=0.04, disk_gb=10, disk_folder=str(tmp_path))
    assert "fp8" not in info["applied"] and info["model"]["weight_bytes"] == total
    assert torch.equal(qarch.forward(out), qarch.reference)
    assert os.listdir(tmp_path) == []


def test_save_sharded_on_quantized_zoo_reloads_to_the_same_output(qarch):
    """Save Sharded writes the stored fp8 bytes and scales (core's per-layer format); the shards, read
    as Sharded Checkpoint Loader reads them, load into the same model and compute the same output.
    (Core's model detection does not recognise the zoo's tiny configurations, so the reload builds
    the zoo model and loads the shards' tensors into it, as build_zoo_quantized does.)"""
    import shutil

    from comfyui_memorykit.memorykit import sharded
    from comfyui_memorykit.memorykit.comfy_integration import save_model_sharded
    total, _ = _stored(qarch.dm)
    with torch.inference_mode():  # as the server runs Save Sharded (core loads the model to save it)
        rep = save_model_sharded(qarch.patcher, f"mk_zoo_quant_save_{qarch.name}_{qarch.layout}", overwrite=True)
    try:
        sd, _meta = sharded.load_state_dict(sharded.read_index(rep["folder"]), lambda done, n: None)
        assert any(v.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for v in sd.values())
        assert rep["total_bytes"] < total * 1.02, "the stored bytes are written, not a dequantised copy"
        prefix = "model.diffusion_model."  # as core's loader strips it (comfy.sd.load_diffusion_model_state_dict)
        assert all(k.startswith(prefix) for k in sd)
        reloaded = quant_models.load_zoo_quantized(qarch.name, {k[len(prefix):]: v for k, v in sd.items()})
        assert torch.equal(qarch.forward(reloaded), qarch.reference)
    finally:
        shutil.rmtree(rep["folder"], ignore_errors=True)
