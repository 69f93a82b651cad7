"""The float8 layer FP8 Layerwise Cast builds where core's quantized Linear is not used: a ComfyUI
cast-op module of the original's class plus :class:`_Fp8CastOp` (float8 weight, scale, bias copy),
and how a new layer is made from the original (:func:`_fp8_layer`). The patcher that puts these
layers into a clone is :mod:`.fp8_patcher`."""
from __future__ import annotations

from typing import ClassVar

import torch

from .. import fp8
from . import linear_args
from .compat import apply_weight_patch

# Attributes ComfyUI sets on a loaded module; a new layer starts without them.
_COMFY_TRANSIENT = {"comfy_cast_weights", "prev_comfy_cast_weights", "weight_function", "bias_function",
                    "comfy_patched_weights", "seed_key"}
# Dynamic-VRAM (0.33+) state core keeps on a module: its VRAM allocation (_v, _v_weight, ...), pins
# (_pin_state), prefetch (_prefetch), per-forward LoRA (weight_lowvram_function) and the dtype the
# stager casts to (weight_comfy_model_dtype: copied, float8 would be staged as bf16). A new layer
# starts without any of it, so core stages its float8 bytes afresh.
_DYNAMIC_PREFIXES = ("_v", "_pin", "_prefetch")
_DYNAMIC_SUFFIXES = ("_lowvram_function", "_comfy_model_dtype")


def _is_transient(name: str) -> bool:
    return name in _COMFY_TRANSIENT or name.startswith(_DYNAMIC_PREFIXES) or name.endswith(_DYNAMIC_SUFFIXES)


def layer_scale(module) -> torch.Tensor | None:
    """The scale that turns ``module.weight`` (float8) into real values now: the one re-derived
    when a LoRA was merged into this weight (kept on the weight Parameter itself, so restoring
    the unpatched Parameter restores its scale too), else the layer's own ``scale_weight``."""
    return getattr(module.weight, "_mk_scale", module.scale_weight)


