"""FP8 Layerwise Cast on core's own quantized weights (``comfy.quant_ops.QuantizedTensor``).

Where the running ComfyUI has them (:func:`compat.core_fp8_format`), each cast Linear becomes
core's mixed-precision Linear (``comfy.ops.mixed_precision_ops(...).Linear``) loaded from the
tensors a checkpoint with core's quantization metadata holds (float8 weight, per-tensor
``weight_scale``), exactly as core builds it for such a checkpoint; every core path that reads
weights (``cast_bias_weight``, dynamic VRAM's staging of float8 bytes, fp8 matmul, LoRA
re-quantisation with ``want_requant``, ``linear_input_act``'s shortcut, saving) then treats it
as its own. The layer class is core's with :class:`CoreFp8Lora` in front, which only changes
what a LoRA does (see there). Core's float8 layouts carry one scale per tensor and core builds
no quantized Conv layers: per-output-channel scaling and Conv layers keep MemoryKit's own cast
layers (``fp8_layers._Fp8CastOp``).

LoRA (``lora_mode``):

- ``unmerged`` (default): the float8 weight is never rewritten. A LoRA's delta is added at
  forward time, in the compute dtype, to the dequantised weight (core's own ``LowVramPatch``,
  as core does for a partially loaded model), so the output error is FP8's own error whatever
  the LoRA's size, and a strength change reuses the float8 tensors as they are.
- ``merged``: ModelPatcher merges the delta into the original high-precision weight (one
  rounding) and core re-quantises the sum with a scale re-derived from it; no per-forward cost,
  but the rounding error grows with the merged weight (a LoRA larger than the weight → larger
  error than FP8 alone).
"""
from __future__ import annotations

import comfy.model_patcher
import comfy.patcher_extension
import torch

from . import compat, linear_args

LORA_MODES = ("unmerged", "merged")
_CALLBACK_KEY = "memorykit_fp8_unmerged_lora"


class CoreFp8Lora:
    """Mixin put before core's mixed-precision Linear: LoRA per :data:`LORA_MODES`.

    ``_mk_original`` (a 1-tuple: the layer this one replaced, not a registered submodule) gives
    the original high-precision weight for a merge; ``_mk_lora_mode`` the mode."""

    _mk_lora_mode = "unmerged"
    _mk_original = (None,)
    # Core's fused shortcuts call this layer's forward (see :mod:`.linear_args`).
    comfy_force_forward = True

    def forward(self, input, *args, **kwargs):
        """Core's forward, with core's Linear arguments (input activation, residual) applied
        as core does (:mod:`.linear_args`): core's mixed-precision Linear would drop them."""
        return linear_args.call_linear(self, super().forward, input, args, kwargs)

    def convert_weight(self, weight, inplace=False, **kwargs):
        """``inplace=True`` (ModelPatcher's merge at load): the original high-precision weight
        (a copy), so merged LoRA + float8 rounds once; else core's (dequantise)."""
        original = self._mk_original[0]
        if inplace and original is not None:  # 0.3.75's QuantizedTensor reports its float8 dtype: use float32 then
            dtype = weight.dtype if weight.dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float32
            with torch.no_grad():
                return original.weight.detach().to(device=weight.device, dtype=dtype, copy=True)
        return super().convert_weight(weight, inplace=inplace, **kwargs)

    def set_weight(self, weight, inplace_update=False, seed=None, return_weight=False, **kwargs):
        """Merged mode: core's (re-quantise with a recalculated scale). Unmerged mode: a merge at
        load leaves the float8 weight as it is (the delta is added per forward by the patch
        :func:`add_unmerged_patches` installs), and a per-forward patch (``return_weight``, 0.3.75's
        ``LowVramPatch``) returns the patched weight in the compute dtype without re-quantising."""
        if self._mk_lora_mode == "merged":
            return super().set_weight(weight, inplace_update=inplace_update, seed=seed, return_weight=return_weight,
                                      **kwargs)
        if return_weight:
            return weight
        return None


def build_layer(orig: torch.nn.Linear, q: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
                fmt: str, compute_dtype: torch.dtype, fp8_matmul: bool, lora_mode: str) -> torch.nn.Module:
    """Core's mixed-precision Linear (with :class:`CoreFp8Lora`) holding float8 ``q`` and its
    per-tensor ``scale`` (None: 1) as core's ``QuantizedTensor``, ``bias`` (a copy), for the
    Linear ``orig`` (kept by reference for merges, never written). ``fp8_matmul``: core
    multiplies in float8 where it supports it on the device (else dequantises)."""
    s = torch.ones((), dtype=torch.float32) if scale is None else scale
    layer = compat.core_fp8_linear(q, s, bias, fmt, compute_dtype, full_precision_mm=not fp8_matmul,
                                   mixin=CoreFp8Lora)
    layer.training = orig.training
    layer._mk_original = (orig,)
    layer._mk_lora_mode = lora_mode
    return layer


