"""Memory Report node: passthrough of any value plus a memory report as UI output."""
from __future__ import annotations

from comfy_api.latest import io

from ..memorykit import badge, comfy_integration, memory, report
from .schema_util import PassthroughNode, make_schema


class MemoryReport(PassthroughNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return make_schema(
            node_id="MemoryKitMemoryReport",
            display_name="Memory Report",
            category="MemoryKit",
            description=(
                "Passes its input through unchanged and reports memory at this point of the graph: "
                "peak and current VRAM (per CUDA device), process RAM, and every model ComfyUI "
                "holds with how much of it sits on the GPU. Place it after the node you want to measure."
            ),
            search_aliases=["vram usage", "memory usage", "ram", "profiler", "peak memory", "lowvram"],
            is_output_node=True,
            inputs=[
                io.AnyType.Input("value", tooltip="Any output (IMAGE, LATENT, MODEL, ...). Passed through "
                                 "unchanged; the report is taken once it has been computed."),
                io.String.Input("label", default="", tooltip="Name shown at the top of the report "
                                "(e.g. 'after sampling')."),
                io.Boolean.Input("reset_peak", default=True, tooltip="After reporting, reset the peak "
                                 "VRAM/RAM counters so the next Memory Report shows the peak of the "
                                 "work between the two."),
            ],
            outputs=[io.AnyType.Output("passthrough", display_name="value", tooltip="The input, unchanged.")],
        )

    @classmethod
    def execute(cls, value, label: str = "", reset_peak: bool = True) -> io.NodeOutput:
        rep = report.build_report(label, comfy_integration.loaded_models())
        if reset_peak:
            memory.reset_cuda_peak()
            memory.reset_host_peak()
        return io.NodeOutput(value, ui={"memorykit_report": [badge.with_badge(rep)], "text": [report.format_report(rep)]})
