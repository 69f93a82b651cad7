"""The techniques on a text encoder (ComfyUI's ``comfy.sd.CLIP``, which holds its own
ModelPatcher ``clip.patcher`` around ``clip.cond_stage_model``).

Public API (stable; the nodes and Memory Plan call it). Each function takes a CLIP, never
changes it, and returns ``(new CLIP, info)``; the new CLIP is ``clip.clone()`` with its own
patcher carrying the technique, applied when ComfyUI loads the text encoder to encode a prompt:

- :func:`text_encoder_group_offload` (``GroupOffloadSettings`` as for a MODEL): Group Offload's
  patcher and event ring, one offload per encoder of the CLIP (``clip_l``, ``t5xxl``, ...);
- :func:`text_encoder_fp8` (storage dtype, scaling, skip preset ``auto`` / ``none``, extra
  patterns, LoRA mode): FP8 Layerwise Cast's float8 layers as object patches;
- :func:`text_encoder_device` (``"cpu"`` / ``"cuda:N"``): the whole text encoder computes on
  that device (core's ``load_device``, as CLIPLoader's ``device`` option), the diffusion model
  stays where it is.

A text encoder runs once per prompt (once per 77-token chunk for CLIP-L/G): the streaming cost
in ``info`` is per prompt, not per sampling step. The techniques combine in the order placement,
fp8, offload (e.g. fp8 then Group Offload streams the float8 bytes).
"""
from __future__ import annotations

import torch

from .. import fp8, offload, offload_plan, weight_parts
from . import compat, fp8_core, fp8_patcher, placement
from .cleanup import default_disk_folder, usable_disk_folder
from .compat import OPTED_OUT_NOTE, is_dynamic, opt_out_of_dynamic_vram
from .gguf_weights import placement_class
from .model_view import own_module
from .offload_patcher import (
    _STORE,
    GROUP_OFFLOAD_KEY,
    GroupOffloadModelPatcher,
    GroupOffloadSettings,
    _OffloadState,
)
from .text_encoder_formats import (
    gguf_class,
    gguf_clip_description,
    stored_notes,
    streamable_weights,
)

TE_DEVICE_KEY = "memorykit_text_encoder_device"
TE_SKIP_PRESETS = ("auto", "none")


def _check_clip(clip, node: str) -> None:
    if not hasattr(clip, "patcher") or not hasattr(clip, "cond_stage_model") or not hasattr(clip, "clone"):
        raise ValueError(f"{node}: 'clip' must be a CLIP (from Load CLIP, DualCLIPLoader, Load Checkpoint ...), "
                         f"got {type(clip).__name__}")


