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


# =============================================================================================
# Balanced Device Map (issue 7): a device map applied when ComfyUI loads the model, removed
# when ComfyUI unloads/detaches it.
#
# Why a ModelPatcher subclass and not CallbacksMP.ON_LOAD: ON_LOAD runs at the end of
# ModelPatcher.load, after ComfyUI has already moved the weights to the load device (or set up
# its lowvram casting) — for a model split across GPUs that is the out-of-memory we avoid.
# Overriding load/partially_load/partially_unload/unpatch_model/detach on a per-model subclass
# (the mechanism city96/ComfyUI-GGUF uses) lets ComfyUI patch the weights (LoRA) on the offload
# device and then hands placement to accelerate. The subclass is made over the input's own
# class, for the clone only: nothing of ComfyUI is replaced globally.
# =============================================================================================
import uuid  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402

from . import device_map as _dm  # noqa: E402
from .device_dispatch import dispatch_device_map as _dispatch  # noqa: E402

DEVICE_MAP_ATTACHMENT = "memorykit_device_map"
# ComfyUI passes transformer_options (patches, wrappers, callbacks) down every forward; its
# content is not input data and must reach the blocks as it is (not copied, not moved).
_DEVICE_MAP_SKIP_KEYS = ["transformer_options"]


@dataclass(frozen=True, eq=False)
class DeviceMapPlan:
    """What a Balanced Device Map clone carries (as the attachment ``memorykit_device_map``).

    ``device_map``: accelerate map of ``model.diffusion_model`` (module order);
    ``main_device``: where its inputs go; ``offload_folder``: parent folder for ``disk`` entries.
    """

    device_map: dict
    main_device: object
    offload_folder: str


@dataclass
class _AppliedDeviceMap:
    handle: object          # device_dispatch.DispatchedModel
    plan: DeviceMapPlan
    owner_token: str        # _mk_device_map_owner of the ModelPatcher that applied it
    patches_uuid: object


_APPLIED_ATTR = "memorykit_device_map_applied"


def _applied(base_model) -> _AppliedDeviceMap | None:
    return base_model.__dict__.get(_APPLIED_ATTR)


def _remove_applied_device_map(base_model, offload_device) -> bool:
    """Undo a device map applied to ``base_model.diffusion_model`` (by any patcher); True if one was."""
    st = base_model.__dict__.pop(_APPLIED_ATTR, None)
    if st is None:
        return False
    st.handle.remove()
    base_model.model_loaded_weight_memory = 0
    base_model.device = offload_device
    return True


def _map_device_of(device) -> object:
    d = torch.device(device) if device is not None else torch.device("cpu")
    return (d.index or 0) if d.type == "cuda" else d.type


class _DeviceMapPatcherMixin:
    """ModelPatcher behaviour for a clone carrying a :class:`DeviceMapPlan` (see section notes)."""

    def _device_map_plan(self) -> DeviceMapPlan | None:
        return self.get_attachment(DEVICE_MAP_ATTACHMENT)

    def _owns_device_map(self) -> bool:
        st = _applied(self.model)
        return st is not None and st.owner_token == self.__dict__.get("_mk_device_map_owner")

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
        plan = self._device_map_plan()
        if plan is None:
            return super().load(device_to, lowvram_model_memory, force_patch_weights, full_load)
        _remove_applied_device_map(self.model, self.offload_device)
        # ComfyUI's own full load onto the offload device: applies weight patches (LoRA), no
        # lowvram casting, weights stay in RAM; accelerate then places them.
        super().load(self.offload_device, 0, force_patch_weights, True)
        handle = _dispatch(self.model.diffusion_model, plan.device_map, plan.offload_folder, plan.main_device,
                           skip_keys=_DEVICE_MAP_SKIP_KEYS)
        token = self.__dict__.setdefault("_mk_device_map_owner", uuid.uuid4().hex)
        self.model.__dict__[_APPLIED_ATTR] = _AppliedDeviceMap(handle, plan, token, self.patches_uuid)
        on_load_device = _dm.bytes_per_device(self.model.diffusion_model, plan.device_map).get(
            _dm.device_name(_map_device_of(device_to)), 0)
        self.model.device = device_to
        self.model.model_lowvram = False
        self.model.model_loaded_weight_memory = on_load_device
        self.model.model_offload_buffer_memory = 0

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        plan = self._device_map_plan()
        if plan is None:
            return super().partially_load(device_to, extra_memory, force_patch_weights)
        st = _applied(self.model)
        if (st is not None and self._owns_device_map() and st.plan is plan and not force_patch_weights
                and st.patches_uuid == self.patches_uuid):
            return 0  # already placed by this patcher
        with self.use_ejected(skip_and_inject_on_exit_only=True):
            # Start from ComfyUI's unloaded state whatever was there (the plain model, another map).
            self.unpatch_model(self.offload_device, unpatch_weights=True)
            self.patch_model(load_weights=False)
            try:
                self.load(device_to, force_patch_weights=force_patch_weights, full_load=True)
            except Exception:
                self.detach()
                raise
        return self.model.model_loaded_weight_memory

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
        if _applied(self.model) is not None:
            return 0  # a device map is removed whole (detach), never in part
        return super().partially_unload(device_to, memory_to_free, force_patch_weights)

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        if unpatch_weights:
            _remove_applied_device_map(self.model, self.offload_device)
        return super().unpatch_model(device_to, unpatch_weights)

    def detach(self, unpatch_all=True):
        if self._owns_device_map():
            # "reset device map": weights back where they were, then ComfyUI's full unpatch so
            # its bookkeeping (patched weights, loaded size) matches.
            _remove_applied_device_map(self.model, self.offload_device)
            unpatch_all = True
        return super().detach(unpatch_all)


