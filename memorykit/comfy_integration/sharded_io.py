"""Sharded checkpoints inside ComfyUI (Sharded Checkpoint Loader, Sharded Text Encoder Loader,
Save Sharded).

The technique (index validation, mmap loading, shard writing) is ``memorykit/sharded*.py``;
this module only finds ComfyUI's model folders and hands state dicts to ComfyUI's own loaders
(``comfy.sd.load_diffusion_model_state_dict`` converts diffusers names and detects the model,
exactly as for one file) and takes a MODEL's state dict the way ComfyUI's ModelSave does.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .. import badge, report, safe_files, sharded, sharded_save, validation
from . import fp8_save, placement
from .common import loaded_models, weight_dtype_options
from .compat import model_state_dict_for_saving as _compat_state_dict
from .gguf_weights import gguf_model_description

_CLIP_LOADER_TYPES = ["stable_diffusion", "stable_cascade", "sd3", "stable_audio", "mochi", "ltxv", "pixart",
                      "cosmos", "lumina2", "wan", "hidream", "chroma", "ace", "omnigen2", "qwen_image",
                      "hunyuan_image", "flux2"]


def text_encoder_types() -> list[str]:
    """CLIPLoader's ``type`` choices that this ComfyUI's ``comfy.sd.CLIPType`` knows."""
    import comfy.sd
    return [t for t in _CLIP_LOADER_TYPES if hasattr(comfy.sd.CLIPType, t.upper())]


def sharded_choices(folder_name: str) -> list[str]:
    """Sharded checkpoints (folders or index files, see ``sharded.list_sharded``) under every
    folder ComfyUI registers for ``folder_name`` (``diffusion_models``, ``text_encoders``)."""
    import folder_paths
    out: set[str] = set()
    for root in folder_paths.get_folder_paths(folder_name):
        out.update(sharded.list_sharded(root))
    return sorted(out)


def resolve_sharded(folder_name: str, choice: str) -> Path:
    """Path of a :func:`sharded_choices` entry. Raises ValueError for a name that leaves the
    model folder (``..``, absolute) or that exists in none of ComfyUI's folders."""
    import folder_paths
    parts = str(choice).replace("\\", "/").split("/")
    if not choice or os.path.isabs(choice) or ".." in parts:
        raise ValueError(f"{choice!r}: not a path inside models/{folder_name}")
    roots = folder_paths.get_folder_paths(folder_name)
    for root in roots:
        cand = Path(root) / choice
        if cand.exists():
            return cand
    raise ValueError(f"Sharded checkpoint {choice!r} not found in {', '.join(roots)}")


def _shard_progress(index):
    import comfy.utils
    bar = comfy.utils.ProgressBar(len(index.shards))
    return lambda done, total: bar.update_absolute(done, total)


def load_sharded_diffusion_model(path, weight_dtype: str = "default", progress=None, disable_dynamic: bool = False):
    """Load a sharded diffusion model (folder or index file) as UNETLoader loads one file.

    Validates the whole checkpoint first (``sharded.read_index``), loads the shards one at a
    time memory-mapped, then calls ``comfy.sd.load_diffusion_model_state_dict`` (diffusers
    names of Flux/SD3/AuraFlow/PixArt/UNets converted, model detected, ``weight_dtype`` as in
    UNETLoader). ``progress(done, total)`` defaults to a ComfyUI progress bar over shards.
    ``disable_dynamic``: passed on where ComfyUI has dynamic VRAM (0.33+). The MODEL gets core's
    ``cached_patcher_init`` (as ``comfy.sd.load_diffusion_model`` sets it), so core's features
    that rebuild a model from its loader (multi-GPU clones, non-dynamic delegates) work on it.
    Returns ``(ModelPatcher, info)`` with ``info`` from ``sharded.describe``. Raises
    ``sharded.ShardedCheckpointError`` (a ValueError) for bad checkpoints and RuntimeError when
    ComfyUI recognises no model in the tensors.
    """
    import inspect

    import comfy.sd
    options = weight_dtype_options(weight_dtype)
    with sharded.Timer() as t:
        index = sharded.read_index(path)
        sd, metadata = sharded.load_state_dict(index, progress or _shard_progress(index))
        kwargs = {"metadata": metadata} if metadata else {}
        if disable_dynamic and "disable_dynamic" in inspect.signature(comfy.sd.load_diffusion_model_state_dict).parameters:
            kwargs["disable_dynamic"] = True
        model = comfy.sd.load_diffusion_model_state_dict(sd, model_options=options, **kwargs)
    if model is None:
        raise RuntimeError(f"Could not detect the model type of {index.index_path}: its {len(index.weight_map)} "
                           "tensors match no diffusion model ComfyUI knows (diffusers names are converted for "
                           "Flux, SD3, AuraFlow, PixArt and standard UNets). Is it a text encoder or a VAE?")
    if hasattr(model, "cached_patcher_init"):
        model.cached_patcher_init = (_reload_sharded_diffusion_model, (str(path), weight_dtype))
    return model, sharded.describe(index, t.seconds)


