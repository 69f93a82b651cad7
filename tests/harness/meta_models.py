"""Full-size ComfyUI diffusion models on the meta device (no memory, built in milliseconds).

For planning tests and figures: device-map planning only reads tensor sizes, so a model built
from ComfyUI's own classes with ``device="meta"`` plans exactly as the real one would.

- ``flux_dev``: Flux.1-dev shape (hidden 3072, 19 double + 38 single blocks), 11.9 B params, bf16.
- ``wan_14b``: Wan 2.1 14B t2v shape (dim 5120, ffn 13824, 40 layers), 14.3 B params, bf16.
- ``sdxl``: the SDXL base UNet (model_channels 320, channel_mult 1/2/4, transformer depth 2/10,
  context 2048, adm 2816), 2.57 B params, fp16 (as SDXL checkpoints ship).
- :data:`FULL_SIZE` (FP8 coverage planning): SD3.5 Large, Qwen-Image, HunyuanVideo,
  HunyuanVideo 1.5, AuraFlow (published shapes, as core's model detection reads them from the
  released checkpoints), built by :func:`meta_diffusion_model`.
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
HV_COMMON = {"image_model": "hunyuan_video", "mlp_ratio": 4.0, "theta": 256, "qkv_bias": True, "axes_dim": [16, 56, 56],
             "meanflow": False, "meanflow_sum": False}
# name → (comfy.supported_models class, config): the published full sizes.
FULL_SIZE = {
    "sd35_large": ("SD3", {"in_channels": 16, "out_channels": 16, "patch_size": 2, "depth": 38, "input_size": None,
                           "num_patches": 36864, "pos_embed_max_size": 192, "adm_in_channels": 2048,
                           "context_embedder_config": {"target": "torch.nn.Linear",
                                                       "params": {"in_features": 4096, "out_features": 2432}},
                           "qk_norm": "rms", "pos_embed_scaling_factor": None, "x_block_self_attn_layers": []}),
    "qwen_image": ("QwenImage", {"image_model": "qwen_image", "in_channels": 64, "out_channels": 16, "num_layers": 60,
                                 "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 3584,
                                 "axes_dims_rope": [16, 56, 56]}),
    "hunyuan_video": ("HunyuanVideo", {**HV_COMMON, "in_channels": 16, "out_channels": 16, "patch_size": [1, 2, 2],
                                       "vec_in_dim": 768, "context_in_dim": 4096, "hidden_size": 3072, "num_heads": 24,
                                       "depth": 20, "depth_single_blocks": 40, "guidance_embed": True, "byt5": False,
                                       "use_cond_type_embedding": False, "vision_in_dim": None}),
    "hunyuan_video15": ("HunyuanVideo15", {**HV_COMMON, "in_channels": 65, "out_channels": 32, "patch_size": [1, 1, 1],
                                           "vec_in_dim": None, "context_in_dim": 3584, "hidden_size": 2048,
                                           "num_heads": 16, "depth": 54, "depth_single_blocks": 0,
                                           "guidance_embed": False, "byt5": True, "use_cond_type_embedding": True,
                                           "vision_in_dim": 1152}),
    "auraflow": ("AuraFlow", {"max_seq": 9216, "cond_seq_dim": 2048, "n_double_layers": 4, "n_layers": 36, "dim": 3072,
                              "n_heads": 24, "global_conddim": 3072, "in_channels": 4, "out_channels": 4,
                              "patch_size": 2}),
}


def meta_diffusion_model(name: str, dtype: torch.dtype = torch.bfloat16):
    """The diffusion model (``nn.Module`` on the meta device) of :data:`FULL_SIZE`'s ``name``, or of
    ``flux_dev`` / ``wan_14b``; None when this ComfyUI lacks the architecture. Config keys the
    core's params dataclass lacks (0.3.75: no HunyuanVideo 1.5 fields) are dropped."""
    import dataclasses
    import importlib
    comfy_env.setup_comfy()
    import comfy.supported_models as sm
    if name in ("flux_dev", "wan_14b"):
        return meta_patcher(name, dtype).model.diffusion_model
    cls_name, cfg = FULL_SIZE[name]
    if not hasattr(sm, cls_name):
        return None
    cfg = dict(cfg)
    if cfg.get("image_model") == "hunyuan_video":
        params = importlib.import_module("comfy.ldm.hunyuan_video.model").HunyuanVideoParams
        fields = {f.name for f in dataclasses.fields(params)} | {"image_model"}
        cfg = {k: v for k, v in cfg.items() if k in fields}
    mc = getattr(sm, cls_name)(cfg)
    mc.set_inference_dtype(dtype, None)
    return mc.get_model({}, device=torch.device("meta")).diffusion_model


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
