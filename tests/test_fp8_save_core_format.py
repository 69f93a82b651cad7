"""Save Sharded of an FP8 model writes core's own quantized format, and both loaders give the live
FP8 model back (issue 19 item 5). In-process, tiny fixtures, one forward per model.

Each case: FP8 Layerwise Cast → Save Sharded's own code (``save_model_sharded``) → (a) core's
``comfy.sd.load_diffusion_model`` on the shards merged into one file (Save Sharded writes shards
only; the test merges them with Save Sharded's safetensors writer, header metadata included) and (b) Sharded Checkpoint
Loader on the folder. Layers in core's format hold the live float8 values and scales and core
dequantises them as it does live, so the reload equals the live output bit for bit. Layers core's
format cannot hold (e5m2 where core has no e5m2 layout, per-output-channel scales, Conv) are
saved dequantised: relative L2 ≤ 1e-5 to live (float32 rounding: live multiplies the scale into
the input or output, the reload into the weight). Before this change the saver wrote the legacy
scaled-fp8 form and quantised the layers FP8 kept in high precision: Wan e4m3 reloaded 0.0036
from plain vs live FP8 0.00018 (this input), the bit-exact checks failed, and an unmerged-LoRA
FP8 model did not save at all (ImportError).
"""
from __future__ import annotations

import json
import shutil
import uuid

import pytest
import torch
from harness.fp8_checks import cast, load_and_forward, rel, wan_model_and_inputs

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
DEQUANTISED_TOL = 1e-5


@pytest.fixture(scope="module")
def wan(comfy, fixture_models):
    plain, args, kwargs = wan_model_and_inputs(fixture_models)
    yield plain, args, kwargs, load_and_forward(plain, *args, **kwargs)
    import comfy.model_management as mm
    mm.unload_all_models()


def _read_folder(folder) -> tuple[dict, dict]:
    from safetensors import safe_open
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    sd, meta = {}, {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / shard), framework="pt") as f:
            meta = f.metadata() or {}
            sd.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is not iterable)
    return sd, meta


def _save_and_reload(ci, model, tmp_path) -> tuple[dict, dict, dict, list]:
    """Save Sharded → (saved tensors, file metadata, node info, [core's reload, ours])."""
    import comfy.sd
    from comfyui_memorykit.memorykit.aligned_safetensors import save_file
    name = f"mk_test_fp8core_{uuid.uuid4().hex[:8]}"
    with torch.inference_mode():
        info = ci.save_model_sharded(model, name, max_shard_size="1MB", progress=lambda d, t: None)
    folder = ci.diffusion_models_dir() / name
    try:
        sd, meta = _read_folder(folder)
        merged = tmp_path / f"{name}.safetensors"
        # written as Save Sharded writes its shards (tensors 16/64-byte aligned): with
        # safetensors.torch.save_file a weight's alignment in the file, and so a batch-1 Linear's
        # float32 bits on the CPU (about 1e-8), would depend on the header's length
        save_file(sd, str(merged), metadata=meta)
        with torch.inference_mode():
            reloads = [comfy.sd.load_diffusion_model(str(merged)),
                       ci.load_sharded_diffusion_model(folder, progress=lambda d, t: None)[0]]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert info["shards"] > 1
    return sd, meta, info, reloads