_DEVICE_MAP_CLASSES: dict = {}


def _device_map_patcher_class(base: type) -> type:
    if issubclass(base, _DeviceMapPatcherMixin):
        return base
    cls = _DEVICE_MAP_CLASSES.get(base)
    if cls is None:
        cls = type(f"DeviceMap{base.__name__}", (_DeviceMapPatcherMixin, base), {"__module__": __name__})
        _DEVICE_MAP_CLASSES[base] = cls
    return cls


def _clone_without_dynamic_vram(model):
    """``model.clone()``; on ComfyUI with dynamic VRAM (0.38+, ``ModelPatcherDynamic``) a clone that
    opts out of it, or RuntimeError when that is not possible."""
    if "Dynamic" not in type(model).__name__:
        return model.clone()
    try:
        n = model.clone(disable_dynamic=True)
    except TypeError:
        n = None
    if n is None or "Dynamic" in type(n).__name__:
        raise RuntimeError("this ComfyUI manages the model with dynamic VRAM (ModelPatcherDynamic), which cannot "
                           "carry a device map; start ComfyUI with --disable-dynamic-vram")
    return n


def _is_comfy_unet(diffusion_model) -> bool:
    return hasattr(diffusion_model, "input_blocks") and hasattr(diffusion_model, "output_blocks")


def device_map_model(model, strategy: str, max_memory: str, offload_folder: str = "",
                     custom_device_map: str = "") -> tuple[object, dict, str]:
    """Plan a device map for ``model``'s diffusion model; return ``(clone, report, text)``.

    The clone carries the plan; it is applied when ComfyUI loads the clone for sampling and
    removed when ComfyUI unloads or detaches it. ``report`` is the Memory Report dict plus
    ``device_map`` (the ``hf_device_map`` the model will get: module → GPU index / "cpu" /
    "disk"), ``strategy``, ``max_memory`` (budgets in bytes after balancing, keyed by device
    name; None for a custom map), ``no_split_module_classes``, ``bytes_per_device``,
    ``main_device``, ``offload_folder``, ``missing_devices``. Raises ValueError for bad input
    (see :mod:`memorykit.device_map`).
    """
    import folder_paths
    from .report import build_report, format_report

    diffusion_model = model.get_model_object("diffusion_model")
    no_split = _dm.block_classes(diffusion_model)
    if custom_device_map and custom_device_map.strip():
        device_map = _dm.validate_device_map(diffusion_model, _dm.parse_custom_device_map(custom_device_map))
        budgets, source = None, "custom device map"
    else:
        mm = _dm.parse_max_memory(max_memory)
        device_map, budgets = _dm.plan_device_map(diffusion_model, mm.budgets, strategy, no_split, mm.allow_disk)
        source = f"{strategy}, max_memory {mm.describe()}"
    split = _dm.split_blocks(device_map, _dm.block_names(diffusion_model, no_split))
    main = _dm.main_device(device_map)
    gpus = sorted({d for d in device_map.values() if d not in _dm.OFFLOAD_DEVICES}, key=str)
    if _is_comfy_unet(diffusion_model) and len(gpus) > 1:
        raise ValueError("ComfyUI's UNet (SD1.x/SDXL) joins skip connections of its blocks in its own forward, so "
                         f"its blocks cannot run on different GPUs ({', '.join(map(_dm.device_name, gpus))}); use "
                         "one GPU plus cpu/disk, e.g. cuda:0=6GiB, cpu=32GiB")
    folder = (offload_folder or "").strip() or folder_paths.get_temp_directory()
    plan = DeviceMapPlan(device_map, main, folder)
    clone = _clone_without_dynamic_vram(model)
    clone.__class__ = _device_map_patcher_class(type(clone))
    clone.set_attachments(DEVICE_MAP_ATTACHMENT, plan)

    n_cuda = torch.cuda.device_count()
    missing = [_dm.device_name(d) for d in gpus if isinstance(d, int) and d >= n_cuda]
    per_device = _dm.bytes_per_device(diffusion_model, device_map)
    rep = build_report("Balanced Device Map", loaded_models())
    rep.update({
        "device_map": dict(device_map),
        "strategy": None if budgets is None else strategy,
        "max_memory": None if budgets is None else {_dm.device_name(d): int(b) for d, b in budgets.items()},
        "no_split_module_classes": no_split,
        "split_blocks": split,
        "bytes_per_device": per_device,
        "main_device": _dm.device_name(main),
        "offload_folder": folder if "disk" in device_map.values() else None,
        "missing_devices": missing,
    })
    lines = [f"[Balanced Device Map] {source}",
             "per device: " + ", ".join(f"{d} {_dm.format_bytes(b)}" for d, b in per_device.items()),
             f"inputs on {_dm.device_name(main)}; blocks kept whole: {', '.join(no_split) or '-'}"]
    lines += _dm.summarize_device_map(device_map, diffusion_model)
    if missing:
        lines.append(f"NOTE: {', '.join(missing)} not on this machine: preview only, sampling will fail")
    text = "\n".join(lines + ["", format_report(rep)])
    return clone, rep, text
# --------------------------------------------------------------------------------------------
# Free Memory: unload models and empty caches through ComfyUI's own unloading
# --------------------------------------------------------------------------------------------

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
# Sharded checkpoints (Sharded Checkpoint Loader, Sharded Text Encoder Loader, Save Sharded).
# The technique (index validation, mmap loading, shard writing) is memorykit/sharded*.py; this
# section only finds ComfyUI's model folders and hands state dicts to ComfyUI's own loaders
# (comfy.sd.load_diffusion_model_state_dict converts diffusers names and detects the model,
# exactly as for one file) and takes a MODEL's state dict the way ComfyUI's ModelSave does.
# =============================================================================================
import json as _json  # noqa: E402
import os as _os  # noqa: E402
from pathlib import Path as _Path  # noqa: E402

