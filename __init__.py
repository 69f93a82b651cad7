"""ComfyUI-MemoryKit: run diffusion models bigger than your GPU.

ComfyUI entry point: ``comfy_entrypoint`` returns the V3 extension listing every node;
``WEB_DIRECTORY`` serves the frontend extension in ``js/``.
"""
from .nodes import MemoryKitExtension

WEB_DIRECTORY = "./js"


async def comfy_entrypoint() -> MemoryKitExtension:
    """Called by ComfyUI when it loads the pack (in the server's main thread): folders a killed
    server left behind are removed and this one's are removed on SIGTERM."""
    from .memorykit.comfy_integration import start_leftover_cleanup
    start_leftover_cleanup()
    return MemoryKitExtension()


__all__ = ["comfy_entrypoint", "WEB_DIRECTORY"]