def _check_header(ci, sd: dict, meta: dict, info: dict, model) -> int:
    """Cast Linears in core's format (float8 weight + weight_scale + comfy_quant, or listed in
    _quantization_metadata), kept layers in high precision, no legacy marker. Returns how many
    layers are in core's format."""
    prefix = "model.diffusion_model."
    layers = json.loads(meta["_quantization_metadata"])["layers"] if "_quantization_metadata" in meta else {}
    assert not any(k.endswith(("scaled_fp8", ".scale_weight")) for k in sd), "legacy scaled-fp8 keys written"
    n = 0
    for name in _cast_names(ci, model):
        w = sd[f"{prefix}{name}.weight"]
        if w.dtype not in FLOAT8:
            assert f"{prefix}{name}.weight_scale" not in sd and f"{prefix}{name}.comfy_quant" not in sd
            continue
        n += 1
        assert sd[f"{prefix}{name}.weight_scale"].dtype == torch.float32, name
        q = sd.get(f"{prefix}{name}.comfy_quant")
        conf = json.loads(bytes(q.tolist())) if q is not None else layers[name]  # one of the two, as core writes
        assert (q is None) == bool(layers) and conf["format"] == str(w.dtype).replace("torch.", ""), (name, conf)
        assert conf.get("full_precision_matrix_mult") is True, (name, conf)  # as live: fp8_matmul off
    for kept in info["kept_layers"]:
        w = sd.get(f"{prefix}{kept['name']}.weight")
        assert w is not None and w.dtype not in FLOAT8, kept["name"]
        assert f"{prefix}{kept['name']}.comfy_quant" not in sd and kept["name"] not in layers
    return n


def _check_reloads(ci, name, model, live, ref, reloads, args, kwargs, n_core: int, exact: bool):
    import comfy.quant_ops
    live_err = rel(live, ref)
    for which, re in zip(("core's Load Diffusion Model (merged file)", "Sharded Checkpoint Loader"), reloads):
        out = load_and_forward(re, *args, **kwargs)
        quantized = sum(isinstance(getattr(m, "weight", None), comfy.quant_ops.QuantizedTensor)
                        for m in re.model.diffusion_model.modules())
        err, err_plain = rel(out, live), rel(out, ref)
        print(f"\n{name} via {which}: reload vs live {err:.2e}, reload vs plain {err_plain:.5f} "
              f"(live FP8 vs plain {live_err:.5f}); {quantized} QuantizedTensor layers loaded")
        assert quantized == n_core, f"{which}: core loaded {quantized} quantized layers, {n_core} saved"
        if exact:
            assert torch.equal(out, live), f"{name} via {which}: reload differs from live FP8 by {err:.2e}"
        else:
            assert err <= DEQUANTISED_TOL, f"{name} via {which}: reload vs live {err:.2e}"
        assert err_plain <= live_err * (1 + 1e-3) + 1e-7, f"{name} via {which}: farther from plain than live FP8"
        del re


def _cast_names(ci, model) -> list[str]:
    return model.get_attachment(ci.FP8_ATTACHMENT)["cast"]


@pytest.mark.parametrize("storage,scaling", [("float8_e4m3fn", "per-tensor"), ("float8_e5m2", "per-tensor"),
                                             ("float8_e4m3fn", "per-output-channel")])
def test_wan_fp8_save_reloads_to_live(ci, wan, tmp_path, storage, scaling):
    plain, args, kwargs, ref = wan
    model, info = cast(ci, plain, storage=storage, scaling=scaling)
    live = load_and_forward(model, *args, **kwargs)
    sd, meta, saved, reloads = _save_and_reload(ci, model, tmp_path)
    n_core = _check_header(ci, sd, meta, info, model)
    core_ok = ci.compat.core_fp8_format(getattr(torch, storage)) is not None and scaling == "per-tensor"
    print(f"\n{storage} {scaling}: {info['path']}; saved: {saved['fp8']['note']}")
    assert n_core == (info["cast_layers"] if core_ok else 0)
    assert saved["fp8"]["core"] == n_core and saved["fp8"]["dequantised"] == info["cast_layers"] - n_core
    _check_reloads(ci, f"Wan {storage} {scaling}", model, live, ref, reloads, args, kwargs, n_core, exact=core_ok)


