"""The one package that knows ComfyUI's model management (``comfy.model_management``,
``comfy.model_patcher``). Node code calls in here; the technique modules never do.

One file per technique, each with the ModelPatcher mechanics that technique needs:
``common`` (loaded models), ``free`` (Free Memory), ``sharded_io`` (sharded load/save through
ComfyUI's loaders), ``fp8_patcher`` (FP8 Layerwise Cast object patches), ``offload_patcher``
(Group Offload ModelPatcher subclass), ``device_map_patcher`` (Balanced Device Map ModelPatcher
subclass), ``tiled_vae_io`` (Tiled VAE on ComfyUI's VAE object). Their public names are re-exported here.
"""
from .common import *  # noqa: F401,F403
from .device_map_patcher import *  # noqa: F401,F403
from .fp8_patcher import *  # noqa: F401,F403
from .free import *  # noqa: F401,F403
from .offload_patcher import *  # noqa: F401,F403
from .sharded_io import *  # noqa: F401,F403
from .tiled_vae_io import *  # noqa: F401,F403
from . import device_map_patcher, fp8_patcher, offload_patcher, sharded_io, tiled_vae_io  # noqa: F401,E402
