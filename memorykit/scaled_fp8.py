"""Float8 layers in a checkpoint that ComfyUI's own loaders read back correctly.

A model whose layers hold float8 storage values and a scale (FP8 Layerwise Cast) cannot be
saved as plain tensors: the scale is not a weight, and the float8 values alone are wrong by the
scale (NaN-producing after a few layers). Where ComfyUI has its own quantized weights
(``QuantizedTensor``) Save Sharded writes core's per-layer format instead
(``comfy_integration.fp8_save``); this legacy form is for a core without them. Core's loaders
read it on every version, the *scaled-fp8* checkpoint:

- a marker tensor ``<prefix>scaled_fp8`` whose dtype is the float8 format; two elements mean
  "multiply in full precision" (one element or none turns on core's float8 matmul with an
  input scale, which this model never had);
- every Linear layer built by core's cast ops holds a ``float8_e4m3fn`` weight and a 0-d
  float32 ``<layer>.scale_weight`` (real weight = weight · scale_weight).

ComfyUI 0.3.75 builds *every* such Linear in float8 when it sees the marker (a weight written in
high precision would be cast without a scale), and 0.33 converts the layers that carry a
``scale_weight`` to its ``weight_scale`` / ``comfy_quant`` form with the format fixed to
e4m3fn. So the format can hold per-tensor e4m3 Linear layers only: layers kept in high
precision are quantised per tensor too, and everything else (e5m2 storage, per-channel scales,
float8 convolutions) is dequantised to its high-precision dtype. Knows nothing of ComfyUI.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import fp8

SCALED_FORMAT = torch.float8_e4m3fn


@dataclass(frozen=True)
class Fp8Layer:
    """One float8 layer of a state dict: ``scale`` (None, 0-d, or per output channel),
    ``dtype`` (the high-precision dtype it was cast from), ``linear`` (a Linear layer that the
    loader builds with core's cast ops)."""

    scale: torch.Tensor | None
    dtype: torch.dtype
    linear: bool


def _per_tensor(scale: torch.Tensor | None) -> bool:
    return scale is None or scale.numel() == 1


def checkpoint_tensors(sd: dict, prefix: str, layers: dict[str, Fp8Layer],
                       core_linears: set[str]) -> tuple[dict, dict]:
    """``sd`` with its float8 layers in a form core's loaders read correctly.

    ``sd``: checkpoint names → tensors (``<prefix><layer>.weight``); ``layers``: layer name
    (without ``prefix``) → :class:`Fp8Layer` for every layer whose weight in ``sd`` holds float8
    storage values; ``core_linears``: names of all Linear layers core's cast ops build (float8
    in a scaled-fp8 checkpoint). ``sd`` is not modified (a new dict is returned; unchanged
    tensors are shared).

    When every float8 Linear is ``float8_e4m3fn`` with a per-tensor (or no) scale, the result
    is a scaled-fp8 checkpoint (see the module doc): float8 weights unchanged (bit-exact),
    ``scale_weight`` added, the other core Linear layers quantised per tensor, float8
    non-Linear layers dequantised. Otherwise every float8 layer is dequantised and no marker is
    written (a plain high-precision checkpoint). Returns ``(state_dict, info)``; ``info``:
    ``format`` (``scaled-fp8`` / ``dequantised``), ``scaled`` (layers saved as float8),
    ``quantised`` (kept Linear layers quantised for the format), ``dequantised`` (layers turned
    back to high precision), ``reason`` (why, when dequantised).
    """
    out = dict(sd)
    linear_fp8 = {n: layer for n, layer in layers.items() if layer.linear and n in core_linears}
    scaled_ok = bool(linear_fp8) and all(
        out[f"{prefix}{n}.weight"].dtype == SCALED_FORMAT and _per_tensor(layer.scale)
        for n, layer in linear_fp8.items())
    info = {"format": "scaled-fp8" if scaled_ok else "dequantised", "scaled": 0, "quantised": 0, "dequantised": 0}
    for name, layer in layers.items():
        key = f"{prefix}{name}.weight"
        if scaled_ok and name in linear_fp8:
            scale = torch.ones(()) if layer.scale is None else layer.scale.detach().reshape(())
            out[f"{prefix}{name}.scale_weight"] = scale.to("cpu", torch.float32).clone()
            info["scaled"] += 1
        else:
            out[key] = fp8.dequantize_weight(out[key].to("cpu"), layer.scale, layer.dtype)
            info["dequantised"] += 1
    if scaled_ok:
        for name in sorted(core_linears - set(layers)):
            key = f"{prefix}{name}.weight"
            w = out.get(key)
            if w is None or not w.is_floating_point() or w.dtype.itemsize == 1:
                continue
            q, s = fp8.quantize_weight(w.to("cpu"), SCALED_FORMAT, "per-tensor")
            out[key], out[f"{prefix}{name}.scale_weight"] = q, s.to(torch.float32).reshape(())
            info["quantised"] += 1
        # Two elements: full-precision matmul (core reads one element or none as "float8 matmul").
        out[f"{prefix}scaled_fp8"] = torch.zeros(2, dtype=SCALED_FORMAT)
    else:
        kinds = sorted({str(sd[f"{prefix}{n}.weight"].dtype).replace("torch.", "")
                        + ("" if _per_tensor(layer.scale) else " per-channel") for n, layer in layers.items()})
        info["reason"] = ("ComfyUI's scaled-fp8 checkpoints hold float8_e4m3fn Linear layers with one scale per "
                          f"layer only (this model: {', '.join(kinds) or 'no float8 Linear layer'})")
    return out, info


def describe(info: dict) -> str:
    """One line for a node's report about :func:`checkpoint_tensors`' ``info``."""
    if info["format"] == "scaled-fp8":
        s = (f"fp8: {info['scaled']} layers saved as float8_e4m3fn in ComfyUI's scaled-fp8 format "
             "(loads with Sharded Checkpoint Loader or Load Diffusion Model, weight_dtype default)")
        if info["quantised"]:
            s += (f"; {info['quantised']} Linear layers kept in high precision were quantised too "
                  "(the format stores every Linear layer in float8)")
        if info["dequantised"]:
            s += f"; {info['dequantised']} float8 non-Linear layers dequantised"
        return s
    return (f"fp8: {info['dequantised']} float8 layers dequantised to their original dtype: "
            f"{info['reason']}; the saved model is full size")