def test_sd15_conv_layers_saved_dequantised(ci, comfy, fixture_models, tmp_path):
    """SD1.5: core-format Linears beside MemoryKit's Conv cast layers (core quantises no Conv)."""
    import comfy.model_management as mm

    import nodes
    with torch.inference_mode():
        plain = nodes.CheckpointLoaderSimple().load_checkpoint("mk_sd15_tiny.safetensors")[0]
    gen = torch.Generator().manual_seed(2)
    args = (torch.randn(1, 4, 16, 16, generator=gen), torch.tensor([500.0]))
    kwargs = {"c_crossattn": torch.randn(1, 77, 768, generator=gen)}
    try:
        ref = load_and_forward(plain, *args, **kwargs)
        model, info = cast(ci, plain)
        live = load_and_forward(model, *args, **kwargs)
        sd, meta, saved, reloads = _save_and_reload(ci, model, tmp_path)
        n_core = _check_header(ci, sd, meta, info, model)
        convs = [n for n in _cast_names(ci, model) if sd[f"model.diffusion_model.{n}.weight"].ndim > 2]
        print(f"\nSD1.5: {info['path']}; saved: {saved['fp8']['note']}")
        assert convs and n_core == info["core_layers"] and saved["fp8"]["dequantised"] == len(convs)
        _check_reloads(ci, "SD1.5 e4m3 per-tensor", model, live, ref, reloads, args, kwargs, n_core,
                       exact=False)
    finally:
        mm.unload_all_models()


@pytest.mark.parametrize("lora_mode", ["unmerged", "merged"])
def test_wan_fp8_lora_save_reloads_to_live(ci, wan, tmp_path, lora_mode):
    """FP8 + a LoRA (ΔW about the weight's size). ``unmerged``: the file holds no per-forward patch,
    so the LoRA is merged into the original weight and re-quantised once
    (``fp8_core.merged_for_saving``); the reload differs from live FP8 + LoRA by that one rounding:
    within 2 × FP8's own error against plain + LoRA. ``merged``: the live layers hold the merged,
    re-quantised float8 weight, which is what is saved: bit-exact."""
    import comfy.sd
    plain, args, kwargs, _ = wan
    gen = torch.Generator().manual_seed(5)
    lora, rank = {}, 4
    for name, m in plain.model.diffusion_model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.startswith("blocks.") and ("attn" in name or "ffn" in name):
            a = (float(m.weight.detach().float().std()) / rank ** 0.5) ** 0.5  # ΔW ~ the weight's own size
            lora[f"diffusion_model.{name}.lora_up.weight"] = torch.randn(m.out_features, rank, generator=gen) * a
            lora[f"diffusion_model.{name}.lora_down.weight"] = torch.randn(rank, m.in_features, generator=gen) * a
            lora[f"diffusion_model.{name}.alpha"] = torch.tensor(float(rank))
    with torch.inference_mode():
        plain_lora = comfy.sd.load_lora_for_models(plain, None, lora, 1.0, 0.0)[0]
        fp8, info = cast(ci, plain, lora_mode=lora_mode)
        live_model = comfy.sd.load_lora_for_models(fp8, None, lora, 1.0, 0.0)[0]
    ref = load_and_forward(plain_lora, *args, **kwargs)
    live = load_and_forward(live_model, *args, **kwargs)
    sd, meta, saved, reloads = _save_and_reload(ci, live_model, tmp_path)
    n_core = _check_header(ci, sd, meta, info, live_model)
    live_err = rel(live, ref)
    print(f"\nWan {lora_mode} LoRA: live FP8+LoRA vs plain+LoRA {live_err:.5f}; saved: {saved['fp8']['note']}")
    assert n_core == info["core_layers"]
    if lora_mode == "unmerged":  # re-quantised for the file with a power-of-two scale: exact in any compute dtype
        merged = [k[len("diffusion_model."):-len(".lora_up.weight")] for k in lora if k.endswith(".lora_up.weight")]
        scales = [sd[f"model.diffusion_model.{n}.weight_scale"] for n in merged
                  if f"model.diffusion_model.{n}.weight_scale" in sd]
        assert scales and all(float(torch.exp2(torch.round(torch.log2(sc)))) == float(sc) for sc in scales)
        # the report says the LoRA was merged and re-quantised, and by how much that moved the weights
        # (hostile inputs round 3, item 4: it said only "N layers saved as float8"); the figure is the file's
        fp = saved["fp8"]
        assert fp["lora_requantised"] == len(merged), fp
        shown = f"moved these layers' weights by {fp['lora_shift']:.2%} of their size (FP8's own rounding of them: " \
                f"{fp['fp8_own_error']:.2%})"
        assert "merged into their original weights and the result re-quantised to float8" in fp["note"] and \
            shown in fp["note"], fp["note"]
        assert abs(_file_lora_shift(ci, sd, live_model, merged) - fp["lora_shift"]) <= 1e-3 * fp["lora_shift"]
    else:
        assert "lora_requantised" not in saved["fp8"] and "LoRA" not in saved["fp8"]["note"]
    for which, re in zip(("core's Load Diffusion Model", "Sharded Checkpoint Loader"), reloads):
        out = load_and_forward(re, *args, **kwargs)
        print(f"  {which}: reload vs live {rel(out, live):.5f}, vs plain+LoRA {rel(out, ref):.5f}")
        if lora_mode == "merged":
            assert torch.equal(out, live), which
        assert rel(out, live) <= 2 * live_err and rel(out, ref) <= 2 * live_err, which


