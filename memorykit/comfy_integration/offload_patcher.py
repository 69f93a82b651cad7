"""Group offloading inside ComfyUI (Group Offload / Group Offload Loader nodes).

The node returns a clone whose class is :class:`GroupOffloadModelPatcher` (a ModelPatcher
subclass, as city96/ComfyUI-GGUF makes its patcher) carrying :class:`GroupOffloadSettings` as an
attachment. When ComfyUI loads it (``load_models_gpu`` → ``partially_load``) the plan is
applied: LoRA patches are computed on the load device as ComfyUI does, the weights go back to
the offload device, and :mod:`memorykit.offload` streams the diffusion model's blocks.
``unpatch_model``/``detach`` (unload, or another clone of the same weights being loaded) undo it
exactly. Reuse, ownership and hand-over follow :mod:`.placement`, the rule shared with Balanced
Device Map. ``loaded_size()`` reports the real footprint (resident weights + streaming buffers).
An OUTER_SAMPLE wrapper removes the offload after an error or interrupt and reports each run
to the node.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import comfy.model_management as mm
import comfy.model_patcher
import comfy.patcher_extension as pe
import comfy.utils
import torch

from .. import badge, offload, offload_plan, report, weight_parts
from . import compat, placement
from .placement import comfy_block_lists
from ..units import size_text
from .cleanup import default_disk_folder, usable_disk_folder
from .common import loaded_models, weight_dtype_options
from .compat import (
    OPTED_OUT_NOTE,
    PAGEABLE_NOTE,
    is_dynamic,
    opt_out_of_dynamic_vram,
    patcher_free_memory,
)
from .fp8_patcher import plain_fp8_layers
from .gguf_weights import is_gguf_patcher, placement_class
from .model_view import own_module

_log = logging.getLogger("MemoryKit")
GROUP_OFFLOAD_KEY = placement.GROUP_OFFLOAD_KEY
_STORE = torch.device("cpu")  # where offloaded weights wait (ComfyUI's offload device is the GPU with --highvram)


@dataclasses.dataclass(frozen=True)
class GroupOffloadSettings:
    """What a Group Offload node asks for. ``vram_budget_bytes`` 0 = auto (what ComfyUI's memory
    manager offers the weights; on a CPU onload device: stream everything). ``node_id`` receives
    the report after each run."""

    options: offload_plan.GroupOffloadOptions
    vram_budget_bytes: int = 0
    disk_folder: str = ""
    node_id: str | None = None


class _OffloadState(placement.Placement):
    """The applied offload (a :class:`placement.Placement`, keyed on settings, patch uuid, device)."""

    memory_path = "MemoryKit group offload"

    def __init__(self, handle, settings, patches_uuid, device, offload_device, backup, parts=None):
        super().__init__((settings, patches_uuid, device))
        self.handle, self.settings, self.patches_uuid = handle, settings, patches_uuid
        self.parts = parts  # weight_parts.Decomposed: GGUF weights streamed as their raw bytes
        self.device, self.offload_device, self.backup = device, offload_device, backup
        self.last_run: dict | None = None
        self.notes: list[str] = []
        self.counted_pinned = 0  # page-locked bytes added to core's pinned-memory count

    def undo(self, base_model) -> None:
        """Weights back on the offload device with their unpatched values (LoRA backups restored
        as ``ModelPatcher.unpatch_model`` does), weight functions wiped, ComfyUI's load counters reset."""
        offload.remove_group_offload(self.handle)
        if self.parts is not None:
            self.parts.restore()
        compat.count_pinned(-self.counted_pinned)
        self.counted_pinned = 0
        placement.fault_point("undo")
        for k, bk in list(self.backup.items()):
            (comfy.utils.copy_to_param if bk.inplace_update else comfy.utils.set_attr_param)(base_model, k, bk.weight)
        self.backup.clear()
        for m in base_model.modules():
            if hasattr(m, "comfy_cast_weights"):
                comfy.model_patcher.wipe_lowvram_weight(m)
            if hasattr(m, "comfy_patched_weights"):
                del m.comfy_patched_weights
        base_model.to(self.offload_device)
        base_model.device = self.offload_device
        base_model.model_loaded_weight_memory = 0
        base_model.model_offload_buffer_memory = 0
        base_model.model_lowvram = False
        base_model.lowvram_patch_counter = 0
        base_model.current_weight_patches_uuid = None


def _offload_state(base_model) -> _OffloadState | None:
    p = placement.applied(base_model)
    return p if isinstance(p, _OffloadState) else None


def group_offload_applied(base_model) -> bool:
    """True while a Group Offload is applied to ``base_model`` (a ComfyUI BaseModel)."""
    return _offload_state(base_model) is not None


