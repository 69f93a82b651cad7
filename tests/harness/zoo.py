"""A model zoo: a tiny instance of every diffusion architecture the tested ComfyUI builds.

Each architecture is built from core's own classes: its ``comfy.supported_models`` config
class with a tiny ``unet_config`` and ``get_model`` (so the ``BaseModel`` subclass, its model
sampling and ComfyUI's operations are the real ones), float32, every tensor initialised
(finite, std 0.02, deterministic per architecture). Inputs go through the model's own
``extra_conds`` (the sampler's conditioning path) and one forward runs through
``BaseModel.apply_model``, so ComfyUI's pre/post-processing runs too.

Public names (stable; other tests and branches use them):

- ``ARCHS``: the architecture names this module knows, in a fixed order (``"sdxl"``, ``"sd3"``,
  ``"flux"``, ``"flux2"``, ``"chroma"``, ``"qwen_image"``, ``"z_image"``, ``"lumina2"``,
  ``"hunyuan_video"``, ``"hunyuan_video15"``, ``"ltxv"``, ``"wan21"``, ``"wan22"``,
  ``"hidream"``, ``"kandinsky5"``, ``"auraflow"``, ``"pixart_sigma"``, ``"mochi"``,
  ``"cogvideox"``, ``"cosmos_predict2"``, ``"ace_step"``, ``"stable_audio"``, ``"hunyuan3d2"``,
  ``"hunyuan_dit"``, ``"omnigen2"``, ``"stable_cascade_c"``; new names are only appended).
- ``available(name) -> str | None``: None when this ComfyUI can build ``name``, else the reason
  (the supported-model class it lacks) -- tests skip with it.
- ``build(name) -> comfy.model_patcher.ModelPatcher``: a fresh tiny model (load and offload
  device cpu); ``patcher.model`` is the ``BaseModel``, ``patcher.model.diffusion_model`` the
  ``nn.Module`` the techniques act on. Raises ``LookupError`` when unavailable.
- ``inputs(name, base_model) -> (x, sigma, kwargs)``: deterministic inputs for one
  ``base_model.apply_model(x, sigma, **kwargs)``.
- ``forward(patcher_or_base_model, name, inputs=None) -> Tensor``: that forward under
  ``torch.no_grad()``.
- ``SPECS[name].supported_model``: the ``comfy.supported_models`` class name used.
- ``seconds_embedders()``: the state dict of Stable Audio's seconds conditioners (``get_model`` reads it).
- ``version_config(supported_model, config)``: ``config`` for this core (keys its params dataclass lacks dropped).
- ``reads_outside_forward(model, name)``: parameters one forward reads outside their module's forward.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from . import comfy_env


@dataclasses.dataclass(frozen=True)
class Spec:
    """One architecture: its supported-model class, tiny config and conditioning shapes."""
    supported_model: str
    config: dict
    latent: tuple                  # noise shape (batch 1)
    context: tuple | None = None   # cross_attn shape
    pooled: tuple | None = None    # pooled_output shape
    extra: Callable | None = None  # (generator) -> dict of more extra_conds kwargs
    sigma: float = 0.5
    state_dict: Callable | None = None  # () -> the state dict ``get_model`` reads (conditioners)
    post_build: Callable | None = None  # (diffusion_model, operations) -> None: shrink a fixed-size part


def seconds_embedders() -> dict:
    """Stable Audio's two seconds conditioners (output 768 is fixed in ``StableAudio1``), as
    ``get_model`` reads them from a checkpoint."""
    from comfy.ldm.audio.embedders import NumberConditioner
    sd = {}
    for i, key in enumerate(("seconds_start", "seconds_total")):
        c = NumberConditioner(768, min_val=0, max_val=512)
        init_weights(c, 77 + i)
        sd.update({f"conditioner.conditioners.{key}.{k}": v for k, v in c.state_dict().items()})
    return sd


def _small_lyric_encoder(dm, operations) -> None:
    """ACE-Step's lyric encoder is built with fixed width 1024 and 6 blocks (~130 M params);
    replaced by core's same class (``ConformerEncoder``) at the zoo's width."""
    from comfy.ldm.ace.lyric_encoder import ConformerEncoder
    width = dm.lyric_proj.in_features
    dm.lyric_encoder = ConformerEncoder(input_size=width, output_size=width, attention_heads=2, linear_units=2 * width,
                                        num_blocks=1, static_chunk_size=0, dtype=torch.float32, operations=operations)


def _mask(n):
    return lambda g: {"attention_mask": torch.ones(1, n, dtype=torch.long)}


SPECS: dict[str, Spec] = {
    "sdxl": Spec("SDXL", {
        "model_channels": 32, "use_linear_in_transformer": True, "transformer_depth": [0, 1],
        "context_dim": 64, "adm_in_channels": 2816, "use_temporal_attention": False,
        "in_channels": 4, "out_channels": 4, "num_res_blocks": [1, 1], "channel_mult": [1, 2],
        "transformer_depth_middle": 1, "transformer_depth_output": [0, 0, 1, 1], "num_head_channels": 16,
        "use_spatial_transformer": True, "legacy": False, "num_classes": "sequential", "image_size": 32}, (1, 4, 8, 8),
        context=(1, 8, 64), pooled=(1, 1280)),
    "sd3": Spec("SD3", {
        "in_channels": 16, "out_channels": 16, "patch_size": 2, "depth": 2, "input_size": None,
        "adm_in_channels": 32, "context_embedder_config": {
            "target": "torch.nn.Linear", "params": {"in_features": 64, "out_features": 128}},
        "num_patches": 64, "pos_embed_max_size": 8, "qk_norm": "rms", "pos_embed_scaling_factor": None,
        "x_block_self_attn_layers": [0]}, (1, 16, 8, 8), context=(1, 8, 64), pooled=(1, 32)),
    "flux": Spec("Flux", {
        "image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 32, "context_in_dim": 64,
        "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 2, "depth": 1, "depth_single_blocks": 2,
        "axes_dim": [8, 12, 12], "theta": 10000, "patch_size": 2, "qkv_bias": True, "guidance_embed": True,
        "txt_ids_dims": []},
        (1, 16, 8, 8), context=(1, 8, 64), pooled=(1, 32)),
    "flux2": Spec("Flux2", {
        "image_model": "flux2", "in_channels": 16, "out_channels": 16, "vec_in_dim": None, "context_in_dim": 64,
        "hidden_size": 64, "mlp_ratio": 3.0, "num_heads": 2, "depth": 1, "depth_single_blocks": 2,
        "axes_dim": [8, 8, 8, 8], "theta": 2000, "patch_size": 1, "qkv_bias": False, "guidance_embed": True,
        "global_modulation": True, "mlp_silu_act": True, "ops_bias": False, "default_ref_method": "index",
        "ref_index_scale": 10.0, "txt_ids_dims": [3]}, (1, 16, 8, 8), context=(1, 8, 64), pooled=(1, 32)),
    "chroma": Spec("Chroma", {
        "image_model": "chroma", "in_channels": 64, "out_channels": 64, "context_in_dim": 64,
        "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 2, "depth": 1, "depth_single_blocks": 2,
        "axes_dim": [8, 12, 12], "theta": 10000, "patch_size": 2, "qkv_bias": True, "in_dim": 64, "out_dim": 64,
        "hidden_dim": 64, "n_layers": 2, "vec_in_dim": None, "txt_ids_dims": []},
        (1, 16, 8, 8), context=(1, 8, 64), pooled=(1, 32)),
    "qwen_image": Spec("QwenImage", {
        "image_model": "qwen_image", "in_channels": 64, "out_channels": 16, "num_layers": 2,
        "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 64,
        "axes_dims_rope": [4, 6, 6]}, (1, 16, 1, 8, 8), context=(1, 8, 64)),
    "z_image": Spec("ZImage", {
        "image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 256, "cap_feat_dim": 32,
        "n_layers": 2, "n_refiner_layers": 1, "qk_norm": True, "n_heads": 2, "n_kv_heads": 2,
        "axes_dims": [32, 48, 48], "axes_lens": [64, 32, 32], "rope_theta": 256.0, "ffn_dim_multiplier": 8.0 / 3.0,
        "z_image_modulation": True, "time_scale": 1000.0, "pad_tokens_multiple": 32},
        (1, 16, 8, 8), context=(1, 8, 32), extra=_mask(8)),
    "lumina2": Spec("Lumina2", {
        "image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 64, "cap_feat_dim": 32,
        "n_layers": 2, "n_refiner_layers": 1, "qk_norm": True, "n_heads": 2, "n_kv_heads": 1,
        "axes_dims": [8, 12, 12], "axes_lens": [64, 32, 32], "rope_theta": 10000.0, "ffn_dim_multiplier": 4.0},
        (1, 16, 8, 8), context=(1, 8, 32), extra=_mask(8)),
    "hunyuan_video": Spec("HunyuanVideo", {
        "image_model": "hunyuan_video", "in_channels": 16, "out_channels": 16, "patch_size": [1, 2, 2],
        "vec_in_dim": 32, "axes_dim": [4, 6, 6], "context_in_dim": 64, "hidden_size": 32, "mlp_ratio": 2.0,
        "num_heads": 2, "depth": 1, "depth_single_blocks": 1, "theta": 256, "qkv_bias": True,
        "guidance_embed": True, "byt5": False, "meanflow": False, "use_cond_type_embedding": False,
        "vision_in_dim": None, "meanflow_sum": False}, (1, 16, 2, 8, 8), context=(1, 8, 64), pooled=(1, 32)),
    "hunyuan_video15": Spec("HunyuanVideo15", {
        "image_model": "hunyuan_video", "in_channels": 65, "out_channels": 32, "patch_size": [1, 1, 1],
        "vec_in_dim": None, "axes_dim": [4, 6, 6], "context_in_dim": 64, "hidden_size": 32, "mlp_ratio": 2.0,
        "num_heads": 2, "depth": 2, "depth_single_blocks": 0, "theta": 256, "qkv_bias": True,
        "guidance_embed": False, "byt5": False, "use_cond_type_embedding": True, "vision_in_dim": 32,
        "meanflow": False, "meanflow_sum": True}, (1, 32, 2, 4, 4), context=(1, 8, 64), pooled=(1, 32)),
    "ltxv": Spec("LTXV", {
        "image_model": "ltxv", "in_channels": 128, "num_layers": 2, "attention_head_dim": 16,
        "num_attention_heads": 2, "cross_attention_dim": 32, "caption_channels": 64},
        (1, 128, 2, 4, 4), context=(1, 8, 64), extra=_mask(8)),
    "wan21": Spec("WAN21_T2V", {
        "image_model": "wan2.1", "model_type": "t2v", "dim": 32, "out_dim": 16, "num_heads": 2, "ffn_dim": 64,
        "num_layers": 2, "patch_size": (1, 2, 2), "freq_dim": 32, "window_size": (-1, -1), "qk_norm": True,
        "cross_attn_norm": True, "eps": 1e-6, "in_dim": 16, "text_dim": 64, "text_len": 8},
        (1, 16, 2, 8, 8), context=(1, 8, 64)),
    "wan22": Spec("WAN22_T2V", {
        "image_model": "wan2.1", "model_type": "t2v", "dim": 32, "out_dim": 48, "num_heads": 2, "ffn_dim": 64,
        "num_layers": 2, "patch_size": (1, 2, 2), "freq_dim": 32, "window_size": (-1, -1), "qk_norm": True,
        "cross_attn_norm": True, "eps": 1e-6, "in_dim": 48, "text_dim": 64, "text_len": 8},
        (1, 48, 2, 8, 8), context=(1, 8, 64)),
    "hidream": Spec("HiDream", {
        "image_model": "hidream", "attention_head_dim": 16, "axes_dims_rope": [8, 4, 4], "caption_channels": [64, 64],
        "max_resolution": [16, 16], "in_channels": 16, "llama_layers": [0, 1], "num_attention_heads": 2,
        "num_routed_experts": 2, "num_activated_experts": 1, "num_layers": 1, "num_single_layers": 1,
        "out_channels": 16, "patch_size": 2, "text_emb_dim": 32},
        (1, 16, 8, 8), context=(1, 8, 64), pooled=(1, 32),
        extra=lambda g: {"conditioning_llama3": torch.randn(1, 2, 8, 64, generator=g)}),
    "kandinsky5": Spec("Kandinsky5", {
        "image_model": "kandinsky5", "model_dim": 64, "axes_dims": (8, 12, 12), "time_dim": 32, "ff_dim": 128,
        "visual_embed_dim": 132, "num_text_blocks": 1, "num_visual_blocks": 2, "in_text_dim": 64,
        "in_text_dim2": 32, "patch_size": (1, 2, 2)}, (1, 16, 1, 8, 8), context=(1, 8, 64), pooled=(1, 32)),
    "auraflow": Spec("AuraFlow", {
        "max_seq": 64, "cond_seq_dim": 64, "n_double_layers": 1, "n_layers": 2, "dim": 64, "n_heads": 2,
        "global_conddim": 64, "in_channels": 4, "out_channels": 4, "patch_size": 2},
        (1, 4, 8, 8), context=(1, 8, 64)),
    "pixart_sigma": Spec("PixArtSigma", {
        "image_model": "pixart_sigma", "num_heads": 2, "patch_size": 2, "hidden_size": 64, "in_channels": 4,
        "depth": 2, "micro_condition": False, "caption_channels": 64, "model_max_length": 8,
        "input_size": 64, "pe_interpolation": 1}, (1, 4, 64, 64), context=(1, 8, 64)),
    "mochi": Spec("GenmoMochi", {
        "image_model": "mochi_preview", "depth": 2, "patch_size": 2, "num_heads": 2, "hidden_size_x": 96,
        "hidden_size_y": 32, "mlp_ratio_x": 128.0, "mlp_ratio_y": 2.0, "learn_sigma": False, "in_channels": 12,
        "qk_norm": True, "qkv_bias": False, "out_bias": True, "attn_drop": 0.0, "patch_embed_bias": True,
        "posenc_preserve_area": True, "timestep_mlp_bias": True, "attend_to_padding": False,
        "timestep_scale": 1000.0, "use_t5": True, "t5_feat_dim": 64, "t5_token_length": 8, "rope_theta": 10000.0},
        (1, 12, 2, 8, 8), context=(1, 8, 64), extra=_mask(8)),
    "cogvideox": Spec("CogVideoX_T2V", {
        "image_model": "cogvideox", "num_attention_heads": 2, "attention_head_dim": 48, "time_embed_dim": 32,
        "num_layers": 2, "in_channels": 16, "out_channels": 16, "patch_size": 2, "text_embed_dim": 64,
        "sample_height": 8, "sample_width": 8, "sample_frames": 5, "max_text_seq_length": 8},
        (1, 16, 2, 8, 8), context=(1, 8, 64)),
    "cosmos_predict2": Spec("CosmosT2IPredict2", {
        "image_model": "cosmos_predict2", "max_img_h": 16, "max_img_w": 16, "max_frames": 4, "in_channels": 16,
        "out_channels": 16, "patch_spatial": 2, "patch_temporal": 1, "model_channels": 64, "concat_padding_mask": True,
        "crossattn_emb_channels": 64, "pos_emb_cls": "rope3d", "pos_emb_learnable": True,
        "pos_emb_interpolation": "crop", "min_fps": 1, "max_fps": 30, "use_adaln_lora": True,
        "adaln_lora_dim": 16, "num_blocks": 2, "num_heads": 2, "extra_per_block_abs_pos_emb": False,
        "rope_h_extrapolation_ratio": 4.0, "rope_w_extrapolation_ratio": 4.0, "rope_t_extrapolation_ratio": 1.0,
        "extra_h_extrapolation_ratio": 1.0, "extra_w_extrapolation_ratio": 1.0, "extra_t_extrapolation_ratio": 1.0,
        "rope_enable_fps_modulation": False}, (1, 16, 1, 8, 8), context=(1, 8, 64)),
    "ace_step": Spec("ACEStep", {
        "audio_model": "ace", "attention_head_dim": 16, "in_channels": 8, "inner_dim": 32, "max_height": 16,
        "max_position": 256, "max_width": 256, "mlp_ratio": 2.0, "num_attention_heads": 2, "num_layers": 2,
        "out_channels": 8, "patch_size": [16, 1], "rope_theta": 1000000.0, "speaker_embedding_dim": 512,
        "text_embedding_dim": 64, "ssl_encoder_depths": [1, 1], "ssl_latent_dims": [16, 16],
        "ssl_names": ["mert", "m-hubert"], "lyric_encoder_vocab_size": 64, "lyric_hidden_size": 32},
        (1, 8, 16, 8), context=(1, 8, 64), post_build=_small_lyric_encoder,
        extra=lambda g: {"conditioning_lyrics": torch.randint(0, 64, (1, 8), generator=g)}),
    "stable_audio": Spec("StableAudio", {
        "audio_model": "dit1.0", "io_channels": 8, "embed_dim": 64, "depth": 2, "num_heads": 2,
        "cond_token_dim": 768, "global_cond_dim": 1536, "project_cond_tokens": True, "input_concat_dim": 0}, (1, 8, 16), context=(1, 8, 768), state_dict=seconds_embedders),
    "hunyuan3d2": Spec("Hunyuan3Dv2", {
        "image_model": "hunyuan3d2", "in_channels": 8, "context_in_dim": 32, "hidden_size": 64, "mlp_ratio": 2.0,
        "num_heads": 2, "depth": 1, "depth_single_blocks": 1, "qkv_bias": True, "guidance_embed": False},
        (1, 8, 16), context=(1, 8, 32)),
    "hunyuan_dit": Spec("HunyuanDiT", {
        "image_model": "hydit", "depth": 2, "hidden_size": 64, "num_heads": 2, "text_states_dim": 64,
        "text_states_dim_t5": 32, "text_len": 8, "text_len_t5": 8, "input_size": (8, 8), "patch_size": 2,
        "in_channels": 4, "learn_sigma": True}, (1, 4, 8, 8), context=(1, 8, 64),
        extra=lambda g: {"attention_mask": torch.ones(1, 8, dtype=torch.long),
                         "conditioning_mt5xl": torch.randn(1, 8, 32, generator=g),
                         "attention_mask_mt5xl": torch.ones(1, 8, dtype=torch.long)}),
    "omnigen2": Spec("Omnigen2", {
        "image_model": "omnigen2", "axes_dim_rope": [8, 12, 12], "axes_lens": [64, 64, 64], "ffn_dim_multiplier": None,
        "hidden_size": 64, "in_channels": 16, "multiple_of": 32, "norm_eps": 1e-05, "num_attention_heads": 2,
        "num_kv_heads": 1, "num_layers": 2, "num_refiner_layers": 1, "out_channels": None, "patch_size": 2,
        "text_feat_dim": 64, "timestep_scale": 1000.0}, (1, 16, 8, 8), context=(1, 8, 64), extra=_mask(8)),
    "stable_cascade_c": Spec("Stable_Cascade_C", {
        "stable_cascade_stage": "c", "c_cond": 32, "c_hidden": [32, 32], "nhead": [2, 2], "blocks": [[1, 1], [1, 1]],
        "block_repeat": [[1, 1], [1, 1]], "c_clip_text": 64, "c_clip_text_pooled": 64, "c_clip_img": 768, "c_r": 16},
        (1, 16, 8, 8), context=(1, 8, 64), pooled=(1, 1, 64)),
}
ARCHS: tuple[str, ...] = tuple(SPECS)


def available(name: str) -> str | None:
    """None when this ComfyUI can build ``name``; else why not (for ``pytest.skip``)."""
    comfy_env.setup_comfy()
    import comfy.supported_models as sm
    spec = SPECS[name]
    if not hasattr(sm, spec.supported_model):
        return f"this ComfyUI has no comfy.supported_models.{spec.supported_model}"
    return None


# Models whose constructor passes its kwargs to a params dataclass: keys that this core's
# dataclass lacks are dropped (0.3.75 has no ``txt_ids_dims``, no HunyuanVideo 1.5 fields).
_PARAMS = {"Flux": ("comfy.ldm.flux.model", "FluxParams"), "Flux2": ("comfy.ldm.flux.model", "FluxParams"),
           "Chroma": ("comfy.ldm.chroma.model", "ChromaParams"),
           "HunyuanVideo": ("comfy.ldm.hunyuan_video.model", "HunyuanVideoParams"),
           "HunyuanVideo15": ("comfy.ldm.hunyuan_video.model", "HunyuanVideoParams"),
           "Hunyuan3Dv2": ("comfy.ldm.hunyuan3d.model", "Hunyuan3DParams")}


def _config(name: str) -> dict:
    return version_config(SPECS[name].supported_model, SPECS[name].config)


def version_config(supported_model: str, config: dict) -> dict:
    """``config`` without the keys this core's params dataclass of ``supported_model`` lacks."""
    import importlib
    cfg = dict(config)
    where = _PARAMS.get(supported_model)
    if where is not None:
        cls = getattr(importlib.import_module(where[0]), where[1], None)
        if cls is not None:
            fields = {f.name for f in dataclasses.fields(cls)} | {"image_model"}
            cfg = {k: v for k, v in cfg.items() if k in fields}
    return cfg


