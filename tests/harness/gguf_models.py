"""Tiny GGUF diffusion models, written with ``gguf.GGUFWriter`` as city96's converter lays them out.

The UNet of the SD1.5-shaped test checkpoint (``models.make_sd15_checkpoint``; the same
weights, so the test LoRA applies), stored as GGUF (``general.architecture`` ``sd1``, ComfyUI's
UNet key names, no prefix) in ``diffusion_models/``:

- ``mk_sd15_unet_q8_0.gguf``: every 2-D weight Q8_0, the rest F32;
- ``mk_sd15_unet_q4_k.gguf``: the 2-D weights whose rows are a multiple of 256 values Q4_K
  (``gguf`` writes no K-quants, so its blocks are random valid bytes: d, dmin, 6-bit scales,
  4-bit values, the same layout llama.cpp writes), the rest F32;
- ``mk_sd15_unet_f16.gguf``: every weight of 2 or more dimensions F16, the rest F32.

Written to ``<name>.<pid>.partial`` and renamed; a stamp marks the current version.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from . import models, paths

VERSION = "1"
QUANTS = ("q8_0", "q4_k", "f16")


def path_for(quant: str) -> Path:
    return paths.MODELS / "diffusion_models" / f"mk_sd15_unet_{quant}.gguf"


def _q4_k_blocks(shape, seed: int) -> np.ndarray:
    """Random valid Q4_K data for a ``shape`` (rows, cols) weight, cols a multiple of 256: per
    block of 256 values 144 bytes (f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 of 4-bit values)."""
    rows, cols = shape
    n = rows * cols // 256
    rng = np.random.default_rng(seed)
    blocks = np.empty((n, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.full(n, 1e-4, dtype=np.float16).view(np.uint8).reshape(n, 2)
    blocks[:, 2:4] = np.full(n, 7e-4, dtype=np.float16).view(np.uint8).reshape(n, 2)
    blocks[:, 4:] = rng.integers(0, 256, size=(n, 140), dtype=np.uint8)
    return blocks.reshape(rows, cols // 256 * 144)


def write_gguf(unet_sd: dict, path: Path, quant: str) -> None:
    """Write ``unet_sd`` (ComfyUI UNet names → float tensors) as a GGUF file of ``quant`` (see module doc)."""
    import gguf
    from gguf import GGMLQuantizationType as T
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.partial")
    w = gguf.GGUFWriter(str(tmp), "sd1")
    w.add_type("diffusion")  # general.type, as city96's converter writes it
    for i, (k, v) in enumerate(sorted(unet_sd.items())):
        a = v.float().numpy()
        if quant == "q8_0" and a.ndim == 2 and a.shape[1] % 32 == 0:
            w.add_tensor(k, gguf.quants.quantize(a, T.Q8_0), raw_dtype=T.Q8_0)
        elif quant == "q4_k" and a.ndim == 2 and a.shape[1] % 256 == 0:
            w.add_tensor(k, _q4_k_blocks(a.shape, i), raw_dtype=T.Q4_K)
        elif quant == "f16" and a.ndim >= 2:
            w.add_tensor(k, a.astype(np.float16))
        else:
            w.add_tensor(k, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)


def ensure_gguf_models() -> dict[str, Path]:
    """The three GGUF UNets (keys :data:`QUANTS`), generated from the SD1.5 test checkpoint on first use."""
    out = {q: path_for(q) for q in QUANTS}
    todo = [q for q, p in out.items() if not (p.exists() and p.with_name(p.name + f".v{VERSION}.ok").exists())]
    if todo:
        from safetensors.torch import load_file
        ckpt = models.ensure_models(("sd15",))["sd15"]
        prefix = "model.diffusion_model."
        sd = {k[len(prefix):]: v for k, v in load_file(str(ckpt)).items() if k.startswith(prefix)}
        for q in todo:
            write_gguf(sd, out[q], q)
            out[q].with_name(out[q].name + f".v{VERSION}.ok").touch()
    return out


# zoo architecture → the ``general.architecture`` city96's loader knows it by (its IMG_ARCH_LIST)
ZOO_ARCHS = {"sdxl": "sdxl", "sd3": "sd3", "flux": "flux", "qwen_image": "qwen_image", "lumina2": "lumina2",
             "hunyuan_video": "hyvid", "ltxv": "ltxv", "wan21": "wan", "hidream": "hidream", "auraflow": "aura",
             "cosmos_predict2": "cosmos"}


def zoo_gguf(name: str, folder: Path):
    """The zoo's tiny ``name`` model stored as GGUF Q8_0 in ``folder`` and loaded back the way
    ``UnetLoaderGGUF`` loads: city96's ``gguf_sd_loader`` reads the file, its ``GGMLOps`` build the
    layers, its ``GGUFModelPatcher`` manages the model. Only the model detection is the zoo's
    (its tiny configs are not full-size ones core's detection knows). Returns the patcher."""
    import comfy.model_patcher
    import comfy.supported_models as sm
    import torch

    from . import gguf_pack, zoo
    gnodes = gguf_pack.load_in_process()
    import sys
    loader = sys.modules[gguf_pack.MODULE_NAME + ".loader"]
    plain = zoo.build(name)
    dm = plain.model.diffusion_model
    sd = dict(dm.state_dict())
    # as city96's converter: the weights of Linear layers are quantized, other tensors (modulation
    # tables, gates held as bare parameters, norms, biases) stay F32
    linear = {f"{n}.weight" for n, m in dm.named_modules() if isinstance(m, torch.nn.Linear)}
    path = folder / f"{name}_q8_0.gguf"
    _write_arch(sd, path, ZOO_ARCHS[name], linear)
    del plain
    gsd = loader.gguf_sd_loader(str(path))
    mc = getattr(sm, zoo.SPECS[name].supported_model)(zoo._config(name))
    mc.set_inference_dtype(torch.float32, None)
    mc.custom_operations = gnodes.GGMLOps()
    spec = zoo.SPECS[name]
    model = mc.get_model(spec.state_dict() if spec.state_dict else {})
    if spec.post_build is not None:
        spec.post_build(model.diffusion_model, mc.custom_operations)
    model.load_model_weights(gsd, "")
    model.eval()
    return gnodes.GGUFModelPatcher.clone(comfy.model_patcher.ModelPatcher(model, torch.device("cpu"),
                                                                          torch.device("cpu")))


def _write_arch(sd: dict, path: Path, arch: str, quantize: set) -> None:
    import gguf
    from gguf import GGMLQuantizationType as T
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in sorted(sd.items()):
        a = v.float().numpy()
        if k in quantize and a.ndim == 2 and a.shape[1] % 32 == 0:
            w.add_tensor(k, gguf.quants.quantize(a, T.Q8_0), raw_dtype=T.Q8_0)
        else:
            w.add_tensor(k, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
