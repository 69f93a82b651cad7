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
- :data:`PLANNING` (block-coverage planning, ``tests/test_zoo_full_size.py``): 21 published
  full-size configurations (``kind → (supported-model class, unet_config)``), the shapes core's
  model detection derives from the released checkpoints or the published model cards (noted per
  entry), built by :func:`meta_patcher` too.
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

PLANNING = {
    "sdxl": ("SDXL", SDXL),  # model_detection's SDXL
    "sd35_large": ("SD3", {  # SD3.5 Large: depth 38 (hidden 2432), context 4096 → 2432, pos_embed 192²
        "in_channels": 16, "out_channels": 16, "patch_size": 2, "depth": 38, "input_size": None, "adm_in_channels": 2048,
        "context_embedder_config": {"target": "torch.nn.Linear", "params": {"in_features": 4096, "out_features": 2432}},
        "num_patches": 36864, "pos_embed_max_size": 192, "qk_norm": "rms", "pos_embed_scaling_factor": None,
        "x_block_self_attn_layers": []}),
    "flux_dev": ("Flux", FLUX_DEV),
    "flux2_dev": ("Flux2", {  # model_detection's flux2 (hidden 6144, 48 heads), FLUX.2-dev: 8 double + 48 single
        "image_model": "flux2", "axes_dim": [32, 32, 32, 32], "num_heads": 48, "mlp_ratio": 3.0, "theta": 2000,
        "out_channels": 128, "global_modulation": True, "mlp_silu_act": True, "qkv_bias": False, "ops_bias": False,
        "default_ref_method": "index", "ref_index_scale": 10.0, "txt_ids_dims": [3], "patch_size": 1,
        "in_channels": 128, "hidden_size": 6144, "context_in_dim": 15360, "vec_in_dim": None, "depth": 8,
        "depth_single_blocks": 48, "guidance_embed": True}),
    "chroma": ("Chroma", {  # model_detection's chroma on Flux-schnell's 19 + 38 blocks
        "image_model": "chroma", "in_channels": 64, "out_channels": 64, "context_in_dim": 4096, "hidden_size": 3072,
        "mlp_ratio": 4.0, "num_heads": 24, "depth": 19, "depth_single_blocks": 38, "axes_dim": [16, 56, 56],
        "theta": 10000, "patch_size": 2, "qkv_bias": True, "in_dim": 64, "out_dim": 3072, "hidden_dim": 5120,
        "n_layers": 5, "vec_in_dim": None, "txt_ids_dims": []}),
    "qwen_image": ("QwenImage", {"image_model": "qwen_image", "in_channels": 64, "num_layers": 60}),  # class defaults
    "z_image": ("ZImage", {  # model_detection's dim 3840 branch, Z-Image-Turbo: 30 layers, Qwen3-4B features
        "image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 3840, "cap_feat_dim": 2560, "n_layers": 30,
        "qk_norm": True, "n_heads": 30, "n_kv_heads": 30, "axes_dims": [32, 48, 48], "axes_lens": [1536, 512, 512],
        "rope_theta": 256.0, "ffn_dim_multiplier": 8.0 / 3.0, "z_image_modulation": True, "time_scale": 1000.0,
        "pad_tokens_multiple": 32}),
    "lumina2": ("Lumina2", {  # model_detection's dim 2304 branch, Lumina-Image 2.0: 26 layers, Gemma-2-2B features
        "image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 2304, "cap_feat_dim": 2304, "n_layers": 26,
        "qk_norm": True, "n_heads": 24, "n_kv_heads": 8, "axes_dims": [32, 32, 32], "axes_lens": [300, 512, 512],
        "rope_theta": 10000.0, "ffn_dim_multiplier": 4.0}),
    "hunyuan_video": ("HunyuanVideo", {  # model_detection (hidden 3072 = 24 heads × 128), 20 double + 40 single
        "image_model": "hunyuan_video", "in_channels": 16, "out_channels": 16, "patch_size": [1, 2, 2], "vec_in_dim": 768,
        "axes_dim": [16, 56, 56], "context_in_dim": 4096, "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24,
        "depth": 20, "depth_single_blocks": 40, "theta": 256, "qkv_bias": True, "guidance_embed": True, "byt5": False,
        "meanflow": False, "use_cond_type_embedding": False, "vision_in_dim": None, "meanflow_sum": False}),
    "hunyuan_video15": ("HunyuanVideo15", {  # HunyuanVideo-1.5 (8.3 B): hidden 2048, 54 double blocks
        "image_model": "hunyuan_video", "in_channels": 65, "out_channels": 32, "patch_size": [1, 1, 1], "vec_in_dim": None,
        "axes_dim": [16, 56, 56], "context_in_dim": 3584, "hidden_size": 2048, "mlp_ratio": 4.0, "num_heads": 16,
        "depth": 54, "depth_single_blocks": 0, "theta": 256, "qkv_bias": True, "guidance_embed": False, "byt5": True,
        "meanflow": False, "use_cond_type_embedding": True, "vision_in_dim": 1152, "meanflow_sum": True}),
    "ltxv_2b": ("LTXV", {"image_model": "ltxv", "num_layers": 28, "attention_head_dim": 64,  # LTX-Video 2B
                         "cross_attention_dim": 2048}),
    "wan22_5b": ("WAN22_T2V", {  # Wan 2.2 TI2V 5B: dim 3072, ffn 14336, 30 layers, 48-channel latents
        "image_model": "wan2.1", "model_type": "t2v", "dim": 3072, "out_dim": 48, "num_heads": 24, "ffn_dim": 14336,
        "num_layers": 30, "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1), "qk_norm": True,
        "cross_attn_norm": True, "eps": 1e-6, "in_dim": 48}),
    "wan_14b": ("WAN21_T2V", WAN_14B),
    "auraflow": ("AuraFlow", {"max_seq": 9216, "cond_seq_dim": 2048, "n_double_layers": 4, "n_layers": 36}),  # v0.3
    "pixart_sigma": ("PixArtSigma", {  # model_detection's PixArt (hidden 1152, 16 heads), 28 blocks, 1024 px
        "image_model": "pixart_sigma", "num_heads": 16, "patch_size": 2, "hidden_size": 1152, "in_channels": 4,
        "depth": 28, "micro_condition": False, "model_max_length": 300, "input_size": 128, "pe_interpolation": 2}),
    "mochi": ("GenmoMochi", {  # model_detection's mochi_preview
        "image_model": "mochi_preview", "depth": 48, "patch_size": 2, "num_heads": 24, "hidden_size_x": 3072,
        "hidden_size_y": 1536, "mlp_ratio_x": 4.0, "mlp_ratio_y": 4.0, "learn_sigma": False, "in_channels": 12,
        "qk_norm": True, "qkv_bias": False, "out_bias": True, "attn_drop": 0.0, "patch_embed_bias": True,
        "posenc_preserve_area": True, "timestep_mlp_bias": True, "attend_to_padding": False, "timestep_scale": 1000.0,
        "use_t5": True, "t5_feat_dim": 4096, "t5_token_length": 256, "rope_theta": 10000.0}),
    "hidream": ("HiDream", {  # model_detection's hidream
        "image_model": "hidream", "attention_head_dim": 128, "axes_dims_rope": [64, 32, 32], "caption_channels": [4096, 4096],
        "max_resolution": [128, 128], "in_channels": 16, "llama_layers": list(range(32)) + [31] * 16,
        "num_attention_heads": 20, "num_routed_experts": 4, "num_activated_experts": 2, "num_layers": 16,
        "num_single_layers": 32, "out_channels": 16, "patch_size": 2, "text_emb_dim": 2048}),
    "cosmos_predict2_2b": ("CosmosT2IPredict2", {  # model_detection's cosmos_predict2, 2B: 2048 channels, 28 blocks
        "image_model": "cosmos_predict2", "max_img_h": 240, "max_img_w": 240, "max_frames": 128, "in_channels": 16,
        "out_channels": 16, "patch_spatial": 2, "patch_temporal": 1, "model_channels": 2048, "concat_padding_mask": True,
        "crossattn_emb_channels": 1024, "pos_emb_cls": "rope3d", "pos_emb_learnable": True, "pos_emb_interpolation": "crop",
        "min_fps": 1, "max_fps": 30, "use_adaln_lora": True, "adaln_lora_dim": 256, "num_blocks": 28, "num_heads": 16,
        "extra_per_block_abs_pos_emb": False, "rope_h_extrapolation_ratio": 4.0, "rope_w_extrapolation_ratio": 4.0,
        "rope_t_extrapolation_ratio": 1.0, "extra_h_extrapolation_ratio": 1.0, "extra_w_extrapolation_ratio": 1.0,
        "extra_t_extrapolation_ratio": 1.0, "rope_enable_fps_modulation": False}),
    "ace_step": ("ACEStep", {  # model_detection's ace
        "audio_model": "ace", "attention_head_dim": 128, "in_channels": 8, "inner_dim": 2560, "max_height": 16,
        "max_position": 32768, "max_width": 32768, "mlp_ratio": 2.5, "num_attention_heads": 20, "num_layers": 24,
        "out_channels": 8, "patch_size": [16, 1], "rope_theta": 1000000.0, "speaker_embedding_dim": 512,
        "text_embedding_dim": 768, "ssl_encoder_depths": [8, 8], "ssl_latent_dims": [1024, 768],
        "ssl_names": ["mert", "m-hubert"], "lyric_encoder_vocab_size": 6693, "lyric_hidden_size": 1024}),
    "stable_audio_open": ("StableAudio", {  # Stable Audio Open 1.0: 1536 wide, 24 layers, 24 heads
        "audio_model": "dit1.0", "io_channels": 64, "embed_dim": 1536, "depth": 24, "num_heads": 24,
        "cond_token_dim": 768, "global_cond_dim": 1536, "project_cond_tokens": False, "input_concat_dim": 0}),
    "hunyuan3d2": ("Hunyuan3Dv2", {  # Hunyuan3D-2.0 DiT: hidden 2048, 16 double + 32 single, 1536-d DINOv2 context
        "image_model": "hunyuan3d2", "in_channels": 64, "context_in_dim": 1536, "hidden_size": 2048, "mlp_ratio": 4.0,
        "num_heads": 16, "depth": 16, "depth_single_blocks": 32, "qkv_bias": True, "guidance_embed": False}),
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
    (``flux_dev``, ``wan_14b``, ``sdxl`` or a key of :data:`PLANNING`; ``dtype`` default: bf16,
    fp16 for SDXL). LookupError when this ComfyUI lacks the supported-model class."""
    comfy_env.setup_comfy()
    import comfy.model_patcher
    import comfy.supported_models as sm

    from . import zoo
    cls_name, cfg = PLANNING[kind]
    if not hasattr(sm, cls_name):
        raise LookupError(f"this ComfyUI has no comfy.supported_models.{cls_name}")
    cfg = zoo.version_config(cls_name, {**cfg, **(comfy_env.flux_version_params() if cls_name == "Flux" else {})})
    mc = getattr(sm, cls_name)(dict(cfg))
    mc.set_inference_dtype(dtype or (torch.float16 if kind == "sdxl" else torch.bfloat16), None)
    model = mc.get_model(zoo.seconds_embedders() if cls_name == "StableAudio" else {}, device=torch.device("meta"))
    return comfy.model_patcher.ModelPatcher(model, torch.device("cpu"), torch.device("cpu"))