from . import report as _report, sharded as _sharded, sharded_save as _sharded_save  # noqa: E402

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
    return {"memorykit_report": [rep], "text": ["\n".join(lines)]}
# FP8 Layerwise Cast (issue 4)
#
# The float8 tensors belong to the clone: each cast layer becomes a *new* ComfyUI cast-op
# module (same class as the original, plus the mixin below) holding the float8 weight, its
# scale and a copy of the bias; the clone carries these modules as object patches. ComfyUI
# swaps object patches in at ``patch_model`` (before ``load`` moves weights, so only float8
# bytes ever reach the device, and any later ON_LOAD hook such as group offloading sees and
# streams float8 tensors) and restores the originals at ``unpatch_model``. The shared
# nn.Module is never written. LoRA patches (before or after this node) reach the new
# modules through ComfyUI's ``convert_weight``/``set_weight`` protocol (as core's scaled-fp8
# ops): at load the LoRA delta is added to the original high-precision weight in float32 and
# the sum is stored in float8 once.
# =============================================================================================
import uuid as _uuid
from typing import ClassVar

import torch as _torch

from . import fp8 as _fp8

FP8_ATTACHMENT = "memorykit_fp8"
# Attributes ComfyUI sets on a loaded module; a new layer starts without them.
_COMFY_TRANSIENT = {"comfy_cast_weights", "prev_comfy_cast_weights", "weight_function", "bias_function",
                    "comfy_patched_weights"}


class _Fp8CastOp:
    """Mixin for a ComfyUI cast op (``comfy.ops.*.Linear/ConvNd``) whose weight is float8.

    ``comfy.ops.cast_bias_weight`` moves/casts the weight to the input's device and dtype (and
    applies ComfyUI's lowvram LoRA ``weight_function``s, which work in the storage domain),
    then the scale is applied. ``convert_weight``/``set_weight`` follow the contract of core's
    scaled-fp8 ops (``comfy.ops.scaled_fp8_ops``) so ``ModelPatcher`` can patch LoRA into it.
    """

    comfy_cast_weights = True
    # Class-level empty lists, as in comfy.ops.CastWeightBiasOp: ComfyUI assigns per-instance lists.
    weight_function: ClassVar[list] = []
    bias_function: ClassVar[list] = []

    def forward(self, *args, **kwargs):
        import comfy.ops
        if hasattr(comfy.ops, "run_every_op"):
            comfy.ops.run_every_op()  # honours ComfyUI's interrupt between ops
        return self.forward_comfy_cast_weights(*args, **kwargs)

    def forward_comfy_cast_weights(self, input, *args, **kwargs):
        import comfy.ops
        if self._mk_fp8_matmul and isinstance(self, _torch.nn.Linear) and _fp8.fp8_matmul_supported(input, self.weight):
            # Weight stays float8 (moved to the device; lowvram LoRA functions return float8 too).
            weight, bias, offload_stream = comfy.ops.cast_bias_weight(self, input, dtype=self.weight.dtype,
                                                                      bias_dtype=input.dtype, offloadable=True)
            out = _fp8.fp8_linear(input, weight, self.scale_weight, bias)
            comfy.ops.uncast_bias_weight(self, weight, bias, offload_stream)
            return out
        weight, bias, offload_stream = comfy.ops.cast_bias_weight(self, input, offloadable=True)
        if isinstance(self, _torch.nn.Linear):
            out = _fp8.scaled_linear(input, weight, self.scale_weight, bias)
        else:
            out = self._conv_forward(input, _fp8.scale_weight(weight, self.scale_weight), bias)
        comfy.ops.uncast_bias_weight(self, weight, bias, offload_stream)
        return out

    def convert_weight(self, weight, inplace=False, **kwargs):
        """Storage-domain weight → the real weight a LoRA delta is added to.

        ``inplace=True`` is ModelPatcher's one-off patch at load (``patch_weight_to_device``):
        return the original high-precision weight, so LoRA + float8 rounds once. Otherwise
        (core's per-forward lowvram patch, weight already on the compute device) dequantise
        the given values: no extra host→device transfer per step.
        """
        original = self._mk_original[0]  # out of the tree while this layer is in it: holds the unpatched weight
        with _torch.no_grad():
            if inplace and original is not None:  # a copy: the caller patches it in place
                return original.weight.detach().to(device=weight.device, dtype=weight.dtype, copy=True)
            dtype = weight.dtype if weight.dtype in _fp8.HIGH_PRECISION else _torch.float32
            return _fp8.dequantize_weight(weight.detach(), self.scale_weight, dtype)

    def set_weight(self, weight, inplace_update=False, seed=None, return_weight=False, **kwargs):
        """Real weight (float32, LoRA applied) → float8 with this layer's scale."""
        with _torch.no_grad():
            q = _fp8.quantize_with_scale(weight.detach(), self.weight.dtype, self.scale_weight)
        if return_weight:
            return q
        if inplace_update:
            self.weight.data.copy_(q)
        else:
            self.weight = _torch.nn.Parameter(q, requires_grad=False)


_FP8_CLASSES: dict[type, type] = {}


def _fp8_class(cls: type) -> type:
    if cls not in _FP8_CLASSES:
        _FP8_CLASSES[cls] = type(f"MemoryKitFp8{cls.__name__}", (_Fp8CastOp, cls), {"__module__": __name__})
    return _FP8_CLASSES[cls]


