"""Balanced Device Map inside ComfyUI: a device map applied when ComfyUI loads the model,
removed when ComfyUI unloads or detaches it.

Why a ModelPatcher subclass and not ``CallbacksMP.ON_LOAD``: ON_LOAD runs at the end of
``ModelPatcher.load``, after ComfyUI has already moved the weights to the load device (or set up
its lowvram casting) — for a model split across GPUs that is the out-of-memory we avoid.
Overriding load/partially_load/partially_unload/unpatch_model/detach on a per-model subclass
(the mechanism city96/ComfyUI-GGUF uses) lets ComfyUI patch the weights (LoRA) on the offload
device and then hands placement to accelerate. The subclass is made over the input's own
class, for the clone only: nothing of ComfyUI is replaced globally. Reuse between queues,
ownership and hand-over follow :mod:`.placement`, the rule shared with Group Offload.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import device_map as dmap, weight_parts
from ..device_dispatch import dispatch_device_map
from . import compat, placement
from .cleanup import default_disk_folder, usable_disk_folder
from .common import loaded_models
from .compat import OPTED_OUT_NOTE, is_dynamic, opt_out_of_dynamic_vram
from .fp8_patcher import plain_fp8_layers
from .model_view import own_module

DEVICE_MAP_ATTACHMENT = placement.DEVICE_MAP_ATTACHMENT
# ComfyUI passes transformer_options (patches, wrappers, callbacks) down every forward; its
# content is not input data and must reach the blocks as it is (not copied, not moved).
_DEVICE_MAP_SKIP_KEYS = ["transformer_options"]


@dataclass(frozen=True, eq=False)
class DeviceMapPlan:
    """What a Balanced Device Map clone carries (as the attachment ``memorykit_device_map``).

    ``device_map``: accelerate map of ``model.diffusion_model`` (module order);
    ``main_device``: where its inputs go; ``offload_folder``: parent folder for ``disk`` entries;
    ``block_classes``: the blocks' class names, preloaded whole when offloaded.
    """

    device_map: dict
    main_device: object
    offload_folder: str
    block_classes: tuple = ()


class _AppliedDeviceMap(placement.Placement):
    """The dispatched map (a :class:`placement.Placement`, keyed on plan, patch uuid, device)."""

    memory_path = "MemoryKit device map"

    def __init__(self, handle, plan: DeviceMapPlan, patches_uuid, device, offload_device, parts=None):
        super().__init__((plan, patches_uuid, device))
        self.handle = handle    # device_dispatch.DispatchedModel
        self.parts = parts      # weight_parts.Decomposed: GGUF weights placed as their raw bytes
        self.plan = plan
        self.offload_device = offload_device

    def undo(self, base_model) -> None:
        """Hooks removed, every weight back where it was (``DispatchedModel.remove``), counters reset."""
        self.handle.remove()
        if self.parts is not None:
            self.parts.restore()
        placement.fault_point("undo")
        base_model.model_loaded_weight_memory = 0
        base_model.device = self.offload_device


def _applied(base_model) -> _AppliedDeviceMap | None:
    p = placement.applied(base_model)
    return p if isinstance(p, _AppliedDeviceMap) else None


def device_map_applied(base_model) -> bool:
    """True while a Balanced Device Map is applied to ``base_model`` (a ComfyUI BaseModel)."""
    return _applied(base_model) is not None


def _device(device):
    return torch.device(device) if device is not None else None


def _map_device_of(device) -> object:
    d = torch.device(device) if device is not None else torch.device("cpu")
    return (d.index or 0) if d.type == "cuda" else d.type


class _DeviceMapPatcherMixin(placement.PlacementPatcher):
    """ModelPatcher behaviour for a clone carrying a :class:`DeviceMapPlan`: the placement
    lifecycle of :class:`placement.PlacementPatcher`, applying the device map."""

    def _device_map_plan(self) -> DeviceMapPlan | None:
        if placement.wants_plain_load(self):
            return None  # saving: ComfyUI's own load, real weights (placement.plain_load)
        return self.get_attachment(DEVICE_MAP_ATTACHMENT)

    _placement_kind = _AppliedDeviceMap

    def _placement_plan(self, device_to, force_patch_weights):
        if force_patch_weights:
            return None  # core loads to read the merged weights (0.3.75's Save Checkpoint, Extract LoRA)
        return self._device_map_plan()

    # Core's readers of the weights (savers, model merging, LoRA extraction, a ControlNet
    # "difference"): with the map applied, the entries placed elsewhere are ``meta`` placeholders.
    def _load_plainly(self) -> None:
        """Load this patcher the plain way when a placement is applied (its weights real, patched)."""
        if placement.applied(self.model) is not None:
            import comfy.model_management as mm
            with placement.plain_load(self):
                mm.load_models_gpu([self])

    def model_state_dict(self, filter_prefix=None):
        self._load_plainly()
        return super().model_state_dict(filter_prefix)

    def get_key_patches(self, filter_prefix=None):
        placement.release(self.model)  # core hands out the unpatched weights: the real ones, back in place
        return super().get_key_patches(filter_prefix)

    def _placement_key(self, plan, device_to) -> tuple:
        return (plan, self.patches_uuid, _device(device_to))

    def _apply_placement(self, device_to, plan, memory, force_patch_weights) -> None:
        # ComfyUI's own full load onto the offload device: applies weight patches (LoRA), no
        # lowvram casting, weights stay in RAM; accelerate then places them.
        self._core_load(self.offload_device, 0, force_patch_weights, True)
        parts = weight_parts.decompose(self.model.diffusion_model)  # GGUF: raw bytes placed, rebuilt at forward
        try:
            handle = dispatch_device_map(self.model.diffusion_model, plan.device_map, plan.offload_folder,
                                         plan.main_device, skip_keys=_DEVICE_MAP_SKIP_KEYS,
                                         preload_module_classes=list(plan.block_classes), is_oom=compat.is_oom)
        except BaseException:
            parts.restore()
            raise
        placement.install(self, _AppliedDeviceMap(handle, plan, self.patches_uuid, _device(device_to),
                                                  self.offload_device, parts))
        on_load_device = dmap.bytes_per_device(self.model.diffusion_model, plan.device_map).get(
            dmap.device_name(_map_device_of(device_to)), 0)
        self.model.device = device_to
        self.model.model_lowvram = False
        self.model.model_loaded_weight_memory = on_load_device
        self.model.model_offload_buffer_memory = 0


def _state_dict_for_saving(self, *args, **kwargs):
    """0.33+'s saver entry (``ModelPatcher.state_dict_for_saving``), reading real weights."""
    self._load_plainly()
    return self._memorykit_base.state_dict_for_saving(self, *args, **kwargs)


