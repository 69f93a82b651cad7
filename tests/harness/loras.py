"""A small random LoRA for the SD1.5-shaped test checkpoint, in ComfyUI's key format.

``loras/mk_sd15_lora_fp8test.safetensors`` (cached under ``paths.MODELS``): rank-4 LoRA
(``lora_unet_<module name with _>.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha``)
on every Linear of the UNet's transformer blocks, the resblocks' 3×3 convs, the 1×1
``proj_in``/``proj_out`` convs and ``time_embed.0`` (a layer FP8 Layerwise Cast keeps).
Effective delta ΔW = up @ down · alpha/rank has element std ≈ 0.001 (5 % of the fixture's
weight std 0.02): below a float8 e4m3 rounding step of those weights, so a LoRA merged into
already-rounded float8 weights would mostly vanish, while one merged before rounding survives.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from . import comfy_env, paths

LORA_NAME = "mk_sd15_lora_fp8test.safetensors"
LORA_VERSION = "1"
RANK = 4
TARGETS = re.compile(r"(transformer_blocks\.\d+\.(attn\d\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))"
                     r"|in_layers\.2|out_layers\.3|proj_in|proj_out|^time_embed\.0)$")


# A LoRA that moves weights far: rank 4 on every attention and feed-forward Linear, up and down
# weights of std 0.3 each, so each ΔW element has std 0.3 · 0.3 · sqrt(4) = 0.18 ≈ 9 × the
# fixture's weight std 0.02 — past the amax a float8 scale computed before the LoRA covers.
BIG_LORA_NAME = "mk_sd15_lora_big.safetensors"
BIG_TARGETS = re.compile(r"transformer_blocks\.\d+\.(attn\d\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))$")


def make_sd15_lora(path: Path, seed: int = 4242, delta_std: float = 1e-3, targets: re.Pattern = TARGETS,
                   updown_std: float | None = None) -> None:
    """Write the LoRA described in the module docstring (float32, deterministic); ``targets``
    and ``updown_std`` (std of each of up/down, overriding ``delta_std``) make other ones."""
    comfy_env.setup_comfy()
    import comfy.ops
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
    from safetensors.torch import save_file

    from .models import sd15_unet_config

    with torch.device("meta"):
        unet = UNetModel(**sd15_unet_config(), operations=comfy.ops.disable_weight_init)
    gen = torch.Generator().manual_seed(seed)
    # ΔW element std = std_up · std_down · sqrt(rank) (alpha = rank → scale 1).
    std = updown_std if updown_std is not None else (delta_std / RANK ** 0.5) ** 0.5
    sd = {}
    for name, m in unet.named_modules():
        if not targets.search(name) or not isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
            continue
        out_ch, in_ch = m.weight.shape[:2]
        kernel = tuple(m.weight.shape[2:])
        key = "lora_unet_" + name.replace(".", "_")
        sd[f"{key}.lora_down.weight"] = torch.randn((RANK, in_ch) + kernel, generator=gen) * std
        sd[f"{key}.lora_up.weight"] = torch.randn((out_ch, RANK) + (1,) * len(kernel), generator=gen) * std
        sd[f"{key}.alpha"] = torch.tensor(float(RANK))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.partial")
    save_file(sd, str(tmp))
    os.replace(tmp, path)


def _ensure(name: str, **kwargs) -> Path:
    """Path of ``loras/<name>``, written by :func:`make_sd15_lora` (``kwargs``) on first use and
    then cached (a stamp file marks a complete one of this :data:`LORA_VERSION`)."""
    path = paths.MODELS / "loras" / name
    stamp = path.with_name(path.name + f".v{LORA_VERSION}.ok")
    if not path.exists() or not stamp.exists():
        make_sd15_lora(path, **kwargs)
        stamp.touch()
    return path


def ensure_sd15_lora() -> Path:
    """Path of the LoRA (generated on first use, then cached)."""
    return _ensure(LORA_NAME)


def ensure_big_lora() -> Path:
    """Path of the far-moving LoRA (:data:`BIG_LORA_NAME`; generated on first use, then cached)."""
    return _ensure(BIG_LORA_NAME, seed=4343, targets=BIG_TARGETS, updown_std=0.3)


# A LoRA the size of the weights: the same layers as the big one, up and down std 0.1, so each ΔW
# element has std 0.1 · 0.1 · sqrt(4) = 0.02 = the fixture's weight std (at strength 2: twice it).
SIZED_LORA_NAME = "mk_sd15_lora_sized.safetensors"


def ensure_sized_lora() -> Path:
    """Path of :data:`SIZED_LORA_NAME` (generated on first use, then cached)."""
    return _ensure(SIZED_LORA_NAME, seed=4444, targets=BIG_TARGETS, updown_std=0.1)