class GroupOffloadModelPatcher(placement.PlacementPatcher, comfy.model_patcher.ModelPatcher):
    """ModelPatcher that loads its diffusion model group-offloaded (see the section comment); its
    load/unload/detach lifecycle is :class:`placement.PlacementPatcher`."""

    def _offload_settings(self, device_to, force_patch_weights=False):
        s = self.get_attachment(GROUP_OFFLOAD_KEY)
        if s is None or force_patch_weights or device_to is None or placement.wants_plain_load(self):
            return None
        if torch.device(device_to).type == "cpu" and s.options.offload_to == "cpu":
            return None  # computing on the CPU from CPU RAM: nothing to offload
        return s

    _placement_kind = _OffloadState

    def _placement_plan(self, device_to, force_patch_weights):
        return self._offload_settings(device_to, force_patch_weights)

    def _placement_key(self, plan, device_to) -> tuple:
        return (plan, self.patches_uuid, torch.device(device_to))

    def _placement_store(self):
        return _STORE

    def _apply_placement(self, device_to, plan, memory, force_patch_weights) -> None:
        self._apply_group_offload(torch.device(device_to), plan, memory)

    def _apply_group_offload(self, device_to, s: GroupOffloadSettings, extra_memory) -> None:
        self._finalize_weights(device_to)
        dm = self.model.diffusion_model
        for child in self.model.children():
            if child is not dm:
                child.to(device_to)
        opts, notes, budget = self._run_options(device_to, s, extra_memory)
        parts = weight_parts.decompose(dm)  # GGUF weights: their raw bytes stream, rebuilt at forward
        try:
            handle = offload.apply_group_offload(
                dm, device_to, _STORE, options=opts, budget_bytes=budget,
                block_lists=comfy_block_lists(dm),
                disk_folder=usable_disk_folder(s.disk_folder) if opts.offload_to == "disk" else default_disk_folder(),
                disk_tag=f"{type(self.model).__name__}-{str(self.patches_uuid)[:8]}")
        except BaseException:
            parts.restore()
            raise
        if parts:
            notes.append(", ".join(f"{n} {k} weights" for k, n in parts.kinds.items())
                         + " streamed as stored (quantized bytes, dequantised by their layers at forward)")
        if handle.plan.below_minimum:
            notes.append(f"budget {size_text(budget)} is below the minimum footprint: everything streams")
        st = _OffloadState(handle, s, self.patches_uuid, device_to, self.offload_device, self.backup, parts)
        st.notes += notes
        st.counted_pinned = offload.page_locked_bytes(handle)
        compat.count_pinned(st.counted_pinned)  # core's pin budget sees the ring's page-locked host memory
        placement.install(self, st)
        plan = handle.plan
        _log.info("Group Offload: %s resident %.2f GiB, streamed %.2f GiB (%s), footprint %.2f GiB",
                  type(self.model).__name__, plan.resident_bytes / 2**30, plan.streamed_bytes / 2**30,
                  opts.offload_to, plan.footprint_bytes / 2**30)
        self._mark_loaded(device_to, plan.footprint_bytes, plan.buffer_bytes)

    def _finalize_weights(self, device_to) -> None:
        """Weights final before streaming: LoRA patches computed on the load device (as
        ModelPatcher.load does) and stored back on the offload device; ComfyUI's per-forward
        weight functions moved to the load device."""
        if self.hook_patches:
            raise RuntimeError("Group Offload cannot stream weights that ComfyUI hooks change during sampling "
                               "(Create Hook LoRA / Set Model Hooks). Use LoraLoader before or after Group "
                               "Offload instead.")
        self.unpatch_hooks()
        store = _STORE
        for key in list(self.patches):  # LoRA: computed on the load device as ModelPatcher.load does
            self.patch_weight_to_device(key, device_to=device_to)
            w = comfy.utils.get_attr(self.model, key)
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
            comfy.model_patcher.move_weight_functions(m, device_to)

    def _run_options(self, device_to, s: GroupOffloadSettings, extra_memory):
        """``(options, notes, budget bytes or None)`` for applying ``s`` on ``device_to``."""
        opts, notes = s.options, []
        if device_to.type == "cpu" and opts.use_stream:
            opts = dataclasses.replace(opts, use_stream=False, record_stream=False)
            notes.append("use_stream/record_stream ignored: computing on the CPU")
        opts = dataclasses.replace(opts, exclude_kwargs=("transformer_options",))
        if compat.pinned_memory_disabled():
            opts = dataclasses.replace(opts, page_lock=False)
            if device_to.type == "cuda":
                notes.append(PAGEABLE_NOTE)
        budget = s.vram_budget_bytes or None
        if budget is None and device_to.type != "cpu":
            budget = patcher_free_memory(self, device_to) - mm.minimum_inference_memory()
            budget = max(0, int(min(budget, extra_memory)))
        return opts, notes, budget

    def _mark_loaded(self, device_to, footprint_bytes: int, buffer_bytes: int) -> None:
        """ComfyUI's load bookkeeping for the applied offload, ON_LOAD callbacks, forced hooks."""
        self.model.model_loaded_weight_memory = footprint_bytes
        self.model.model_offload_buffer_memory = buffer_bytes
        self.model.model_lowvram = True  # partly on the device; ModelPatcher.unpatch_model then wipes weight functions
        self.model.lowvram_patch_counter = 0
        self.model.device = device_to
        self.model.current_weight_patches_uuid = self.patches_uuid
        for callback in self.get_all_callbacks(pe.CallbacksMP.ON_LOAD):
            callback(self, device_to, footprint_bytes, False, False)
        self.apply_hooks(self.forced_hooks, force_apply=True)


