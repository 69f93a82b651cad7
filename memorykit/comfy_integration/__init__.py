"""The one package that knows ComfyUI's model management (``comfy.model_management``,
``comfy.model_patcher``). Node code calls in here; the technique modules never do.

Modules, one per technique plus two shared ones:

- ``compat``: every difference between the supported ComfyUI versions, detected in one place;
- ``common``: the models ComfyUI holds, ``weight_dtype`` → ``model_options``;
- ``cleanup``: folders left by a stopped server removed at start and on SIGTERM;
- ``free`` (Free Memory), ``sharded_io`` (sharded load/save through core's loaders),
  ``fp8_patcher`` (FP8 Layerwise Cast object patches), ``offload_patcher`` (Group Offload's
  ModelPatcher subclass), ``device_map_patcher`` (Balanced Device Map's ModelPatcher subclass),
  ``tiled_vae_io`` (Tiled VAE on core's VAE object), ``text_encoder`` (the techniques on a CLIP).

The names below are the public API the nodes use.
"""
from .cleanup import start_leftover_cleanup
from .common import WEIGHT_DTYPES, loaded_models, weight_dtype_options
from .compat import is_dynamic, memory_path, opt_out_of_dynamic_vram, patcher_free_memory
from .device_map_patcher import DEVICE_MAP_ATTACHMENT, DeviceMapPlan, device_map_applied, device_map_model
from .fp8_core import LORA_MODES as FP8_LORA_MODES
from .fp8_patcher import FP8_ATTACHMENT, format_fp8_info, fp8_layerwise_cast, model_compute_dtype
from .free import free_memory
from .offload_patcher import (GROUP_OFFLOAD_KEY, GroupOffloadModelPatcher, GroupOffloadSettings,
                              comfy_block_lists, group_offload_applied, group_offload_state_info,
                              group_offload_ui, load_group_offload_model, prepare_group_offload)
from .sharded_io import (diffusion_models_dir, load_sharded_diffusion_model, load_sharded_text_encoder,
                         model_state_dict_for_saving, resolve_sharded, save_model_sharded, sharded_choices,
                         sharded_ui, text_encoder_types)
from .text_encoder import (TE_DEVICE_KEY, TextEncoderOffloadModelPatcher, encoder_block_lists, encoder_roots,
                           format_text_encoder_info, text_encoder_device, text_encoder_fp8,
                           text_encoder_group_offload)
from .tiled_vae_io import TiledVAEOptions, tiled_vae_decode, tiled_vae_encode, vae_shape

__all__ = [
    "start_leftover_cleanup",
    "WEIGHT_DTYPES", "loaded_models", "weight_dtype_options",
    "is_dynamic", "memory_path", "opt_out_of_dynamic_vram", "patcher_free_memory",
    "DEVICE_MAP_ATTACHMENT", "DeviceMapPlan", "device_map_applied", "device_map_model",
    "FP8_ATTACHMENT", "FP8_LORA_MODES", "format_fp8_info", "fp8_layerwise_cast", "model_compute_dtype",
    "free_memory",
    "GROUP_OFFLOAD_KEY", "GroupOffloadModelPatcher", "GroupOffloadSettings", "comfy_block_lists",
    "group_offload_applied", "group_offload_state_info", "group_offload_ui", "load_group_offload_model",
    "prepare_group_offload",
    "diffusion_models_dir", "load_sharded_diffusion_model", "load_sharded_text_encoder",
    "model_state_dict_for_saving", "resolve_sharded", "save_model_sharded", "sharded_choices", "sharded_ui",
    "text_encoder_types",
    "TE_DEVICE_KEY", "TextEncoderOffloadModelPatcher", "encoder_block_lists", "encoder_roots",
    "format_text_encoder_info", "text_encoder_device", "text_encoder_fp8", "text_encoder_group_offload",
    "TiledVAEOptions", "tiled_vae_decode", "tiled_vae_encode", "vae_shape",
]
