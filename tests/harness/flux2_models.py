"""Stand-ins for the Flux 2 [dev] template (``memory_plan_flux2_dev_16gb_vram_64gb_ram``).

- ``diffusion_models/mk_flux2_tiny.safetensors``: a Flux 2-shaped diffusion model of core's own
  class (``comfy.ldm.flux.model.Flux``, ``image_model="flux2"``) that core's detection reads as
  Flux 2: hidden size 128 (one head of 4 × 32 rotary axes), 1 double + 1 single block, 128 latent
  channels, guidance input, text context 4096 (what the test-only text encode gives: Flux 2's own
  text encoder, Mistral Small 3 24B, is far too big for a CPU test). ≈ 1.4 M parameters, fp32.
- ``vae/mk_flux2_vae.safetensors``: a Flux 2 VAE (32-channel KL autoencoder with the batch-norm
  latent). Core's VAE detection fixes its widths (128 channels, 2 res blocks), so it is full size
  (≈ 84 M parameters, fp16), as the SD1.5 VAE stand-in is.
"""
from __future__ import annotations

from pathlib import Path

from . import comfy_env, models, paths

DM = "mk_flux2_tiny.safetensors"
VAE = "mk_flux2_vae.safetensors"
VERSION = 1
PARAMS = dict(image_model="flux2", in_channels=128, out_channels=128, vec_in_dim=None, context_in_dim=4096,
              hidden_size=128, mlp_ratio=3.0, num_heads=1, depth=1, depth_single_blocks=1,
              axes_dim=[32, 32, 32, 32], theta=2000, patch_size=1, qkv_bias=False, guidance_embed=True,
              global_modulation=True, mlp_silu_act=True, ops_bias=False, default_ref_method="index",
              ref_index_scale=10.0, txt_ids_dims=[3])


def make_flux2(path: Path) -> None:
    comfy_env.setup_comfy()
    from comfy.ldm.flux.model import Flux
    params = dict(PARAMS)
    try:
        m = Flux(operations=models._ops(), **params)
    except TypeError:  # a core whose FluxParams lacks a newer field
        for k in ("txt_ids_dims", "ref_index_scale", "default_ref_method"):
            params.pop(k, None)
        m = Flux(operations=models._ops(), **params)
    models.randomize_(m, models.SEED + 60)
    models._save(m.state_dict(), path)


def make_flux2_vae(path: Path) -> None:
    comfy_env.setup_comfy()
    from comfy.ldm.models.autoencoder import AutoencoderKL
    ddconfig = {"double_z": True, "z_channels": 32, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0,
                "batch_norm_latent": True}
    m = models.randomize_(AutoencoderKL(ddconfig=ddconfig, embed_dim=32), models.SEED + 61)
    m.bn.running_var.abs_().add_(1.0)  # a variance: positive
    sd = {k: (v.half() if v.is_floating_point() else v) for k, v in m.state_dict().items()}
    models._save(sd, path)


def ensure_flux2() -> dict[str, Path]:
    """Generate the two files if missing (or of an older version); returns {"dm": path, "vae": path}."""
    out = {"dm": paths.MODELS / "diffusion_models" / DM, "vae": paths.MODELS / "vae" / VAE}
    for key, make in (("dm", make_flux2), ("vae", make_flux2_vae)):
        stamp = out[key].with_name(out[key].name + f".v{VERSION}.ok")
        if not stamp.exists() or not out[key].is_file():
            make(out[key])
            stamp.touch()
    return out
