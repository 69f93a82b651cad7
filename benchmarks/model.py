"""The benchmark model: a Flux-shaped diffusion model built from ComfyUI's own classes.

Random weights (std 0.02), hidden size 3072, 24 heads (ComfyUI's Flux detection fixes
these), depth set by flags. Default on a GPU: 8 double + 16 single blocks = 5.05 B params
(9.4 GiB bf16), the model of design.md's anchor table; on CPU a 1 + 1 block model.
"""
from __future__ import annotations

import torch


# The runbook's DEVICE=cpu dry run: same classes, narrow enough for a CI machine (0.9 M params).
TINY = {"hidden_size": 128, "num_heads": 2, "context_in_dim": 64, "axes_dim": [8, 28, 28], "text_tokens": 16}


def flux_config(depth: int, single: int, tiny: bool = False) -> dict:
    """ComfyUI unet_config of the Flux-shaped model (as ``comfy.supported_models.Flux`` takes it).
    ``tiny``: hidden size 128, 2 heads, context dim 64 (built directly, never detected)."""
    cfg = {"image_model": "flux", "in_channels": 16, "patch_size": 2, "out_channels": 16, "vec_in_dim": 768,
           "context_in_dim": 4096, "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "depth": depth,
           "depth_single_blocks": single, "axes_dim": [16, 56, 56], "theta": 10000, "qkv_bias": True,
           "guidance_embed": True}
    if tiny:
        cfg.update({k: v for k, v in TINY.items() if k != "text_tokens"})
    return cfg


def build(depth: int, single: int, dtype: torch.dtype, device: torch.device, weight_dtype=None,
          manual_cast=None, seed: int = 0, tiny: bool = False):
    """Build ComfyUI's Flux BaseModel on the CPU with random weights; returns the BaseModel.

    ``weight_dtype``/``manual_cast`` as ``model_config.set_inference_dtype`` takes them (core's
    fp8 path: weight_dtype=float8_e4m3fn, manual_cast=compute dtype). Weights are drawn on
    ``device`` (fast on a GPU) and stored on the CPU.
    """
    import dataclasses

    import comfy.ldm.flux.model as flux_model
    import comfy.supported_models as sm
    cfg = flux_config(depth, single, tiny)
    if "txt_ids_dims" in {f.name for f in dataclasses.fields(flux_model.FluxParams)}:
        cfg["txt_ids_dims"] = []  # required since ComfyUI 0.33 (Flux.1 has none)
    mc = sm.Flux(cfg)
    mc.set_inference_dtype(weight_dtype or dtype, manual_cast)
    model = mc.get_model({}, device=torch.device("cpu"))
    gen_dev = device if device.type == "cuda" else torch.device("cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            t = torch.empty(p.shape, dtype=torch.float32, device=gen_dev).normal_(0, 0.02)
            p.data = t.to("cpu", p.dtype)
    return model


def inputs(res: int, dtype: torch.dtype, device: torch.device, text_tokens: int = 512, tiny: bool = False):
    """Inputs of one forward at ``res``² pixels: latent (1,16,res/8,res/8), timestep (1,),
    context (1,text_tokens,4096) (tiny: (1,16,64)), pooled y (1,768), guidance (1,)."""
    g = torch.Generator().manual_seed(1)
    lat = res // 8
    ctx_dim = TINY["context_in_dim"] if tiny else 4096
    text_tokens = TINY["text_tokens"] if tiny else text_tokens
    x = torch.randn(1, 16, lat, lat, generator=g).to(device, dtype)
    t = torch.tensor([0.5]).to(device, dtype)
    ctx = torch.randn(1, text_tokens, ctx_dim, generator=g).to(device, dtype)
    y = torch.randn(1, 768, generator=g).to(device, dtype)
    guidance = torch.tensor([3.5]).to(device, dtype)
    return x, t, ctx, y, guidance


def param_bytes(module: torch.nn.Module) -> int:
    """Bytes of all parameters and buffers of ``module``."""
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))