def is_unmerged_layer(m) -> bool:
    """True for a float8 layer (core path or MemoryKit's) whose LoRA is added per forward."""
    return getattr(m, "_mk_lora_mode", None) == "unmerged" and hasattr(m, "_mk_original")


def is_core_layer(m) -> bool:
    """True for a layer :func:`build_layer` made."""
    return isinstance(m, CoreFp8Lora)


def storage_tensor(m) -> torch.Tensor:
    """The float8 tensor a cast layer holds (core's ``QuantizedTensor`` data, or the weight)."""
    return getattr(m.weight, "_qdata", m.weight)


def weight_scale(m) -> torch.Tensor | None:
    """The per-tensor scale of a core-path layer's ``QuantizedTensor`` (0.3.75: in its layout
    params dict; 0.33+: ``_params.scale``)."""
    w = m.weight
    params = getattr(w, "_params", None)
    if params is not None:
        return params.scale
    return w._layout_params["scale"]


def add_unmerged_patches(patcher, *args, **kwargs) -> None:
    """ON_LOAD callback: on every fully loaded unmerged-mode layer whose weight has patches
    (LoRA), put core's ``LowVramPatch(key, patches)`` first in its ``weight_function`` list, so
    ``comfy.ops.cast_bias_weight`` adds the delta to the dequantised weight per forward, in the
    compute dtype (without convert/set functions: nothing is re-quantised). Partially loaded
    layers already get one from core. Dynamic VRAM (0.33+) stages patches itself
    (``weight_lowvram_function``, applied to the dequantised weight): nothing is added there."""
    if compat.is_dynamic(patcher):
        return
    for name, m in patcher.model.named_modules():
        if not is_unmerged_layer(m) or not getattr(m, "comfy_patched_weights", False):
            continue
        key = f"{name}.weight"
        if key not in patcher.patches:
            continue
        if any(isinstance(f, comfy.model_patcher.LowVramPatch) and f.key == key for f in m.weight_function):
            continue
        m.weight_function = [comfy.model_patcher.LowVramPatch(key, patcher.patches)] + list(m.weight_function)


def remove_unmerged_patches(patcher, *args, **kwargs) -> None:
    """ON_DETACH callback: drop the patches :func:`add_unmerged_patches` installed (core only
    wipes ``weight_function`` lists of partially loaded models at unpatch)."""
    for m in patcher.model.modules():
        if is_unmerged_layer(m) and m.weight_function:
            m.weight_function = [f for f in m.weight_function if not (
                isinstance(f, comfy.model_patcher.LowVramPatch) and f.convert_func is None and f.set_func is None)]


def merged_for_saving(layer, patches: dict, key: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(float8 weight, scale)`` of an unmerged-mode layer with its LoRA merged, for a saved
    checkpoint (a file holds no per-forward patch): core's ``calculate_weight`` of ``patches[key]``
    on the original high-precision weight in float32 (one rounding), quantised with the layer's
    storage dtype and a scale re-derived from the sum (per tensor on the core path, a power of two
    there: core's loader multiplies by it in the compute dtype, where a power of two is exact;
    else the layer's own scaling)."""
    import comfy.lora

    from .. import fp8
    original = layer._mk_original[0]
    storage = storage_tensor(layer)
    with torch.no_grad():
        w = original.weight.detach().to(torch.float32, copy=True)
        merged = comfy.lora.calculate_weight(patches[key], w, key)
        core = is_core_layer(layer)
        scaling = "per-tensor" if core else layer._mk_scaling
        q, s = fp8.quantize_weight(merged, storage.dtype, scaling if scaling != "none" else "per-tensor",
                                   power_of_two=core)
    return q.to("cpu"), s.to("cpu")


def register_callbacks(patcher) -> None:
    """Register the unmerged-LoRA callbacks on ``patcher`` (a clone; clones made from it, e.g.
    by a LoRA loader after this node, carry them)."""
    cb = comfy.patcher_extension.CallbacksMP
    patcher.add_callback_with_key(cb.ON_LOAD, _CALLBACK_KEY, add_unmerged_patches)
    patcher.add_callback_with_key(cb.ON_DETACH, _CALLBACK_KEY, remove_unmerged_patches)


def describe_path(info: dict) -> str:
    """One line: which FP8 path ran (for the node's text and the report)."""
    n_core, n_own = info.get("core_layers", 0), info.get("cast_layers", 0) - info.get("core_layers", 0)
    if n_core and not n_own:
        return f"path: ComfyUI's QuantizedTensor ({info['core_layout']}), {n_core} Linear layers"
    if n_core:
        return (f"path: ComfyUI's QuantizedTensor ({info['core_layout']}) for {n_core} Linear layers, "
                f"MemoryKit cast layers for {n_own} ({info['own_reason']})")
    return f"path: MemoryKit cast layers ({info['own_reason']})"
