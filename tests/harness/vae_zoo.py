"""A zoo of tiny VAEs: one instance of each VAE type ComfyUI's ``comfy.sd.VAE`` detects from a
state dict (image and video), built from core's own classes with random finite weights
(std 0.02, norm scales ≈ 1; :func:`models.randomize_`).

Two ways in, both through ``comfy.sd.VAE(sd=...)``:

- **read from the state dict** (Wan 2.1 and its 4-channel RGBA variant, Qwen-Image's VAE = Wan
  2.1's detection, LTX-Video and LTX 2.4 from the ``config`` metadata, TAESD, TAEHV — the last two
  core's full-size models, already small): the tiny model's own state dict is
  handed to ``comfy.sd.VAE`` and core builds the model from it — nothing else involved.
- **fixed config in core** (SD/SDXL, the 16-channel Flux/SD3 VAE, Flux 2's, Wan 2.2, HunyuanVideo,
  HunyuanVideo 1.5, Mochi, Cosmos, MiniMax-H3, HunyuanImage 2.1, CogVideoX, SeedVR2, Mage-VAE):
  core's detection always builds the full-size
  model, far too slow for CPU tests. :func:`detected` runs core's detection on the tiny state
  dict's keys with the model on the ``meta`` device (no memory, no weights; where core reads a
  shape that the tiny model does not have, the full-size shape from core's own size-mismatch
  message is used), so every attribute of the VAE object — ratios, time formulas, process_input/
  output, memory estimates, ``handles_tiling`` — is core's own; then the tiny model, an instance
  of the very classes core built (checked), takes the full-size one's place with a fresh
  ModelPatcher. What differs from a downloaded VAE is the width and depth only.

``ZOO``: name → :class:`Entry` (``build()`` returns the ``comfy.sd.VAE``; ``video``; ``since``: a
core attribute/class the entry needs, absent on older cores → skipped with the reason).
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import comfy_env, models

_MISMATCH = re.compile(r"size mismatch for (\S+): copying a param with shape torch\.Size\((\[[^\]]*\])\) from "
                       r"checkpoint, the shape in current model is torch\.Size\((\[[^\]]*\])\)")


def _ops():
    import comfy.ops
    return comfy.ops.disable_weight_init


def _tiny(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``module`` with random finite weights; parameters created as expanded views (LTX-Video's
    ``scale_shift_table``) get their own storage first."""
    keep = {}
    for m in module.modules():
        for name in m._non_persistent_buffers_set:  # constants (Cosmos' wavelets): not weights
            if m._buffers.get(name) is not None and m._buffers[name].device.type != "meta":
                keep[(id(m), name)] = (m, m._buffers[name].clone())
        for name, p in list(m._parameters.items()):
            if p is not None and 0 in p.stride():
                m._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
        for name, b in list(m._buffers.items()):
            if b is not None and 0 in b.stride():
                m._buffers[name] = b.contiguous().clone()
    models.randomize_(module, models.SEED + 100 + seed)
    for (_, name), (m, b) in keep.items():
        m._buffers[name].copy_(b)
    return module.eval()


def from_state_dict(model: torch.nn.Module, metadata: dict | None = None):
    """``comfy.sd.VAE`` built by core from ``model``'s state dict (dims read from it)."""
    import comfy.sd
    return comfy.sd.VAE(sd=model.state_dict(), metadata=metadata)


