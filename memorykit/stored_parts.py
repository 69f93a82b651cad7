"""A weight as the plain tensors that store it, in place: the rule the event ring and the offload plan use.

(:mod:`memorykit.weight_parts` is the one rule that swaps weights for plain tensors while a placement
is applied; for weights of several parts it decomposes them with the adapters here. This module
names the stored parts of a weight *in place*, which is how Group Offload's event ring moves them.)

Checkpoints users download hold weights that are not plain tensors: core's quantized weights
(``comfy.quant_ops.QuantizedTensor``: float8 data + a scale, a tensor *wrapper* subclass) and
GGUF weights (city96/ComfyUI-GGUF's ``GGMLTensor``). Group Offload and Balanced Device Map move
bytes; they must move the bytes as stored (fp8 data and scales, GGUF blocks), never a
dequantised copy. This module says, for any weight ``w``:

- :func:`parts` — the plain tensors holding ``w``'s stored bytes, as the very objects ``w``
  holds: setting ``part.data`` (a ring view, a disk view, a copy on another device) changes
  what ``w`` reads, in place, without rebuilding ``w``. A plain tensor is its own only part.
- :func:`rebuild` — a new weight of ``w``'s kind over other tensors (same order and meaning as
  ``parts(w)``), e.g. the same parts moved to another device.
- :func:`stored_nbytes` — the bytes ``w`` stores (sum of its parts), not ``numel × element_size``
  of its logical dtype.

Kinds are handled by adapters (:class:`WeightAdapter`), asked in registration order, newest
first. Built in: :class:`FlattenAdapter`, torch's tensor-subclass protocol
(``__tensor_flatten__`` / ``__tensor_unflatten__``, which core's ``QuantizedTensor`` implements,
as do torchao's quantized tensors), applied recursively to inner tensors. A weight no adapter
takes raises :class:`UnsupportedWeight` (a TypeError) naming its type.

GGUF's ``GGMLTensor`` (a plain-storage subclass carrying ``tensor_type`` / ``tensor_shape`` /
``patches``) is a one-part kind: :mod:`memorykit.weight_parts` takes it through its registered
codec (``comfy_integration/gguf_weights.py``); here it is its own only part.

Plain torch only; no ComfyUI here.
"""
from __future__ import annotations

import torch

__all__ = ["WeightAdapter", "FlattenAdapter", "UnsupportedWeight", "register", "unregister", "adapter_for",
           "is_plain", "is_quantized", "parts", "expand", "rebuild", "stored_nbytes", "describe"]


class UnsupportedWeight(TypeError):
    """A weight whose stored tensors no registered adapter can name."""


