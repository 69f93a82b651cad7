"""Generated test models of real architectures (random weights, deterministic, cached).

Each model is built from ComfyUI's own classes, every tensor initialised (finite, std ≈ 0.02;
1-D norm scales ≈ 1), and saved with safetensors under ``paths.MODELS`` in ComfyUI's folder
layout. A file is written to ``<name>.partial`` and renamed, so a killed run leaves no half
file. Nothing here goes into git.

Models (see design.md, "Testing against the real thing"):
- ``checkpoints/mk_sd15_tiny.safetensors``: SD1.5-shaped checkpoint (UNet with one level,
  model_channels 320, context_dim 768; full-size CLIP-L and SD VAE, fp16).
- ``diffusion_models/mk_wan21_tiny.safetensors``: Wan 2.1 t2v, dim 128, ffn 256, 2 layers.
- ``vae/mk_wan21_vae_tiny.safetensors``: Wan 2.1 VAE, dim 16.
- ``diffusion_models/mk_flux_tiny.safetensors``: Flux-shaped (hidden 3072, 1 double + 1 single
  block), ComfyUI key names, fp32; and ``diffusion_models/mk_flux_tiny_sharded/``: the same
  weights in diffusers key names as 3+ shards with ``diffusion_pytorch_model.safetensors.index.json``.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from . import comfy_env, paths, sharded_models

FIXTURE_VERSION = "1"
SEED = 20261130


def randomize_(module: torch.nn.Module, seed: int = SEED, std: float = 0.02) -> torch.nn.Module:
    """Fill every floating parameter and buffer of ``module`` in place, deterministically.

    1-D tensors named ``weight``/``scale``/``gamma`` (norm scales) get ``1 + std·N(0,1)``;
    everything else ``std·N(0,1)``. ComfyUI's ``disable_weight_init`` ops leave tensors
    uninitialised, so this is required before any use.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if not t.is_floating_point():
                continue
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32) * std
            leaf = name.rsplit(".", 1)[-1]
            if t.ndim == 1 and leaf in ("weight", "scale", "gamma"):
                noise += 1.0
            elif t.ndim >= 1 and leaf == "gamma":  # Wan RMS_norm gamma has shape (C, 1, 1[, 1])
                noise += 1.0
            t.copy_(noise.to(t.dtype))
    return module


def _save(sd: dict[str, torch.Tensor], path: Path, metadata: dict | None = None) -> None:
    from safetensors.torch import save_file
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.partial")
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def _ops():
    import comfy.ops
    return comfy.ops.disable_weight_init


def sd15_unet_config() -> dict:
    """ComfyUI UNet config of the SD1.5-shaped test UNet: one level, one res block."""
    return {
        "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
        "legacy": False, "adm_in_channels": None, "dtype": torch.float32, "in_channels": 4,
        "model_channels": 320, "num_res_blocks": [1], "transformer_depth": [1], "channel_mult": [1],
        "transformer_depth_middle": 1, "use_linear_in_transformer": False, "context_dim": 768,
        "num_heads": 8, "transformer_depth_output": [1, 1], "use_temporal_attention": False,
        "use_temporal_resblock": False,
    }


def make_sd15_checkpoint(path: Path) -> None:
    """Write the SD1.5-shaped checkpoint (UNet + CLIP-L + VAE, fp16) that CheckpointLoaderSimple loads."""
    comfy_env.setup_comfy()
    import comfy.supported_models
    import comfy.sd
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
    from comfy.ldm.models.autoencoder import AutoencoderKL

    unet = randomize_(UNetModel(**sd15_unet_config(), operations=_ops()), SEED)
    sd = {"model.diffusion_model." + k: v for k, v in unet.state_dict().items()}
    del unet
    model_config = comfy.supported_models.SD15({})
    target = model_config.clip_target()
    clip = target.clip(device="cpu", dtype=torch.float32)
    randomize_(clip, SEED + 1)
    for k, v in clip.state_dict().items():
        if k.startswith("clip_l."):
            sd["cond_stage_model." + k[len("clip_l."):]] = v
    del clip
    ddconfig = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3,
                "ch": 128, "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
    vae = randomize_(AutoencoderKL(ddconfig=ddconfig, embed_dim=4), SEED + 2)
    for k, v in vae.state_dict().items():
        sd["first_stage_model." + k] = v
    sd = {k: (v.half() if v.is_floating_point() and "position_ids" not in k else v) for k, v in sd.items()}
    _save(sd, path)


def make_wan21(path: Path) -> None:
    """Write a Wan 2.1 t2v diffusion model: dim 128, ffn 256, 2 layers, 1 head (≈1.1 M params), fp32."""
    comfy_env.setup_comfy()
    from comfy.ldm.wan.model import WanModel
    m = WanModel(model_type="t2v", dim=128, ffn_dim=256, num_heads=1, num_layers=2, in_dim=16,
                 out_dim=16, text_dim=4096, operations=_ops())
    randomize_(m, SEED + 3)
    _save(m.state_dict(), path)


def make_wan21_vae(path: Path) -> None:
    """Write a Wan 2.1 VAE with dim 16 (≈3.6 M params), fp32."""
    comfy_env.setup_comfy()
    from comfy.ldm.wan.vae import WanVAE
    m = WanVAE(dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
               temperal_downsample=[False, True, True], dropout=0.0)
    randomize_(m, SEED + 4)
    _save(m.state_dict(), path)