def detected(model: torch.nn.Module, trigger: dict | None = None, meta: bool = True):
    """``comfy.sd.VAE`` whose attributes come from core's detection of ``model``'s state dict
    (or ``trigger``: the keys detection reads, added to it) and whose model is ``model``.
    ``meta=False``: core's full-size model is built on the CPU (never-touched ``torch.empty``
    pages) for a class whose constructor calls ``.item()``, which the meta device refuses.

    Raises AssertionError when core detects a different class than ``model``'s."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.sd
    import contextlib
    dev = "meta" if meta else "cpu"
    sd = {k: torch.empty(v.shape, dtype=v.dtype, device=dev) for k, v in model.state_dict().items()}
    sd.update({k: torch.empty(s, device=dev) for k, s in (trigger or {}).items()})
    for _ in range(4):
        try:
            with torch.device("meta") if meta else contextlib.nullcontext():
                vae = comfy.sd.VAE(sd=dict(sd))  # a copy: core renames keys in place (Mage-VAE's prefixes)
            break
        except RuntimeError as e:
            fixes = _MISMATCH.findall(str(e))
            if not fixes:
                raise
            sd.update({k: torch.empty(json.loads(full), device=dev) for k, _, full in fixes})
    else:
        raise RuntimeError("core's VAE detection kept reporting size mismatches")
    full = vae.first_stage_model
    for name in ("", "encoder", "decoder"):
        if name and not hasattr(full, name):  # Mage-VAE: dconv_encoder / decoder_model
            continue
        a, b = (getattr(m, name) if name else m for m in (full, model))
        assert type(a) is type(b), f"core detected {type(a).__name__} for {name or 'the model'}, the zoo built {type(b).__name__}"
    vae.first_stage_model = model.to(vae.vae_dtype)
    if hasattr(mm, "archive_model_dtypes"):
        mm.archive_model_dtypes(model)
    vae.patcher = comfy.model_patcher.ModelPatcher(model, load_device=vae.device, offload_device=mm.vae_offload_device())
    vae.size = None
    vae.model_size()
    return vae


# -- builders ------------------------------------------------------------------------------------

def _kl_config(z: int, **kw) -> dict:
    cfg = {"double_z": True, "z_channels": z, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 32,
           "ch_mult": [1, 2, 4, 4], "num_res_blocks": 1, "attn_resolutions": [], "dropout": 0.0}
    cfg.update(kw)
    return cfg


def _engine(enc_target: str, dec_target: str, enc: dict, dec: dict | None = None, regularizer="DiagonalGaussianRegularizer"):
    from comfy.ldm.models.autoencoder import AutoencodingEngine
    return AutoencodingEngine(regularizer_config={"target": f"comfy.ldm.models.autoencoder.{regularizer}"},
                              encoder_config={"target": enc_target, "params": enc},
                              decoder_config={"target": dec_target, "params": dec or enc})


_SD_ENC = "comfy.ldm.modules.diffusionmodules.model.Encoder"
_SD_DEC = "comfy.ldm.modules.diffusionmodules.model.Decoder"


def sd_kl():
    from comfy.ldm.models.autoencoder import AutoencoderKL
    return detected(_tiny(AutoencoderKL(ddconfig=_kl_config(4), embed_dim=4), 1))


def flux_kl16():
    return detected(_tiny(_engine(_SD_ENC, _SD_DEC, _kl_config(16)), 2))


def flux2():
    from comfy.ldm.models.autoencoder import AutoencoderKL
    m = _tiny(AutoencoderKL(ddconfig=_kl_config(32, batch_norm_latent=True), embed_dim=32), 3)
    m.bn.running_var.abs_().add_(1.0)  # a variance: positive
    return detected(m)


def _wan21(**kw):
    from comfy.ldm.wan.vae import WanVAE
    return _tiny(WanVAE(dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                        temperal_downsample=[False, True, True], dropout=0.0, **kw), 4)


def wan21():
    return from_state_dict(_wan21())


def wan21_rgba():
    return from_state_dict(_wan21(image_channels=4, conv_out_channels=4))


def wan22():
    from comfy.ldm.wan.vae2_2 import WanVAE
    return detected(_tiny(WanVAE(dim=16, dec_dim=16, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
                                 temperal_downsample=[False, True, True], dropout=0.0), 5))


def hunyuan_video():
    from comfy.ldm.models.autoencoder import AutoencoderKL
    cfg = _kl_config(16, conv3d=True, time_compress=4)
    return detected(_tiny(AutoencoderKL(ddconfig=cfg, embed_dim=16), 6))


def hunyuan_video15():
    cfg = {"block_out_channels": [32, 32, 64, 64, 64], "in_channels": 3, "out_channels": 3, "num_res_blocks": 1,
           "ffactor_spatial": 16, "ffactor_temporal": 4, "downsample_match_channel": True,
           "upsample_match_channel": True, "z_channels": 32}
    p = "comfy.ldm.hunyuan_video.vae_refiner."
    return detected(_tiny(_engine(p + "Encoder", p + "Decoder", cfg, regularizer="EmptyRegularizer"), 7))


LTXV_CONFIG = {
    "_class_name": "CausalVideoAutoencoder", "dims": 3, "in_channels": 3, "out_channels": 3, "latent_channels": 128,
    "blocks": [["res_x", 1], ["compress_all", 1], ["res_x_y", 1], ["compress_all", 1], ["res_x_y", 1],
               ["compress_all", 1], ["res_x", 1]],
    "scaling_factor": 1.0, "norm_layer": "pixel_norm", "patch_size": 4, "latent_log_var": "uniform",
    "use_quant_conv": False, "causal_decoder": False,
    "encoder_base_channels": 16, "decoder_base_channels": 16,
}


def ltxv():
    """LTX-Video from its ``config`` metadata; a core whose config has no base width (0.3.75
    fixes 128) gets encoder and decoder of width 16 in place of its own (see :func:`detected`)."""
    import inspect
    from comfy.ldm.lightricks.vae import causal_video_autoencoder as cva
    if "encoder_base_channels" in inspect.getsource(cva.VideoVAE.__init__):
        m = _ltxv_stats(_tiny(cva.VideoVAE(config=LTXV_CONFIG), 8))
        return from_state_dict(m, metadata={"config": json.dumps({"vae": LTXV_CONFIG})})
    c = LTXV_CONFIG
    with torch.device("meta"):
        m = cva.VideoVAE(config=c)
    m.encoder = cva.Encoder(dims=3, in_channels=3, out_channels=c["latent_channels"], blocks=c["blocks"],
                            patch_size=c["patch_size"], latent_log_var=c["latent_log_var"], norm_layer=c["norm_layer"],
                            base_channels=16)
    m.decoder = cva.Decoder(dims=3, in_channels=c["latent_channels"], out_channels=3, blocks=c["blocks"], base_channels=16,
                            patch_size=c["patch_size"], norm_layer=c["norm_layer"], causal=False)
    m.to_empty(device="cpu")
    return detected(_ltxv_stats(_tiny(m, 8)))


def _ltxv_stats(m):
    """Latent statistics of a real file's kind (mean 0, std 1), not random numbers near 0."""
    for name, b in m.per_channel_statistics.named_buffers():
        b.fill_(1.0 if name.startswith("std") else 0.0)
    return m