def _standard_clone(model):
    """A clone of ``model`` managed by core's standard ModelPatcher or ComfyUI-GGUF's (opted out of
    dynamic VRAM without a second copy, see :func:`compat.opt_out_of_dynamic_vram`).

    Raises RuntimeError when another node pack's patcher class manages the model (its own load
    logic would conflict with offloading; GGUF's is composed with the offload, see
    :func:`gguf_weights.placement_class`) or when the MODEL has no diffusion model; ValueError
    when it comes through Balanced Device Map (both decide where the weights live).
    """
    if model.get_attachment(placement.DEVICE_MAP_ATTACHMENT) is not None:
        raise ValueError("Group Offload: this MODEL comes through Balanced Device Map, and both nodes decide where "
                         "the weights live. Connect Group Offload to the loader (or LoRA loader) directly, or use "
                         "Balanced Device Map alone.")
    n = opt_out_of_dynamic_vram(model, "Group Offload")
    if not (type(n) is comfy.model_patcher.ModelPatcher or isinstance(n, GroupOffloadModelPatcher)
            or is_gguf_patcher(n)):
        raise RuntimeError(f"Group Offload needs a model managed by ComfyUI's standard ModelPatcher or ComfyUI-GGUF's "
                           f"GGUFModelPatcher; this MODEL uses {type(n).__name__} (from another custom node). Load "
                           "it with a core loader or a GGUF loader.")
    if not isinstance(getattr(n.model, "diffusion_model", None), torch.nn.Module):
        raise RuntimeError("Group Offload takes a diffusion model (MODEL from a checkpoint or diffusion-model loader).")
    return n


def _options_info(s: GroupOffloadSettings) -> dict:
    o = dataclasses.asdict(s.options)
    o.pop("exclude_kwargs", None)
    o.pop("page_lock", None)  # not a node option: follows --disable-pinned-memory (the notes say so)
    return o


def _preview_budget(patcher, s: GroupOffloadSettings) -> int | None:
    if s.vram_budget_bytes:
        return s.vram_budget_bytes
    dev = torch.device(patcher.load_device)
    if dev.type == "cpu":
        return None
    return max(0, int(patcher_free_memory(patcher, dev) - mm.minimum_inference_memory()))


def prepare_group_offload(model, settings: GroupOffloadSettings):
    """The Group Offload node: returns ``(MODEL, info)``. MODEL is a clone carrying ``settings``
    (applied when ComfyUI loads it), or ``model`` itself when offloading means nothing (cpu
    target and no GPU: a warning). ``info`` is the report entry (plan for the budget known now).
    Raises RuntimeError for an unusable disk folder or model (see :func:`_standard_clone`)."""
    if settings.options.offload_to == "cpu" and torch.device(model.load_device).type == "cpu":
        reason = ("no GPU: ComfyUI computes on the CPU, so offloading to CPU RAM changes nothing "
                  "(offload_to=disk still saves RAM)")
        _log.warning("Group Offload: %s; the model is passed through unchanged.", reason)
        return model, {"status": "passthrough", "reason": reason, "options": _options_info(settings)}
    if settings.options.offload_to == "disk":
        usable_disk_folder(settings.disk_folder)
    n = _standard_clone(model)
    plain_fp8_layers(n, "Group Offload")  # core's QuantizedTensor layers → plain float8 tensors
    if not isinstance(n, GroupOffloadModelPatcher):  # same object layout; how ComfyUI-GGUF makes its patcher from a clone
        n.__class__ = (GroupOffloadModelPatcher if type(n) is comfy.model_patcher.ModelPatcher
                       else placement_class(GroupOffloadModelPatcher, type(n)))  # over GGUFModelPatcher
    n.set_attachments(GROUP_OFFLOAD_KEY, settings)
    n.remove_wrappers_with_key(pe.WrappersMP.OUTER_SAMPLE, GROUP_OFFLOAD_KEY)
    n.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, GROUP_OFFLOAD_KEY, _group_offload_outer_sample)
    dm = own_module(n)  # the preview sizes this MODEL's modules, not another loaded clone's patches
    budget = _preview_budget(n, settings)
    opts = settings.options
    if torch.device(n.load_device).type == "cpu":
        opts = dataclasses.replace(opts, use_stream=False, record_stream=False)
    preview = offload_plan.plan_offload(dm, opts, budget, comfy_block_lists(dm))
    info = {"status": "planned (applied when sampling loads the model)", "options": _options_info(settings),
            "disk_folder": settings.disk_folder or default_disk_folder(), "plan": preview.as_dict(),
            "model_bytes": n.model_size()}
    info["notes"] = [OPTED_OUT_NOTE] if is_dynamic(model) else []
    if compat.pinned_memory_disabled() and torch.device(n.load_device).type == "cuda":
        dataclasses.replace(opts, page_lock=False).validate()  # diffusers' stream path would pin: refused
        info["notes"].append(PAGEABLE_NOTE)
    return n, info


