"""How many pixels one latent pixel of a ComfyUI VAE stands for, from the model itself.

Core's VAE object carries the factors as ``upscale_ratio`` / ``downscale_ratio``; Tiled VAE
(and Memory Plan's VAE, through :func:`tiled_vae_io.vae_shape`) sizes and places its tiles with
the factor the model really has, read from the model's own layout where core's figure is known
to disagree with it:

- TAESD-family tiny autoencoders (``comfy.taesd.taesd.TAESD``): the decoder's ``nn.Upsample``
  factors (the encoder's strided convs), times 2 for the FLUX.2 variant (``DecoderFlux2`` /
  ``EncoderFlux2``: its 128-channel latent is a 32-channel one folded 2×2). ComfyUI 0.33 gives
  TAEF2 (``taef2`` in the VAE Loader) core's default ratio of 8 although one latent pixel decodes
  to 16×16 pixels: its VAE Decode (Tiled) crashes on a 512² image and returns a wrong image
  (overlapping copies) for a 1024² one.

Every other VAE keeps core's decode factor (the VAE zoo checks, for every VAE core detects, that a
tiled decode/encode has the untiled shape). The temporal factor is always core's.
"""
from __future__ import annotations

import math

import torch


def _core_spatial(vae, direction: str) -> int:
    return int(vae.spacial_compression_decode() if direction == "decode" else vae.spacial_compression_encode())


def _taesd_factor(model, direction: str) -> int | None:
    """Pixels per latent pixel side of core's TAESD model from its layout, or None for another model."""
    try:
        import comfy.taesd.taesd as taesd
    except ImportError:
        return None
    if type(model) is not getattr(taesd, "TAESD", None):
        return None
    if direction == "decode":
        coder = model.taesd_decoder
        f = math.prod(int(m.scale_factor) for m in coder.modules() if isinstance(m, torch.nn.Upsample))
    else:
        coder = model.taesd_encoder
        f = math.prod(int(m.stride[0]) for m in coder.modules() if isinstance(m, torch.nn.Conv2d))
    folded = getattr(taesd, "DecoderFlux2" if direction == "decode" else "EncoderFlux2", None)
    return f * 2 if folded is not None and isinstance(coder, folded) else f


def spatial_factor(vae, direction: str = "decode") -> int:
    """Pixels per latent pixel side of ``vae`` (a ``comfy.sd.VAE``) in ``direction``: the
    model's own where it is known (see the module docstring), else core's."""
    own = _taesd_factor(vae.first_stage_model, direction)
    return own if own is not None else int(vae.spacial_compression_decode())  # core's, as tiling always took it


def core_ratio_note(vae, direction: str = "decode") -> str | None:
    """A sentence for the node's report where core's VAE object has another spatial factor than
    the model (None where they agree)."""
    own = _taesd_factor(vae.first_stage_model, direction)
    core = _core_spatial(vae, direction)
    if own is None or own == core:
        return None
    name = type(vae.first_stage_model).__name__
    return (f"ComfyUI's VAE object gives this VAE ({name}, {vae.latent_channels} latent channels) a "
            f"{'decode' if direction == 'decode' else 'encode'} ratio of {core}, but the model works at "
            f"{own}x: tiles are placed at {own}x (ComfyUI's VAE {direction.capitalize()} (Tiled) is wrong for it)")


def crop_to_factor(pixels: torch.Tensor, factor: int) -> torch.Tensor:
    """``pixels`` (``[B, H, W, C]``) centre-cropped to a multiple of ``factor`` per side, as core's
    ``vae_encode_crop_pixels`` does with its own ratio."""
    for d in (1, 2):
        n = pixels.shape[d]
        keep = n // factor * factor
        if keep != n:
            pixels = pixels.narrow(d, (n % factor) // 2, keep)
    return pixels
