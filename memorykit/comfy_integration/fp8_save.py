"""FP8 Layerwise Cast's layers in a saved checkpoint (Save Sharded), in core's own format.

Where this ComfyUI has core's ``QuantizedTensor`` (:func:`compat.core_fp8_format`), every cast
Linear whose float8 format core has a layout for and whose scale is one per tensor is written
exactly as core writes its own mixed-precision Linear (what core's saver put in the state dict,
else :func:`compat.core_quant_tensors`):
``<layer>.weight`` (float8 data), ``<layer>.weight_scale`` (0-d float32) and, on 0.33+,
``<layer>.comfy_quant`` (the layer's JSON config as uint8); 0.3.75 instead lists the layer in
the file's ``_quantization_metadata`` (its loader reads only that). Core-path layers are saved
by core's own state-dict code; MemoryKit's own per-tensor Linear layers are first put into core's
layer with the same float8 values and scale. The float8 values and scales are the live model's,
so a reload computes what the live model computes.

Layers core's format cannot hold (per-output-channel scales, Conv layers, e5m2 on a core
without an e5m2 layout) are dequantised to their original high-precision dtype (the live
layer's value × scale; the saved model is larger there). Layers FP8 Layerwise Cast kept in
high precision are written as they are (never quantised). A ComfyUI without ``QuantizedTensor``
gets the legacy scaled-fp8 form (:mod:`memorykit.scaled_fp8`).
"""
from __future__ import annotations

import torch

from .. import fp8, scaled_fp8
from . import compat, fp8_core
from .fp8_patcher import FP8_ATTACHMENT, layer_scale

# What a checkpoint may hold for one quantized layer besides its bias (core's and the legacy names).
_QUANT_SUFFIXES = ("weight", "weight_scale", "comfy_quant", "scale_weight", "input_scale", "scale_input")
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_layers_for_saving(model, sd: dict, metadata: dict) -> tuple[dict, dict, dict | None]:
    """``(sd, metadata, info)``: the MODEL ``model``'s saving state dict ``sd`` (checkpoint names,
    see ``sharded_io.model_state_dict_for_saving``) and safetensors ``metadata`` (str → str)
    with FP8 Layerwise Cast's layers as the module doc says. Neither input is modified.

    ``info`` (None for a model without cast layers): ``format`` (``comfy-quant``: core's
    per-layer format; ``dequantised``; or the legacy ``scaled-fp8``), ``core`` (layers written in
    core's format), ``dequantised`` (layers written in high precision), ``reason`` (why, when
    some were), ``file_metadata`` (True when ``_quantization_metadata`` was written)."""
    cast = (model.get_attachment(FP8_ATTACHMENT) or {}).get("cast") or []
    if not cast:
        return sd, metadata, None
    # The prefix core's savers give diffusion-model keys (model.diffusion_model., net., ...).
    prefix = next(iter(model.model.model_config.process_unet_state_dict_for_saving({"": None})))
    if compat.core_fp8_format(torch.float8_e4m3fn) is None:
        sd, info = _legacy(model, sd, prefix, cast)
        return sd, metadata, info
    sd, metadata = dict(sd), dict(metadata)
    file_layers: dict[str, dict] = {}
    kinds: set[str] = set()
    info = {"format": "comfy-quant", "core": 0, "dequantised": 0, "file_metadata": False}
    shift = _LoraShift()
    for name in cast:
        layer = model.get_model_object(f"diffusion_model.{name}")
        p = f"{prefix}{name}."
        patch_key = f"diffusion_model.{name}.weight"
        lora = fp8_core.is_unmerged_layer(layer) and patch_key in model.patches
        if fp8_core.is_core_layer(layer) and not lora:
            if all(p + k in sd for k in ("weight", "weight_scale", "comfy_quant")):
                info["core"] += 1  # core's saver wrote its own format (0.33+; lazily patched LoRA included)
                continue
            tensors, conf = compat.core_quant_tensors(layer, p)  # core's own state-dict code
        else:
            if lora:  # a file holds no per-forward patch: merge once, re-quantise (see merged_for_saving)
                q, s = fp8_core.merged_for_saving(layer, model.patches, patch_key)
                shift.add(layer, q, s, model.patches, patch_key)
            else:
                q, s = sd.get(p + "weight"), layer_scale(layer)
                if q is None or q.dtype not in _FLOAT8:
                    continue
            tensors, conf, kind = _own_layer(layer, q, s, p)
            if kind:
                kinds.add(kind)
        if p + "bias" in sd:  # the model's (possibly LoRA-patched) bias, not the layer's
            tensors.pop(p + "bias", None)
        for suffix in _QUANT_SUFFIXES:
            sd.pop(p + suffix, None)
        sd.update(tensors)
        if conf is not None:
            file_layers[name] = conf
        info["core" if sd[p + "weight"].dtype in _FLOAT8 else "dequantised"] += 1
    if file_layers:  # 0.3.75: core's loader reads the layers' formats from the file's metadata
        metadata[compat.QUANT_METADATA_KEY] = compat.quantization_metadata(
            file_layers, metadata.get(compat.QUANT_METADATA_KEY))
        info["file_metadata"] = True
    if not info["core"]:
        info["format"] = "dequantised"
    info.update(shift.info())
    if info["dequantised"]:
        info["reason"] = ("ComfyUI's quantized format holds float8 Linear layers with one scale per layer, in a "
                          f"format this ComfyUI has a layout for (dequantised here: {', '.join(sorted(kinds))})")
    return sd, metadata, info