def _fp8_layer(orig: _torch.nn.Module, q: _torch.Tensor, scale, bias, fp8_matmul: bool = False) -> _torch.nn.Module:
    """New cast-op module like ``orig`` (same class + :class:`_Fp8CastOp`, same config) holding
    float8 ``q``, ``scale`` (non-persistent buffer ``scale_weight``) and ``bias`` (a copy).
    Keeps a reference to ``orig`` (read by ``convert_weight``, never written)."""
    cls = _fp8_class(type(orig))
    new = cls.__new__(cls)
    _torch.nn.Module.__init__(new)
    fresh = set(new.__dict__)
    for k, v in orig.__dict__.items():
        if k not in fresh and k not in _COMFY_TRANSIENT:
            new.__dict__[k] = v
    new.training = orig.training
    new.weight = _torch.nn.Parameter(q, requires_grad=False)
    if bias is None:
        new.register_parameter("bias", None)
    else:
        new.bias = _torch.nn.Parameter(bias, requires_grad=False)
    new.register_buffer("scale_weight", scale, persistent=False)
    new._mk_original = (orig,)  # a tuple: not registered as a submodule
    new._mk_fp8_matmul = fp8_matmul
    return new


def _unpatched(patcher, module, key: str, param: str, in_tree: bool):
    """``module.<param>`` without any LoRA another loaded clone patched into the tree
    (ModelPatcher keeps the original in its shared ``backup``)."""
    bk = patcher.backup.get(f"{key}.{param}") if in_tree else None
    return bk.weight if bk is not None else getattr(module, param)


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def model_compute_dtype(model) -> _torch.dtype:
    """The dtype ComfyUI computes this MODEL in: its manual-cast dtype if set, else its weight dtype."""
    mc = model.get_model_object("manual_cast_dtype") if hasattr(model.model, "manual_cast_dtype") else None
    return mc if mc is not None else model.model_dtype()


def fp8_layerwise_cast(model, storage_dtype: str = "float8_e4m3fn", compute_dtype: str = "auto",
                       scaling: str = "per-tensor", skip_preset: str = "auto",
                       extra_skip_patterns: str = "", fp8_matmul: bool = False) -> tuple[object, dict]:
    """Clone of ``model`` whose diffusion-model layers are stored in float8 while loaded.

    ``storage_dtype``: ``float8_e4m3fn`` / ``float8_e5m2``; ``compute_dtype``: ``auto`` (what
    ComfyUI already computes this model in) / ``bfloat16`` / ``float16`` / ``float32``;
    ``scaling``: ``none`` / ``per-tensor`` / ``per-output-channel``; ``skip_preset`` and
    ``extra_skip_patterns``: see :func:`memorykit.fp8.default_skip_patterns` and
    :func:`memorykit.fp8.parse_patterns`; ``fp8_matmul``: Linear layers multiply on float8
    tensor cores (:func:`memorykit.fp8.fp8_linear`; needs float8_e4m3fn). Quantises every
    cast layer now (on the load device when it is a GPU) and keeps the results on the
    offload device with the clone (host RAM: about half the bf16 size of the cast layers).

    Returns ``(clone, info)``; ``info``: family, dtypes, scaling, patterns, ``weight_bytes_before``
    / ``weight_bytes_after`` (the whole model's weights, bytes), ``cast_layers``, ``cast_params``,
    ``kept_layers`` ([{name, reason}]). Raises ValueError for a bad option or pattern, a device
    that cannot use the dtypes, a MODEL already cast by this node, or nothing to cast.
    """
    import comfy.model_management as cmm
    import comfy.utils

    if model.get_attachment(FP8_ATTACHMENT) is not None:
        raise ValueError("This MODEL already went through FP8 Layerwise Cast; use one FP8 Layerwise Cast "
                         "node per model (connect the loader's MODEL instead).")
    if storage_dtype not in _fp8.STORAGE_DTYPES:
        raise ValueError(f"storage_dtype must be one of {list(_fp8.STORAGE_DTYPES)}, got {storage_dtype!r}")
    if scaling not in _fp8.SCALINGS:
        raise ValueError(f"scaling must be one of {list(_fp8.SCALINGS)}, got {scaling!r}")
    storage = _fp8.STORAGE_DTYPES[storage_dtype]
    current = model_compute_dtype(model)
    if compute_dtype == "auto":
        compute = current if current in _fp8.HIGH_PRECISION else _torch.float32
    elif compute_dtype in _fp8.COMPUTE_DTYPES:
        compute = _fp8.COMPUTE_DTYPES[compute_dtype]
    else:
        raise ValueError(f"compute_dtype must be auto or one of {list(_fp8.COMPUTE_DTYPES)}, got {compute_dtype!r}")
    device = model.load_device
    if not cmm.supports_cast(device, storage):
        raise ValueError(f"ComfyUI cannot use {storage_dtype} weights on {device} (e.g. Apple MPS and DirectML "
                         "have no float8); leave this model unquantised on this device.")
    _fp8.check_dtypes(device, storage, compute)
    if fp8_matmul:
        if storage != _torch.float8_e4m3fn:
            raise ValueError("fp8_matmul needs storage_dtype float8_e4m3fn (float8 GEMMs take e4m3 weights).")
        _fp8.check_fp8_matmul(device)

    n = model.clone()
    dm = n.model.diffusion_model
    family = _fp8.detect_family(dm)
    patterns = _fp8.default_skip_patterns(family, skip_preset) + _fp8.parse_patterns(extra_skip_patterns)
    prefix = "diffusion_model."

    def original(name, m):
        key = prefix + name
        if key in n.object_patches or key in n.object_patches_backup:
            return n.get_model_object(key)
        return m

    plan = _fp8.plan_layers(dm, patterns, get_module=original)
    if not plan.cast:
        reasons = sorted(set(plan.kept.values()))[:5]
        raise ValueError(f"FP8 Layerwise Cast: no layer of this {family} model left to cast (kept for: {reasons}). "
                         "Relax the skip patterns, or load the model unquantised (weight_dtype default).")

    size_before = n.model_size()
    work = device if getattr(device, "type", "cpu") == "cuda" else None
    pbar = comfy.utils.ProgressBar(len(plan.cast))
    saved = cast_params = 0
    for name in plan.cast:
        cmm.throw_exception_if_processing_interrupted()  # Cancel stops here; the clone is dropped
        key = prefix + name
        in_tree = key not in n.object_patches and key not in n.object_patches_backup
        orig = original(name, None) if not in_tree else comfy.utils.get_attr(n.model, key)
        w = _unpatched(n, orig, key, "weight", in_tree)
        q, s = _fp8.quantize_weight(w, storage, scaling, work_device=work, out_device=n.offload_device)
        b = _unpatched(n, orig, key, "bias", in_tree)
        b = None if b is None else b.detach().to(n.offload_device, copy=True)
        n.add_object_patch(key, _fp8_layer(orig, q, s, b, fp8_matmul))
        saved += _fp8.param_bytes(w) - _fp8.param_bytes(q)
        cast_params += w.numel()
        pbar.update(1)

    if compute != current:
        n.set_model_compute_dtype(compute)  # core's own switch: inputs and kept layers cast to it
    n.patches_uuid = _uuid.uuid4()  # weights differ from the input's: make ComfyUI reload, not reuse
    n.size = size_before - saved    # what load_models_gpu budgets for this model
    info = {
        "family": family, "storage_dtype": storage_dtype, "compute_dtype": _dtype_name(compute),
        "scaling": scaling, "skip_preset": skip_preset, "fp8_matmul": bool(fp8_matmul),
        "skip_patterns": [p if isinstance(p, str) else p[0] for p in patterns],
        "weight_bytes_before": int(size_before), "weight_bytes_after": int(n.size),
        "cast_layers": len(plan.cast), "cast_params": int(cast_params),
        "kept_layers": [{"name": k, "reason": v} for k, v in plan.kept.items()],
    }
    n.set_attachments(FP8_ATTACHMENT, {k: v for k, v in info.items() if k != "kept_layers"} | {"cast": list(plan.cast)})
    return n, info