def _operations(model):
    import comfy.ops
    return comfy.ops.pick_operations(None, model.manual_cast_dtype, model_config=model.model_config)


def init_weights(module: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Every floating tensor a checkpoint would hold (parameters and persistent buffers, i.e.
    the state dict): normal(0, std) from a generator seeded with ``seed`` (core's operations
    leave them uninitialised, ``torch.empty``). Non-persistent buffers are computed by the
    model (position tables, frequencies) and stay as built."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, t in sorted(module.state_dict(keep_vars=True).items(), key=lambda kv: kv[0]):
            if t.is_floating_point() and t.device.type != "meta":
                t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype) * std)
        for _, t in module.named_buffers():  # a computed buffer left empty would be garbage
            if t.is_floating_point() and t.device.type != "meta" and not torch.isfinite(t).all():
                t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype) * std)


def _seed(name: str) -> int:
    return 1000 + ARCHS.index(name)


def build(name: str):
    """A fresh tiny ``name`` model as a ComfyUI ModelPatcher (cpu, float32). LookupError when
    this ComfyUI lacks the architecture (see :func:`available`)."""
    why = available(name)
    if why:
        raise LookupError(why)
    import comfy.model_patcher
    import comfy.supported_models as sm
    mc = getattr(sm, SPECS[name].supported_model)(_config(name))
    mc.set_inference_dtype(torch.float32, None)
    spec = SPECS[name]
    model = mc.get_model(spec.state_dict() if spec.state_dict else {})
    if spec.post_build is not None:
        spec.post_build(model.diffusion_model, mc.custom_operations or _operations(model))
    init_weights(model.diffusion_model, _seed(name))
    model.eval()
    return comfy.model_patcher.ModelPatcher(model, torch.device("cpu"), torch.device("cpu"))


