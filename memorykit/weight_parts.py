"""Weights that are tensor subclasses, seen as plain tensors by the placement engines.

The event ring (:mod:`memorykit.offload_stream`) and the device map (accelerate, through
:mod:`memorykit.device_dispatch`) move weights by swapping ``tensor.data`` or by rebuilding a
``Parameter`` of the tensor's class: both need plain tensors. A quantized weight of another
library (e.g. GGUF's ``GGMLTensor``: the raw quantized bytes, its quantization type and logical
shape, dequantised by its layer at forward time) is a subclass with metadata. Here such a weight
is *decomposed* for the time a placement is applied:

- the module's parameter becomes a plain ``Parameter`` holding the stored bytes (same name,
  same storage: what the engines stream is what is stored, never a dequantised copy);
- the module's class becomes a subclass whose ``forward`` rebuilds the original tensor type
  around the current plain tensor (wherever the engine has put it: a ring region, the GPU, the
  host) for the duration of the forward, so the layer computes exactly as before;
- :meth:`Decomposed.restore` puts the original tensor objects back (with their metadata, e.g.
  LoRA patches) holding the plain tensors' current data, and the original classes.

A :class:`Codec` says how one kind of subclass is split and rebuilt; the integration layer
registers the codecs (:func:`register`). Plain torch; nothing of ComfyUI here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


class Codec:
    """How one kind of tensor subclass is decomposed. Subclasses implement all four methods."""

    name = "tensor subclass"

    def matches(self, t: torch.Tensor) -> bool:
        raise NotImplementedError

    def plain(self, t: torch.Tensor) -> torch.Tensor:
        """The stored bytes of ``t`` as a plain tensor sharing its storage."""
        raise NotImplementedError

    def rebuild(self, original: torch.Tensor, plain: torch.Tensor) -> torch.Tensor:
        """A tensor of ``original``'s kind and metadata viewing ``plain`` (used during a forward)."""
        raise NotImplementedError

    def restore(self, original: torch.Tensor, plain: torch.Tensor) -> None:
        """Give ``original`` the data of ``plain`` (where and what it is now), metadata kept."""
        raise NotImplementedError


_CODECS: list[Codec] = []


def register(codec: Codec) -> None:
    """Add ``codec`` (once per class)."""
    if not any(type(c) is type(codec) for c in _CODECS):
        _CODECS.append(codec)


def codec_for(t) -> Codec | None:
    """The registered codec that handles ``t``, or None (plain tensors and unknown kinds)."""
    if t is None or type(t) in (torch.Tensor, nn.Parameter):
        return None
    return next((c for c in _CODECS if c.matches(t)), None)


_CLASSES: dict[type, type] = {}
_PARTS = "_memorykit_weight_parts"


def _rebuilding_class(cls: type) -> type:
    """``cls`` with a ``forward`` that rebuilds the decomposed tensors around the plain ones."""
    if cls in _CLASSES:
        return _CLASSES[cls]

    def forward(self, *args, **kwargs):
        parts = self.__dict__.get(_PARTS) or {}
        params = self._parameters
        plain = {n: params[n] for n in parts}
        try:
            for n, (original, codec) in parts.items():
                params[n] = codec.rebuild(original, plain[n])
            return cls.forward(self, *args, **kwargs)
        finally:
            params.update(plain)

    new = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, "_memorykit_rebuilds": cls})
    _CLASSES[cls] = new
    return new


@dataclass(eq=False)
class Decomposed:
    """What :func:`decompose` changed; :meth:`restore` undoes it. ``kinds``: codec name → count."""

    entries: list = field(default_factory=list)  # (module, name, original tensor, codec)
    classes: list = field(default_factory=list)  # (module, original class)
    kinds: dict = field(default_factory=dict)

    def restore(self) -> None:
        """The original tensors back (holding the plain tensors' current data), classes back. Idempotent."""
        for module, name, original, codec in self.entries:
            plain = module._parameters.get(name)
            if plain is not None and plain is not original:
                codec.restore(original, plain)
            module._parameters[name] = original
        for module, cls in self.classes:
            module.__class__ = cls
            module.__dict__.pop(_PARTS, None)
        self.entries.clear()
        self.classes.clear()

    def __bool__(self) -> bool:
        return bool(self.entries)


def decompose(root: nn.Module) -> Decomposed:
    """Replace every registered tensor-subclass parameter under ``root`` by its plain stored
    bytes (see module docstring). Modules without such parameters are left alone; a module
    that reads a decomposed weight through a parent's forward (not its own) would see the
    plain bytes, so every decomposed parameter belongs to a module whose own forward uses it."""
    out = Decomposed()
    try:
        for module in root.modules():
            found = {}
            for name, t in list(module._parameters.items()):
                codec = codec_for(t)
                if codec is None:
                    continue
                plain = nn.Parameter(codec.plain(t), requires_grad=False)
                module._parameters[name] = plain
                out.entries.append((module, name, t, codec))
                out.kinds[codec.name] = out.kinds.get(codec.name, 0) + 1
                found[name] = (t, codec)
            if found:
                cls = type(module)
                module.__dict__[_PARTS] = found
                out.classes.append((module, cls))
                module.__class__ = _rebuilding_class(cls)
    except BaseException:
        out.restore()
        raise
    return out