def format_fp8_info(info: dict, max_kept: int = 12) -> str:
    """One-screen summary of :func:`fp8_layerwise_cast`'s info (sizes in GiB)."""
    from .memory import gib
    before, after = info["weight_bytes_before"], info["weight_bytes_after"]
    matmul = " (float8 matmul)" if info.get("fp8_matmul") else ""
    lines = [(f"FP8 Layerwise Cast ({info['family']}): {info['storage_dtype']} storage, "
              f"{info['compute_dtype']} compute{matmul}, scaling {info['scaling']}"),
             (f"weights {gib(before)} GiB -> {gib(after)} GiB ({after / max(1, before):.2f}x); "
              f"{info['cast_layers']} layers cast, {len(info['kept_layers'])} kept:")]
    for k in info["kept_layers"][:max_kept]:
        lines.append(f"  {k['name']}: {k['reason']}")
    if len(info["kept_layers"]) > max_kept:
        lines.append(f"  ... and {len(info['kept_layers']) - max_kept} more")
    return "\n".join(lines)
# Group offloading (Group Offload / Group Offload Loader nodes)
#
# The node returns a clone whose class is GroupOffloadModelPatcher (a ModelPatcher subclass, as
# city96/ComfyUI-GGUF does) carrying GroupOffloadSettings as an attachment. When ComfyUI loads
# it (load_models_gpu → partially_load) the plan is applied: LoRA patches are computed on the
# load device as ComfyUI does, the weights go back to the offload device, and
# memorykit.offload streams the diffusion model's blocks. unpatch_model/detach (unload, or
# another clone of the same weights being loaded) undo it exactly. loaded_size() reports the
# real footprint (resident weights + streaming buffers). An OUTER_SAMPLE wrapper removes the
# offload after an error or interrupt and reports each run to the node.
# =============================================================================================
import dataclasses as _dc
import logging as _logging
import time as _time
import weakref as _weakref

import torch as _torch

import comfy.model_patcher as _mp
import comfy.patcher_extension as _pe
import comfy.utils as _cu

from . import offload as _offload
from . import offload_plan as _plan
from . import report as _report

_log = _logging.getLogger("MemoryKit")
GROUP_OFFLOAD_KEY = "memorykit_group_offload"
_STATE_ATTR = "_memorykit_group_offload_state"
_STORE = _torch.device("cpu")  # where offloaded weights wait (ComfyUI's offload device is the GPU with --highvram)


@_dc.dataclass(frozen=True)
class GroupOffloadSettings:
    """What a Group Offload node asks for. ``vram_budget_bytes`` 0 = auto (what ComfyUI's memory
    manager offers the weights; on a CPU onload device: stream everything). ``node_id`` receives
    the report after each run."""

    options: _plan.GroupOffloadOptions
    vram_budget_bytes: int = 0
    disk_folder: str = ""
    node_id: str | None = None


class _OffloadState:
    """Lives on the BaseModel while the offload is applied (shared by all clones of it)."""

    def __init__(self, handle, settings, patches_uuid, device, offload_device, backup):
        self.handle, self.settings, self.patches_uuid = handle, settings, patches_uuid
        self.device, self.offload_device, self.backup = device, offload_device, backup
        self.finalizer = None
        self.last_run: dict | None = None
        self.keep_on_detach: int | None = None  # id of the patcher whose next detach(False) may keep the offload
        self.notes: list[str] = []


def default_disk_folder() -> str:
    """ComfyUI's temp folder (emptied by ComfyUI at start-up), used when the node's folder is empty."""
    import os

    import folder_paths
    path = folder_paths.get_temp_directory()
    os.makedirs(path, exist_ok=True)  # ComfyUI deletes it at start-up and exit and recreates it on demand
    return path


