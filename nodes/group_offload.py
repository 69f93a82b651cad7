"""Group Offload (MODEL → MODEL) and Group Offload Loader nodes: schemas and a thin call into
``memorykit.comfy_integration`` (which applies ``memorykit.offload`` when ComfyUI loads the model)."""
from __future__ import annotations

from comfy_api.latest import io

import folder_paths

from ..memorykit import comfy_integration, validation
from ..memorykit.offload_plan import SCHEDULERS, GroupOffloadOptions

DESCRIPTION = (
    "Keeps the diffusion model's weights in CPU RAM (or on disk) and streams its blocks to the GPU "
    "just in time, so models larger than VRAM run. Under a VRAM budget as many blocks as fit stay "
    "resident and only the rest stream. Applied when sampling loads the model, undone when ComfyUI "
    "unloads it; the output equals the plain model's. MemoryKit's event-ring scheduler prefetches "
    "the next groups into a fixed VRAM ring without stalling the GPU, from CPU RAM or from an "
    "unnamed file on disk. "
    "Without a GPU, offload_to=cpu passes the model through unchanged; offload_to=disk saves RAM."
)


def _offload_inputs(blocks: str = "whole transformer/UNet blocks") -> list:
    return [
        io.Combo.Input("offload_type", options=["block_level", "leaf_level"], default="block_level",
                       tooltip=f"block_level streams {blocks} (fast with use_stream); "
                               "leaf_level streams single Linear/Conv modules (lowest VRAM, more transfers)."),
        io.Int.Input("num_blocks_per_group", default=1, min=1, max=1024,
                     tooltip="block_level: blocks moved together (the diffusers scheduler forces 1 with "
                             "use_stream; the memorykit one takes any value). A value at least the number of "
                             "blocks moves each block list at once."),
        io.Float.Input("vram_budget_gb", default=0.0, min=0.0, max=1024.0, step=0.25,
                       tooltip="GiB of VRAM the weights may use, streaming buffers included: blocks that fit "
                               "stay resident, the rest stream. 0 = auto (what ComfyUI's memory manager "
                               "offers; everything streams on a CPU-only machine). A small value (e.g. 0.5) "
                               "streams everything."),
        io.Boolean.Input("use_stream", default=True,
                         tooltip="Copy the next groups on a separate CUDA stream while the current one computes "
                                 "(the fast path; offloaded weights are page-locked). GPU only, ignored on CPU."),
        io.Boolean.Input("record_stream", default=False,
                         tooltip="diffusers scheduler with use_stream: free streamed weights without waiting for "
                                 "the GPU (a little faster, a little more VRAM). Needs use_stream; the memorykit "
                                 "scheduler never waits, so it ignores this."),
        io.Boolean.Input("low_cpu_mem_usage", default=False,
                         tooltip="Do not page-lock the offloaded weights (no locked RAM; copies from pageable "
                                 "memory are slower and do not overlap compute)."),
        io.Combo.Input("offload_to", options=["cpu", "disk"], default="cpu",
                       tooltip="Where offloaded weights wait: cpu = RAM; disk = a file in disk_folder (for low "
                               "RAM), freed when the model is unloaded."),
        io.String.Input("disk_folder", default="",
                        tooltip="Folder for offload files (offload_to=disk). Must exist and be writable; a "
                                "fast SSD is best. Empty = __memorykit/offload in ComfyUI's user directory (not the temp "
                                "folder, which ComfyUI empties at start)."),
        io.Combo.Input("scheduler", options=list(SCHEDULERS), default="memorykit", optional=True,
                       tooltip="Who streams from CPU RAM. memorykit: prefetch into a fixed VRAM ring ordered by "
                               "CUDA events (the host never waits; any num_blocks_per_group). diffusers: its "
                               "group-offloading hooks as they are. Disk offload always uses the memorykit ring."),
    ]


def _settings(node_id, offload_type, num_blocks_per_group, vram_budget_gb, use_stream, record_stream,
              low_cpu_mem_usage, offload_to, disk_folder,
              scheduler="memorykit") -> comfy_integration.GroupOffloadSettings:
    # scheduler is optional: workflows saved before it existed run with the default
    options = GroupOffloadOptions(offload_type=offload_type, num_blocks_per_group=num_blocks_per_group,
                                  use_stream=use_stream, record_stream=record_stream,
                                  low_cpu_mem_usage=low_cpu_mem_usage, offload_to=offload_to,
                                  scheduler=scheduler or "memorykit")
    options.validate()
    vram_budget_gb = validation.finite_number(vram_budget_gb, "vram_budget_gb", 0.0, 1024.0)
    return comfy_integration.GroupOffloadSettings(options=options, vram_budget_bytes=int(vram_budget_gb * 2**30),
                                                  disk_folder=disk_folder.strip(),
                                                  node_id=None if node_id is None else str(node_id))


class GroupOffload(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="MemoryKitGroupOffload",
            display_name="Group Offload",
            category="MemoryKit",
            description=DESCRIPTION,
            inputs=[io.Model.Input("model", tooltip="The diffusion model to offload (from a checkpoint or "
                                                     "diffusion-model loader, LoRA before or after is fine).")]
            + _offload_inputs(),
            outputs=[io.Model.Output(tooltip="The same model, loaded group-offloaded when sampled.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, **options) -> io.NodeOutput:
        settings = _settings(cls.hidden.unique_id, **options)
        out, info = comfy_integration.prepare_group_offload(model, settings)
        return io.NodeOutput(out, ui=comfy_integration.group_offload_ui("Group Offload", info))


class GroupOffloadLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="MemoryKitGroupOffloadLoader",
            display_name="Group Offload Loader",
            category="MemoryKit",
            description="Loads a diffusion model from models/diffusion_models into CPU RAM (never whole onto the "
                        "GPU) and returns it group-offloaded. " + DESCRIPTION,
            inputs=[
                io.Combo.Input("unet_name", options=folder_paths.get_filename_list("diffusion_models"),
                               tooltip="Diffusion model file in models/diffusion_models."),
                io.Combo.Input("weight_dtype", options=comfy_integration.WEIGHT_DTYPES,
                               default="default", tooltip="Storage dtype, as in Load Diffusion Model: fp8 halves "
                                                          "the bytes streamed."),
            ] + _offload_inputs(),
            outputs=[io.Model.Output(tooltip="The loaded model, group-offloaded when sampled.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, unet_name: str, weight_dtype: str, **options) -> io.NodeOutput:
        settings = _settings(cls.hidden.unique_id, **options)
        out, info = comfy_integration.load_group_offload_model(unet_name, weight_dtype, settings)
        return io.NodeOutput(out, ui=comfy_integration.group_offload_ui("Group Offload Loader", info))
