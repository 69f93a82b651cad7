"""Text encoders in the formats users download, built from the text-encoder zoo's tiny encoders
(:mod:`harness.te_zoo`) and loaded the way the real loaders load them:

- ``fp8_scaled`` ``legacy`` / ``mixed``: the encoder's state dict written in Comfy-Org's
  layouts (:func:`harness.quant_models.quantize_state_dict`: the block Linears float8 with a
  scale, the rest bfloat16) and loaded as core's ``CLIPLoader`` does (``comfy.sd.load_clip``:
  ``convert_old_quants`` where the core has it, then the encoder class chosen with core's own
  ``t5_xxl_detect`` / ``llama_detect`` on the state dict, ``CLIP.load_sd``). ComfyUI 0.33 builds
  core's ``QuantizedTensor`` layers (mixed: e4m3, e5m2 and bf16 layers); 0.3.75 loads the legacy
  file with its scaled-fp8 ops (plain float8 tensors). ``mixed`` is 0.33 only.
- ``gguf`` ``q8_0`` / ``q4_k`` / ``f16``: the state dict written as GGUF in llama.cpp's tensor names
  (``general.architecture`` ``t5encoder`` / ``qwen3``), read back by city96's
  ``gguf_clip_loader`` and loaded as its ``CLIPLoaderGGUF`` does (its ``GGMLOps``, the CLIP's
  patcher replaced by ``GGUFModelPatcher.clone``). ``q4_k``: the MLP down projections (rows of
  256 values: the tiny encoder is built with a 256-wide MLP) Q4_K, random valid blocks as
  :mod:`harness.gguf_models` writes them; the other Linears Q8_0. ``f16``: the Linears F16.

Only the encoder detection is the harness's (core's ``detect_te_model`` knows full-size shapes).
Everything is built in memory (safetensors / GGUF bytes written to a temporary file and read
back), nothing goes into git.
"""
from __future__ import annotations

import inspect
import os
import tempfile

import torch

from . import te_zoo

ENCODERS = ("t5xxl", "qwen3_4b")  # a T5-class (Flux, SD3, LTX-Video) and a Qwen-class (Z-Image) encoder
FORMATS = ("fp8_scaled_legacy", "fp8_scaled_mixed", "gguf_q8_0", "gguf_q4_k")
# each layout and GGUF type once, each encoder in both families of formats (suite time)
CASES = [("t5xxl", "fp8_scaled_legacy"), ("t5xxl", "gguf_q8_0"),
         ("qwen3_4b", "fp8_scaled_mixed"), ("qwen3_4b", "gguf_q4_k"), ("qwen3_4b", "gguf_f16")]
_ROOT = {"t5xxl": "t5xxl", "qwen3_4b": "qwen3_4b"}
_TE = {"t5xxl": ("text_encoders.sd3_clip:sd3_clip", {"clip_l": False, "clip_g": False, "t5": True}),
       "qwen3_4b": ("text_encoders.z_image:te", {})}
_GGUF_ARCH = {"t5xxl": "t5encoder", "qwen3_4b": "qwen3"}
_WIDE = {"t5xxl": {"d_ff": 256}, "qwen3_4b": {"intermediate_size": 256}}  # Q4_K needs rows of 256


def _detect(name: str, sd: dict) -> dict:
    if name == "t5xxl":
        from comfy.text_encoders.sd3_clip import t5_xxl_detect
        return t5_xxl_detect(sd)
    from comfy.text_encoders.hunyuan_video import llama_detect
    return llama_detect(sd)


def _plain_state_dict(name: str, config: dict | None = None) -> dict:
    clip = te_zoo.build(name, config=config)
    return {k: v.detach().clone() for k, v in getattr(clip.cond_stage_model, _ROOT[name]).transformer.state_dict().items()}


def _targets(sd: dict) -> list[str]:
    """What Comfy-Org's converters quantise in a text encoder: the 2-D Linear weights of the blocks."""
    return [k[:-len(".weight")] for k, v in sd.items()
            if k.endswith(".weight") and v.ndim == 2 and (".block." in k or ".layers." in k)
            and "norm" not in k and "relative_attention_bias" not in k]


