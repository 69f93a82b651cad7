"""Weights that are tensor subclasses, seen as plain tensors by the placement engines: the one rule.

The event ring (:mod:`memorykit.offload_stream`) and the device map (accelerate, through
:mod:`memorykit.device_dispatch`) move weights by swapping ``tensor.data`` or by rebuilding a
``Parameter`` of the tensor's class: both need plain tensors. A quantized weight is a subclass
with metadata (GGUF's ``GGMLTensor``: the raw quantized bytes, its quantization type and logical
shape; core's ``QuantizedTensor``: fp8 data + scales). :func:`decompose` swaps such weights for
plain Parameters holding the stored bytes for the time a placement is applied (what the engines
stream and place is what is stored, never a dequantised copy), and the layer's forward gets the
original kind of weight rebuilt around the plain tensors, wherever the engine has put them (a
ring region, the GPU, the host), so it computes exactly as before. :meth:`Decomposed.restore`
puts the original weights back (metadata kept, e.g. LoRA patches) over the parts' current data.

Per weight, the kind decides how many parts it has:

- **one part** (a registered :class:`Codec`, e.g. GGUF): the parameter keeps its name and becomes
  a plain ``Parameter`` over the same storage; the module's class becomes a subclass whose
  ``forward`` rebuilds the weight (the ring and the device map alike);
- **several parts** (``several=True``: any other non-plain weight, decomposed by the
  :mod:`memorykit.stored_parts` adapters, e.g. core's ``QuantizedTensor``): the parameter
  ``<name>`` is replaced by plain Parameters ``<name>__mk_part<i>``, the layer shows a weight
  without data (``meta``) outside its forward and gets an instance ``forward`` rebuilding it.
  Group Offload does not ask for it: its event ring moves these parts in place
  (``stored_parts.parts``: setting ``part.data`` changes the weight), the device map does.

The integration layer registers the codecs (:func:`register`). Plain torch; nothing of ComfyUI here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from . import stored_parts
from .offload_plan import copy_at_phase


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

    entries: list = field(default_factory=list)  # (module, name, original tensor, codec): one part each
    classes: list = field(default_factory=list)  # (module, original class)
    kinds: dict = field(default_factory=dict)
    split: list = field(default_factory=list)  # _Split: weights of several parts

    def restore(self) -> None:
        """The original tensors back (holding the plain tensors' current data), classes and forwards back.
        Idempotent; when it raised half-way, calling it again finishes it."""
        for u in self.split:
            u.restore()
        self.split.clear()
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
        return bool(self.entries) or bool(self.split)


def decompose(root: nn.Module, several: bool = False) -> Decomposed:
    """Replace every registered tensor-subclass parameter under ``root`` by its plain stored
    bytes, and with ``several`` every other weight that is not a plain tensor by the plain
    tensors of its stored parts (see module docstring; a kind no adapter knows raises
    :class:`memorykit.stored_parts.UnsupportedWeight`, ``root`` left as it was). Modules without
    such parameters are left alone; a module that reads a decomposed weight through a parent's
    forward (not its own) would see the plain bytes, so every decomposed parameter belongs to a
    module whose own forward uses it."""
    out = Decomposed()
    try:
        for module in root.modules():
            found, mine = {}, []
            for name, t in list(module._parameters.items()):
                codec = codec_for(t)
                if codec is None:
                    if several and t is not None and not stored_parts.is_plain(t):
                        mine.append(_Split(module, name, t))
                        out.split.append(mine[-1])
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
            if mine:
                mine[0].own_forward = module.__dict__.get("forward")
                module.forward = _split_forward(module, module.forward, mine)
    except BaseException:
        out.restore()
        raise
    return out


PART = "__mk_part"


class _Split:
    """One weight ``module.<name>`` of several parts replaced by plain Parameters of its parts (see
    module doc). Holds no tensor with data: the parts' Parameters are their only holders in the module."""

    def __init__(self, module: nn.Module, name: str, weight: torch.Tensor):
        self.module, self.name = module, name
        parts = stored_parts.parts(weight)
        self.inference = [p.is_inference() for p in parts]
        self.was_param = isinstance(weight, nn.Parameter)
        self.order = list(module._parameters)
        self.names = [f"{name}{PART}{i}" for i in range(len(parts))]
        self.meta = stored_parts.rebuild(weight, [torch.empty_like(p, device="meta") for p in parts])
        for n, p in zip(self.names, parts):
            module._parameters[n] = nn.Parameter(p, requires_grad=False)
        del module._parameters[name]
        module.__dict__[name] = self.meta  # outside its forward the layer shows a weight without data

    def rebuilt(self) -> torch.Tensor:
        return stored_parts.rebuild(self.meta, [self.module._parameters[n] for n in self.names])

    def restore(self) -> None:
        """The weight back in the module as a Parameter, rebuilt over its restored parts (copies made
        inference tensors where they were: core rebuilds its quantized Parameters in inference mode),
        and the module's own ``forward`` back."""
        m = self.module
        if self.name not in m._parameters:
            parts = []
            for n, inf in zip(self.names, self.inference):
                cur = m._parameters.pop(n)
                if cur.is_inference() == inf:
                    parts.append(cur.data)  # its own storage as loaded, nothing moved it (same alignment, kernels)
                    continue
                with torch.inference_mode(inf):
                    own = copy_at_phase(cur.data)
                parts.append(own)
            m.__dict__.pop(self.name, None)
            with torch.inference_mode(any(self.inference)):
                w = stored_parts.rebuild(self.meta, parts)
                m._parameters[self.name] = nn.Parameter(w, requires_grad=False) if self.was_param else w
            items = dict(m._parameters)  # the parameters in their order as loaded
            m._parameters.clear()
            m._parameters.update({k: items.pop(k) for k in self.order if k in items})
            m._parameters.update(items)
        if hasattr(self, "own_forward"):
            m.__dict__.pop("forward", None)
            if self.own_forward is not None:
                m.forward = self.own_forward


def _split_forward(m, forward, split: list[_Split]):
    def run(*args, **kwargs):
        for u in split:
            m.__dict__[u.name] = u.rebuilt()
        try:
            return forward(*args, **kwargs)
        finally:
            for u in split:
                m.__dict__[u.name] = u.meta
    return run