FLUX_PARAMS = dict(in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=4096, hidden_size=3072,
                   mlp_ratio=4.0, num_heads=24, depth=1, depth_single_blocks=1, axes_dim=[16, 56, 56],
                   theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True)


def flux_comfy_to_diffusers(sd: dict[str, torch.Tensor], params: dict) -> dict[str, torch.Tensor]:
    """ComfyUI-format Flux state dict → diffusers key names (inverse of ``comfy.utils.flux_to_diffusers``).

    Fused qkv tensors are split by the map's (dim, start, length) offsets; the map's only value
    function, ``swap_scale_shift``, is its own inverse. Raises ValueError when a ComfyUI key is
    left unmapped.
    """
    import comfy.utils
    key_map = comfy.utils.flux_to_diffusers(
        {"depth": params["depth"], "depth_single_blocks": params["depth_single_blocks"],
         "hidden_size": params["hidden_size"]}, output_prefix="")
    out, used, written = {}, set(), set()
    for dkey, target in key_map.items():
        # ComfyUI 0.33's map also lists alias names (LyCoris "ff.linear_in", Flux 2) for tensors
        # that already have one: write each ComfyUI tensor (or qkv slice) under its first name only.
        ident = target if isinstance(target, str) else (target[0], tuple(target[1] or ()))
        if ident in written:
            continue
        if isinstance(target, str):
            if target in sd:
                out[dkey] = sd[target].clone()
                used.add(target)
                written.add(ident)
            continue
        ckey, offset = target[0], target[1]
        fun = target[2] if len(target) > 2 else (lambda a: a)
        if ckey not in sd:
            continue
        written.add(ident)
        w = sd[ckey]
        if offset is not None:
            w = w.narrow(offset[0], offset[1], offset[2])
        out[dkey] = fun(w).clone()
        used.add(ckey)
    missing = set(sd) - used
    if missing:
        raise ValueError(f"ComfyUI Flux keys without a diffusers name: {sorted(missing)[:5]}")
    return out


def make_flux(single_path: Path, sharded_dir: Path) -> None:
    """Write the Flux-shaped model (≈0.55 B params, fp32) as one ComfyUI-format file and as
    diffusers-named shards (``max_shard_size`` 800 MB → 3 shards) with an index."""
    comfy_env.setup_comfy()
    from comfy.ldm.flux.model import Flux
    from huggingface_hub import save_torch_state_dict
    m = Flux(operations=_ops(), **FLUX_PARAMS, **comfy_env.flux_version_params())
    randomize_(m, SEED + 5)
    sd = {k: v for k, v in m.state_dict().items()}
    del m
    _save(sd, single_path)
    dsd = flux_comfy_to_diffusers(sd, FLUX_PARAMS)
    tmp = sharded_dir.with_name(sharded_dir.name + f".{os.getpid()}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_torch_state_dict(dsd, str(tmp), filename_pattern="diffusion_pytorch_model{suffix}.safetensors",
                          max_shard_size="800MB", safe_serialization=True)
    index = json.loads((tmp / "diffusion_pytorch_model.safetensors.index.json").read_text())
    if len(set(index["weight_map"].values())) < 3:
        raise RuntimeError("Flux fixture wrote fewer than 3 shards")
    shutil.rmtree(sharded_dir, ignore_errors=True)
    os.replace(tmp, sharded_dir)


def _stamped(path: Path) -> Path:
    return path.with_name(path.name + f".v{FIXTURE_VERSION}.ok")


def ensure_models(which: tuple[str, ...] = ("sd15", "wan", "flux")) -> dict[str, Path]:
    """Generate the requested fixtures if missing; return their paths (keys below).

    Keys: ``sd15`` (checkpoint), ``wan`` (diffusion model), ``wan_vae``, ``flux`` (single
    ComfyUI-format file), ``flux_sharded`` (folder); with ``sd15`` also the parts cut from it
    (see ``sharded_models``): ``sd15_clip_l``, ``sd15_clip_l_sharded``, ``sd15_unet_sharded``,
    ``sd15_vae``. Generation is skipped when a stamp file
    of the current FIXTURE_VERSION exists.
    """
    m = paths.MODELS
    out = {
        "sd15": m / "checkpoints" / "mk_sd15_tiny.safetensors",
        "wan": m / "diffusion_models" / "mk_wan21_tiny.safetensors",
        "wan_vae": m / "vae" / "mk_wan21_vae_tiny.safetensors",
        "flux": m / "diffusion_models" / "mk_flux_tiny.safetensors",
        "flux_sharded": m / "diffusion_models" / "mk_flux_tiny_sharded",
        **sharded_models.paths_for(m),
    }
    jobs = []
    if "sd15" in which:
        jobs.append((out["sd15"], lambda: make_sd15_checkpoint(out["sd15"])))
        jobs.append((out["sd15_vae"], lambda: sharded_models.make_sd15_parts(out["sd15"], out)))
    if "wan" in which:
        jobs.append((out["wan"], lambda: make_wan21(out["wan"])))
        jobs.append((out["wan_vae"], lambda: make_wan21_vae(out["wan_vae"])))
    if "flux" in which:
        jobs.append((out["flux"], lambda: make_flux(out["flux"], out["flux_sharded"])))
    for path, make in jobs:
        stamp = _stamped(path)
        if not stamp.exists() or not path.exists():
            make()
            stamp.touch()
    return out


if __name__ == "__main__":
    import sys
    for k, v in ensure_models(tuple(sys.argv[1:]) or ("sd15", "wan", "flux")).items():
        print(k, v)
