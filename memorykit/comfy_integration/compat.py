"""Every difference between the ComfyUI versions the pack supports, detected in this one place.

Tested versions: 0.3.75 and 0.33.0 (read against 0.38.1). Each function feature-detects the API
it needs (never a version number) and does the right thing on both sides:

- dynamic VRAM (0.33+, ``ModelPatcherDynamic``, comfy-aimdo): :func:`is_dynamic`,
  :func:`opt_out_of_dynamic_vram`, :func:`memory_path`;
- free memory as core itself would offer it: :func:`patcher_free_memory`;
- saving: :func:`model_state_dict_for_saving` (0.33 moved it to ``ModelPatcher`` and made it lazy);
  core's per-layer quantization format: :func:`core_quant_tensors`, :func:`quantization_metadata`;
- the VAE ``Decoder`` lost ``give_pre_end`` in 0.33: :func:`decoder_gives_pre_end`;
- video VAEs whose own classes run time in causal chunks with a carried cache (0.33+):
  :func:`core_carries_time`;
- per-forward LoRA patches on float8 layers: :func:`apply_weight_patch`;
- core's Linear call arguments (input activation, residual; newest core): :func:`core_linear_act`;
- core's switches and helpers: :func:`pinned_memory_disabled`, :func:`count_pinned`, :func:`is_oom`;
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


def saves_through_patcher(patcher_or_class) -> bool:
    """Whether core's savers read weights through ``ModelPatcher.state_dict_for_saving`` (0.33+),
    not through ``BaseModel.state_dict_for_saving`` after a forced-patch load (before)."""
    return hasattr(patcher_or_class, "state_dict_for_saving")


def model_state_dict_for_saving(patcher) -> dict:
    """``patcher``'s diffusion-model state dict with every weight patch (LoRA) merged, in the
    checkpoint names core's savers write (``model.diffusion_model.*`` or the type's prefix).

    0.33+: loads the model as core's ``save_checkpoint`` does (``load_models_gpu`` without
    ``force_patch_weights``, which a dynamic patcher refuses) and takes
    ``ModelPatcher.state_dict_for_saving()``, materialising its lazily patched weights one by one.
    Before: ``load_models_gpu(force_patch_weights=True)`` and ``BaseModel.state_dict_for_saving()``.
    Values may be non-tensors (``_quantization_metadata``).
    """
    if saves_through_patcher(patcher):
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


def core_linear_act():
    """``(comfy.ops._eager_input_act, comfy.ops._linear_residual)`` where this core has them (after
    0.38: the meaning of a Linear's ``input_act``/``act_weight``/``act_eps`` and ``residual``/
    ``residual_scale``), else None (:mod:`.linear_args` then does the same math)."""
    import comfy.ops
    act, res = getattr(comfy.ops, "_eager_input_act", None), getattr(comfy.ops, "_linear_residual", None)
    return (act, res) if callable(act) and callable(res) else None


def pinned_memory_disabled() -> bool:
    """True when the user started ComfyUI with ``--disable-pinned-memory`` (core then pins
    nothing; MemoryKit's own page-locking follows it)."""
    try:
        from comfy.cli_args import args
    except ImportError:
        return False
    return bool(getattr(args, "disable_pinned_memory", False))


PAGEABLE_NOTE = ("pinned memory disabled (--disable-pinned-memory): weights are copied from pageable memory, "
                 "slower on the GPU")


def count_pinned(nbytes: int) -> None:
    """Add ``nbytes`` (negative: remove) to core's count of page-locked host memory
    (``model_management.TOTAL_PINNED_MEMORY``, which core's pin budget compares with
    ``MAX_PINNED_MEMORY``) where this core keeps one."""
    if isinstance(getattr(mm, "TOTAL_PINNED_MEMORY", None), int):
        mm.TOTAL_PINNED_MEMORY = max(0, mm.TOTAL_PINNED_MEMORY + int(nbytes))


def is_oom(e: BaseException) -> bool:
    """True for an out-of-memory error as core counts one: ``model_management.is_oom`` where it
    exists (0.33+: also ``torch.AcceleratorError`` code 2), else ``torch.OutOfMemoryError``."""
    fn = getattr(mm, "is_oom", None)
    if callable(fn):
        return bool(fn(e))
    return isinstance(e, torch.OutOfMemoryError)


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


def core_carries_time(coder) -> bool:
    """True when ``coder`` (a video VAE's ``encoder`` or ``decoder``) runs time itself in causal
    chunks carrying each causal conv's last input frames from chunk to chunk, so that a whole-
    length forward costs one chunk's memory and time need not be cut from outside:

    - HunyuanVideo's ``Encoder``/``Decoder`` (comfy/ldm/modules/diffusionmodules/model.py) with
      ``carried`` set (0.33+: ``CarriedConv3d`` + ``conv_carry_causal_3d``, chunks of 2 latent
      frames; 0.3.75 has no ``carried`` and runs the whole length at once);
    - HunyuanVideo 1.5's (comfy/ldm/hunyuan_video/vae_refiner.py) where that module uses
      ``conv_carry_causal_3d`` (0.3.75 and 0.33: chunks of 2 latent frames);
    - LTX-Video's (comfy/ldm/lightricks/vae/causal_video_autoencoder.py) whose ``CausalConv3d``
      layers keep a ``temporal_cache_state`` (0.33+: the encoder always chunks, the decoder
      when a chunk would exceed its memory share).

    Wan's ``feat_cache`` is detected by class in ``tiled_vae_io.vae_shape``."""
    import sys
    if coder is None:
        return False
    if getattr(coder, "carried", False) is True:
        return True
    mod = sys.modules.get(type(coder).__module__)
    if type(coder).__module__.endswith("hunyuan_video.vae_refiner") and hasattr(mod, "conv_carry_causal_3d"):
        return True
    if type(coder).__module__.endswith("lightricks.vae.causal_video_autoencoder"):
        return any(isinstance(getattr(m, "temporal_cache_state", None), dict) for m in coder.modules())
    return False


def core_model_carries_time(model) -> bool:
    """True when a video VAE's model (``first_stage_model``) itself runs time in causal chunks
    or frame by frame inside its ``encode``/``decode``, so that a whole-length call costs a few
    frames' memory (at one tile's size) and time need not be cut from outside:

    - CogVideoX's ``AutoencoderKLCogVideoX`` (comfy/ldm/cogvideo/vae.py, 0.33+): ``encode`` runs
      chunks of ``num_sample_frames_batch_size`` frames carrying each causal conv's ``conv_cache``;
      ``decode`` is ``_decode_rolling`` (the low-resolution layers on all frames, the rest in
      chunks of 4 frames with the cache). Its decoder maps n latent frames to 4n − 3 frames only
      for odd n (2 → 8): a temporal tile of 2 latent frames cannot be placed at all.
    - TAEHV / taew / lighttae (``comfy.taesd.taehv.TAEHV``) with ``parallel`` off (core's
      choice): ``apply_model_with_memblocks`` runs one frame at a time, each ``MemBlock`` keeping
      the previous frame's input.

    Reads those private names; ``tests/test_vae_zoo.py::test_core_time_carry_detection_follows_core``
    fails when they change."""
    import sys
    name, mod = type(model).__name__, type(model).__module__
    if name == "AutoencoderKLCogVideoX" and mod.endswith("cogvideo.vae"):
        return hasattr(model, "_decode_rolling") and hasattr(model, "num_sample_frames_batch_size")
    if name == "TAEHV" and mod.endswith("taesd.taehv"):
        return getattr(model, "parallel", True) is False and hasattr(sys.modules.get(mod), "apply_model_with_memblocks")
    return False


def core_fp8_format(storage_dtype: torch.dtype) -> tuple[str, str] | None:
    """``(quant_format, layout)`` of core's own quantized float8 weights for ``storage_dtype``,
    or None when this ComfyUI cannot hold such weights.

    Core's quantized weights are ``comfy.quant_ops.QuantizedTensor`` (a ``torch.Tensor`` subclass;
    0.3.75: core's own class, 0.33+: comfy-kitchen's) in the Linear of
    ``comfy.ops.mixed_precision_ops``; ``comfy.quant_ops.QUANT_ALGOS[format]`` names the layout
    (0.3.75: ``float8_e4m3fn`` → ``TensorCoreFP8Layout`` only; 0.33: ``float8_e4m3fn`` →
    ``TensorCoreFP8E4M3Layout``, ``float8_e5m2`` → ``TensorCoreFP8E5M2Layout``). Without
    comfy-kitchen, 0.33's ``QuantizedTensor`` is a placeholder class: None.
    """
    try:
        import comfy.ops
        import comfy.quant_ops as qo
    except ImportError:
        return None
    qt = getattr(qo, "QuantizedTensor", None)
    if not (isinstance(qt, type) and issubclass(qt, torch.Tensor)) or not hasattr(comfy.ops, "mixed_precision_ops"):
        return None
    fmt = str(storage_dtype).replace("torch.", "")
    algo = getattr(qo, "QUANT_ALGOS", {}).get(fmt)
    if not algo or algo.get("storage_t") != storage_dtype or "comfy_tensor_layout" not in algo:
        return None
    return fmt, algo["comfy_tensor_layout"]



_CORE_FP8_CLASSES: dict = {}


def core_fp8_linear(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, fmt: str,
                    compute_dtype: torch.dtype, full_precision_mm: bool, mixin: type | None = None):
    """Core's mixed-precision Linear (``comfy.ops.mixed_precision_ops(...).Linear``, the layer core
    builds for a checkpoint with quantization metadata) holding float8 ``q`` (out, in) with the
    per-tensor ``scale`` (0-d float32; real weight = q · scale) as a ``QuantizedTensor``, and
    ``bias``. Loaded through the layer's own ``_load_from_state_dict`` from the tensors a quantized
    checkpoint holds: ``weight``, ``weight_scale`` and, on 0.33+, ``comfy_quant`` (JSON
    ``{"format": fmt}``, plus ``"full_precision_matrix_mult": true`` with ``full_precision_mm``);
    0.3.75 reads the format from the ``layer_quant_config`` of its ops class instead (keyed by
    layer name; the layer is loaded with prefix ""). ``full_precision_mm``: the weight is
    dequantised to the compute dtype per forward (no float8 matmul). ``mixin``: a class put before
    core's (``type(name, (mixin, core_linear), {})``). Raises RuntimeError with core's
    message when core refuses the tensors."""
    import json

    import comfy.ops
    old = "layer_quant_config" in inspect.signature(comfy.ops.mixed_precision_ops).parameters  # 0.3.75
    key = (fmt, compute_dtype, bool(full_precision_mm), mixin)
    cls = _CORE_FP8_CLASSES.get(key)
    if cls is None:
        config = {"": {"format": fmt}} if old else {}
        base = comfy.ops.mixed_precision_ops(config, compute_dtype, full_precision_mm=full_precision_mm).Linear
        cls = base if mixin is None else type(f"MemoryKitFp8{base.__name__}", (mixin, base), {"__module__": mixin.__module__})
        _CORE_FP8_CLASSES[key] = cls
    out_features, in_features = q.shape
    with torch.device("meta"):
        layer = cls(in_features, out_features, bias=bias is not None, device=None)
    sd = {"weight": q, "weight_scale": scale.detach().reshape(()).to(device=q.device, dtype=torch.float32)}
    if bias is not None:
        sd["bias"] = bias
    if not old:  # full_precision_mm travels in the layer's config, so core's state dict writes it (as for a
        # checkpoint that asked for it) and a reload multiplies in full precision too
        conf = {"format": fmt, "full_precision_matrix_mult": True} if full_precision_mm else {"format": fmt}
        sd["comfy_quant"] = torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)
    layer.factory_kwargs["device"] = q.device
    if bias is not None:
        layer.bias = torch.nn.Parameter(torch.empty_like(bias, dtype=compute_dtype), requires_grad=False)
    missing, unexpected, errors = [], [], []
    layer._load_from_state_dict(sd, "", {}, True, missing, unexpected, errors)
    if missing or unexpected or errors:
        raise RuntimeError(f"core's mixed-precision Linear refused a {fmt} weight: missing {missing}, "
                           f"unexpected {unexpected}, {errors}")
    return layer


