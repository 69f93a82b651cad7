"""The one module that knows ComfyUI's model management (``comfy.model_management``,
``comfy.model_patcher``). Node code calls in here; the technique modules never do.
"""
from __future__ import annotations

import comfy.model_management as mm


def loaded_models() -> list[dict]:
    """Models ComfyUI's memory manager currently holds, one dict each.

    Keys: ``name`` (class of the wrapped model, e.g. ``WAN21``, ``SD1ClipModel``),
    ``load_device``, ``current_device``, ``size_bytes`` (all weights),
    ``loaded_bytes`` (weights ComfyUI has moved to the load device) and
    ``on_gpu_bytes`` (``loaded_bytes`` when the load device is a GPU, else 0).
    """
    out = []
    for lm in list(mm.current_loaded_models):
        patcher = lm.model
        if patcher is None:  # weakref died: the model is being freed
            continue
        load_device = getattr(patcher, "load_device", None)
        size = int(patcher.model_size())
        loaded = int(patcher.loaded_size())
        out.append({
            "name": type(patcher.model).__name__,
            "load_device": str(load_device),
            "current_device": str(patcher.current_loaded_device()),
            "size_bytes": size,
            "loaded_bytes": loaded,
            "on_gpu_bytes": loaded if getattr(load_device, "type", "cpu") != "cpu" else 0,
        })
    return out