def mochi():
    from comfy.ldm.genmo.vae import model as mv
    with torch.device("meta"):
        m = mv.VideoVAE()
    m.encoder = mv.Encoder(in_channels=15, base_channels=32, channel_multipliers=[1, 2, 3, 4], num_res_blocks=[1, 1, 1, 1, 1],
                           latent_dim=12, temporal_reductions=[1, 2, 3], spatial_reductions=[2, 2, 2],
                           prune_bottlenecks=[False] * 5, has_attentions=[False, True, True, True, True], affine=True,
                           bias=True, input_is_conv_1x1=True, padding_mode="replicate")
    m.decoder = mv.Decoder(out_channels=3, base_channels=32, channel_multipliers=[1, 2, 3, 4], temporal_expansions=[1, 2, 3],
                           spatial_expansions=[2, 2, 2], num_res_blocks=[1, 1, 1, 1, 1], latent_dim=12,
                           has_attention=[False] * 5, padding_mode="replicate", output_norm=False, nonlinearity="silu",
                           output_nonlinearity="silu", causal=True)
    return detected(_tiny(m, 9))


def cosmos():
    from comfy.ldm.cosmos.vae import CausalContinuousVideoTokenizer
    cfg = {"z_channels": 16, "latent_channels": 16, "z_factor": 1, "resolution": 1024, "in_channels": 3, "out_channels": 3,
           "channels": 16, "channels_mult": [2, 2, 2], "num_res_blocks": 1, "attn_resolutions": [32], "dropout": 0.0,
           "patch_size": 4, "num_groups": 1, "temporal_compression": 8, "spacial_compression": 8}
    # the key core detects Cosmos by is a non-persistent buffer (in the released files, not in state_dict())
    return detected(_tiny(CausalContinuousVideoTokenizer(**cfg), 10), trigger={"decoder.unpatcher3d.wavelets": [8]},
                    meta=False)