def inputs(name: str, base_model) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(x, sigma, kwargs)`` for ``base_model.apply_model(x, sigma, **kwargs)``: random noise of
    the spec's latent shape, conditioning turned into model kwargs by the model's own
    ``extra_conds`` (as ComfyUI's sampler does)."""
    spec = SPECS[name]
    g = torch.Generator().manual_seed(_seed(name))
    x = torch.randn(spec.latent, generator=g)
    cond = {"noise": x, "device": torch.device("cpu"), "width": 64, "height": 64}
    if spec.context is not None:
        cond["cross_attn"] = torch.randn(spec.context, generator=g) * 0.5
    if spec.pooled is not None:
        cond["pooled_output"] = torch.randn(spec.pooled, generator=g) * 0.5
    if spec.extra is not None:
        cond.update(spec.extra(g))
    kwargs = {}
    for k, v in base_model.extra_conds(**cond).items():
        kwargs[k] = v.process_cond(batch_size=1, device=torch.device("cpu"), area=None).cond \
            if hasattr(v, "process_cond") else v
    return x, torch.tensor([spec.sigma]), kwargs


def forward(model, name: str, args=None) -> torch.Tensor:
    """One ``apply_model`` forward of ``model`` (a ModelPatcher or BaseModel) on ``inputs``."""
    base = getattr(model, "model", model)
    x, sigma, kwargs = args if args is not None else inputs(name, base)
    with torch.no_grad():
        return base.apply_model(x, sigma, **kwargs)


def reads_outside_forward(model, name: str) -> list[str]:
    """Parameters of ``model``'s diffusion model that one :func:`forward` reads while their own
    module's forward is not running (e.g. NextDiT's and Cosmos' q/k-norm weights, read by the
    attention's fused RoPE kernel on ComfyUI 0.33): what a per-module offload hook never loads.
    Found with a ``TorchFunctionMode`` that sees every tensor each torch function receives."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_flatten
    base = getattr(model, "model", model)
    owner = {id(p): (mn, m, pn) for mn, m in base.diffusion_model.named_modules()
             for pn, p in m.named_parameters(recurse=False)}
    active: dict[int, int] = {}
    found: list[str] = []

    def enter(m, *_):
        active[id(m)] = active.get(id(m), 0) + 1

    def leave(m, *_):
        active[id(m)] -= 1

    class Reads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            for t in tree_flatten((args, kwargs))[0]:
                o = owner.get(id(t))
                if o is not None and not active.get(id(o[1])) and f"{o[0]}.{o[2]}" not in found:
                    found.append(f"{o[0]}.{o[2]}")
            return func(*args, **kwargs)

    hooks = []
    for m in base.diffusion_model.modules():
        hooks += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    try:
        with Reads():
            forward(base, name)
    finally:
        for h in hooks:
            h.remove()
    return found
