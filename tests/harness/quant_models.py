"""Quantized checkpoints as users download them (Comfy-Org's ``*_fp8_scaled`` files), generated.

Two layouts of one state dict (a diffusion model's, ComfyUI key names):

- ``legacy``: the older ``scaled_fp8`` layout. A ``scaled_fp8`` marker (an empty float8_e4m3fn
  tensor), every chosen Linear weight in float8_e4m3fn with a per-tensor ``scale_weight``
  (float32, real weight = fp8 · scale); everything else in bfloat16. ComfyUI 0.33 turns it
  into per-layer ``comfy_quant`` layers (``comfy.utils.convert_old_quants``) holding core's
  ``QuantizedTensor``; 0.3.75 loads it with scaled_fp8 ops holding plain float8 tensors.
- ``mixed``: the per-layer ``comfy_quant`` layout (``<layer>.comfy_quant`` JSON bytes,
  ``<layer>.weight`` float8, ``<layer>.weight_scale``), chosen Linear layers alternating
  float8_e4m3fn and float8_e5m2, the others left in bfloat16 (ComfyUI 0.33 only: 0.3.75 reads
  per-layer formats from the file's metadata, not from ``comfy_quant`` keys).

The fp8 values are the bf16 weights quantised with scale amax / fp8 max (as Comfy-Org's
converters do). Files go under ``paths.MODELS/diffusion_models``; nothing here goes into git.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from . import models, paths

QUANT_VERSION = "1"
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FORMAT = {torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}


def _quantize(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.float()
    scale = (w.abs().amax() / FP8_MAX[dtype]).clamp(min=1e-12)
    return (w / scale).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype), scale.reshape(())


def default_targets(sd: dict[str, torch.Tensor]) -> list[str]:
    """Layers (names without ``.weight``) of every 2-D weight inside a transformer block / a block
    list entry: what Comfy-Org quantises (attention and MLP Linears), never embedders or the
    final layer."""
    out = []
    for k, v in sd.items():
        if not k.endswith(".weight") or v.ndim != 2 or not v.is_floating_point():
            continue
        layer = k[:-len(".weight")]
        if any(s in layer for s in ("transformer_blocks.", "blocks.", "layers.")) and "norm" not in layer:
            out.append(layer)
    return out


def quantize_state_dict(sd: dict[str, torch.Tensor], layout: str, targets: list[str] | None = None) -> dict:
    """``sd`` (float weights) written in ``layout`` (``"legacy"`` or ``"mixed"``, see module doc).
    In ``mixed`` every third target layer is left in bfloat16, the others alternate e4m3 / e5m2."""
    targets = default_targets(sd) if targets is None else targets
    out = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in sd.items()}
    if layout == "legacy":
        out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
        for layer in targets:
            q, s = _quantize(sd[layer + ".weight"], torch.float8_e4m3fn)
            out[layer + ".weight"], out[layer + ".scale_weight"] = q, s
        return out
    if layout != "mixed":
        raise ValueError(f"layout must be 'legacy' or 'mixed', got {layout!r}")
    for i, layer in enumerate(targets):
        if i % 3 == 2:
            continue  # left in bf16
        dtype = torch.float8_e4m3fn if i % 3 == 0 else torch.float8_e5m2
        q, s = _quantize(sd[layer + ".weight"], dtype)
        out[layer + ".weight"], out[layer + ".weight_scale"] = q, s
        out[layer + ".comfy_quant"] = torch.tensor(list(json.dumps({"format": FORMAT[dtype]}).encode()),
                                                   dtype=torch.uint8)
    return out


def sd15_unet_state_dict() -> dict[str, torch.Tensor]:
    """The SD1.5-shaped test UNet of :mod:`harness.models` (same seed), fp32, ComfyUI names."""
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
    unet = models.randomize_(UNetModel(**models.sd15_unet_config(), operations=models._ops()), models.SEED)
    return dict(unet.state_dict())


def path_for(name: str, layout: str) -> Path:
    return paths.MODELS / "diffusion_models" / f"mk_{name}_fp8_scaled_{layout}.safetensors"


def ensure(name: str, layout: str, make_state_dict) -> Path:
    """The ``layout`` file of the model ``name`` (``make_state_dict()`` → float state dict),
    generated once (stamped with :data:`QUANT_VERSION`)."""
    path = path_for(name, layout)
    stamp = path.with_name(path.name + f".q{QUANT_VERSION}.ok")
    if not (path.exists() and stamp.exists()):
        models._save(quantize_state_dict(make_state_dict(), layout), path)
        stamp.touch()
    return path


def ensure_sd15(layout: str) -> Path:
    from . import comfy_env
    comfy_env.setup_comfy()
    return ensure("sd15", layout, sd15_unet_state_dict)


def build_zoo_quantized(name: str, layout: str, weight_dtype=torch.float32):
    """The zoo model ``name`` (:mod:`harness.zoo`) as core loads it from an fp8_scaled file of
    ``layout``: its state dict written in that layout, turned into per-layer ``comfy_quant``
    layers as core's loader does (``comfy.utils.convert_old_quants`` for the legacy marker), and
    loaded into a model built with core's mixed-precision ops (``model_config.quant_config``).
    Core's file detection does not recognise the zoo's tiny configurations, so the model is
    built from the zoo's config and loaded with ``load_model_weights``. ComfyUI 0.33 only.
    Returns a ModelPatcher (cpu), loaded inside inference mode as the server loads."""
    from . import zoo
    return load_zoo_quantized(name, quantize_state_dict(dict(zoo.build(name).model.diffusion_model.state_dict()),
                                                        layout), weight_dtype)


def load_zoo_quantized(name: str, q: dict, weight_dtype=torch.float32):
    """The zoo model ``name`` built from the quantized state dict ``q`` (either layout, or what Save
    Sharded wrote: core's per-layer ``comfy_quant`` form), as :func:`build_zoo_quantized` loads it.
    ``weight_dtype``: the layers that are not quantized hold this dtype and the model computes in
    it (float32: as core loads on the CPU; bfloat16: as on a GPU)."""
    import comfy.model_patcher
    import comfy.supported_models as sm
    import comfy.utils

    from . import zoo
    spec = zoo.SPECS[name]
    q, _ = comfy.utils.convert_old_quants(dict(q), "", {})
    with torch.inference_mode():
        mc = getattr(sm, spec.supported_model)(zoo._config(name))
        # quantized layers compute in float32 on the CPU; bfloat16: in bfloat16, as on a GPU
        mc.set_inference_dtype(weight_dtype, torch.float32 if weight_dtype == torch.float32 else None)
        mc.quant_config = comfy.utils.detect_layer_quantization(q, "")
        model = mc.get_model(spec.state_dict() if spec.state_dict else {})
        if spec.post_build is not None:
            spec.post_build(model.diffusion_model, mc.custom_operations or zoo._operations(model))
        missing, unexpected = model.diffusion_model.load_state_dict(q, strict=False)
        if [k for k in missing if not k.endswith("comfy_quant")] or unexpected:
            raise RuntimeError(f"{name}: quantized state dict does not fit: {missing[:3]} {unexpected[:3]}")
        model.eval()
    return comfy.model_patcher.ModelPatcher(model, torch.device("cpu"), torch.device("cpu"))