def minimax_h3():
    """MiniMax-H3's video VAE with a 1-layer, 2-head ViT decoder (the class fixes 36 layers ×
    2048 wide: 2.4 B parameters) and a narrow encoder."""
    from comfy.ldm.minimax import vae as mv
    with torch.device("meta"):
        m = mv.MiniMaxH3VideoVAE(ch=32, ch_mult=(1, 1, 1, 1, 2, 2), num_res_blocks=1, operations=_ops())
    m.decoder = mv.ViT3DDecoder(patch_size=m.vae_ratio, patch_size_t=m.vae_ratio_t, in_channels=24, out_channels=3,
                                num_layers=1, heads=2, dim_head=32, operations=_ops())
    m.to_empty(device="cpu")
    _tiny(m, 11)
    for name, value in (("latents_mean", mv.LATENTS_MEAN), ("latents_std", mv.LATENTS_STD)):
        getattr(m, name).copy_(torch.tensor(value))
    m.pixel_mean.copy_(torch.tensor(mv.IMAGENET_MEAN).view(1, 3, 1, 1, 1))
    m.pixel_std.copy_(torch.tensor(mv.IMAGENET_STD).view(1, 3, 1, 1, 1))
    return detected(m)


def hunyuan_image21():
    """HunyuanImage 2.1's VAE (64 channels, 32× spatial; 2-D ``hunyuan_video.vae`` Encoder/Decoder)
    with 32-64-128 wide stages (core fixes 128-1024) and one res block per stage."""
    cfg = {"block_out_channels": [32, 32, 64, 64, 128, 128], "in_channels": 3, "out_channels": 3, "num_res_blocks": 1,
           "ffactor_spatial": 32, "downsample_match_channel": True, "upsample_match_channel": True, "z_channels": 64}
    p = "comfy.ldm.hunyuan_video.vae."
    return detected(_tiny(_engine(p + "Encoder", p + "Decoder", cfg), 12))


def cogvideox():
    """CogVideoX's VAE (16 channels, 8× spatial, 4× time) with stages 32-32-64-64 wide (core
    fixes 128-512) and one res block per stage (core 3)."""
    from comfy.ldm.cogvideo.vae import AutoencoderKLCogVideoX
    return detected(_tiny(AutoencoderKLCogVideoX(block_out_channels=(32, 32, 64, 64), latent_channels=16,
                                                 layers_per_block=1), 13))


TAE_GAIN = 1.0


def _scaled_convs(module: torch.nn.Module, gain: float, seed: int) -> torch.nn.Module:
    """Conv weights of std ``gain / sqrt(fan_in)``, biases 0: TAESD/TAEHV have no norms, and at
    std 0.02 (:func:`_tiny`) their output is a constant (VAE Decode of TAESD then 0 everywhere)."""
    gen = torch.Generator().manual_seed(models.SEED + 200 + seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, torch.nn.Conv2d):
                fan_in = m.weight[0].numel()
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * gain / fan_in ** 0.5)
                if m.bias is not None:
                    m.bias.zero_()
        last = [m for m in module.decoder.modules() if isinstance(m, torch.nn.Conv2d)][-1] if hasattr(module, "decoder") \
            else [m for m in module.taesd_decoder.modules() if isinstance(m, torch.nn.Conv2d)][-1]
        last.bias.fill_(0.5)  # decoded pixels around mid-grey, as a real image
    return module


