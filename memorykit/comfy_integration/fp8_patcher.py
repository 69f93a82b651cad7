"""FP8 Layerwise Cast inside ComfyUI.

The float8 tensors belong to the clone: each cast layer becomes a *new* layer holding the float8
weight, its scale and a copy of the bias — core's mixed-precision Linear with a
``QuantizedTensor`` where this ComfyUI has one (:mod:`.fp8_core`), else a ComfyUI cast-op module
(same class as the original, plus :class:`.fp8_layers._Fp8CastOp`); the clone carries these modules as
object patches. ComfyUI swaps object patches in at ``patch_model`` (before ``load`` moves
weights, so only float8 bytes ever reach the device, and any later ON_LOAD hook such as group
offloading sees and streams float8 tensors) and restores the originals at ``unpatch_model``. The
shared nn.Module is never written. LoRA patches (before or after this node) reach the new
modules through ComfyUI's ``convert_weight``/``set_weight`` protocol (as core's scaled-fp8 ops):
by default (``lora_mode="unmerged"``) the delta is added per forward to the dequantised weight;
``merged`` adds it at load to the original high-precision weight in float32 and stores the sum
in float8 once.
"""
from __future__ import annotations

import uuid
import weakref

import torch

from .. import fp8
from . import compat, fp8_core, placement
from .fp8_info import format_fp8_info, passed_through_info  # noqa: F401 - re-exported
from .fp8_layers import _fp8_layer, _Fp8CastOp, layer_scale  # noqa: F401 - re-exported
from .gguf_weights import gguf_model_description
from .model_view import own_module, own_object

FP8_ATTACHMENT = "memorykit_fp8"
# Float8 tensors of core-path layers per original weight, so a re-run of the node on another clone
# of the same model (a LoRA strength change before this node) reuses them (core's layers never
# write them in place): id(weight) → (weakref to it, {(storage, scaling, power of two, device): (q, s)}).
_QUANTIZED: dict[int, tuple] = {}


def core_power_of_two_scale(core: bool, compute: torch.dtype) -> bool:
    """Whether a layer's per-tensor scale is rounded up to a power of two: on the core path
    (``core``) with a compute dtype narrower than float32. Core's QuantizedTensor multiplies by
    the scale in the compute dtype, where amax/fmax would be rounded (bf16 keeps 8 bits; an e5m2
    scale is an fp16 subnormal) and a power of two is exact; in float32 amax/fmax is exact, and
    the layer then holds the same float8 values and scale as MemoryKit's own layers (same error)."""
    return core and compute != torch.float32


def _quantized(w: torch.Tensor, storage, scaling: str, work, out_device, memo: bool, power_of_two: bool):
    """:func:`memorykit.fp8.quantize_weight` of ``w`` (``power_of_two``: see there); ``memo``
    (the core path): memoised per (weight tensor, storage, scaling, scale kind, device) while
    ``w`` lives."""
    key = (storage, scaling, power_of_two, str(out_device))
    entry = _QUANTIZED.get(id(w))
    if memo and entry is not None and entry[0]() is w and key in entry[1]:
        return entry[1][key]
    out = fp8.quantize_weight(w, storage, scaling, work_device=work, out_device=out_device, power_of_two=power_of_two)
    if memo:
        if entry is None or entry[0]() is not w:
            wid = id(w)
            entry = (weakref.ref(w, lambda _r, wid=wid: _QUANTIZED.pop(wid, None)), {})
            _QUANTIZED[wid] = entry
        entry[1][key] = out
    return out


def _unpatched(patcher, module, key: str, param: str, in_tree: bool):
    """``module.<param>`` without any LoRA another loaded clone patched into the tree
    (ModelPatcher keeps the original in its shared ``backup``)."""
    bk = patcher.backup.get(f"{key}.{param}") if in_tree else None
    return bk.weight if bk is not None else getattr(module, param)


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def model_compute_dtype(model) -> torch.dtype:
    """The dtype ComfyUI computes this MODEL in: its manual-cast dtype if set, else its weight dtype."""
    mc = model.get_model_object("manual_cast_dtype") if hasattr(model.model, "manual_cast_dtype") else None
    return mc if mc is not None else model.model_dtype()




