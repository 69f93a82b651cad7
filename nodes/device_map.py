"""Balanced Device Map node: split one diffusion model across GPUs / CPU / disk (accelerate)."""
from __future__ import annotations

from comfy_api.latest import io

from ..memorykit import badge, comfy_integration
from ..memorykit.device_map import STRATEGIES


class BalancedDeviceMap(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="MemoryKitBalancedDeviceMap",
            display_name="Balanced Device Map",
            category="MemoryKit",
            description=(
                "Splits the diffusion model's blocks across GPUs (and CPU RAM / disk) with accelerate's "
                "device map, so a model bigger than one GPU runs on several. Blocks are never split. The map "
                "is applied when the model is loaded for sampling and removed when ComfyUI unloads it; the "
                "map is shown on the node. Output equals the plain model's. Not after Group Offload (both "
                "decide where the weights live): connect it to the loader."
            ),
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model to split (from Load Diffusion Model / Load "
                               "Checkpoint, after LoRAs or before: either order works)."),
                io.Combo.Input("strategy", options=list(STRATEGIES), default="balanced",
                               tooltip="balanced: same share on every GPU. balanced_low_0: keep cuda:0 as light as "
                               "possible (room for VAE/text encoders). sequential: fill cuda:0, then cuda:1, ... "
                               "Ignored when a custom device map is given."),
                io.String.Input("max_memory", default="auto",
                                tooltip="Budget per device, e.g. 'cuda:0=20GiB, cuda:1=22GiB, cpu=64GiB' (GiB/MiB "
                                "= powers of 2, GB/MB = powers of 10). Add 'disk' to allow streaming weights from "
                                "files. 'auto' = the free memory of every GPU and of the CPU. Leave room for "
                                "activations. What lies outside the blocks (embedders, final layer) stays on the first "
                                "GPU (or cpu without one), never on disk; a budget smaller than what the plan puts on "
                                "a device (e.g. cpu=4MiB, disk with a real model) is an error saying how much it "
                                "needs."),
                io.String.Input("offload_folder", default="",
                                tooltip="Folder for weights mapped to 'disk' (a fresh subfolder is made per load and "
                                "deleted on unload). Empty = __memorykit/offload in ComfyUI's user directory (not the "
                                "temp folder, which ComfyUI empties at start)."),
                io.String.Input("custom_device_map", default="", multiline=True,
                                tooltip="Optional full device map as JSON, module name → device, e.g. "
                                "{\"img_in\": \"cuda:0\", \"double_blocks\": \"cuda:0\", \"single_blocks\": "
                                "\"cuda:1\", ...}. Every module must get a device. Overrides strategy/max_memory."),
            ],
            outputs=[io.Model.Output(tooltip="A copy of the model carrying the device map (the input is unchanged).")],
        )

    @classmethod
    def execute(cls, model, strategy: str = "balanced", max_memory: str = "auto", offload_folder: str = "",
                custom_device_map: str = "") -> io.NodeOutput:
        clone, rep, text = comfy_integration.device_map_model(model, strategy, max_memory, offload_folder,
                                                              custom_device_map)
        return io.NodeOutput(clone, ui={"memorykit_report": [badge.with_badge(rep)], "text": [text]})