def taesd():
    """TAESD for SD's 4-channel latent, core's own full-size model (64 wide already) with
    random weights; core reads the latent channels from the state dict."""
    from comfy.taesd.taesd import TAESD
    m = _scaled_convs(_tiny(TAESD(latent_channels=4), 14), TAE_GAIN, 14)
    m.vae_scale.data.fill_(1.0)
    m.vae_shift.data.fill_(0.0)
    return from_state_dict(m)


def taef2():
    """TAEF2, FLUX.2's tiny autoencoder (``EncoderFlux2`` / ``DecoderFlux2``: a 32-channel 8×
    TAESD whose latent is folded 2×2 into 128 channels, 16×), core's own full-size model with
    random weights, built as the VAE Loader builds ``taef2`` (``tae_latent_channels`` metadata).
    Core's VAE object gives it a ratio of 8 (see ``vae_factors``)."""
    from comfy.taesd.taesd import TAESD
    m = _scaled_convs(_tiny(TAESD(latent_channels=128), 20), TAE_GAIN, 20)
    m.vae_scale.data.fill_(1.0)
    m.vae_shift.data.fill_(0.0)
    return from_state_dict(m, metadata={"tae_latent_channels": 128})


def taehv():
    """TAEHV / taew2.1 / lighttaew2_1 (16 channels, 8× spatial, 4× time; float32 weights, so
    core takes it for lighttaew2_1: no latent scaling): core's own full-size model (64-256 wide)."""
    from comfy.taesd.taehv import TAEHV
    return from_state_dict(_scaled_convs(_tiny(TAEHV(latent_channels=16), 15), TAE_GAIN, 15))


def minimax_h3_light():
    """MiniMax-H3's light VAE (a TAEHV with 24 latent channels, 2×2 patches, 17 frames ↔ 5 latent
    frames), core's own full-size model (64-256 wide) with random weights."""
    from comfy.taesd.taehv import TAEHV
    return from_state_dict(_scaled_convs(_tiny(TAEHV(latent_channels=24), 17), TAE_GAIN, 17))


def seedvr2():
    """SeedVR2's video VAE (16 channels, 8× spatial, 4× time; tiles itself: ``handles_tiling``)
    with stages 32-32-64-64 wide (the class fixes 128-512) and one res block per stage."""
    from comfy.ldm.seedvr import vae as sv
    with torch.device("meta"):
        m = sv.VideoAutoencoderKLWrapper()
    kw = dict(block_out_channels=(32, 32, 64, 64), layers_per_block=1, norm_num_groups=32, inflation_mode="pad",
              time_receptive_field="full")
    m.encoder = sv.Encoder3D(in_channels=3, out_channels=sv.SEEDVR2_LATENT_CHANNELS, down_block_types=("DownEncoderBlock3D",) * 4,
                             temporal_down_num=2, **kw)
    m.decoder = sv.Decoder3D(in_channels=sv.SEEDVR2_LATENT_CHANNELS, out_channels=3, up_block_types=("UpDecoderBlock3D",) * 4,
                             temporal_up_num=2, **kw)
    m.to_empty(device="cpu")
    m.set_memory_limit(sv.BYTEDANCE_VAE_CONV_MEM_GIB, sv.BYTEDANCE_VAE_NORM_MEM_GIB)
    return detected(_tiny(m, 16))