class _Fp8CastOp:
    """Mixin for a ComfyUI cast op (``comfy.ops.*.Linear/ConvNd``) whose weight is float8.

    ``comfy.ops.cast_bias_weight`` moves/casts the weight to the input's device and dtype (and
    applies ComfyUI's lowvram LoRA ``weight_function``s, which work in the storage domain),
    then the scale is applied. ``convert_weight``/``set_weight`` follow the contract of core's
    scaled-fp8 ops (``comfy.ops.scaled_fp8_ops``) so ``ModelPatcher`` can patch LoRA into it.
    """

    comfy_cast_weights = True
    # Core's fused shortcuts (fp16 accumulation, linear_input_act) call this layer's forward instead
    # of reading its float8 weight without the scale.
    comfy_force_forward = True
    # Class-level empty lists, as in comfy.ops.CastWeightBiasOp: ComfyUI assigns per-instance lists.
    weight_function: ClassVar[list] = []
    bias_function: ClassVar[list] = []

    def forward(self, *args, **kwargs):
        import comfy.ops
        if hasattr(comfy.ops, "run_every_op"):
            comfy.ops.run_every_op()  # honours ComfyUI's interrupt between ops
        return self.forward_comfy_cast_weights(*args, **kwargs)

    def forward_comfy_cast_weights(self, input, *args, **kwargs):
        """Core's Linear arguments (input activation, residual) or Conv ``autopad`` applied as core
        does (:mod:`.linear_args`); anything else raises TypeError."""
        if isinstance(self, torch.nn.Linear):
            return linear_args.call_linear(self, self._fp8_forward, input, args, kwargs)
        return self._fp8_forward(input, **linear_args.split_conv_call(self, args, kwargs))

    def _fp8_forward(self, input, **conv_kwargs):
        import comfy.ops
        lowvram_patch = getattr(self, "weight_lowvram_function", None)
        if self.weight_function or lowvram_patch is not None:
            return self._forward_with_weight_patches(input, lowvram_patch, **conv_kwargs)
        scale = layer_scale(self)
        if self._mk_fp8_matmul and isinstance(self, torch.nn.Linear) and fp8.fp8_matmul_supported(input, self.weight):
            # Weight stays float8 (moved to the device; lowvram LoRA functions return float8 too).
            weight, bias, offload_stream = comfy.ops.cast_bias_weight(self, input, dtype=self.weight.dtype,
                                                                      bias_dtype=input.dtype, offloadable=True)
            out = fp8.fp8_linear(input, weight, scale, bias)
            comfy.ops.uncast_bias_weight(self, weight, bias, offload_stream)
            return out
        weight, bias, offload_stream = comfy.ops.cast_bias_weight(self, input, offloadable=True)
        if isinstance(self, torch.nn.Linear) and getattr(self, "_mk_weight_math", False):
            out = torch.nn.functional.linear(input, fp8.scale_weight(weight, scale), bias)  # as core's layer
        elif isinstance(self, torch.nn.Linear):
            out = fp8.scaled_linear(input, weight, scale, bias)
        else:
            out = self._conv_forward(input, fp8.scale_weight(weight, scale), bias, **conv_kwargs)
        comfy.ops.uncast_bias_weight(self, weight, bias, offload_stream)
        return out

    def _forward_with_weight_patches(self, input, lowvram_patch, **conv_kwargs):
        """LoRA on a partially or dynamically loaded model: core applies its per-forward patches
        (``weight_function`` / 0.33's ``weight_lowvram_function``) to the storage-domain values
        (float8 / scale) it casts, and 0.33's ``LowVramPatch`` no longer calls ``convert_weight``
        /``set_weight``: the delta would be added to the wrong quantity and then scaled. Here the
        weight is cast without them, dequantised, and the patches are applied to the real weight."""
        import comfy.ops
        fns = self.weight_function
        self.weight_function = []
        if lowvram_patch is not None:
            self.weight_lowvram_function = None
        try:
            weight, bias, offload_stream = comfy.ops.cast_bias_weight(self, input, offloadable=True)
        finally:
            self.weight_function = fns
            if lowvram_patch is not None:
                self.weight_lowvram_function = lowvram_patch
        real = fp8.scale_weight(weight, layer_scale(self))
        if lowvram_patch is not None:
            real = apply_weight_patch(lowvram_patch, real)
            clear = getattr(lowvram_patch, "clear_prepared", None)  # 0.33: patches a prefetch staged
            if clear is not None:
                clear()
        for f in fns:
            real = apply_weight_patch(f, real)
        real = real.to(weight.dtype)
        if isinstance(self, torch.nn.Linear):
            out = torch.nn.functional.linear(input, real, bias)
        else:
            out = self._conv_forward(input, real, bias, **conv_kwargs)
        comfy.ops.uncast_bias_weight(self, weight, bias, offload_stream)
        return out

    def convert_weight(self, weight, inplace=False, **kwargs):
        """Storage-domain weight → the real weight a LoRA delta is added to.

        ``inplace=True`` is ModelPatcher's one-off patch at load (``patch_weight_to_device``):
        return the original high-precision weight, so LoRA + float8 rounds once. Otherwise
        (core's per-forward lowvram patch, weight already on the compute device) dequantise
        the given values: no extra host→device transfer per step.
        """
        original = self._mk_original[0]  # out of the tree while this layer is in it: holds the unpatched weight
        with torch.no_grad():
            if inplace and original is not None:  # a copy: the caller patches it in place
                return original.weight.detach().to(device=weight.device, dtype=weight.dtype, copy=True)
            dtype = weight.dtype if weight.dtype in fp8.HIGH_PRECISION else torch.float32
            return fp8.dequantize_weight(weight.detach(), layer_scale(self), dtype)

    def set_weight(self, weight, inplace_update=False, seed=None, return_weight=False, **kwargs):
        """Real weight (float32, LoRA applied) → float8.

        A merged weight (ModelPatcher's load) gets a scale re-derived from it, with this layer's
        scaling (per-tensor / per-output-channel): a LoRA can push weights far past the
        original amax, and the original scale would clamp them. The new scale travels on the
        new weight Parameter (:func:`layer_scale`), so ModelPatcher's restore of the unpatched
        Parameter restores the original scale with it. ``return_weight`` (a per-forward patch
        that must match the stored scale) and ``inplace_update`` (the Parameter object stays,
        so a scale on it could outlive the restore) keep the layer's scale.
        """
        if self._mk_lora_mode == "unmerged" and not return_weight and not inplace_update:
            return  # the delta is added per forward (fp8_core.add_unmerged_patches)
        with torch.no_grad():
            if return_weight or inplace_update or self._mk_scaling == "none":
                q = fp8.quantize_with_scale(weight.detach(), self.weight.dtype, layer_scale(self))
            else:
                q, scale = fp8.quantize_weight(weight.detach(), self.weight.dtype, self._mk_scaling)
        if return_weight:
            return q
        if inplace_update:
            self.weight.data.copy_(q)
            return
        param = torch.nn.Parameter(q, requires_grad=False)
        if self._mk_scaling != "none":
            param._mk_scale = scale.to(self.scale_weight.device)
        self.weight = param


_FP8_CLASSES: dict[type, type] = {}


def _fp8_class(cls: type) -> type:
    if cls not in _FP8_CLASSES:
        _FP8_CLASSES[cls] = type(f"MemoryKitFp8{cls.__name__}", (_Fp8CastOp, cls), {"__module__": __name__})
    return _FP8_CLASSES[cls]


def _fp8_layer(orig: torch.nn.Module, q: torch.Tensor, scale, bias, fp8_matmul: bool = False,
              scaling: str = "per-tensor", lora_mode: str = "merged") -> torch.nn.Module:
    """New cast-op module like ``orig`` (same class + :class:`_Fp8CastOp`, same config) holding
    float8 ``q``, ``scale`` (non-persistent buffer ``scale_weight``) and ``bias`` (a copy).
    Keeps a reference to ``orig`` (read by ``convert_weight``, never written)."""
    cls = _fp8_class(type(orig))
    new = cls.__new__(cls)
    torch.nn.Module.__init__(new)
    fresh = set(new.__dict__)
    for k, v in orig.__dict__.items():
        if k not in fresh and not _is_transient(k):
            new.__dict__[k] = v
    new.training = orig.training
    new.weight = torch.nn.Parameter(q, requires_grad=False)
    if bias is None:
        new.register_parameter("bias", None)
    else:
        new.bias = torch.nn.Parameter(bias, requires_grad=False)
    new.register_buffer("scale_weight", scale, persistent=False)
    new._mk_original = (orig,)  # a tuple: not registered as a submodule
    new._mk_fp8_matmul = fp8_matmul
    new._mk_scaling = scaling
    new._mk_lora_mode = lora_mode
    return new

