"""ComfyUI integration: sharded io (see the section comment below)."""
from __future__ import annotations

import comfy.model_management as mm  # noqa: F401

from .common import loaded_models  # noqa: F401


# Sharded checkpoints (Sharded Checkpoint Loader, Sharded Text Encoder Loader, Save Sharded).
# The technique (index validation, mmap loading, shard writing) is memorykit/sharded*.py; this
# section only finds ComfyUI's model folders and hands state dicts to ComfyUI's own loaders
# (comfy.sd.load_diffusion_model_state_dict converts diffusers names and detects the model,
# exactly as for one file) and takes a MODEL's state dict the way ComfyUI's ModelSave does.
# =============================================================================================
import json as _json  # noqa: E402
import os as _os  # noqa: E402
from pathlib import Path as _Path  # noqa: E402

from .. import badge as _badge, report as _report, sharded as _sharded, sharded_save as _sharded_save  # noqa: E402

# Same choices and meaning as core's UNETLoader / CLIPLoader (nodes.py, ComfyUI 0.3.75).
WEIGHT_DTYPES = ["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"]
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
        out.update(_sharded.list_sharded(root))
    return sorted(out)


def resolve_sharded(folder_name: str, choice: str) -> _Path:
    """Path of a :func:`sharded_choices` entry. Raises ValueError for a name that leaves the
    model folder (``..``, absolute) or that exists in none of ComfyUI's folders."""
    import folder_paths
    parts = str(choice).replace("\\", "/").split("/")
    if not choice or _os.path.isabs(choice) or ".." in parts:
        raise ValueError(f"{choice!r}: not a path inside models/{folder_name}")
    roots = folder_paths.get_folder_paths(folder_name)
    for root in roots:
        cand = _Path(root) / choice
        if cand.exists():
            return cand
    raise ValueError(f"Sharded checkpoint {choice!r} not found in {', '.join(roots)}")


def _shard_progress(index):
    import comfy.utils
    bar = comfy.utils.ProgressBar(len(index.shards))
    return lambda done, total: bar.update_absolute(done, total)


def _weight_dtype_options(weight_dtype: str) -> dict:
    import torch
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


def load_sharded_diffusion_model(path, weight_dtype: str = "default", progress=None):
    """Load a sharded diffusion model (folder or index file) as UNETLoader loads one file.

    Validates the whole checkpoint first (``sharded.read_index``), loads the shards one at a
    time memory-mapped, then calls ``comfy.sd.load_diffusion_model_state_dict`` (diffusers
    names of Flux/SD3/AuraFlow/PixArt/UNets converted, model detected, ``weight_dtype`` as in
    UNETLoader). ``progress(done, total)`` defaults to a ComfyUI progress bar over shards.
    Returns ``(ModelPatcher, info)`` with ``info`` from ``sharded.describe``. Raises
    ``sharded.ShardedCheckpointError`` (a ValueError) for bad checkpoints and RuntimeError when
    ComfyUI recognises no model in the tensors.
    """
    import comfy.sd
    options = _weight_dtype_options(weight_dtype)
    with _sharded.Timer() as t:
        index = _sharded.read_index(path)
        sd, metadata = _sharded.load_state_dict(index, progress or _shard_progress(index))
        kwargs = {"metadata": metadata} if metadata else {}
        model = comfy.sd.load_diffusion_model_state_dict(sd, model_options=options, **kwargs)
    if model is None:
        raise RuntimeError(f"Could not detect the model type of {index.index_path}: its {len(index.weight_map)} "
                           "tensors match no diffusion model ComfyUI knows (diffusers names are converted for "
                           "Flux, SD3, AuraFlow, PixArt and standard UNets). Is it a text encoder or a VAE?")
    return model, _sharded.describe(index, t.seconds)


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
    with _sharded.Timer() as t:
        index = _sharded.read_index(path)
        sd, metadata = _sharded.load_state_dict(index, progress or _shard_progress(index))
        if metadata.get("_quantization_metadata") is not None:  # as comfy.sd.load_clip does for one file
            sd["_quantization_metadata"] = metadata["_quantization_metadata"]
        clip = comfy.sd.load_text_encoder_state_dicts(
            [sd], embedding_directory=folder_paths.get_folder_paths("embeddings"),
            clip_type=getattr(comfy.sd.CLIPType, clip_type.upper()), model_options=options)
    return clip, _sharded.describe(index, t.seconds)


