"""ComfyUI-MemoryKit: run diffusion models bigger than your GPU.

ComfyUI entry point: ``comfy_entrypoint`` returns the V3 extension listing every node;
``WEB_DIRECTORY`` serves the frontend extension in ``js/``.
"""
from .nodes import MemoryKitExtension

WEB_DIRECTORY = "./js"


async def comfy_entrypoint() -> MemoryKitExtension:
    """Called by ComfyUI when it loads the pack."""
    return MemoryKitExtension()


__all__ = ["comfy_entrypoint", "WEB_DIRECTORY"]