LTX24_CONFIG = {
    "_class_name": "CausalDiffusionVAE", "dims": 3, "model_output_type": "x0",
    "encoder": {"dims": 3, "in_channels": 3, "out_channels": 128, "patch_size": 4, "latent_log_var": "constant",
                "norm_layer": "pixel_norm", "base_channels": 16, "spatial_padding_mode": "zeros",
                "blocks": [["res_x", {"num_layers": 1}], ["compress_space_res", {"multiplier": 2}],
                           ["res_x", {"num_layers": 1}], ["compress_time_res", {"multiplier": 2}],
                           ["res_x", {"num_layers": 1}], ["compress_all_res", {"multiplier": 2}],
                           ["res_x", {"num_layers": 1}], ["compress_all_res", {"multiplier": 1}],
                           ["res_x", {"num_layers": 1}]]},
    "decoder": {"in_channels": 128, "out_channels": 3, "patch_size": 4, "head_dim": 16,
                "stage_channels": [128, 64, 32, 32, 16], "stage_depths": [1, 1, 1, 1, 1],
                "stage_kernels": [[3, 7, 7], [3, 7, 7], [3, 5, 5], [3, 5, 5], [3, 3, 3]],
                "upsamples": [[[1, 2, 2], 2], [[2, 1, 1], 2], [[2, 2, 2], 1], [[2, 2, 2], 2]],
                "stage5_kernel": [3, 3, 3], "timestep_scale_multiplier": 1000.0, "default_num_inference_steps": 1},
}


def ltx24():
    """LTX 2.4's VAE (LTX-Video's conv encoder + the one-step diffusion decoder with
    neighbourhood attention, ``CausalDiffusionVAE``) from its ``config`` metadata, 16-128 wide,
    one block per stage, stage-5 window 3³ (the file's: 11³)."""
    from comfy.ldm.lightricks.vae.na_diffusion_decoder import CausalDiffusionVAE
    m = _ltxv_stats(_tiny(CausalDiffusionVAE(config=LTX24_CONFIG), 17))
    return from_state_dict(m, metadata={"config": json.dumps({"vae": LTX24_CONFIG})})


def _fan_in(module: torch.nn.Module, seed: int, gain: float = 1.0) -> torch.nn.Module:
    """Every Conv2d/Linear weight of std ``gain / sqrt(fan_in)`` (biases as they are)."""
    gen = torch.Generator().manual_seed(models.SEED + 200 + seed)
    with torch.no_grad():
        for mod in module.modules():
            if isinstance(mod, (torch.nn.Conv2d, torch.nn.Linear)):
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen) * gain / mod.weight[0].numel() ** 0.5)
    return module


def mage():
    """Mage-VAE (one-step diffusion codec, 128 channels, 16×): encoder 64 wide with one block
    (the class fixes 384/768 wide, 21 + 2 blocks), denoiser 64 wide with one conditioning block and
    one MLP block (24); core renames ``student.dconv_encoder.`` / ``pipeline.`` on load."""
    from comfy.ldm.mage_flow import vae as mv
    with torch.device("meta"):
        m = mv.MageVAE()
    m.dconv_encoder = mv.DConvEncoder(hidden_size=64, num_blocks=1, head_size=64, num_head_blocks=1)
    m.decoder_model = mv.DConvDenoiser(hidden_size=64, hidden_size_x=16, num_blocks=2, num_cond_blocks=1)
    m.to_empty(device="cpu")
    _tiny(m, 18)
    _fan_in(m, 18)  # at std 0.02 the decoded image is flat grey (std 0.012)
    return detected(m, trigger={"student.dconv_encoder.proj_out.weight": [256, 384, 1, 1]})


def stage_a():
    """Stable Cascade's stage A (VQGAN, 4 channels, 4×) 64 wide with one bottleneck block (core
    fixes 384 and 12) and a 16-entry codebook (unused: Tiled VAE encodes unquantized, as core)."""
    from comfy.ldm.cascade.stage_a import StageA
    m = _fan_in(_tiny(StageA(bottleneck_blocks=1, c_hidden=64, codebook_size=16), 19), 19)  # std 0.02: 0.014 out
    for b in m.modules():
        if isinstance(b, torch.nn.BatchNorm2d):
            b.running_var.abs_().add_(1.0)  # a variance: positive
    return detected(m)


