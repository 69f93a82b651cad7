"""Sharded fixtures cut from the SD1.5-shaped checkpoint (tests of the sharded loaders, demo).

Written with huggingface_hub's ``save_torch_state_dict`` (independent of the pack's own
``Save Sharded``), each file/folder written under a ``.partial`` name and renamed:

- ``text_encoders/mk_sd15_clip_l.safetensors``: the checkpoint's CLIP-L in transformers'
  names (``text_model.*``, ``text_projection.weight``), one file, as Load CLIP takes it;
- ``text_encoders/mk_sd15_clip_l_sharded/``: the same tensors as 3 shards
  (``model-0000i-of-00003.safetensors`` + ``model.safetensors.index.json``, transformers' names);
- ``diffusion_models/mk_sd15_tiny_unet_sharded/``: the checkpoint's UNet in ComfyUI's names
  (no prefix), 3 shards + index;
- ``vae/mk_sd15_vae_tiny.safetensors``: the checkpoint's VAE (for the example workflow).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path


def paths_for(models: Path) -> dict[str, Path]:
    return {
        "sd15_clip_l": models / "text_encoders" / "mk_sd15_clip_l.safetensors",
        "sd15_clip_l_sharded": models / "text_encoders" / "mk_sd15_clip_l_sharded",
        "sd15_unet_sharded": models / "diffusion_models" / "mk_sd15_tiny_unet_sharded",
        "sd15_vae": models / "vae" / "mk_sd15_vae_tiny.safetensors",
    }


def _part(sd: dict, prefix: str, new_prefix: str = "") -> dict:
    return {new_prefix + k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def _save_folder(sd: dict, folder: Path, max_shard_size: str) -> None:
    from huggingface_hub import save_torch_state_dict
    tmp = folder.with_name(folder.name + f".{os.getpid()}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_torch_state_dict(sd, str(tmp), max_shard_size=max_shard_size)  # model-0000i-of-0000N + index
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


def _save_file(sd: dict, path: Path) -> None:
    from safetensors.torch import save_file
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.partial")
    save_file(sd, str(tmp))
    os.replace(tmp, path)


def make_sd15_parts(ckpt: Path, out: dict[str, Path]) -> None:
    """Write the four fixtures above from the SD1.5-shaped checkpoint (fp16 tensors kept as is);
    the VAE last (the stamp's file)."""
    from safetensors.torch import load_file
    sd = load_file(str(ckpt))
    clip = _part(sd, "cond_stage_model.transformer.")
    _save_file(clip, out["sd15_clip_l"])
    _save_folder(clip, out["sd15_clip_l_sharded"], "100MB")  # 247 MB fp16 → 3 shards
    _save_folder(_part(sd, "model.diffusion_model."), out["sd15_unet_sharded"], "20MB")  # 52 MB → 3 shards
    _save_file(_part(sd, "first_stage_model."), out["sd15_vae"])