def comfy_block_lists(diffusion_model: _torch.nn.Module) -> _plan.BlockLists:
    """Blocks of a ComfyUI diffusion model: diffusers' rule, except that the elements of a
    ``TimestepEmbedSequential`` (SD/SDXL UNets) are the blocks, because ComfyUI's
    ``forward_timestep_embed`` calls those layers directly and never the container's forward."""
    from comfy.ldm.modules.diffusionmodules.openaimodel import TimestepEmbedSequential
    out = []
    for name, lists in _plan.default_block_lists(diffusion_model):
        items = []
        for qn, b in lists:
            if isinstance(b, TimestepEmbedSequential):
                items += [(f"{qn}.{j}", layer) for j, layer in enumerate(b)]
            else:
                items.append((qn, b))
        out.append((name, items))
    return out


def _remove_offload_state(base_model) -> bool:
    """Undo an applied offload on ``base_model``: weights back on the offload device with their
    unpatched values (LoRA backups restored as ``ModelPatcher.unpatch_model`` does), weight
    functions wiped, ComfyUI's load counters reset. Returns False when none was applied."""
    st = base_model.__dict__.pop(_STATE_ATTR, None)
    if st is None:
        return False
    if st.finalizer is not None:
        st.finalizer.detach()
    _offload.remove_group_offload(st.handle)
    for k, bk in list(st.backup.items()):
        (_cu.copy_to_param if bk.inplace_update else _cu.set_attr_param)(base_model, k, bk.weight)
    st.backup.clear()
    for m in base_model.modules():
        if hasattr(m, "comfy_cast_weights"):
            _mp.wipe_lowvram_weight(m)
        if hasattr(m, "comfy_patched_weights"):
            del m.comfy_patched_weights
    base_model.to(st.offload_device)
    base_model.device = st.offload_device
    base_model.model_loaded_weight_memory = 0
    base_model.model_offload_buffer_memory = 0
    base_model.model_lowvram = False
    base_model.lowvram_patch_counter = 0
    base_model.current_weight_patches_uuid = None
    return True


def _finalize_offload(base_model, state) -> None:
    """The patcher that applied ``state`` was garbage-collected while loaded: undo it, unless
    another clone has re-applied since."""
    if base_model.__dict__.get(_STATE_ATTR) is state:
        _remove_offload_state(base_model)


def _has_offload(patcher) -> bool:
    return _STATE_ATTR in patcher.model.__dict__