_DEVICE_MAP_CLASSES: dict = {}


def _device_map_patcher_class(base: type) -> type:
    if issubclass(base, _DeviceMapPatcherMixin):
        return base
    cls = _DEVICE_MAP_CLASSES.get(base)
    if cls is None:
        extra = {"__module__": __name__, "_memorykit_base": base}
        if compat.saves_through_patcher(base):  # 0.33+
            extra["state_dict_for_saving"] = _state_dict_for_saving
        cls = type(f"DeviceMap{base.__name__}", (_DeviceMapPatcherMixin, base), extra)
        _DEVICE_MAP_CLASSES[base] = cls
    return cls


def _is_comfy_unet(diffusion_model) -> bool:
    return hasattr(diffusion_model, "input_blocks") and hasattr(diffusion_model, "output_blocks")


def device_map_model(model, strategy: str, max_memory: str, offload_folder: str = "",
                     custom_device_map: str = "") -> tuple[object, dict, str]:
    """Plan a device map for ``model``'s diffusion model; return ``(clone, report, text)``.

    The clone carries the plan; it is applied when ComfyUI loads the clone for sampling and
    removed when ComfyUI unloads or detaches it. ``report`` is the Memory Report dict plus
    ``device_map`` (the ``hf_device_map`` the model will get: module → GPU index / "cpu" /
    "disk"), ``strategy``, ``max_memory`` (budgets in bytes after balancing, keyed by device
    name; None for a custom map), ``no_split_module_classes``, ``blocks`` (the blocks kept whole:
    those Group Offload streams), ``bytes_per_device``,
    ``main_device``, ``offload_folder``, ``missing_devices``. Raises ValueError for bad input
    (see :mod:`memorykit.device_map`), RuntimeError naming ``offload_folder`` when the map puts
    weights on disk and that folder is missing or not writable (as Group Offload's
    ``disk_folder``; free space is checked when the map is applied, before anything is written).
    """
    from ..report import build_report, format_report

    if model.get_attachment(placement.GROUP_OFFLOAD_KEY) is not None:
        node = placement.placed_by(model)  # Group Offload, or Memory Plan that applied it
        how = "" if node == "Group Offload" else " (its pick streams the weights from RAM or disk)"
        raise ValueError(f"Balanced Device Map: this MODEL comes through {node}{how}, and both nodes decide where "
                         "the weights live. Connect Balanced Device Map to the loader (or LoRA loader) directly, "
                         f"or use {node} alone.")
    diffusion_model = own_module(model)  # its own modules, not another loaded clone's patches
    blocks = placement.comfy_block_names(diffusion_model)  # the blocks Group Offload streams
    no_split = dmap.block_classes(diffusion_model, blocks)
    if custom_device_map and custom_device_map.strip():
        device_map = dmap.validate_device_map(diffusion_model, dmap.parse_custom_device_map(custom_device_map))
        budgets, source = None, "custom device map"
    else:
        mm = dmap.parse_max_memory(max_memory)
        device_map, budgets = dmap.plan_device_map(diffusion_model, mm.budgets, strategy, no_split, mm.allow_disk,
                                                   blocks)
        source = f"{strategy}, max_memory {mm.describe()}"
    split = dmap.split_blocks(device_map, blocks)
    main = dmap.main_device(device_map)
    gpus = sorted({d for d in device_map.values() if d not in dmap.OFFLOAD_DEVICES}, key=str)
    if _is_comfy_unet(diffusion_model) and len(gpus) > 1:
        raise ValueError("ComfyUI's UNet (SD1.x/SDXL) joins skip connections of its blocks in its own forward, so "
                         f"its blocks cannot run on different GPUs ({', '.join(map(dmap.device_name, gpus))}); use "
                         "one GPU plus cpu/disk, e.g. cuda:0=6GiB, cpu=32GiB")
    folder = (offload_folder or "").strip()
    per_device = dmap.bytes_per_device(diffusion_model, device_map)
    if "disk" in per_device:
        folder = usable_disk_folder(folder, what="offload_folder")
    folder = folder or default_disk_folder()
    # preloaded whole when offloaded: the blocks, whose own forward runs (see comfy_block_lists)
    plan = DeviceMapPlan(device_map, main, folder, tuple(no_split))
    clone = opt_out_of_dynamic_vram(model, "Balanced Device Map")
    plain_fp8_layers(clone, "Balanced Device Map")  # core's QuantizedTensor layers → plain float8 tensors
    clone.__class__ = _device_map_patcher_class(type(clone))
    clone.set_attachments(DEVICE_MAP_ATTACHMENT, plan)

    n_cuda = torch.cuda.device_count()
    missing = [dmap.device_name(d) for d in gpus if isinstance(d, int) and d >= n_cuda]
    rep = build_report("Balanced Device Map", loaded_models())
    rep.update({
        "device_map": dict(device_map),
        "strategy": None if budgets is None else strategy,
        "max_memory": None if budgets is None else {dmap.device_name(d): int(b) for d, b in budgets.items()},
        "no_split_module_classes": no_split,
        "blocks": blocks,
        "split_blocks": split,
        "bytes_per_device": per_device,
        "main_device": dmap.device_name(main),
        "offload_folder": folder if "disk" in device_map.values() else None,
        "missing_devices": missing,
    })
    lines = [f"[Balanced Device Map] {source}",
             "per device: " + ", ".join(f"{d} {dmap.format_bytes(b)}" for d, b in per_device.items()),
             f"inputs on {dmap.device_name(main)}; blocks kept whole: {', '.join(no_split) or '-'}"]
    lines += dmap.summarize_device_map(device_map, diffusion_model)
    if missing:
        lines.append(f"NOTE: {', '.join(missing)} not on this machine: preview only, sampling will fail")
    if is_dynamic(model):
        rep["notes"] = [OPTED_OUT_NOTE]
        lines.append(OPTED_OUT_NOTE)
    text = "\n".join(lines + ["", format_report(rep)])
    return clone, rep, text