def _reload_sharded_diffusion_model(path: str, weight_dtype: str, disable_dynamic: bool = False):
    """core's ``cached_patcher_init`` factory for a sharded MODEL: the same load, no progress bar."""
    return load_sharded_diffusion_model(path, weight_dtype, progress=lambda done, total: None,
                                        disable_dynamic=disable_dynamic)[0]


def load_sharded_text_encoder(path, clip_type: str = "stable_diffusion", device: str = "default", progress=None):
    """Load a sharded text encoder (folder or index file) as CLIPLoader loads one file.

    ``clip_type``: one of :func:`text_encoder_types`; ``device``: ``default`` or ``cpu`` (keep
    the encoder on the CPU). Calls ``comfy.sd.load_text_encoder_state_dicts``. Returns
    ``(CLIP, info)``. Raises ValueError for an unknown type/device or a bad checkpoint.
    """
    import torch
    import comfy.sd
    import folder_paths
    if clip_type not in text_encoder_types():
        raise ValueError(f"text encoder type {clip_type!r}: choose one of {text_encoder_types()}")
    if device not in ("default", "cpu"):
        raise ValueError(f"device {device!r}: choose 'default' or 'cpu'")
    options = {}
    if device == "cpu":
        options["load_device"] = options["offload_device"] = torch.device("cpu")
    with sharded.Timer() as t:
        index = sharded.read_index(path)
        sd, metadata = sharded.load_state_dict(index, progress or _shard_progress(index))
        if metadata.get("_quantization_metadata") is not None:  # as comfy.sd.load_clip does for one file
            sd["_quantization_metadata"] = metadata["_quantization_metadata"]
        clip = comfy.sd.load_text_encoder_state_dicts(
            [sd], embedding_directory=folder_paths.get_folder_paths("embeddings"),
            clip_type=getattr(comfy.sd.CLIPType, clip_type.upper()), model_options=options)
    return clip, sharded.describe(index, t.seconds)


def diffusion_models_dir() -> Path:
    """Where Save Sharded writes: ComfyUI's ``models/diffusion_models`` (the registered
    ``diffusion_models`` folder named so, else the first registered one)."""
    import folder_paths
    roots = folder_paths.get_folder_paths("diffusion_models")
    named = [r for r in roots if os.path.basename(os.path.normpath(r)) == "diffusion_models"]
    return Path((named or roots)[0])


def model_state_dict_for_saving(model) -> tuple[dict, dict, dict | None]:
    """A MODEL's diffusion-model state dict in ComfyUI's names, as ModelSave saves it.

    Like ``comfy.sd.save_checkpoint`` on each ComfyUI version (see
    :func:`compat.model_state_dict_for_saving`): LoRA and other weight patches merged, keys
    prefixed ``model.diffusion_model.`` or the model type's own prefix. Non-tensor entries
    (``_quantization_metadata``) are returned as JSON strings in the second dict (safetensors
    metadata). Weights patched in place are the model's own tensors (no copy). Layers cast by
    FP8 Layerwise Cast are written in core's own quantized format where core has one
    (:func:`fp8_save.fp8_layers_for_saving`, which may add ``_quantization_metadata`` to the
    second dict); the third value is its info (None for a model without float8 layers). A
    placed model (Group Offload, Balanced Device Map) is read the plain way
    (:func:`placement.plain_load`): its placement may hold placeholders or meta tensors, and the
    saver must read the real weights (issue 23 items 4 and 11).
    """
    with placement.plain_load(model):
        sd = _compat_state_dict(model)
    metadata = {}
    for k in [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]:
        v = sd.pop(k)
        metadata[k] = v if isinstance(v, str) else json.dumps(v)
    return fp8_save.fp8_layers_for_saving(model, sd, metadata)