def _clip(name: str, sd: dict, model_options: dict, config: dict | None = None):
    import comfy.sd
    cfg = dict(te_zoo.SPECS[name].configs[_ROOT[name]], **(config or {}))
    cpu = torch.device("cpu")
    holder = type("ClipTarget", (), {})()
    fn, kw = _TE[name]
    holder.clip = te_zoo._attr(fn)(**kw, **_detect(name, sd))
    holder.params = {}
    holder.tokenizer = lambda embedding_directory=None, tokenizer_data=None, **kw: te_zoo._tokenizer(name)
    opts = {"load_device": cpu, "offload_device": cpu, "initial_device": cpu,
            f"{_ROOT[name]}_model_config": cfg, **model_options}
    if "state_dict" in inspect.signature(comfy.sd.CLIP).parameters:  # 0.33: the CLIP loads it, then onto its device
        return comfy.sd.CLIP(holder, model_options=opts, state_dict=[sd])
    clip = comfy.sd.CLIP(holder, model_options=opts)
    missing, unexpected = clip.load_sd(sd)
    if unexpected or [k for k in missing if "comfy_quant" not in k and "scaled_fp8" not in k]:
        raise RuntimeError(f"{name}: state dict does not fit: {missing[:3]} {unexpected[:3]}")
    return clip


def fp8_scaled(name: str, layout: str):
    """The tiny ``name`` encoder from an fp8_scaled file of ``layout`` as core's CLIPLoader loads it."""
    import comfy.utils
    from safetensors.torch import load, save

    from .quant_models import quantize_state_dict
    sd = _plain_state_dict(name)
    sd = load(save(quantize_state_dict(sd, layout, _targets(sd))))  # the file's bytes, read back
    if hasattr(comfy.utils, "convert_old_quants"):  # comfy.sd.load_clip, 0.33
        sd, _ = comfy.utils.convert_old_quants(sd, model_prefix="", metadata={})
    return _clip(name, sd, {})


def _reverse(key: str, mapping: dict) -> str:
    for s, d in reversed(list(mapping.items())):
        key = key.replace(d, s)
    return key


def _write_gguf(name: str, sd: dict, path: str, quant: str, loader) -> None:
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as T

    from .gguf_models import _q4_k_blocks
    mapping = loader.T5_SD_MAP if _GGUF_ARCH[name] == "t5encoder" else loader.LLAMA_SD_MAP
    targets = {t + ".weight" for t in _targets(sd)}
    w = gguf.GGUFWriter(path, _GGUF_ARCH[name])
    for i, (k, v) in enumerate(sorted(sd.items())):
        gk = _reverse(k, mapping)
        if loader.sd_map_replace({gk: None}, mapping).keys() != {k}:
            raise RuntimeError(f"{k}: no llama.cpp name maps back to it ({gk})")
        a = v.float().numpy()
        if k in targets and quant == "f16":
            w.add_tensor(gk, a.astype(np.float16))
        elif k in targets and quant == "q4_k" and a.shape[1] % 256 == 0:
            w.add_tensor(gk, _q4_k_blocks(a.shape, i), raw_dtype=T.Q4_K)
        elif k in targets and a.shape[1] % 32 == 0:
            w.add_tensor(gk, gguf.quants.quantize(a, T.Q8_0), raw_dtype=T.Q8_0)
        else:
            w.add_tensor(gk, a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_clip(name: str, quant: str):
    """The tiny ``name`` encoder from a GGUF file of ``quant`` as city96's CLIPLoaderGGUF loads it."""
    import sys

    from . import gguf_pack
    gnodes = gguf_pack.load_in_process()
    loader = sys.modules[gguf_pack.MODULE_NAME + ".loader"]
    config = _WIDE[name] if quant == "q4_k" else None
    sd = _plain_state_dict(name, config)
    fd, path = tempfile.mkstemp(suffix=".gguf")
    os.close(fd)
    try:
        _write_gguf(name, sd, path, quant, loader)
        gsd = loader.gguf_clip_loader(path)
        clip = _clip(name, gsd, {"custom_operations": gnodes.GGMLOps}, config)
    finally:
        os.remove(path)
    clip.patcher = gnodes.GGUFModelPatcher.clone(clip.patcher)
    return clip


def build(name: str, fmt: str):
    """The tiny ``name`` encoder in format ``fmt`` (:data:`FORMATS`, ``gguf_f16``)."""
    if fmt.startswith("fp8_scaled_"):
        return fp8_scaled(name, fmt[len("fp8_scaled_"):])
    return gguf_clip(name, fmt[len("gguf_"):])


def unavailable(fmt: str) -> str | None:
    """Why ``fmt`` cannot be built on this ComfyUI / machine, or None."""
    import comfy.utils
    if fmt == "fp8_scaled_mixed" and not hasattr(comfy.utils, "convert_old_quants"):
        return "per-layer comfy_quant files load on ComfyUI 0.33+ only"
    if fmt.startswith("gguf_"):
        from . import gguf_pack
        return gguf_pack.available()
    return None