class GroupOffloadModelPatcher(_mp.ModelPatcher):
    """ModelPatcher that loads its diffusion model group-offloaded (see the section comment)."""

    def _offload_settings(self, device_to, force_patch_weights=False):
        s = self.get_attachment(GROUP_OFFLOAD_KEY)
        if s is None or force_patch_weights or device_to is None:
            return None
        if _torch.device(device_to).type == "cpu" and s.options.offload_to == "cpu":
            return None  # computing on the CPU from CPU RAM: nothing to offload
        return s

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        s = self._offload_settings(device_to, force_patch_weights)
        if s is None:
            if _has_offload(self):
                self.unpatch_model(self.offload_device, unpatch_weights=True)
            return super().partially_load(device_to, extra_memory, force_patch_weights)
        st = self.model.__dict__.get(_STATE_ATTR)
        if st is not None:
            st.keep_on_detach = None
            if st.settings is s and st.patches_uuid == self.patches_uuid and st.device == _torch.device(device_to):
                return 0
        with self.use_ejected(skip_and_inject_on_exit_only=True):
            before = self.model.model_loaded_weight_memory
            self.unpatch_model(_STORE, unpatch_weights=True)
            self.patch_model(load_weights=False)
            try:
                self._apply_group_offload(_torch.device(device_to), s, extra_memory)
            except BaseException:
                self.detach()
                raise
        return max(0, self.model.model_loaded_weight_memory - before)

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
        s = self._offload_settings(device_to, force_patch_weights)
        if s is None:
            return super().load(device_to, lowvram_model_memory, force_patch_weights, full_load)
        with self.use_ejected():
            self.unpatch_model(_STORE, unpatch_weights=True)
            self._apply_group_offload(_torch.device(device_to), s, lowvram_model_memory or 1e32)

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
        if _has_offload(self):
            return 0  # ComfyUI then unloads the model completely (LoadedModel.model_unload)
        return super().partially_unload(device_to, memory_to_free, force_patch_weights)

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        if _remove_offload_state(self.model):
            unpatch_weights = True
        return super().unpatch_model(device_to, unpatch_weights)

    def is_clone(self, other):
        # load_models_gpu asks the model it is about to load whether each loaded model shares its
        # weights, then detaches those with unpatch_all=False. When the model about to load is a
        # GroupOffloadModelPatcher, its partially_load reuses the offload or replaces it, so that
        # detach may keep it (no re-application between runs). Any other detach undoes it fully.
        same = super().is_clone(other)
        st = self.model.__dict__.get(_STATE_ATTR)
        if same and st is not None:
            st.keep_on_detach = id(other)
        return same

    def detach(self, unpatch_all=True):
        st = self.model.__dict__.get(_STATE_ATTR)
        if st is not None:
            keep = not unpatch_all and st.keep_on_detach == id(self)
            st.keep_on_detach = None
            unpatch_all = not keep
        return super().detach(unpatch_all)

    def _apply_group_offload(self, device_to, s: GroupOffloadSettings, extra_memory) -> None:
        if self.hook_patches:
            raise RuntimeError("Group Offload cannot stream weights that ComfyUI hooks change during sampling "
                               "(Create Hook LoRA / Set Model Hooks). Use LoraLoader before or after Group "
                               "Offload instead.")
        self.unpatch_hooks()
        store = _STORE
        for key in list(self.patches):  # LoRA: computed on the load device as ModelPatcher.load does
            self.patch_weight_to_device(key, device_to=device_to)
            w = _cu.get_attr(self.model, key)
            if w.device != store:
                w.data = w.data.to(store)
        for m in self.model.modules():  # weights are final: ModelPatcher.load must not patch them again
            if hasattr(m, "comfy_cast_weights") or next(m.parameters(recurse=False), None) is not None:
                m.comfy_patched_weights = True
        for n, m in self.model.named_modules():
            if not hasattr(m, "comfy_cast_weights"):
                continue
            if self.force_cast_weights:
                m.prev_comfy_cast_weights = m.comfy_cast_weights
                m.comfy_cast_weights = True
            for kind in ("weight", "bias"):
                wrappers = self.weight_wrapper_patches.get(f"{n}.{kind}")
                if wrappers:
                    setattr(m, f"{kind}_function", list(getattr(m, f"{kind}_function", None) or []) + wrappers)
            _mp.move_weight_functions(m, device_to)
        dm = self.model.diffusion_model
        for child in self.model.children():
            if child is not dm:
                child.to(device_to)
        opts, notes = s.options, []
        if device_to.type == "cpu" and opts.use_stream:
            opts = _dc.replace(opts, use_stream=False, record_stream=False)
            notes.append("use_stream/record_stream ignored: computing on the CPU")
        opts = _dc.replace(opts, exclude_kwargs=("transformer_options",))
        budget = s.vram_budget_bytes or None
        if budget is None and device_to.type != "cpu":
            budget = mm.get_free_memory(device_to) - mm.minimum_inference_memory()
            budget = max(0, int(min(budget, extra_memory)))
        handle = _offload.apply_group_offload(
            dm, device_to, store, options=opts, budget_bytes=budget,
            block_lists=comfy_block_lists(dm), disk_folder=s.disk_folder or default_disk_folder(),
            disk_tag=f"{type(self.model).__name__}-{str(self.patches_uuid)[:8]}")
        if handle.plan.below_minimum:
            notes.append(f"budget {budget / 2**30:.2f} GiB is below the minimum footprint: everything streams")
        st = _OffloadState(handle, s, self.patches_uuid, device_to, self.offload_device, self.backup)
        st.notes += notes
        self.model.__dict__[_STATE_ATTR] = st
        st.finalizer = _weakref.finalize(self, _finalize_offload, self.model, st)
        st.finalizer.atexit = False  # at exit only the disk files matter; offload.py deletes those
        plan = handle.plan
        self.model.model_loaded_weight_memory = plan.footprint_bytes
        self.model.model_offload_buffer_memory = plan.buffer_bytes
        self.model.model_lowvram = True  # partly on the device; ModelPatcher.unpatch_model then wipes weight functions
        self.model.lowvram_patch_counter = 0
        self.model.device = device_to
        self.model.current_weight_patches_uuid = self.patches_uuid
        _log.info("Group Offload: %s resident %.2f GiB, streamed %.2f GiB (%s), footprint %.2f GiB",
                  type(self.model).__name__, plan.resident_bytes / 2**30, plan.streamed_bytes / 2**30,
                  opts.offload_to, plan.footprint_bytes / 2**30)
        for callback in self.get_all_callbacks(_pe.CallbacksMP.ON_LOAD):
            callback(self, device_to, plan.footprint_bytes, False, False)
        self.apply_hooks(self.forced_hooks, force_apply=True)


def _standard_clone(model):
    """A clone of ``model`` managed by ComfyUI's standard (non-dynamic) ModelPatcher.

    Newer ComfyUI (0.38+, "dynamic VRAM") makes ``ModelPatcherDynamic`` the default; it is
    detected by its ``is_dynamic()`` method and opted out with ``clone(disable_dynamic=True)``.
    Raises RuntimeError when that is impossible or when another node pack's patcher class
    manages the model (its own load logic would conflict with offloading).
    """
    is_dynamic = getattr(model, "is_dynamic", None)
    if callable(is_dynamic) and is_dynamic():
        try:
            n = model.clone(disable_dynamic=True)
        except TypeError:
            n = None
        if n is None or (callable(getattr(n, "is_dynamic", None)) and n.is_dynamic()):
            raise RuntimeError("Group Offload: this ComfyUI manages the model with dynamic VRAM and cannot give "
                               "a standard copy of it; start ComfyUI with --disable-dynamic-vram.")
    else:
        n = model.clone()
    if type(n) not in (_mp.ModelPatcher, GroupOffloadModelPatcher):
        raise RuntimeError(f"Group Offload needs a model managed by ComfyUI's standard ModelPatcher; this MODEL "
                           f"uses {type(n).__name__} (from another custom node). Load it with a core loader.")
    if not isinstance(getattr(n.model, "diffusion_model", None), _torch.nn.Module):
        raise RuntimeError("Group Offload takes a diffusion model (MODEL from a checkpoint or diffusion-model loader).")
    return n


def _options_info(s: GroupOffloadSettings) -> dict:
    o = _dc.asdict(s.options)
    o.pop("exclude_kwargs", None)
    return o


def _preview_budget(patcher, s: GroupOffloadSettings) -> int | None:
    if s.vram_budget_bytes:
        return s.vram_budget_bytes
    dev = _torch.device(patcher.load_device)
    if dev.type == "cpu":
        return None
    return max(0, int(mm.get_free_memory(dev) - mm.minimum_inference_memory()))