def load_group_offload_model(unet_name: str, weight_dtype: str, settings: GroupOffloadSettings):
    """The Group Offload Loader node: load ``models/diffusion_models/<unet_name>`` into CPU RAM
    (never onto the GPU; options as UNETLoader's ``weight_dtype``) and return
    :func:`prepare_group_offload`'s ``(MODEL, info)``."""
    import inspect

    import comfy.sd
    import folder_paths
    path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
    model_options = weight_dtype_options(weight_dtype)
    kwargs = {}
    if "disable_dynamic" in inspect.signature(comfy.sd.load_diffusion_model).parameters:
        kwargs["disable_dynamic"] = True
    model = comfy.sd.load_diffusion_model(path, model_options=model_options, **kwargs)
    if model is None:
        raise RuntimeError(f"Group Offload Loader: ComfyUI does not recognise the model in {path} (unet_name): "
                           "pick a diffusion model file; a full checkpoint goes through Load Checkpoint, then "
                           "Group Offload")
    return prepare_group_offload(model, settings)


def group_offload_state_info(base_model) -> dict | None:
    """Report entry of the offload applied to ``base_model`` now (figures + last run), or None."""
    st = _offload_state(base_model)
    if st is None:
        return None
    return {"status": "applied", "options": _options_info(st.settings),
            "disk_folder": st.settings.disk_folder or default_disk_folder(),
            "figures": offload.offload_figures(st.handle), "run": st.last_run,
            "notes": list(st.notes)}


def group_offload_ui(label: str, info: dict) -> dict:
    """Node UI output: a Memory Report dict plus ``group_offload`` (and its text)."""
    from ..offload_report import offload_summary
    rep = report.build_report(label, loaded_models())
    rep["group_offload"] = info
    return {"memorykit_report": [badge.with_badge(rep)],
            "text": ["\n".join([report.format_report(rep)] + offload_summary(info))]}


def _steps(args) -> int | None:
    """Sampling steps of an OUTER_SAMPLE call (``noise, latent_image, sampler, sigmas, ...``):
    one fewer than the sigmas; None when the call is not shaped so."""
    sigmas = args[3] if len(args) > 3 else None
    n = getattr(sigmas, "shape", None)
    return int(n[-1]) - 1 if n is not None and len(n) >= 1 and n[-1] > 1 else None


def _group_offload_outer_sample(executor, *args, **kwargs):
    """OUTER_SAMPLE wrapper: time the run, undo the offload after an error or interrupt (so the
    next run starts from the unmodified model), report the run to the node."""
    patcher = executor.class_obj.model_patcher
    dev = torch.device(patcher.load_device)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    st0 = _offload_state(patcher.model)
    f0 = st0.handle.forwards if st0 is not None else 0
    c0 = st0.handle.ring.copied_bytes if st0 is not None and st0.handle.ring is not None else 0
    t0 = time.perf_counter()
    try:
        out = executor(*args, **kwargs)
    except BaseException:
        try:
            patcher.detach(unpatch_all=True)
        except Exception:  # keep the original error
            _log.exception("Group Offload: undoing the offload after an error failed")
        raise
    st = _offload_state(patcher.model)
    if st is not None:
        forwards = st.handle.forwards - (f0 if st is st0 else 0)
        if st.handle.ring is not None:  # measured: bytes the event ring copied during this run
            moved = st.handle.ring.copied_bytes - (c0 if st is st0 else 0)
        else:
            moved = forwards * (st.handle.plan.streamed_bytes if st.device != st.offload_device or st.handle.disk_dir
                                else 0)
        st.last_run = {"forwards": forwards, "steps": _steps(args), "seconds": time.perf_counter() - t0,
                       "bytes_moved": moved,
                       "peak_vram_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None}
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
