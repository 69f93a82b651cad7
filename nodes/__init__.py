"""ComfyUI surface of MemoryKit: V3 node schemas and thin calls into ``memorykit``."""
import logging

from comfy_api.latest import ComfyExtension, io

from .device_map import BalancedDeviceMap
from .free_memory import FreeMemory
from .fp8 import Fp8LayerwiseCast
from .group_offload import GroupOffload, GroupOffloadLoader
from .memory_plan import MemoryPlan
from .report import MemoryReport
from .sharded import SaveSharded, ShardedCheckpointLoader, ShardedTextEncoderLoader
from .text_encoder import TextEncoderDevice, TextEncoderFp8, TextEncoderGroupOffload
from .tiled_vae import TiledVAEDecode, TiledVAEEncode

CATEGORY = "MemoryKit"


class MemoryKitExtension(ComfyExtension):
    """Registers every MemoryKit node with ComfyUI."""

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        nodes = [MemoryPlan, MemoryReport, FreeMemory, ShardedCheckpointLoader, ShardedTextEncoderLoader, SaveSharded,
                 Fp8LayerwiseCast, GroupOffload, GroupOffloadLoader, BalancedDeviceMap, TiledVAEDecode, TiledVAEEncode,
                 TextEncoderGroupOffload, TextEncoderFp8, TextEncoderDevice]
        # The one line a user looks for in the startup log to know the pack loaded and where it is.
        logging.info("[MemoryKit] %d nodes loaded (category %s; example workflows under ComfyUI-MemoryKit in the "
                     "template browser)", len(nodes), CATEGORY)
        return nodes
