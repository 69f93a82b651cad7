"""Helpers the integration modules share: the models ComfyUI holds, and core's ``weight_dtype``
choices (UNETLoader's) turned into ``model_options``."""
from __future__ import annotations

import torch

import comfy.model_management as mm

from . import placement
from .compat import memory_path

# Same choices and meaning as core's UNETLoader ``weight_dtype`` (nodes.py, 0.3.75 and 0.33).
WEIGHT_DTYPES = ["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"]


def weight_dtype_options(weight_dtype: str) -> dict:
    """``model_options`` for a UNETLoader-style ``weight_dtype`` choice (see :data:`WEIGHT_DTYPES`).

    Raises ValueError naming the choices for an unknown value."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype {weight_dtype!r}: choose one of {WEIGHT_DTYPES}")
    opts: dict = {}
    if weight_dtype.startswith("fp8_e4m3fn"):
        opts["dtype"] = torch.float8_e4m3fn
        if weight_dtype.endswith("_fast"):
            opts["fp8_optimizations"] = True
    elif weight_dtype == "fp8_e5m2":
        opts["dtype"] = torch.float8_e5m2
    return opts


def loaded_models() -> list[dict]:
    """Models ComfyUI's memory manager currently holds, one dict each.

    Keys: ``name`` (class of the wrapped model, e.g. ``WAN21``, ``SD1ClipModel``),
    ``load_device``, ``current_device``, ``size_bytes`` (all weights),
    ``loaded_bytes`` (weights ComfyUI has moved to the load device),
    ``on_gpu_bytes`` (``loaded_bytes`` when the load device is a GPU, else 0) and
    ``memory_path`` (``dynamic VRAM``, ``lowvram (partially loaded)``, ``fully loaded``,
    ``MemoryKit group offload``, ``MemoryKit device map`` or ``not loaded``).
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
            "memory_path": _pack_memory_path(patcher) or memory_path(patcher),
        })
    return out


def _pack_memory_path(patcher) -> str | None:
    # The pack's own placements are recorded on the shared BaseModel while applied (placement).
    return placement.memory_path(patcher.model)