def _file_lora_shift(ci, sd: dict, live_model, names: list[str]) -> float:
    """RMS of (saved − live) weights over the live weights' RMS for ``names``: the saved float8 ×
    ``weight_scale`` from the file; the live weight is the layer's float8 × scale plus the LoRA's
    change on its original weight (what an unmerged layer computes)."""
    import comfy.lora
    err = ref = 0.0
    for n in names:
        layer = live_model.get_model_object(f"diffusion_model.{n}")
        key = f"diffusion_model.{n}.weight"
        w = layer._mk_original[0].weight.detach().float()
        change = comfy.lora.calculate_weight(live_model.patches[key], w.clone(), key) - w
        core = ci.fp8_core.is_core_layer(layer)
        s_live = ci.fp8_core.weight_scale(layer) if core else ci.fp8_patcher.layer_scale(layer)
        live = ci.fp8_core.storage_tensor(layer).float() * (1 if s_live is None else s_live.float()) + change
        saved = sd[f"model.diffusion_model.{n}.weight"].float() * sd[f"model.diffusion_model.{n}.weight_scale"].float()
        err += float((saved - live).double().pow(2).sum())
        ref += float(live.double().pow(2).sum())
    return (err / ref) ** 0.5


def test_core_quant_format_names(ci):
    """The core names Save Sharded's format relies on (fails when one changes): the layer's tensors
    (:func:`compat.core_quant_tensors`) and the ``_quantization_metadata`` reader of this core."""
    import comfy.model_detection
    import comfy.utils
    if ci.compat.core_fp8_format(torch.float8_e4m3fn) is None:
        pytest.skip("this ComfyUI has no QuantizedTensor: the legacy scaled-fp8 form is written")
    q = torch.randn(8, 4).to(torch.float8_e4m3fn)
    layer = ci.compat.core_fp8_linear(q, torch.tensor(0.5), None, "float8_e4m3fn", torch.float32, True)
    tensors, conf = ci.compat.core_quant_tensors(layer, "l.")
    assert torch.equal(tensors["l.weight"].view(torch.uint8), q.view(torch.uint8))
    assert tensors["l.weight_scale"].dtype == torch.float32 and float(tensors["l.weight_scale"]) == 0.5
    conf = conf or json.loads(bytes(tensors["l.comfy_quant"].tolist()))
    assert conf == {"format": "float8_e4m3fn", "full_precision_matrix_mult": True}
    meta = {"_quantization_metadata": ci.compat.quantization_metadata({"l": conf})}
    if hasattr(comfy.utils, "convert_old_quants"):  # 0.33+: the metadata becomes per-layer comfy_quant
        sd, _ = comfy.utils.convert_old_quants({"l.weight": q}, "", metadata=meta)
        assert json.loads(bytes(sd["l.comfy_quant"].tolist())) == conf
    else:  # 0.3.75: the model config's layer_quant_config
        assert comfy.model_detection.detect_layer_quantization(dict(meta)) == {"l": conf}