def save_model_sharded(model, name: str, max_shard_size: str = "5GB", overwrite: bool = False, progress=None) -> dict:
    """Write a MODEL into ``models/diffusion_models/<name>/`` as shards + index.

    ``name``: a folder name (sub-folders with ``/`` allowed; no ``..``, not absolute). See
    ``sharded_save.save_sharded`` for the files, the atomic write and ``overwrite``. Returns its
    summary plus ``seconds`` and ``choice`` (the entry Sharded Checkpoint Loader lists).
    Raises ValueError for a bad name (each component checked by
    :func:`validation.path_component`; a path over PATH_MAX or through an existing file) or
    size, PermissionError for a read-only folder, OSError(ENOSPC) when the disk cannot hold the
    save (checked before writing), FileExistsError for an existing folder (with ``overwrite``:
    one that holds no Save Sharded marker; only that save's files are replaced, other files in
    the folder are kept).
    """
    import comfy.utils
    gguf = gguf_model_description(model)
    if gguf is not None:  # its layers report placeholder tensors for saving; core loads no GGUF weights
        raise ValueError(f"model: this MODEL comes from a GGUF file ({gguf}). Save Sharded writes safetensors for "
                         "core's loaders, which cannot load GGUF-quantized weights: keep using the GGUF file, or "
                         "save the original safetensors model.")
    name = (name or "").strip().rstrip("/") if isinstance(name, str) else name
    if not isinstance(name, str) or not name or os.path.isabs(name):
        raise ValueError(f"name {name!r}: give a folder name inside models/diffusion_models (no '..', not absolute)")
    parts = name.replace("\\", "/").split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"name {name!r}: give a folder name inside models/diffusion_models (no '..', not absolute)")
    for part in parts:
        validation.path_component(part, "name")
    sharded_save.parse_size(max_shard_size)  # fail before any work
    root = diffusion_models_dir()
    dest = root / name
    safe_files.check_destination(dest, 0, "name")  # path length, a file in the way, read-only folder
    if dest.exists() and not overwrite:
        raise FileExistsError(f"{dest} already exists; choose another name or enable overwrite to replace it")
    if dest.exists():
        sharded_save.previous_save(dest)  # refuses a folder that is not an earlier save, before any work
    with sharded.Timer() as t:
        sd, metadata, fp8_info = model_state_dict_for_saving(model)
        bar = None
        if progress is None:
            def progress(done, total):
                nonlocal bar
                bar = bar or comfy.utils.ProgressBar(total)
                bar.update_absolute(done, total)
        info = sharded_save.save_sharded(sd, dest, max_shard_size=max_shard_size, metadata=metadata,
                                          overwrite=overwrite, progress=progress)
    info.update(seconds=round(t.seconds, 3), choice=name, action="Saved")
    if fp8_info is not None:
        info["fp8"] = dict(fp8_info, note=fp8_save.describe(fp8_info))
    return info


def sharded_ui(label: str, info: dict) -> dict:
    """UI output of the sharded nodes: ``memorykit_report`` (Memory Report's dict plus
    ``sharded`` = ``info``) and ``text`` (the summary line, then the memory report)."""
    rep = report.build_report(label, loaded_models())
    rep["sharded"] = info
    lines = report.format_report(rep).split("\n")
    lines.insert(1, sharded.summary_text(info))
    if "fp8" in info:
        lines.insert(2, info["fp8"]["note"])
    return {"memorykit_report": [badge.with_badge(rep)], "text": ["\n".join(lines)]}