def _own_layer(layer, q: torch.Tensor, scale, p: str) -> tuple[dict, dict | None, str | None]:
    """Checkpoint tensors for float8 ``q`` × ``scale`` of ``layer`` (MemoryKit's cast layer, or a
    re-quantised merge): core's format where it holds them (a core Linear built from the same
    values, saved by core's code), else the dequantised weight. Returns ``(tensors, metadata
    entry or None, why dequantised or None)``."""
    fmt = compat.core_fp8_format(q.dtype)
    linear = isinstance(layer, torch.nn.Linear) or fp8_core.is_core_layer(layer)
    per_tensor = scale is None or scale.numel() == 1
    # core's loader multiplies by the scale in the compute dtype: keep core's format only for a scale
    # every compute dtype holds exactly (else the reload would be off the live layer by the rounding)
    exact = scale is None or all(bool((scale.float().to(d).float() == scale.float()).all())
                                 for d in (torch.bfloat16, torch.float16))
    if fmt is not None and linear and per_tensor and exact:
        s = torch.ones((), dtype=torch.float32) if scale is None else scale.detach().to("cpu", torch.float32)
        full = not getattr(layer, "_mk_fp8_matmul", False) if not fp8_core.is_core_layer(layer) \
            else bool(getattr(layer, "_full_precision_mm", True))
        core = compat.core_fp8_linear(q.detach().to("cpu"), s, None, fmt[0], torch.float32, full_precision_mm=full)
        tensors, conf = compat.core_quant_tensors(core, p)
        return tensors, conf, None
    original = getattr(layer, "_mk_original", (None,))[0]
    w = None if original is None else original.weight
    dtype = w.dtype if w is not None and w.is_floating_point() and w.dtype.itemsize > 1 else torch.float32
    s = None if scale is None else scale.detach().to("cpu")
    kind = (str(q.dtype).replace("torch.", "") + ("" if per_tensor else " per-output-channel")
            + ("" if exact or not per_tensor else " scale not exact in bf16/fp16")
            + ("" if linear else f" {type(original or layer).__name__.replace('MemoryKitFp8', '')}"))
    return {p + "weight": fp8.dequantize_weight(q.detach().to("cpu"), s, dtype)}, None, kind


def _legacy(model, sd: dict, prefix: str, cast: list[str]) -> tuple[dict, dict]:
    """A core without ``QuantizedTensor``: the scaled-fp8 form (:func:`scaled_fp8.checkpoint_tensors`)."""
    layers, shift = {}, _LoraShift()
    sd = dict(sd)
    for name in cast:
        layer = model.get_model_object(f"diffusion_model.{name}")
        key = f"{prefix}{name}.weight"
        scale = None
        if fp8_core.is_unmerged_layer(layer) and f"diffusion_model.{name}.weight" in model.patches:
            sd[key], scale = fp8_core.merged_for_saving(layer, model.patches, f"diffusion_model.{name}.weight")
            shift.add(layer, sd[key], scale, model.patches, f"diffusion_model.{name}.weight")
        elif hasattr(layer, "scale_weight"):
            scale = layer_scale(layer)
        weight = sd.get(key)
        if weight is None or weight.dtype not in _FLOAT8:
            continue
        original = getattr(layer, "_mk_original", (None,))[0]
        dtype = original.weight.dtype if original is not None and original.weight.is_floating_point() \
            and original.weight.dtype.itemsize > 1 else torch.float32
        layers[name] = scaled_fp8.Fp8Layer(scale, dtype, isinstance(layer, torch.nn.Linear))
    core_linears = {n for n, m in model.model.diffusion_model.named_modules()
                    if isinstance(m, torch.nn.Linear) and hasattr(m, "comfy_cast_weights")}
    core_linears |= {n for n, layer in layers.items() if layer.linear}
    sd, info = scaled_fp8.checkpoint_tensors(sd, prefix, layers, core_linears)
    return sd, dict(info, **shift.info())


