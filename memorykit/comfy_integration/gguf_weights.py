"""Models loaded by city96/ComfyUI-GGUF (``UnetLoaderGGUF``): what the pack's nodes need of them.

Its weights are ``GGMLTensor`` (a ``torch.Tensor`` subclass holding the raw GGUF bytes, with
``tensor_type``, ``tensor_shape`` and the LoRA ``patches`` its layers apply at forward time);
its patcher is ``GGUFModelPatcher`` (a ``ModelPatcher`` subclass that always patches weights at
load and keeps LoRA as patches on quantized weights). Nothing of that pack is imported: both
are recognised by their attributes, so its forks (same design) are handled alike.

- :class:`GGMLCodec` lets the placement engines stream and place the raw bytes
  (:mod:`memorykit.weight_parts`): the plain tensor is the stored data, the forward rebuilds a
  ``GGMLTensor`` around it with the same type, shape and patches.
- :func:`placement_class` makes the class of a placement node's clone over GGUF's patcher:
  the node's own ModelPatcher behaviour first, then GGUF's (``placement.PlacementPatcher.clone``
  keeps that class: ``GGUFModelPatcher.clone`` turns every clone into a plain ``GGUFModelPatcher``).
"""
from __future__ import annotations

import torch

from .. import weight_parts


def is_ggml(t) -> bool:
    """True for a GGUF weight (a tensor subclass with ``tensor_type`` and ``tensor_shape``)."""
    return isinstance(t, torch.Tensor) and type(t) is not torch.Tensor and hasattr(t, "tensor_type") \
        and hasattr(t, "tensor_shape")


def is_ggml_quantized(t) -> bool:
    """True for a GGUF weight stored in a quantized type (not F32/F16: its bytes are not its values)."""
    if not is_ggml(t):
        return False
    name = getattr(t.tensor_type, "name", str(t.tensor_type))
    return name not in ("F32", "F16")


def is_gguf_patcher(patcher) -> bool:
    """True when ``patcher`` is (a subclass of) ComfyUI-GGUF's ``GGUFModelPatcher``."""
    return any(c.__name__ == "GGUFModelPatcher" for c in type(patcher).__mro__)


def gguf_counts(module: torch.nn.Module) -> dict[str, int]:
    """GGUF weight types under ``module`` → number of tensors (e.g. ``{"Q8_0": 70, "F32": 90}``)."""
    out: dict[str, int] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        if is_ggml(t):
            name = getattr(t.tensor_type, "name", str(t.tensor_type))
            out[name] = out.get(name, 0) + 1
    return out


class GGMLCodec(weight_parts.Codec):
    """``GGMLTensor`` ↔ its raw bytes (a plain tensor of the same storage, dtype and size)."""

    name = "GGUF"

    def matches(self, t) -> bool:
        return is_ggml(t)

    def plain(self, t):
        return t.data.as_subclass(torch.Tensor)

    def rebuild(self, original, plain):
        g = plain.as_subclass(type(original))
        g.tensor_type = original.tensor_type
        g.tensor_shape = original.tensor_shape
        g.patches = getattr(original, "patches", [])
        return g

    def restore(self, original, plain) -> None:
        original.data = plain.data


weight_parts.register(GGMLCodec())

_CLASSES: dict[tuple[type, type], type] = {}


def placement_class(mixin: type, base: type) -> type:
    """``mixin`` (a placement's ModelPatcher behaviour) over ``base`` (the input's patcher
    class), made once per pair (see module docstring)."""
    key = (mixin, base)
    cls = _CLASSES.get(key)
    if cls is None:
        name = mixin.__name__.replace("ModelPatcher", "") + base.__name__
        cls = type(name, (mixin, base), {"__module__": mixin.__module__})
        _CLASSES[key] = cls
    return cls


def gguf_model_description(patcher) -> str | None:
    """``"GGUF (Q8_0 ×70, F32 ×90)"`` for a MODEL loaded by ComfyUI-GGUF (its patcher class or
    GGUF weights in its diffusion model), None for any other."""
    dm = getattr(patcher.model, "diffusion_model", None)
    counts = gguf_counts(dm) if isinstance(dm, torch.nn.Module) else {}
    if not counts and not is_gguf_patcher(patcher):
        return None
    return "GGUF (" + (", ".join(f"{k} ×{v}" for k, v in sorted(counts.items())) or "weights placed") + ")"
