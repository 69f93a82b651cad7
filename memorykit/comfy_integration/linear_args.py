"""Core's Linear call arguments on the pack's own layers.

Newer ComfyUI calls a Linear as ``linear(x)`` or through ``comfy.ops.linear_input_act(linear, x,
input_act, act_weight, act_eps, residual, residual_scale)``, which the layers' own forward also
takes as keyword arguments. Meaning (read from core's ``_eager_input_act`` / ``_linear_residual``;
the result is ``residual + residual_scale · linear(act(x))``):

- ``input_act`` (applied to the input before the matrix product): ``None`` (none), ``"gelu_tanh"``
  (GELU, tanh approximation), ``"swiglu"`` (the last dimension split in halves ``gate | up``:
  ``silu(gate) · up``), ``"rms_norm"`` (RMS norm over the last dimension with the weight and eps
  of ``act_weight``: an RMSNorm module — its weight cast as the module itself would, its ``eps``
  or, when that is None, float32's machine epsilon (float64's for float64 input) — or a weight
  tensor (or None) with ``act_eps``);
- ``residual`` / ``residual_scale``: ``residual + residual_scale · out`` (``addcmul``); without
  ``residual_scale`` the plain sum (as comfy-kitchen's fused epilogue).

The pack's layers (:class:`..fp8_layers._Fp8CastOp`, :class:`..fp8_core.CoreFp8Lora`) set
``comfy_force_forward`` so core's fused shortcuts call their forward instead of reading their
weight, and take exactly these arguments: any other raises TypeError (a dropped activation or
residual would give a wrong image silently). Where the running core has ``_eager_input_act`` /
``_linear_residual`` (:func:`.compat.core_linear_act`) they are used; otherwise the same math here.
"""
from __future__ import annotations

import torch

from . import compat

LINEAR_KWARGS = ("input_act", "act_weight", "act_eps", "residual", "residual_scale")


def input_acts() -> tuple[str, ...]:
    """The ``input_act`` values this core knows (its ``INPUT_ACT_EAGER`` table where it has one)."""
    import comfy.ops
    table = getattr(comfy.ops, "INPUT_ACT_EAGER", None)
    names = set(table) if isinstance(table, dict) else set()
    return tuple(sorted(names | {"gelu_tanh", "swiglu", "rms_norm"}))


def split_linear_call(layer, args: tuple, kwargs: dict) -> dict:
    """Core's Linear arguments of one call (``LINEAR_KWARGS`` → value, missing ones None) after
    the input; raises TypeError naming what else was passed and ValueError for an unknown
    ``input_act``."""
    unknown = sorted(set(kwargs) - set(LINEAR_KWARGS))
    if args or unknown:
        what = (f"{len(args)} extra positional argument(s)" if args else "") + (
            ("; " if args and unknown else "") + f"keyword argument(s) {unknown}" if unknown else "")
        raise TypeError(f"MemoryKit's {type(layer).__name__} (a layer of FP8 Layerwise Cast) got {what}: it takes "
                        f"the input and ComfyUI's Linear arguments {list(LINEAR_KWARGS)} only. This ComfyUI "
                        "calls its layers in a way MemoryKit does not know yet: run the model without FP8 "
                        "Layerwise Cast, or update ComfyUI-MemoryKit.")
    call = {k: kwargs.get(k) for k in LINEAR_KWARGS}
    act = call["input_act"]
    if act is not None and act not in input_acts():
        raise ValueError(f"input_act {act!r}: MemoryKit's float8 layers know {list(input_acts())} (as this ComfyUI).")
    return call


def _norm_weight(x: torch.Tensor, act_weight, act_eps):
    """``(weight, eps)`` for ``rms_norm``: from an RMSNorm module (its weight cast by core's
    ``cast_bias_weight``, with its LoRA functions; its eps, or the machine epsilon) or as given."""
    if not isinstance(act_weight, torch.nn.Module):
        return act_weight, act_eps
    import comfy.ops
    weight = getattr(act_weight, "weight", None)
    if weight is not None and hasattr(act_weight, "weight_function"):
        weight, _ = comfy.ops.cast_bias_weight(act_weight, x)
    eps = getattr(act_weight, "eps", None)
    if eps is None:
        eps = torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps
    return weight, eps


def apply_input_act(x: torch.Tensor, input_act, act_weight=None, act_eps=0.0) -> torch.Tensor:
    """``act(x)`` as core's ``_eager_input_act`` (core's own where it has it)."""
    if input_act is None:
        return x
    core = compat.core_linear_act()
    if core is not None:
        return core[0](x, input_act, act_weight, act_eps)
    if input_act == "rms_norm":
        import comfy.rmsnorm
        weight, eps = _norm_weight(x, act_weight, act_eps)
        return comfy.rmsnorm.rms_norm(x, weight, eps)
    import comfy.ops
    table = getattr(comfy.ops, "INPUT_ACT_EAGER", None) or {}
    if input_act in table:
        return table[input_act](x)
    if input_act == "gelu_tanh":
        return torch.nn.functional.gelu(x, approximate="tanh")
    gate, up = x.chunk(2, dim=-1)  # swiglu
    return torch.nn.functional.silu(gate) * up


def apply_residual(out: torch.Tensor, residual, residual_scale) -> torch.Tensor:
    """``residual + residual_scale · out`` as core's ``_linear_residual`` (core's own where it has
    it); ``residual_scale`` None: ``residual + out``."""
    if residual is None:
        return out
    if residual_scale is None:
        return residual + out
    core = compat.core_linear_act()
    if core is not None:
        return core[1](out, residual, residual_scale)
    return torch.addcmul(residual, out, residual_scale)


def call_linear(layer, forward, input: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    """``forward(act(input))`` with the residual applied, for one call of ``layer`` with core's
    Linear arguments (see :func:`split_linear_call`)."""
    call = split_linear_call(layer, args, kwargs)
    x = apply_input_act(input, call["input_act"], call["act_weight"], call["act_eps"] or 0.0)
    return apply_residual(forward(x), call["residual"], call["residual_scale"])


def split_conv_call(layer, args: tuple, kwargs: dict) -> dict:
    """The keyword arguments core's Conv layers take after the input (``autopad`` where the layer's
    ``_conv_forward`` has it: newer Conv3d); raises TypeError for anything else."""
    import inspect
    known = {"autopad"} & set(inspect.signature(layer._conv_forward).parameters)
    unknown = sorted(set(kwargs) - known)
    if args or unknown:
        raise TypeError(f"MemoryKit's {type(layer).__name__} (a layer of FP8 Layerwise Cast) got "
                        f"{len(args)} extra positional and keyword argument(s) {unknown}: it takes the input"
                        f"{' and autopad' if known else ''} only. Run the model without FP8 Layerwise Cast, "
                        "or update ComfyUI-MemoryKit.")
    return {k: v for k, v in kwargs.items() if v is not None}