def _core_plan(storage, scaling: str, fp8_matmul: bool, device) -> tuple[str | None, str, str]:
    """``(core format or None, core layout, why MemoryKit's cast layers are used)`` for the Linear
    layers under these options (Conv layers always keep MemoryKit's: core quantises no Conv)."""
    fmt = compat.core_fp8_format(storage)
    if fmt is None:
        return None, "", f"this ComfyUI has no QuantizedTensor layout for {_dtype_name(storage)}"
    if scaling == "per-output-channel":
        return None, "", "core's float8 layouts hold one scale per tensor; per-output-channel kept MemoryKit's layers"
    if fp8_matmul and not compat.core_fp8_matmul(device):
        return None, "", f"fp8_matmul: core has no run-time float8 matmul for its QuantizedTensor on {device}"
    return fmt[0], fmt[1], "Conv layers (core quantises Linear layers only)"


def fp8_layerwise_cast(model, storage_dtype: str = "float8_e4m3fn", compute_dtype: str = "auto",
                       scaling: str = "per-tensor", skip_preset: str = "auto",
                       extra_skip_patterns: str = "", fp8_matmul: bool = False,
                       lora_mode: str = "unmerged") -> tuple[object, dict]:
    """Clone of ``model`` whose diffusion-model layers are stored in float8 while loaded.

    ``storage_dtype``: ``float8_e4m3fn`` / ``float8_e5m2``; ``compute_dtype``: ``auto`` (what
    ComfyUI already computes this model in) / ``bfloat16`` / ``float16`` / ``float32``;
    ``scaling``: ``none`` / ``per-tensor`` / ``per-output-channel``; ``skip_preset`` and
    ``extra_skip_patterns``: see :func:`memorykit.fp8.default_skip_patterns` and
    :func:`memorykit.fp8.parse_patterns`; ``fp8_matmul``: Linear layers multiply on float8
    tensor cores (:func:`memorykit.fp8.fp8_linear`, or core's where it has one; needs
    float8_e4m3fn); ``lora_mode``: see :mod:`.fp8_core` (``unmerged`` / ``merged``). Where
    this ComfyUI has core's ``QuantizedTensor`` the Linear layers become core's mixed-precision
    Linear holding one (:mod:`.fp8_core`); ``info["path"]`` says which layers went which way. Quantises every
    cast layer now (on the load device when it is a GPU) and keeps the results on the
    offload device with the clone (host RAM: about half the bf16 size of the cast layers).

    Returns ``(clone, info)``; ``info``: family, dtypes, scaling, patterns, ``weight_bytes_before``
    / ``weight_bytes_after`` (the whole model's weights, bytes), ``cast_layers``, ``cast_params``,
    ``kept_layers`` ([{name, reason}]). A model whose layers are all already stored quantized
    (an fp8_scaled / mixed checkpoint, a GGUF file) is returned as it came, with ``info["passed_through"]``
    saying why (:func:`passed_through_info`): a shared workflow keeps working with the fp8 file.
    Raises ValueError for a bad option or pattern, a device that cannot use the dtypes, a MODEL
    already cast by this node, or nothing to cast for another reason (the skip patterns).
    """
    import comfy.model_management as cmm

    if model.get_attachment(FP8_ATTACHMENT) is not None:
        raise ValueError("This MODEL already went through FP8 Layerwise Cast; use one FP8 Layerwise Cast "
                         "node per model (connect the loader's MODEL instead).")
    if storage_dtype not in fp8.STORAGE_DTYPES:
        raise ValueError(f"storage_dtype must be one of {list(fp8.STORAGE_DTYPES)}, got {storage_dtype!r}")
    if scaling not in fp8.SCALINGS:
        raise ValueError(f"scaling must be one of {list(fp8.SCALINGS)}, got {scaling!r}")
    if lora_mode not in fp8_core.LORA_MODES:
        raise ValueError(f"lora_mode must be one of {list(fp8_core.LORA_MODES)}, got {lora_mode!r}")
    storage = fp8.STORAGE_DTYPES[storage_dtype]
    current = model_compute_dtype(model)
    if compute_dtype == "auto":
        compute = current if current in fp8.HIGH_PRECISION else torch.float32
    elif compute_dtype in fp8.COMPUTE_DTYPES:
        compute = fp8.COMPUTE_DTYPES[compute_dtype]
    else:
        raise ValueError(f"compute_dtype must be auto or one of {list(fp8.COMPUTE_DTYPES)}, got {compute_dtype!r}")
    device = model.load_device
    if not cmm.supports_cast(device, storage):
        raise ValueError(f"ComfyUI cannot use {storage_dtype} weights on {device} (e.g. Apple MPS and DirectML "
                         "have no float8); leave this model unquantised on this device.")
    fp8.check_dtypes(device, storage, compute)
    if fp8_matmul:
        if storage != torch.float8_e4m3fn:
            raise ValueError("fp8_matmul needs storage_dtype float8_e4m3fn (float8 GEMMs take e4m3 weights).")
        fp8.check_fp8_matmul(device)

    gguf = gguf_model_description(model)
    if gguf is not None:
        return model, passed_through_info(
            model, fp8.detect_family(own_module(model)),
            f"this MODEL comes from a GGUF file ({gguf}): its layers are already stored quantized and dequantised "
            "by the GGUF loader's own layers; casting them to float8 would quantize twice", [])
    placement.release(model.model)  # a loaded Group Offload / device map holds placeholders: read real weights
    n = model.clone()
    dm = own_module(n)  # this MODEL's modules, not another loaded clone's applied FP8 layers
    family = fp8.detect_family(dm)
    patterns = fp8.default_skip_patterns(family, skip_preset) + fp8.parse_patterns(extra_skip_patterns)
    prefix = "diffusion_model."

    def original(name, m):
        key = prefix + name
        if key in n.object_patches or key in n.object_patches_backup:
            return n.get_model_object(key)
        return m

    plan = fp8.plan_layers(dm, patterns, get_module=original, check=cmm.throw_exception_if_processing_interrupted)
    if not plan.cast and plan.as_stored:
        return model, passed_through_info(
            model, family, f"this model is already stored quantized: the {len(plan.as_stored)} layers it would cast are "
            "left as stored (never quantized twice)", [{"name": k, "reason": v} for k, v in plan.kept.items()])
    if not plan.cast:
        reasons = sorted(set(plan.kept.values()))[:5]
        raise ValueError(f"FP8 Layerwise Cast: no layer of this {family} model left to cast (kept for: {reasons}). "
                         "Relax the skip patterns, or load the model unquantised (weight_dtype default).")

    size_before = n.model_size()
    core_fmt, core_layout, own_reason = _core_plan(storage, scaling, fp8_matmul, device)
    saved, cast_params, n_core = cast_layers(n, prefix, plan.cast, storage, scaling, compute, core_fmt,
                                             fp8_matmul, lora_mode)

    if lora_mode == "unmerged":
        fp8_core.register_callbacks(n)
    if compute != current:
        n.set_model_compute_dtype(compute)  # core's own switch: inputs and kept layers cast to it
    n.patches_uuid = uuid.uuid4()  # weights differ from the input's: make ComfyUI reload, not reuse
    n.size = size_before - saved    # what load_models_gpu budgets for this model
    info = {
        "family": family, "storage_dtype": storage_dtype, "compute_dtype": _dtype_name(compute),
        "scaling": scaling, "skip_preset": skip_preset, "fp8_matmul": bool(fp8_matmul),
        "skip_patterns": [p if isinstance(p, str) else p[0] for p in patterns],
        "weight_bytes_before": int(size_before), "weight_bytes_after": int(n.size),
        "cast_layers": len(plan.cast), "cast_params": int(cast_params),
        "kept_layers": [{"name": k, "reason": v} for k, v in plan.kept.items()],
        "lora_mode": lora_mode, "core_layers": n_core, "core_layout": core_layout,
        "own_reason": own_reason,
    }
    info["path"] = fp8_core.describe_path(info)
    n.set_attachments(FP8_ATTACHMENT, {k: v for k, v in info.items() if k != "kept_layers"} | {"cast": list(plan.cast)})
    placed = placement.placed_by(model)
    if placed:  # Group Offload / device map before this node (they move plain tensors only): plain float8 tensors, same values and math
        plain_fp8_layers(n, placed)
        info.update(core_layers=0, path=n.get_attachment(FP8_ATTACHMENT)["path"])
    n.set_attachments(FP8_ATTACHMENT, {k: v for k, v in info.items() if k != "kept_layers"} | {"cast": list(plan.cast)})
    return n, info