def diffusion_models_dir() -> _Path:
    """Where Save Sharded writes: ComfyUI's ``models/diffusion_models`` (the registered
    ``diffusion_models`` folder named so, else the first registered one)."""
    import folder_paths
    roots = folder_paths.get_folder_paths("diffusion_models")
    named = [r for r in roots if _os.path.basename(_os.path.normpath(r)) == "diffusion_models"]
    return _Path((named or roots)[0])


def model_state_dict_for_saving(model) -> tuple[dict, dict]:
    """A MODEL's diffusion-model state dict in ComfyUI's names, as ModelSave saves it.

    Like ``comfy.sd.save_checkpoint``: loads the model with ``force_patch_weights=True`` (LoRA
    and other weight patches merged) and takes ``model.model.state_dict_for_saving()`` (keys
    prefixed ``model.diffusion_model.`` or the model type's own prefix). Non-tensor entries
    (``_quantization_metadata``) are returned as JSON strings in the second dict (safetensors
    metadata). The tensors are the model's own (no copy).
    """
    import torch
    mm.load_models_gpu([model], force_patch_weights=True)
    sd = model.model.state_dict_for_saving()
    metadata = {}
    for k in [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]:
        v = sd.pop(k)
        metadata[k] = v if isinstance(v, str) else _json.dumps(v)
    return sd, metadata


def save_model_sharded(model, name: str, max_shard_size: str = "5GB", overwrite: bool = False, progress=None) -> dict:
    """Write a MODEL into ``models/diffusion_models/<name>/`` as shards + index.

    ``name``: a folder name (sub-folders with ``/`` allowed; no ``..``, not absolute). See
    ``sharded_save.save_sharded`` for the files, the atomic write and ``overwrite``. Returns its
    summary plus ``seconds`` and ``choice`` (the entry Sharded Checkpoint Loader lists).
    Raises ValueError for a bad name or size, FileExistsError for an existing folder.
    """
    import comfy.utils
    name = (name or "").strip().rstrip("/")
    parts = name.replace("\\", "/").split("/")
    if not name or _os.path.isabs(name) or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"name {name!r}: give a folder name inside models/diffusion_models (no '..', not absolute)")
    _sharded_save.parse_size(max_shard_size)  # fail before any work
    dest = diffusion_models_dir() / name
    if dest.exists() and not overwrite:
        raise FileExistsError(f"{dest} already exists; choose another name or enable overwrite to replace it")
    with _sharded.Timer() as t:
        sd, metadata = model_state_dict_for_saving(model)
        bar = None
        if progress is None:
            def progress(done, total):
                nonlocal bar
                bar = bar or comfy.utils.ProgressBar(total)
                bar.update_absolute(done, total)
        info = _sharded_save.save_sharded(sd, dest, max_shard_size=max_shard_size, metadata=metadata,
                                          overwrite=overwrite, progress=progress)
    info.update(seconds=round(t.seconds, 3), choice=name, action="Saved")
    return info


def sharded_ui(label: str, info: dict) -> dict:
    """UI output of the sharded nodes: ``memorykit_report`` (Memory Report's dict plus
    ``sharded`` = ``info``) and ``text`` (the summary line, then the memory report)."""
    rep = _report.build_report(label, loaded_models())
    rep["sharded"] = info
    lines = _report.format_report(rep).split("\n")
    lines.insert(1, _sharded.summary_text(info))
    return {"memorykit_report": [_badge.with_badge(rep)], "text": ["\n".join(lines)]}
