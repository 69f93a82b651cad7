"""Every difference between the ComfyUI versions the pack supports, detected in this one place.

Tested versions: 0.3.75 and 0.33.0 (read against 0.38.1). Each function feature-detects the API
it needs (never a version number) and does the right thing on both sides:

- dynamic VRAM (0.33+, ``ModelPatcherDynamic``, comfy-aimdo): :func:`is_dynamic`,
  :func:`opt_out_of_dynamic_vram`, :func:`memory_path`;
- free memory as core itself would offer it: :func:`patcher_free_memory`;
- saving: :func:`model_state_dict_for_saving` (0.33 moved it to ``ModelPatcher`` and made it lazy);
- the VAE ``Decoder`` lost ``give_pre_end`` in 0.33: :func:`decoder_gives_pre_end`;
- per-forward LoRA patches on float8 layers: :func:`apply_weight_patch`;
- a private folder in the user directory: :func:`system_user_directory`.
"""
from __future__ import annotations

import inspect

import torch

import comfy.model_management as mm


def is_dynamic(patcher) -> bool:
    """True when ``patcher`` is core's dynamic-VRAM patcher (``ModelPatcherDynamic``, 0.33+).

    Detected by ``ModelPatcher.is_dynamic()`` (absent before dynamic VRAM existed)."""
    fn = getattr(patcher, "is_dynamic", None)
    return bool(callable(fn) and fn())


def opt_out_of_dynamic_vram(patcher, node: str):
    """A clone of ``patcher`` managed by core's standard ``ModelPatcher``, sharing its module.

    For a dynamic-VRAM patcher (0.33+) this is
    ``patcher.clone(disable_dynamic=True, model_override=patcher.get_clone_model_override())``:
    the loaded ``nn.Module`` is reused, nothing is read from disk again (core's plain
    ``clone(disable_dynamic=True)`` would rebuild the model through ``cached_patcher_init``: a
    second full copy in RAM, and RuntimeError for a MODEL from a loader without one). Any other
    patcher gets a plain ``clone()``. ``node`` names the calling node in errors.

    Raises RuntimeError (saying how to run the node) when this ComfyUI cannot give a standard
    clone that shares the module.
    """
    if not is_dynamic(patcher):
        return patcher.clone()
    params = inspect.signature(patcher.clone).parameters
    if "disable_dynamic" not in params or "model_override" not in params or not hasattr(patcher, "get_clone_model_override"):
        raise RuntimeError(f"{node}: this ComfyUI manages the model with dynamic VRAM and cannot hand it over "
                           "without loading it a second time; start ComfyUI with --disable-dynamic-vram to use "
                           f"{node}, or leave {node} out and let ComfyUI stream the weights itself.")
    n = patcher.clone(disable_dynamic=True, model_override=patcher.get_clone_model_override())
    if is_dynamic(n) or n.model is not patcher.model:
        raise RuntimeError(f"{node}: this ComfyUI did not give a standard patcher for the loaded model; start "
                           f"ComfyUI with --disable-dynamic-vram to use {node}.")
    return n


OPTED_OUT_NOTE = ("dynamic VRAM: this model is taken out of ComfyUI's dynamic VRAM (same loaded weights, "
                  "no second copy); MemoryKit places its weights")


def patcher_free_memory(patcher, device) -> int:
    """Free memory on ``device`` (bytes) as core would offer it to ``patcher``'s model.

    0.33+: ``ModelPatcher.get_free_memory(device)``, which also counts the VRAM dynamic VRAM can
    evict (``model_management.get_free_memory`` under-reports then); before:
    ``model_management.get_free_memory(device)``. ``patcher`` may be None (a VAE or a node with
    no model): the latter is used.
    """
    fn = getattr(patcher, "get_free_memory", None)
    if callable(fn):
        return int(fn(torch.device(device)))
    return int(mm.get_free_memory(device))


def memory_path(patcher) -> str:
    """Which memory path ComfyUI has ``patcher``'s model on now, in a user's words:
    ``dynamic VRAM`` / ``lowvram (partially loaded)`` / ``fully loaded`` / ``not loaded`` (the
    pack's own ``MemoryKit group offload`` and ``MemoryKit device map`` are told by the caller)."""
    if is_dynamic(patcher):
        return "dynamic VRAM"
    if int(patcher.loaded_size()) <= 0:
        return "not loaded"
    if getattr(patcher.model, "model_lowvram", False):
        return "lowvram (partially loaded)"
    return "fully loaded"


def _materialize(value):
    # 0.33's lazy saving params (LazyCastingParam*) report a fake device and compute the patched
    # weight in .to("cpu"), as safetensors' save does.
    if isinstance(value, torch.Tensor) and not isinstance(value.device, torch.device):
        return value.to("cpu")
    return value


def model_state_dict_for_saving(patcher) -> dict:
    """``patcher``'s diffusion-model state dict with every weight patch (LoRA) merged, in the
    checkpoint names core's savers write (``model.diffusion_model.*`` or the type's prefix).

    0.33+: loads the model as core's ``save_checkpoint`` does (``load_models_gpu`` without
    ``force_patch_weights``, which a dynamic patcher refuses) and takes
    ``ModelPatcher.state_dict_for_saving()``, materialising its lazily patched weights one by one.
    Before: ``load_models_gpu(force_patch_weights=True)`` and ``BaseModel.state_dict_for_saving()``.
    Values may be non-tensors (``_quantization_metadata``).
    """
    if hasattr(patcher, "state_dict_for_saving"):
        mm.load_models_gpu([patcher])
        sd = patcher.state_dict_for_saving()
        return {k: _materialize(v) for k, v in sd.items()}
    mm.load_models_gpu([patcher], force_patch_weights=True)
    return patcher.model.state_dict_for_saving()


def apply_weight_patch(patch, weight: torch.Tensor) -> torch.Tensor:
    """Apply one of core's per-forward weight patches to the REAL (dequantised) ``weight``.

    A ``LowVramPatch`` (LoRA on a partially or dynamically loaded model) carries ``key`` and
    ``patches``; 0.3.75's calls the layer's ``convert_weight``/``set_weight`` around the delta
    (for a float8 layer: dequantise, add, re-quantise), 0.33's adds the delta directly. On a
    weight that is already real both must be plain ``comfy.lora.calculate_weight``, so that is
    called where the patch would convert. Other patches (weight wrappers) are called as they are.
    """
    import comfy.model_patcher
    if isinstance(patch, comfy.model_patcher.LowVramPatch) and (getattr(patch, "convert_func", None) is not None
                                                                 or getattr(patch, "set_func", None) is not None):
        import comfy.lora
        return comfy.lora.calculate_weight(patch.patches[patch.key], weight, patch.key, intermediate_dtype=weight.dtype)
    return patch(weight)


def system_user_directory(name: str) -> str:
    """``<ComfyUI user directory>/__<name>``: a folder the user-data HTTP API does not serve.

    ``folder_paths.get_system_user_directory`` where it exists (newer ComfyUI), else the same
    path built from ``get_user_directory()``."""
    import os

    import folder_paths
    if hasattr(folder_paths, "get_system_user_directory"):
        return folder_paths.get_system_user_directory(name)
    return os.path.join(folder_paths.get_user_directory(), f"__{name}")


def decoder_gives_pre_end(decoder) -> bool:
    """True when a ``comfy.ldm...model.Decoder`` stops before its output head
    (``give_pre_end``, an attribute 0.33 removed along with the option)."""
    return bool(getattr(decoder, "give_pre_end", False))
