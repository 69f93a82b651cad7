"""Free Memory node: passthrough that unloads models and empties caches at its point of the graph."""
from __future__ import annotations

from comfy_api.latest import io

from ..memorykit import badge, comfy_integration, memory, report
from .schema_util import PassthroughNode, make_schema


class FreeMemory(PassthroughNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return make_schema(
            node_id="MemoryKitFreeMemory",
            display_name="Free Memory",
            description=(
                "Passes its input through unchanged after unloading every model ComfyUI holds and "
                "emptying the device caches, through ComfyUI's own unloading (the 'del model; "
                "torch.cuda.empty_cache()' habit, done safely). Chain it between two stages, e.g. "
                "KSampler → Free Memory → VAE Decode, so the next stage starts with free VRAM. "
                "Models are reloaded by the nodes that need them later. Runs on every queue, also at the "
                "end of a graph with nothing connected to its output (it is an output node)."
            ),
            search_aliases=["unload models", "empty cache", "free vram", "clear vram", "purge", "gc",
                            "lowvram", "memory"],
            is_output_node=True,  # runs (and shows its badge) also as the last node of a graph
            inputs=[
                io.AnyType.Input("value", tooltip="Any output (LATENT, IMAGE, MODEL, ...). Passed through "
                                 "unchanged; memory is freed once it has been computed."),
                io.Boolean.Input("unload_models", default=True, tooltip="Unload every model ComfyUI's "
                                 "memory manager holds (diffusion model, text encoders, VAE) from its "
                                 "device. Off: only empty the caches."),
                io.Boolean.Input("empty_cache", default=True, tooltip="Run Python's garbage collector and "
                                 "return the cached, unused blocks of the device allocator (CUDA, MPS, "
                                 "XPU, ...) to the driver."),
            ],
            outputs=[io.AnyType.Output("passthrough", display_name="value", tooltip="The input, unchanged.")],
        )

    @classmethod
    def execute(cls, value, unload_models: bool = True, empty_cache: bool = True) -> io.NodeOutput:
        before = memory.snapshot()
        unloaded = comfy_integration.free_memory(unload_models=unload_models, empty_cache=empty_cache)
        rep = report.build_report("Free Memory", comfy_integration.loaded_models())
        rep.update(report.freed_fields(before, rep, unloaded))
        text = report.format_report(rep) + "\n" + report.format_freed(rep)
        return io.NodeOutput(value, ui={"memorykit_report": [badge.with_badge(rep)], "text": [text]})