class _LoraShift:
    """How far merging a per-forward (``unmerged``) LoRA and re-quantising moves the saved layers
    from the live ones: the live layer computes its float8 weight plus the LoRA's change in high
    precision, the file holds float8(original + change). Sums over the merged layers."""

    def __init__(self):
        self.layers, self.err, self.live, self.own, self.orig = 0, 0.0, 0.0, 0.0, 0.0

    def add(self, layer, q: torch.Tensor, s, patches: dict, key: str) -> None:
        import comfy.lora
        with torch.no_grad():
            w = layer._mk_original[0].weight.detach().to("cpu", torch.float32, copy=True)
            change = comfy.lora.calculate_weight(patches[key], w.clone(), key) - w
            scale = fp8_core.weight_scale(layer) if fp8_core.is_core_layer(layer) else layer_scale(layer)
            base = fp8.dequantize_weight(fp8_core.storage_tensor(layer).detach().to("cpu"),
                                         None if scale is None else scale.detach().to("cpu"))
            live = base + change
            saved = fp8.dequantize_weight(q.detach().to("cpu"), None if s is None else s.detach().to("cpu"))
            self.err += float((saved - live).double().pow(2).sum())
            self.live += float(live.double().pow(2).sum())
            self.own += float((base - w).double().pow(2).sum())
            self.orig += float(w.double().pow(2).sum())
        self.layers += 1

    def info(self) -> dict:
        """``lora_requantised`` (layers), ``lora_shift`` (RMS of saved − live weights over the
        live weights' RMS) and ``fp8_own_error`` (the same for FP8's own rounding of those
        layers' original weights); empty when no LoRA was merged."""
        if not self.layers:
            return {}
        return {"lora_requantised": self.layers, "lora_shift": (self.err / max(self.live, 1e-30)) ** 0.5,
                "fp8_own_error": (self.own / max(self.orig, 1e-30)) ** 0.5}


def _describe_lora(info: dict) -> str:
    return (f"LoRA: {info['lora_requantised']} float8 layers add a LoRA per forward in the live model; a file holds no "
            "such patch, so the LoRA was merged into their original weights and the result re-quantised to float8: "
            f"that moved these layers' weights by {info['lora_shift']:.2%} of their size (FP8's own rounding of them: "
            f"{info['fp8_own_error']:.2%}), so the reload computes that much farther from the LoRA'd model than the "
            "live one. To keep the LoRA exact, save before FP8 Layerwise Cast and cast after loading, or apply the "
            "LoRA to the loaded FP8 model")


def describe(info: dict) -> str:
    """One line for Save Sharded's report about :func:`fp8_layers_for_saving`'s ``info``."""
    lora = ("; " + _describe_lora(info)) if info.get("lora_requantised") else ""
    if info["format"] == "scaled-fp8" or "scaled" in info:
        return scaled_fp8.describe(info) + lora
    parts = []
    if info["core"]:
        where = "per-layer weight_scale + " + ("the file's _quantization_metadata" if info["file_metadata"]
                                               else "comfy_quant")
        parts.append(f"fp8: {info['core']} layers saved as float8 in ComfyUI's own quantized format ({where}; "
                     "loads with Sharded Checkpoint Loader or Load Diffusion Model, weight_dtype default)")
    if info["dequantised"]:
        parts.append(f"{'fp8: ' if not parts else ''}{info['dequantised']} float8 layers dequantised to their "
                     f"original dtype: {info['reason']}")
    parts.append("layers FP8 Layerwise Cast kept stay in their own dtype")
    return "; ".join(parts) + lora