def cast_layers(n, prefix: str, names: list[str], storage, scaling: str, compute, core_fmt,
                fp8_matmul: bool, lora_mode: str) -> tuple[int, int, int]:
    """Add to ``n`` (a clone) one float8 object patch per layer ``prefix + name`` of ``names``
    (core's QuantizedTensor Linear when ``core_fmt``, else MemoryKit's cast layer); returns
    ``(bytes saved, parameters cast, core layers)``. Quantises on the load device when it is a
    GPU; the results stay on the offload device. Cancel stops between layers."""
    import comfy.model_management as cmm
    import comfy.utils

    device = n.load_device
    work = device if getattr(device, "type", "cpu") == "cuda" else None
    pbar = comfy.utils.ProgressBar(len(names))
    saved = cast_params = n_core = 0
    for name in names:
        cmm.throw_exception_if_processing_interrupted()  # Cancel stops here; the clone is dropped
        key = prefix + name
        in_tree = key not in n.object_patches and key not in n.object_patches_backup
        orig = own_object(n, key)
        w = _unpatched(n, orig, key, "weight", in_tree)
        core = core_fmt is not None and isinstance(orig, torch.nn.Linear)
        q, s = _quantized(w, storage, scaling, work, n.offload_device, memo=core,
                          power_of_two=core_power_of_two_scale(core, compute))
        b = _unpatched(n, orig, key, "bias", in_tree)
        b = None if b is None else b.detach().to(n.offload_device, copy=True)
        if core:
            layer = fp8_core.build_layer(orig, q, s, b, core_fmt, compute, fp8_matmul, lora_mode)
            n_core += 1
        else:
            layer = _fp8_layer(orig, q, s, b, fp8_matmul, scaling, lora_mode)
        n.add_object_patch(key, layer)
        saved += fp8.param_bytes(w) - fp8.param_bytes(q)
        cast_params += w.numel()
        pbar.update(1)
    return saved, cast_params, n_core


