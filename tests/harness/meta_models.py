"""Full-size ComfyUI diffusion models on the meta device (no memory, built in milliseconds).

For planning tests and figures: device-map planning only reads tensor sizes, so a model built
from ComfyUI's own classes with ``device="meta"`` plans exactly as the real one would.

- ``flux_dev``: Flux.1-dev shape (hidden 3072, 19 double + 38 single blocks), 11.9 B params, bf16.
- ``wan_14b``: Wan 2.1 14B t2v shape (dim 5120, ffn 13824, 40 layers), 14.3 B params, bf16.
- ``sdxl``: the SDXL base UNet (model_channels 320, channel_mult 1/2/4, transformer depth 2/10,
  context 2048, adm 2816), 2.57 B params, fp16 (as SDXL checkpoints ship).
"""
from __future__ import annotations

import torch

from . import comfy_env

FLUX_DEV = {"image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 768,
            "context_in_dim": 4096, "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "depth": 19,
            "depth_single_blocks": 38, "axes_dim": [16, 56, 56], "theta": 10000, "patch_size": 2,
            "qkv_bias": True, "guidance_embed": True}
WAN_14B = {"image_model": "wan2.1", "model_type": "t2v", "dim": 5120, "out_dim": 16, "num_heads": 40,
           "ffn_dim": 13824, "num_layers": 40, "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1),
           "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6, "in_dim": 16}
SDXL = {"use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
        "legacy": False, "num_classes": "sequential", "adm_in_channels": 2816, "in_channels": 4,
        "model_channels": 320, "num_res_blocks": [2, 2, 2], "transformer_depth": [0, 0, 2, 2, 10, 10],
        "channel_mult": [1, 2, 4], "transformer_depth_middle": 10, "use_linear_in_transformer": True,
        "context_dim": 2048, "num_head_channels": 64, "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10],
        "use_temporal_attention": False, "use_temporal_resblock": False}
BLOCK_CLASSES = {"flux_dev": ["DoubleStreamBlock", "SingleStreamBlock"], "wan_14b": ["WanAttentionBlock"]}


def meta_patcher(kind: str, dtype: torch.dtype | None = None):
    """A ComfyUI ModelPatcher (load/offload device cpu) around a ``kind`` model on the meta device
    (``dtype`` default: bf16, fp16 for SDXL)."""
    comfy_env.setup_comfy()
    import comfy.model_patcher
    import comfy.supported_models as sm
    cfg, mc_cls = {"flux_dev": ({**FLUX_DEV, **comfy_env.flux_version_params()}, sm.Flux),
                   "wan_14b": (WAN_14B, sm.WAN21_T2V), "sdxl": (SDXL, sm.SDXL)}[kind]
    mc = mc_cls(dict(cfg))
    mc.set_inference_dtype(dtype or (torch.float16 if kind == "sdxl" else torch.bfloat16), None)
    model = mc.get_model({}, device=torch.device("meta"))
    return comfy.model_patcher.ModelPatcher(model, torch.device("cpu"), torch.device("cpu"))