class WeightAdapter:
    """How one kind of weight decomposes into plain tensors and is rebuilt from them.

    ``name``: shown in messages and reports. ``matches(t)``: True when this adapter handles
    ``t``. ``parts(t)``: the plain tensors holding ``t``'s stored bytes — the objects ``t``
    itself holds, so that ``part.data = x`` changes ``t`` in place (a part may be ``t`` itself
    when its own storage is the stored bytes; then it must accept ``.data`` assignment of a
    tensor of its storage dtype). ``rebuild(t, new_parts)``: a new weight of ``t``'s kind
    over ``new_parts`` (same order as ``parts(t)``), ``t`` left unchanged.
    """

    name = "weight"

    def matches(self, t: torch.Tensor) -> bool:
        raise NotImplementedError

    def parts(self, t: torch.Tensor) -> list[torch.Tensor]:
        raise NotImplementedError

    def rebuild(self, t: torch.Tensor, new_parts: list[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError


class FlattenAdapter(WeightAdapter):
    """Tensor wrapper subclasses that implement torch's ``__tensor_flatten__`` protocol
    (core's ``QuantizedTensor``: inner tensors ``_qdata`` and the scales of its layout params).
    Inner tensors that are themselves subclasses are decomposed again."""

    name = "tensor subclass"

    def matches(self, t):
        return hasattr(type(t), "__tensor_flatten__") and hasattr(type(t), "__tensor_unflatten__")

    def _inner(self, t):
        names, ctx = t.__tensor_flatten__()
        return list(names), ctx, [getattr(t, n) for n in names]

    def parts(self, t):
        out = []
        for inner in self._inner(t)[2]:
            out.extend(parts(inner))
        return out

    def rebuild(self, t, new_parts):
        names, ctx, inners = self._inner(t)
        rebuilt, i = {}, 0
        for n, inner in zip(names, inners):
            k = len(parts(inner))
            rebuilt[n] = rebuild(inner, new_parts[i:i + k])
            i += k
        try:
            stride = t.stride()
        except RuntimeError:
            stride = None
        return type(t).__tensor_unflatten__(rebuilt, ctx, t.size(), stride)


_ADAPTERS: list[WeightAdapter] = [FlattenAdapter()]


def register(adapter: WeightAdapter) -> WeightAdapter:
    """Add ``adapter`` in front of the others (asked first); registering the same object or
    another of the same class again replaces it. Returns it."""
    unregister(adapter)
    _ADAPTERS.insert(0, adapter)
    return adapter


def unregister(adapter: WeightAdapter) -> None:
    """Remove ``adapter`` (or any adapter of its class)."""
    _ADAPTERS[:] = [a for a in _ADAPTERS if a is not adapter and type(a) is not type(adapter)]


def is_plain(t: torch.Tensor) -> bool:
    """True for a plain ``torch.Tensor`` or an ``nn.Parameter`` over one."""
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


def adapter_for(t: torch.Tensor) -> WeightAdapter | None:
    """The adapter that handles ``t`` (None for a plain tensor). Raises :class:`UnsupportedWeight`."""
    if is_plain(t):
        return None
    for a in _ADAPTERS:
        if a.matches(t):
            return a
    raise UnsupportedWeight(f"a weight of type {type(t).__name__} is neither a plain tensor nor a kind MemoryKit "
                            "knows how to store (quantized tensors with torch's subclass protocol, GGUF)")


def is_quantized(t: torch.Tensor) -> bool:
    """True when ``t`` is not a plain tensor but an adapter handles it."""
    try:
        return adapter_for(t) is not None
    except UnsupportedWeight:
        return False


def parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s stored bytes (``[t]`` for a plain tensor, and for a kind
    no adapter knows: e.g. GGUF's, which :mod:`memorykit.weight_parts` decomposes); see module doc."""
    try:
        a = adapter_for(t)
    except UnsupportedWeight:
        return [t]
    return [t] if a is None else a.parts(t)


def expand(tensors) -> list[torch.Tensor]:
    """``tensors`` with every weight replaced by its parts, each part once (by identity), in order."""
    out, seen = [], set()
    for t in tensors:
        for p in parts(t):
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def rebuild(t: torch.Tensor, new_parts: list[torch.Tensor]) -> torch.Tensor:
    """A weight of ``t``'s kind over ``new_parts`` (``new_parts[0]`` for a plain tensor)."""
    a = adapter_for(t)
    if a is None:
        if len(new_parts) != 1:
            raise ValueError(f"a plain tensor has one part, got {len(new_parts)}")
        return new_parts[0]
    return a.rebuild(t, list(new_parts))


def stored_nbytes(t: torch.Tensor) -> int:
    """Bytes ``t`` stores: the sum over its parts (each counted once)."""
    return sum(p.numel() * p.element_size() for p in expand([t]))


def describe(t: torch.Tensor) -> str:
    """Short text for reports: ``"QuantizedTensor (float8_e4m3fn)"``, ``"bfloat16"``."""
    if is_plain(t):
        return str(t.dtype).replace("torch.", "")
    try:
        dtypes = sorted({str(p.dtype).replace("torch.", "") for p in parts(t)})
    except UnsupportedWeight:
        dtypes = []
    return f"{type(t).__name__} ({', '.join(dtypes)})" if dtypes else type(t).__name__


def inference_weights(module: torch.nn.Module) -> bool:
    """True when ``module``'s weights are inference tensors (loaded inside ``torch.inference_mode``,
    as ComfyUI's server runs its loaders). Whatever rebuilds or moves them (core's quantized layers
    make new Parameters on every ``Module.to``) must then run in inference mode too, or the next
    load inside it fails ("Cannot set version_counter for inference tensor")."""
    for t in module.parameters():
        try:
            return any(p.is_inference() for p in parts(t))
        except UnsupportedWeight:
            return False
    return False
