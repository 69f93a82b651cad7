"""Free Memory: unload models and empty caches through ComfyUI's own unloading."""
from __future__ import annotations

import comfy.model_management as mm

from .common import loaded_models


def free_memory(unload_models: bool = True, empty_cache: bool = True) -> list[dict]:
    """Unload the models ComfyUI's memory manager holds and empty the device caches.

    Unloading goes through ComfyUI: ``comfy.model_management.unload_all_models()`` (which frees
    the models on the main torch device), then ``free_memory(1e30, device)`` for any model still
    held on another device (e.g. a text encoder that ComfyUI loads on the CPU next to a GPU
    UNet) — the same call, per device. ComfyUI detaches each model: its weights go back to the
    offload device and its patches are removed; the MODEL/CLIP/VAE objects stay valid and are
    loaded again by the next node that needs them. ``empty_cache``: ``gc.collect()`` then
    ``comfy.model_management.soft_empty_cache()`` (torch.cuda.empty_cache + ipc_collect on CUDA;
    the MPS/XPU/NPU equivalents elsewhere), as ComfyUI's own ``POST /free`` does.

    Returns the models that were unloaded, as dicts of :func:`loaded_models` taken before.
    """
    import gc

    before_ids = _held_patcher_ids()
    before = loaded_models()  # same order as before_ids: both skip models being freed
    if unload_models:
        mm.unload_all_models()
        for device in {lm.device for lm in list(mm.current_loaded_models)}:
            mm.free_memory(1e30, device)
    if empty_cache:
        gc.collect()
        mm.soft_empty_cache()
    still = set(_held_patcher_ids())
    return [info for pid, info in zip(before_ids, before) if pid not in still]


def _held_patcher_ids() -> list[int]:
    """``id()`` of every live ModelPatcher in ``current_loaded_models``, in list order."""
    return [id(lm.model) for lm in list(mm.current_loaded_models) if lm.model is not None]
