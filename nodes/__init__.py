"""ComfyUI surface of MemoryKit: V3 node schemas and thin calls into ``memorykit``."""
from comfy_api.latest import ComfyExtension, io

from .report import MemoryReport
from .tiled_vae import TiledVAEDecode, TiledVAEEncode

CATEGORY = "MemoryKit"


class MemoryKitExtension(ComfyExtension):
    """Registers every MemoryKit node with ComfyUI."""

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [MemoryReport, TiledVAEDecode, TiledVAEEncode]