def encoder_roots(cond_stage_model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The encoders of a CLIP, ``[(name, module), ...]`` in module order: the outermost
    ``comfy.sd1_clip.SDClipModel`` modules (``clip_l``, ``t5xxl``, ``qwen25_7b``, ...), whose
    forward core calls once per prompt (chunk) and which hold every streamed block."""
    from comfy.sd1_clip import SDClipModel
    out: list[tuple[str, torch.nn.Module]] = []
    for name, m in cond_stage_model.named_modules():
        if isinstance(m, SDClipModel) and not any(name.startswith(r + ".") or r == "" for r, _ in out):
            out.append((name, m))
    return out


def encoder_block_lists(encoder: torch.nn.Module) -> offload_plan.BlockLists:
    """The blocks of one encoder: the elements of every ``ModuleList``/``Sequential`` that lies
    in no other such list (CLIP's ``encoder.layers``, T5's ``encoder.block``, Llama's / Qwen's /
    Gemma's / Mistral's ``model.layers``, a vision tower's ``blocks``), in module order; names
    relative to ``encoder``. Text encoders nest their layer list a few modules deep, below the
    depth diffusers' block rule looks at."""
    lists, inside = [], []
    for name, m in encoder.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) and len(m) > 0 and name:
            blocks = [(f"{name}.{i}", b) for i, b in enumerate(m) if offload_plan.module_tensors(b)]
            inside.append(name)
            if blocks:
                lists.append((name, blocks))
    return lists


# -- Group Offload ---------------------------------------------------------------------------------

class _TextEncoderOffloadState(_OffloadState):
    """The offload of every encoder of a CLIP: ``handle`` is the first, ``more`` the rest."""

    def __init__(self, handles, settings, patches_uuid, device, offload_device, backup, parts=None):
        super().__init__(handles[0], settings, patches_uuid, device, offload_device, backup, parts)
        self.more = list(handles[1:])

    @property
    def handles(self) -> list:
        return [self.handle] + self.more

    def undo(self, base_model) -> None:
        for h in self.more:
            offload.remove_group_offload(h)
        self.more = []
        super().undo(base_model)  # GGUF weights recomposed (parts) after every ring is removed


class TextEncoderOffloadModelPatcher(GroupOffloadModelPatcher):
    """Group Offload's patcher for a CLIP's patcher: each encoder (:func:`encoder_roots`) is
    offloaded with its own handle; everything outside them goes to the load device."""

    def _apply_group_offload(self, device_to, s: GroupOffloadSettings, extra_memory) -> None:
        self._finalize_weights(device_to)
        roots = encoder_roots(self.model)
        root_ids = {id(t) for _, r in roots for t in offload_plan.module_tensors(r)}
        for t in offload_plan.module_tensors(self.model):
            if id(t) not in root_ids:
                t.data = t.data.to(device_to)
        opts, notes, budget = self._run_options(device_to, s, extra_memory)
        parts = weight_parts.decompose(self.model)  # GGUF weights: their raw bytes stream, rebuilt at forward
        handles = []
        try:
            for name, root in roots:
                h = offload.apply_group_offload(
                    root, device_to, _STORE, options=opts, budget_bytes=budget,
                    block_lists=encoder_block_lists(root),
                    disk_folder=usable_disk_folder(s.disk_folder) if opts.offload_to == "disk" else default_disk_folder(),
                    disk_tag=f"te-{name}-{str(self.patches_uuid)[:8]}")
                handles.append(h)
                if h.plan.below_minimum:
                    notes.append(f"{name}: budget below the minimum footprint, everything streams")
                if budget is not None:
                    budget = max(0, budget - h.plan.footprint_bytes)
        except BaseException:
            for h in handles:
                offload.remove_group_offload(h)
            parts.restore()
            raise
        st = _TextEncoderOffloadState(handles, s, self.patches_uuid, device_to, self.offload_device, self.backup, parts)
        st.notes += notes + stored_notes(self.model, parts)
        st.counted_pinned = sum(offload.page_locked_bytes(h) for h in handles)
        compat.count_pinned(st.counted_pinned)  # core's pin budget sees the ring's page-locked host memory
        placement.install(self, st)
        self._mark_loaded(device_to, sum(h.plan.footprint_bytes for h in handles),
                          sum(h.plan.buffer_bytes for h in handles))


def _te_offload_options(settings: GroupOffloadSettings) -> GroupOffloadSettings:
    import dataclasses
    return dataclasses.replace(settings, options=dataclasses.replace(settings.options, keep_remainder=True))


def text_encoder_group_offload(clip, settings: GroupOffloadSettings):
    """Group Offload for a CLIP: ``(new CLIP, info)``. ``info["plan"]`` per encoder (bytes
    resident / streamed, the latter read once per prompt), ``streamed_bytes_per_prompt``;
    ``status`` ``passthrough`` (the CLIP itself returned, with ``reason``) when streaming means
    nothing (offload_to=cpu and the text encoder computes on the CPU). The input embeddings and
    everything outside the blocks stay resident, leaf_level too. Raises ValueError for a CLIP
    whose weights cannot be streamed or that already carries a placement, RuntimeError for an
    unusable disk folder."""
    node = "Group Offload (Text Encoder)"
    _check_clip(clip, node)
    settings = _te_offload_options(settings)
    opts = settings.options
    info = {"options": {k: v for k, v in vars(opts).items() if k not in ("exclude_kwargs", "keep_remainder", "page_lock")}}
    if opts.offload_to == "cpu" and torch.device(clip.patcher.load_device).type == "cpu":
        info.update(status="passthrough", reason="the text encoder computes on the CPU, so offloading to CPU RAM "
                    "changes nothing (offload_to=disk still saves RAM)")
        return clip, info
    if opts.offload_to == "disk":
        usable_disk_folder(settings.disk_folder)
    roots = encoder_roots(clip.cond_stage_model)
    if not roots:
        raise ValueError(f"{node}: no encoder MemoryKit can stream in this {type(clip.cond_stage_model).__name__}")
    n = clip.clone()
    p = opt_out_of_dynamic_vram(clip.patcher, node)
    gguf_base = gguf_class(p)
    if (not _is_plain_patcher(p) and gguf_base is None
            and not isinstance(p, (_TextEncoderDeviceMixin, TextEncoderOffloadModelPatcher))):
        raise ValueError(f"{node}: this CLIP is managed by {type(p).__name__} (from another custom node); load it "
                         "with a core loader (Load CLIP, DualCLIPLoader, Load Checkpoint) or a GGUF CLIP loader.")
    fp8_patcher.plain_fp8_layers(p, node)
    streamable_weights(p, node, settings.options)
    # keeps load_device (Text Encoder Device before this node); over ComfyUI-GGUF's patcher, its behaviour below ours
    p.__class__ = (TextEncoderOffloadModelPatcher if gguf_base is None
                   else placement_class(TextEncoderOffloadModelPatcher, gguf_base))
    p.set_attachments(GROUP_OFFLOAD_KEY, settings)
    n.patcher = p
    onload = torch.device(p.load_device)
    if onload.type == "cpu":
        opts = opts.__class__(**{**vars(opts), "use_stream": False, "record_stream": False})
    plans = {}
    for name, root in roots:
        view = own_module(p, name) if name else root  # with this CLIP's own object patches (FP8's float8 layers)
        pl = offload_plan.plan_offload(view, opts, settings.vram_budget_bytes or None, encoder_block_lists(view))
        plans[name] = pl.as_dict()
    per_prompt = sum(pl["streamed_bytes"] for pl in plans.values())
    info.update(status="planned (applied when a prompt is encoded)", plan=plans, streamed_bytes_per_prompt=per_prompt,
                disk_folder=settings.disk_folder or default_disk_folder(), model_bytes=int(p.model_size()),
                load_device=str(onload))
    if is_dynamic(clip.patcher):
        info["notes"] = [OPTED_OUT_NOTE]
    return n, info


def _is_plain_patcher(p) -> bool:
    import comfy.model_patcher
    return type(p) is comfy.model_patcher.ModelPatcher


# -- FP8 Layerwise Cast ----------------------------------------------------------------------------

def text_encoder_fp8(clip, storage_dtype: str = "float8_e4m3fn", scaling: str = "per-tensor",
                     skip_preset: str = "auto", extra_skip_patterns: str = "", lora_mode: str = "unmerged"):
    """FP8 Layerwise Cast for a CLIP: ``(new CLIP, info)``. Every Linear layer of the encoders
    is stored in float8 and computed in the dtype it receives, except (``skip_preset`` ``auto``)
    the embeddings, norms and the final projection (``text_projection``, ``lm_head``);
    ``none`` casts every Linear. ``info`` as :func:`fp8_patcher.fp8_layerwise_cast`'s
    (``weight_bytes_before``/``after``, ``cast_layers``, ``kept_layers``). MemoryKit's cast
    layers are used on every core (a text encoder computes some layers in float32). Raises
    ValueError for bad options, a CLIP already cast, or nothing to cast because of the skip patterns;
    a CLIP whose layers are all already stored quantized (fp8_scaled, GGUF) passes through as it came,
    ``info["passed_through"]`` saying why."""
    import comfy.model_management as cmm
    node = "FP8 Layerwise Cast (Text Encoder)"
    _check_clip(clip, node)
    if clip.patcher.get_attachment(fp8_patcher.FP8_ATTACHMENT) is not None:
        raise ValueError(f"{node}: this CLIP already went through FP8 Layerwise Cast; use one per text encoder.")
    if storage_dtype not in fp8.STORAGE_DTYPES:
        raise ValueError(f"storage_dtype must be one of {list(fp8.STORAGE_DTYPES)}, got {storage_dtype!r}")
    if scaling not in fp8.SCALINGS:
        raise ValueError(f"scaling must be one of {list(fp8.SCALINGS)}, got {scaling!r}")
    if skip_preset not in TE_SKIP_PRESETS:
        raise ValueError(f"skip_preset must be one of {list(TE_SKIP_PRESETS)}, got {skip_preset!r}")
    if lora_mode not in fp8_core.LORA_MODES:
        raise ValueError(f"lora_mode must be one of {list(fp8_core.LORA_MODES)}, got {lora_mode!r}")
    gguf = gguf_clip_description(clip)
    if gguf is not None:
        return clip, fp8_patcher.passed_through_info(
            clip.patcher, "text_encoder", f"'clip' comes from a GGUF file ({gguf}): its layers are already stored "
            "quantized and dequantised by the GGUF loader's own layers; casting them to float8 would quantize twice", [])
    storage = fp8.STORAGE_DTYPES[storage_dtype]
    device = clip.patcher.load_device
    if not cmm.supports_cast(device, storage):
        raise ValueError(f"ComfyUI cannot use {storage_dtype} weights on {device}; leave this text encoder unquantised.")
    placement.release(clip.patcher.model)
    n = clip.clone()
    p = n.patcher
    patterns = fp8.default_skip_patterns("text_encoder", skip_preset) + fp8.parse_patterns(extra_skip_patterns)

    def original(name, m):
        if name in p.object_patches or name in p.object_patches_backup:
            return p.get_model_object(name)
        return m

    plan = fp8.plan_layers(p.model, patterns, get_module=original)
    stored = plan.as_stored
    if not plan.cast and stored:
        return clip, fp8_patcher.passed_through_info(
            clip.patcher, "text_encoder", f"'clip' is already stored quantized (an fp8_scaled file): its {len(stored)} "
            "quantized layers are left as stored (never quantized twice)",
            [{"name": k, "reason": v} for k, v in plan.kept.items()])
    if not plan.cast:
        reasons = sorted(set(plan.kept.values()))[:5]
        raise ValueError(f"{node}: no layer of this text encoder left to cast (kept for: {reasons}). Relax the skip "
                         "patterns, or load the text encoder unquantised.")
    size_before = p.model_size()
    saved, cast_params, _ = fp8_patcher.cast_layers(p, "", plan.cast, storage, scaling, None, None, False, lora_mode)
    if lora_mode == "unmerged":
        fp8_core.register_callbacks(p)
    import uuid
    p.patches_uuid = uuid.uuid4()
    p.size = size_before - saved
    info = {"family": "text_encoder", "storage_dtype": storage_dtype, "compute_dtype": "as received",
            "scaling": scaling, "skip_preset": skip_preset, "fp8_matmul": False,
            "skip_patterns": [q if isinstance(q, str) else q[0] for q in patterns],
            "weight_bytes_before": int(size_before), "weight_bytes_after": int(p.size),
            "cast_layers": len(plan.cast), "cast_params": int(cast_params),
            "kept_layers": [{"name": k, "reason": v} for k, v in plan.kept.items()], "stored_quantized": len(stored),
            "lora_mode": lora_mode, "core_layers": 0, "core_layout": "",
            "path": "path: MemoryKit cast layers (a text encoder computes in the dtype each layer receives)"}
    p.set_attachments(fp8_patcher.FP8_ATTACHMENT,
                      {k: v for k, v in info.items() if k != "kept_layers"} | {"cast": list(plan.cast)})
    return n, info


# -- Placement on one device -----------------------------------------------------------------------

class _TextEncoderDeviceMixin:
    """A CLIP patcher whose load device was changed: weights another clone left loaded on a
    different device are unloaded first (core's partially_load would keep them there), and a
    hand-over to another clone unloads fully."""

    def _unload_if_elsewhere(self, device_to) -> None:
        dev = getattr(self.model, "device", None)
        if (device_to is not None and dev is not None and self.model.model_loaded_weight_memory > 0
                and torch.device(dev) != torch.device(device_to)):
            self.unpatch_model(self.offload_device, unpatch_weights=True)

    # The arguments go on as they came: the base may be another pack's patcher with its own
    # signature (city96's GGUFModelPatcher.load(*args, force_patch_weights=..., **kwargs)) or
    # core's dynamic one (load(..., dirty=...)).
    def partially_load(self, device_to, *args, **kwargs):
        self._unload_if_elsewhere(device_to)
        return super().partially_load(device_to, *args, **kwargs)

    def load(self, device_to=None, *args, **kwargs):
        self._unload_if_elsewhere(device_to)
        return super().load(device_to, *args, **kwargs)

    def clone(self, *args, **kwargs):
        n = super().clone(*args, **kwargs)
        if type(n) is not type(self) and isinstance(self, type(n)):
            n.__class__ = type(self)  # ComfyUI-GGUF's clone makes every clone a plain GGUFModelPatcher
        return n

    def detach(self, unpatch_all=True):
        # unpatch_all=False outside garbage collection: load_models_gpu hands the weights to another
        # clone, which may compute elsewhere (a core patcher would keep them here): unload fully.
        # Collected (core's __del__): as core does, the weights another clone may use stay.
        return super().detach(unpatch_all or not self.__dict__.get("_mk_collected", False))

    def __del__(self):
        self.__dict__["_mk_collected"] = True
        parent = getattr(super(), "__del__", None)
        if parent is not None:
            parent()


_DEVICE_CLASSES: dict[type, type] = {}


def _device_patcher_class(base: type) -> type:
    if issubclass(base, _TextEncoderDeviceMixin):
        return base
    cls = _DEVICE_CLASSES.get(base)
    if cls is None:
        cls = type(f"TextEncoderDevice{base.__name__}", (_TextEncoderDeviceMixin, base), {"__module__": __name__})
        _DEVICE_CLASSES[base] = cls
    return cls


def parse_device(device: str) -> torch.device:
    """``"cpu"`` / ``"cuda"`` / ``"cuda:N"`` → torch.device. Raises ValueError naming ``device``
    for anything else or a GPU this machine does not have."""
    d = (device or "").strip().lower()
    try:
        dev = torch.device(d)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: use cpu or cuda:N (e.g. cuda:1)")
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        idx = dev.index or 0
        if idx >= n:
            raise ValueError(f"device {device!r}: this machine has {n} CUDA GPU(s); use cpu"
                             + (f" or cuda:0..cuda:{n - 1}" if n else ""))
        dev = torch.device("cuda", idx)
    return dev


def text_encoder_device(clip, device: str):
    """Place the whole text encoder on ``device`` (``cpu`` / ``cuda:N``): ``(new CLIP, info)``.
    Its weights wait in RAM (the CLIP's offload device) as before and load onto ``device`` when
    a prompt is encoded; the conditioning is what the same weights give on that device (on
    the device the CLIP already uses: bit for bit the plain conditioning). The diffusion model's
    device is not touched. Raises ValueError for a bad device."""
    node = "Text Encoder Device"
    _check_clip(clip, node)
    dev = parse_device(device)
    before = torch.device(clip.patcher.load_device)
    placement.release(clip.patcher.model)
    n = clip.clone()
    p = opt_out_of_dynamic_vram(clip.patcher, node) if dev.type == "cpu" or is_dynamic(clip.patcher) else n.patcher
    p.__class__ = _device_patcher_class(type(p))
    p.load_device = dev
    p.set_attachments(TE_DEVICE_KEY, str(dev))
    n.patcher = p
    info = {"device": str(dev), "previous_device": str(before), "weight_bytes": int(p.model_size()),
            "offload_device": str(p.offload_device)}
    if is_dynamic(clip.patcher):
        info["notes"] = [OPTED_OUT_NOTE]
    return n, info


def format_text_encoder_info(kind: str, info: dict) -> str:
    """One-screen summary of a text-encoder technique's info (sizes in GiB)."""
    from ..memory import gib
    if kind == "device":
        return (f"Text Encoder Device: computes on {info['device']} (was {info['previous_device']}); "
                f"{gib(info['weight_bytes'])} GiB of weights wait on {info['offload_device']} between prompts")
    if kind == "fp8":
        text = fp8_patcher.format_fp8_info(info)
        if info.get("stored_quantized") and not info.get("passed_through"):
            text += (f"\n{info['stored_quantized']} layers already quantized in the file (fp8_scaled) are left as "
                     "stored (not quantized twice)")
        return text
    if info.get("status") == "passthrough":
        return f"Group Offload (Text Encoder): passed through: {info['reason']}"
    lines = [f"Group Offload (Text Encoder) on {info['load_device']}: {info['status']}",
             f"streamed per prompt: {gib(info['streamed_bytes_per_prompt'])} GiB "
             "(a text encoder runs once per prompt, once per 77-token chunk for CLIP; not per step)"]
    for name, pl in info["plan"].items():
        lines.append(f"  {name}: {pl['resident_blocks']} blocks resident, {pl['streamed_blocks']} streamed, "
                     f"resident {gib(pl['resident_bytes'])} GiB, footprint {gib(pl['footprint_bytes'])} GiB")
    lines += info.get("notes", [])
    return "\n".join(lines)