def plain_fp8_layers(patcher, node: str) -> None:
    """Give ``patcher`` (a clone this module may change) MemoryKit's cast layers instead of core's
    QuantizedTensor layers: Group Offload and Balanced Device Map move, pin and write plain
    tensors only (a tensor subclass has no storage of its own). Same float8 values and scales and
    the same math (the scale multiplies the weight, as core's dequantisation does; a power-of-two
    scale makes it exact), so the output is unchanged. The FP8 attachment's info notes it."""
    att = patcher.get_attachment(FP8_ATTACHMENT)
    if not att or not att.get("core_layers"):
        return
    for key, layer in list(patcher.object_patches.items()):
        if not fp8_core.is_core_layer(layer):
            continue
        orig = layer._mk_original[0]
        b = None if layer.bias is None else layer.bias.detach()
        new = _fp8_layer(orig, fp8_core.storage_tensor(layer).detach(), fp8_core.weight_scale(layer).detach(), b,
                         False, "per-tensor", layer._mk_lora_mode)
        new._mk_weight_math = True
        patcher.add_object_patch(key, new)
    patcher.set_attachments(FP8_ATTACHMENT, dict(att, core_layers=0, path=(
        f"path: MemoryKit cast layers ({node} places plain tensors; core's QuantizedTensor layers replaced)")))