def pixel_space():
    """Core's pixel-space "VAE" (``PixelspaceConversionVAE``: identity, 3 channels, 1×)."""
    import comfy.pixel_space_convert
    return from_state_dict(comfy.pixel_space_convert.PixelspaceConversionVAE())


@dataclass(frozen=True)
class Entry:
    build: Callable[[], object]
    video: bool
    since: str | None = None  # "module:attr" a core needs for this entry

    def missing(self) -> str | None:
        """Why this core cannot build the entry (None when it can)."""
        if self.since is None:
            return None
        import importlib
        import inspect
        mod, _, attr = self.since.partition(":")
        try:
            obj = importlib.import_module(mod)
        except ImportError:
            return f"this ComfyUI has no {mod}"
        name, _, arg = attr.partition("(")
        if name and not hasattr(obj, name):
            return f"this ComfyUI has no {mod}.{name}"
        if arg and arg.rstrip(")") not in inspect.signature(getattr(obj, name)).parameters:
            return f"this ComfyUI's {mod}.{name} has no {arg.rstrip(')')} argument"
        return None


ZOO: dict[str, Entry] = {
    "sd_kl": Entry(sd_kl, False),
    "flux_kl16": Entry(flux_kl16, False),
    "flux2": Entry(flux2, False),
    "qwen_image": Entry(wan21, False),  # Qwen-Image's VAE is detected as Wan 2.1; single images (1 frame)
    "wan21": Entry(wan21, True),
    "wan21_rgba": Entry(wan21_rgba, True, "comfy.ldm.wan.vae:WanVAE(image_channels)"),
    "wan22": Entry(wan22, True),
    "hunyuan_video": Entry(hunyuan_video, True),
    "hunyuan_video15": Entry(hunyuan_video15, True, "comfy.ldm.hunyuan_video.vae_refiner:Encoder"),
    "ltxv": Entry(ltxv, True),
    "mochi": Entry(mochi, True),
    "cosmos": Entry(cosmos, True),
    "minimax_h3": Entry(minimax_h3, True, "comfy.ldm.minimax.vae:MiniMaxH3VideoVAE"),
    "hunyuan_image21": Entry(hunyuan_image21, False, "comfy.ldm.hunyuan_video.vae:Decoder"),
    "cogvideox": Entry(cogvideox, True, "comfy.ldm.cogvideo.vae:AutoencoderKLCogVideoX"),
    "taesd": Entry(taesd, False, "comfy.taesd.taesd:TAESD"),
    "taef2": Entry(taef2, False, "comfy.taesd.taesd:DecoderFlux2"),
    "taehv": Entry(taehv, True, "comfy.taesd.taehv:TAEHV"),
    "seedvr2": Entry(seedvr2, True, "comfy.ldm.seedvr.vae:VideoAutoencoderKLWrapper"),
    "stage_a": Entry(stage_a, False, "comfy.ldm.cascade.stage_a:StageA"),
    "pixel_space": Entry(pixel_space, False, "comfy.pixel_space_convert:PixelspaceConversionVAE"),
    "mage_vae": Entry(mage, False, "comfy.ldm.mage_flow.vae:MageVAE"),
    "ltx24": Entry(ltx24, True, "comfy.ldm.lightricks.vae.na_diffusion_decoder:CausalDiffusionVAE"),
}


# Not in ZOO (its frame mapping cannot be tiled in time: Tiled VAE leaves it to core, one test
# checks that in tests/test_vae_zoo.py); H3 support came with MiniMax-H3's video VAE.
MINIMAX_H3_LIGHT = Entry(minimax_h3_light, True, "comfy.ldm.minimax.vae:MiniMaxH3VideoVAE")


def build(name: str | Entry):
    """The ``comfy.sd.VAE`` of zoo entry ``name`` (or of an :class:`Entry`; ComfyUI set up first)."""
    comfy_env.setup_comfy()
    with torch.no_grad():
        return (name if isinstance(name, Entry) else ZOO[name]).build()