def core_fp8_matmul(device) -> bool:
    """True when core's mixed-precision Linear multiplies in float8 on ``device`` for a weight
    without a stored input scale: ``model_management.supports_fp8_compute(device)`` and a core
    whose Linear quantises its input per tensor at run time (0.33+: ``mixed_precision_ops`` takes
    ``disabled``; 0.3.75's does so only with an ``input_scale`` from the checkpoint)."""
    import comfy.ops
    if "disabled" not in inspect.signature(comfy.ops.mixed_precision_ops).parameters:
        return False
    return bool(mm.supports_fp8_compute(device))


QUANT_METADATA_KEY = "_quantization_metadata"


def core_quant_tensors(layer, prefix: str) -> tuple[dict[str, torch.Tensor], dict | None]:
    """The tensors core writes for its mixed-precision Linear ``layer`` (holding a
    ``QuantizedTensor``) in a checkpoint, names prefixed ``prefix`` (``"<...>.<layer>."``), and
    the layer's entry for the file's ``_quantization_metadata`` (None where the tensors carry it).

    0.33+: the layer's own ``state_dict`` (core's ``_quantized_weight_state_dict``: ``weight`` =
    float8 data, ``weight_scale`` = 0-d float32, ``comfy_quant`` = its JSON config as a uint8
    tensor, ``bias``); no file metadata (core's savers write none). 0.3.75: its Linear has no such
    state dict (the QuantizedTensor itself would be written, without its scale) and its loader
    reads the format from the file's ``_quantization_metadata`` (``{"format_version": "1.0",
    "layers": {name: config}}``, as its ``BaseModel.state_dict_for_saving`` writes): ``weight`` and
    ``weight_scale`` from the layout's ``get_plain_tensors``, ``bias``, and ``{"format": ...}``.
    Tensors are detached (never copied here)."""
    import comfy.quant_ops as qo
    sd = {k: v.detach() for k, v in layer.state_dict(prefix=prefix).items()}
    if f"{prefix}comfy_quant" in sd:
        return sd, None
    w = layer.weight
    qdata, scale = qo.LAYOUTS[layer.layout_type].get_plain_tensors(w)
    sd[f"{prefix}weight"] = qdata.detach()
    sd[f"{prefix}weight_scale"] = scale.detach().to(torch.float32).reshape(())
    fmt = next(f for f, a in qo.QUANT_ALGOS.items()
               if a.get("comfy_tensor_layout") == layer.layout_type and a.get("storage_t") == qdata.dtype)
    conf = {"format": fmt}
    if getattr(layer, "_full_precision_mm", False):
        conf["full_precision_matrix_mult"] = True  # read by 0.33+, which may load this file
    return sd, conf


def quantization_metadata(layers: dict[str, dict], existing: str | None = None) -> str:
    """The ``_quantization_metadata`` safetensors metadata value core's loaders read (0.3.75:
    ``model_detection.detect_layer_quantization``; 0.33+: ``utils.convert_old_quants``):
    JSON ``{"format_version": "1.0", "layers": {layer name without the model prefix: config}}``,
    as 0.3.75's ``BaseModel.state_dict_for_saving`` writes it; ``existing`` (such a JSON string
    from the model's own state dict) is merged in, ``layers`` winning."""
    import json
    merged = dict(json.loads(existing).get("layers", {})) if existing else {}
    merged.update(layers)
    return json.dumps({"format_version": "1.0", "layers": merged})