def prepare_group_offload(model, settings: GroupOffloadSettings):
    """The Group Offload node: returns ``(MODEL, info)``. MODEL is a clone carrying ``settings``
    (applied when ComfyUI loads it), or ``model`` itself when offloading means nothing (cpu
    target and no GPU: a warning). ``info`` is the report entry (plan for the budget known now).
    Raises RuntimeError for an unusable disk folder or model (see :func:`_standard_clone`)."""
    if settings.options.offload_to == "cpu" and _torch.device(model.load_device).type == "cpu":
        reason = ("no GPU: ComfyUI computes on the CPU, so offloading to CPU RAM changes nothing "
                  "(offload_to=disk still saves RAM)")
        _log.warning("Group Offload: %s; the model is passed through unchanged.", reason)
        return model, {"status": "passthrough", "reason": reason, "options": _options_info(settings)}
    if settings.options.offload_to == "disk":
        _offload.check_disk_folder(settings.disk_folder or default_disk_folder())
    n = _standard_clone(model)
    n.__class__ = GroupOffloadModelPatcher  # same object layout; how ComfyUI-GGUF makes its patcher from a clone
    n.set_attachments(GROUP_OFFLOAD_KEY, settings)
    n.remove_wrappers_with_key(_pe.WrappersMP.OUTER_SAMPLE, GROUP_OFFLOAD_KEY)
    n.add_wrapper_with_key(_pe.WrappersMP.OUTER_SAMPLE, GROUP_OFFLOAD_KEY, _group_offload_outer_sample)
    dm = n.model.diffusion_model
    budget = _preview_budget(n, settings)
    opts = settings.options
    if _torch.device(n.load_device).type == "cpu":
        opts = _dc.replace(opts, use_stream=False, record_stream=False)
    preview = _plan.plan_offload(dm, opts, budget, comfy_block_lists(dm))
    return n, {"status": "planned (applied when sampling loads the model)", "options": _options_info(settings),
               "disk_folder": settings.disk_folder or default_disk_folder(), "plan": preview.as_dict(),
               "model_bytes": n.model_size()}


def load_group_offload_model(unet_name: str, weight_dtype: str, settings: GroupOffloadSettings):
    """The Group Offload Loader node: load ``models/diffusion_models/<unet_name>`` into CPU RAM
    (never onto the GPU; options as UNETLoader's ``weight_dtype``) and return
    :func:`prepare_group_offload`'s ``(MODEL, info)``."""
    import inspect

    import comfy.sd
    import folder_paths
    path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
    model_options = {"fp8_e4m3fn": {"dtype": _torch.float8_e4m3fn},
                     "fp8_e4m3fn_fast": {"dtype": _torch.float8_e4m3fn, "fp8_optimizations": True},
                     "fp8_e5m2": {"dtype": _torch.float8_e5m2}}.get(weight_dtype, {})
    kwargs = {}
    if "disable_dynamic" in inspect.signature(comfy.sd.load_diffusion_model).parameters:
        kwargs["disable_dynamic"] = True
    model = comfy.sd.load_diffusion_model(path, model_options=model_options, **kwargs)
    if model is None:
        raise RuntimeError(f"Group Offload Loader: ComfyUI does not recognise the model in {path}")
    return prepare_group_offload(model, settings)


def group_offload_state_info(base_model) -> dict | None:
    """Report entry of the offload applied to ``base_model`` now (figures + last run), or None."""
    st = base_model.__dict__.get(_STATE_ATTR)
    if st is None:
        return None
    return {"status": "applied", "options": _options_info(st.settings),
            "disk_folder": st.settings.disk_folder or default_disk_folder(),
            "figures": _offload.offload_figures(st.handle), "run": st.last_run,
            "notes": list(st.notes)}


def group_offload_ui(label: str, info: dict) -> dict:
    """Node UI output: a Memory Report dict plus ``group_offload`` (and its text)."""
    from .offload_report import offload_summary
    rep = _report.build_report(label, loaded_models())
    rep["group_offload"] = info
    return {"memorykit_report": [rep], "text": ["\n".join([_report.format_report(rep)] + offload_summary(info))]}


def _group_offload_outer_sample(executor, *args, **kwargs):
    """OUTER_SAMPLE wrapper: time the run, undo the offload after an error or interrupt (so the
    next run starts from the unmodified model), report the run to the node."""
    patcher = executor.class_obj.model_patcher
    dev = _torch.device(patcher.load_device)
    if dev.type == "cuda":
        _torch.cuda.reset_peak_memory_stats(dev)
    st0 = patcher.model.__dict__.get(_STATE_ATTR)
    f0 = st0.handle.forwards if st0 is not None else 0
    t0 = _time.perf_counter()
    try:
        out = executor(*args, **kwargs)
    except BaseException:
        try:
            patcher.detach(unpatch_all=True)
        except Exception:  # keep the original error
            _log.exception("Group Offload: undoing the offload after an error failed")
        raise
    st = patcher.model.__dict__.get(_STATE_ATTR)
    if st is not None:
        forwards = st.handle.forwards - (f0 if st is st0 else 0)
        st.last_run = {"forwards": forwards, "seconds": _time.perf_counter() - t0,
                       "bytes_moved": forwards * (st.handle.plan.streamed_bytes
                                                  if st.device != st.offload_device or st.handle.disk_dir else 0),
                       "peak_vram_bytes": _torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None}
        node_id = st.settings.node_id
        if node_id is not None:
            try:
                from server import PromptServer
                srv = PromptServer.instance
                ui = group_offload_ui("Group Offload (last run)", group_offload_state_info(patcher.model))
                srv.send_sync("executed", {"node": node_id, "display_node": node_id, "output": ui,
                                           "prompt_id": getattr(srv, "last_prompt_id", None)}, srv.client_id)
            except Exception:  # no server (in-process use) or a closed client
                _log.debug("Group Offload: run report not sent", exc_info=True)
    return out
