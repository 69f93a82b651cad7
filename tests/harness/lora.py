"""A small random LoRA for the SD1.5-shaped test checkpoint, in ComfyUI's key format.

Keys ``lora_unet_<UNet key with "." → "_">.lora_up.weight`` / ``.lora_down.weight`` /
``.alpha`` (the "lora_unet_" names ``comfy.lora.model_lora_keys_unet`` maps), rank 4, for every
attention projection, feed-forward and transformer in/out projection, the residual blocks'
convolutions and the time embedding. Deterministic, cached under ``.cache/models/loras``
(written to ``.partial`` and renamed), never in git.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from . import models, paths

LORA_NAME = "mk_sd15_lora_tiny.safetensors"
VERSION = "1"
RANK = 4
_TARGETS = (".to_q.", ".to_k.", ".to_v.", ".to_out.0.", ".ff.net.", ".proj_in.", ".proj_out.",
            ".in_layers.2.", ".out_layers.3.", "time_embed.0.")


def make_sd15_lora(checkpoint: Path, path: Path, seed: int = 77) -> None:
    """Write the LoRA for the UNet weights of ``checkpoint`` (2-D linear and 4-D conv weights)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    prefix = "model.diffusion_model."
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(checkpoint), framework="pt") as f:
        for key in sorted(f.keys()):
            if not (key.startswith(prefix) and key.endswith(".weight") and any(t in key for t in _TARGETS)):
                continue
            shape = f.get_slice(key).get_shape()
            if len(shape) not in (2, 4):
                continue
            name = "lora_unet_" + key[len(prefix):-len(".weight")].replace(".", "_")
            down_shape = [RANK, shape[1]] + list(shape[2:])
            up_shape = [shape[0], RANK] + [1] * (len(shape) - 2)
            out[f"{name}.lora_down.weight"] = (torch.randn(down_shape, generator=gen) * 0.05).half()
            out[f"{name}.lora_up.weight"] = (torch.randn(up_shape, generator=gen) * 0.05).half()
            out[f"{name}.alpha"] = torch.tensor(float(RANK))
    if not out:
        raise RuntimeError(f"no LoRA targets found in {checkpoint}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.partial")
    save_file(out, str(tmp))
    os.replace(tmp, path)


def ensure_sd15_lora() -> Path:
    """Path of the SD1.5 test LoRA in ``models/loras`` (generated on first use)."""
    path = paths.MODELS / "loras" / LORA_NAME
    stamp = path.with_name(path.name + f".v{VERSION}.ok")
    if not (path.exists() and stamp.exists()):
        make_sd15_lora(models.ensure_models(("sd15",))["sd15"], path)
        stamp.touch()
    return path
