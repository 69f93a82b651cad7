"""Memory Plan node: MODEL (+ VAE, CLIP, a second MODEL) → the same, with the memory techniques chosen
for this machine and the whole workflow (schema + a thin call into ``memorykit.comfy_integration.memory_plan_io``)."""
from __future__ import annotations

from comfy_api.latest import io

from ..memorykit import badge, comfy_integration, report
from ..memorykit.comfy_integration import memory_plan_io, memory_plan_workflow_io


class MemoryPlan(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="MemoryKitMemoryPlan",
            display_name="Memory Plan",
            category="MemoryKit",
            description=(
                "Chooses the memory techniques for this machine and this model, applies them and says why: "
                "nothing, FP8 Layerwise Cast, Group Offload from RAM under a VRAM budget, FP8 + Group Offload, "
                "or Group Offload to disk, and the VAE's tile size. Predicts peak VRAM, RAM, disk and seconds "
                "per step for each candidate (from measured free memory and bandwidth) and reports the table and "
                "one sentence per decision. A plan that cannot fit is an error naming what is short, before "
                "anything is loaded. Under ComfyUI's dynamic VRAM it leaves residency to core and chooses only "
                "fp8 storage, disk versus RAM and tiles. With a text encoder (clip) and/or a second diffusion model "
                "(model_2, e.g. Wan 2.2's low-noise expert) wired, it plans them all together: one decision and one "
                "reason per component, the workflow's peak VRAM, RAM and disk, and an error naming the component "
                "that does not fit. The inputs are not changed."
            ),
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model to plan for (from a checkpoint or diffusion-model "
                               "loader; LoRA before or after is fine)."),
                io.Combo.Input("plan_for", options=["this machine", "given figures"], default="this machine",
                               tooltip="this machine: measure free VRAM/RAM/disk and bandwidth here (once per server "
                               "start for bandwidths). given figures: plan for another machine from vram_gb, ram_gb "
                               "and disk_gb (a shared workflow), with a PCIe 4.0 card and an NVMe SSD assumed."),
                io.Boolean.Input("allow_fp8", default=True,
                                 tooltip="May store weights in float8 (FP8 Layerwise Cast, about half the bytes; "
                                 "small precision cost). Off: the model keeps its dtype."),
                io.Combo.Input("prefer", options=["speed", "memory"], default="speed",
                               tooltip="speed: the fastest plan that fits. memory: the least VRAM among plans at most "
                               "1.5x slower than the fastest (streams what hides under compute)."),
                io.Float.Input("vram_gb", default=12.0, min=0.0, max=1024.0, step=0.5,
                               tooltip="given figures: free VRAM of the target GPU in GiB (0 = no GPU)."),
                io.Float.Input("ram_gb", default=32.0, min=1.0, max=4096.0, step=1.0,
                               tooltip="given figures: RAM the model may use on the target machine, in GiB."),
                io.Float.Input("disk_gb", default=100.0, min=0.0, max=65536.0, step=1.0,
                               tooltip="given figures: free disk in the offload folder of the target machine, in GiB."),
                io.Int.Input("width", default=1024, min=16, max=16384, step=16,
                             tooltip="Image width in pixels the sampler will make (ignored when a LATENT is wired)."),
                io.Int.Input("height", default=1024, min=16, max=16384, step=16,
                             tooltip="Image height in pixels (ignored when a LATENT is wired)."),
                io.Int.Input("frames", default=81, min=1, max=4096,
                             tooltip="Video models: frames to make (ignored for image models and when a LATENT is wired)."),
                io.Vae.Input("vae", optional=True,
                             tooltip="The VAE that decodes the result: the plan picks its tile size; connect the VAE "
                             "output to VAE Decode (or Tiled VAE Decode)."),
                io.Latent.Input("latent", optional=True,
                                tooltip="The latent the sampler starts from (e.g. Empty Latent Image): its size sets "
                                "the activation estimate."),
                io.Clip.Input("clip", optional=True,
                              tooltip="The text encoder (from Load CLIP / DualCLIPLoader / a checkpoint): planned with "
                              "the rest of the workflow; connect the CLIP output to the text-encode nodes."),
                io.Model.Input("model_2", optional=True,
                               tooltip="A second diffusion model of the same workflow, e.g. Wan 2.2's low-noise expert "
                               "(model: the high-noise one). Planned together; connect the MODEL_2 output to its sampler."),
            ],
            outputs=[io.Model.Output(display_name="MODEL", tooltip="The model with the planned techniques applied."),
                     io.Vae.Output(display_name="VAE", tooltip="The VAE, decoding in the planned tiles (the input "
                                   "VAE when no tiles are needed; none when no VAE is connected)."),
                     io.Clip.Output(display_name="CLIP", tooltip="The text encoder with its planned techniques (none when "
                                    "no clip is connected)."),
                     io.Model.Output(display_name="MODEL_2", tooltip="The second diffusion model with its planned "
                                     "techniques (none when no model_2 is connected).")],
        )

    @classmethod
    def execute(cls, model, plan_for: str = "this machine", allow_fp8: bool = True, prefer: str = "speed",
                vram_gb: float = 12.0, ram_gb: float = 32.0, disk_gb: float = 100.0, width: int = 1024,
                height: int = 1024, frames: int = 81, vae=None, latent=None, clip=None, model_2=None) -> io.NodeOutput:
        if clip is None and model_2 is None:
            out, vae_out, info = memory_plan_io.memory_plan(
                model, vae, latent, plan_for, vram_gb, ram_gb, disk_gb, allow_fp8, prefer, width, height, frames)
            clip_out = model_2_out = None
            text = memory_plan_io.format_plan(info)
        else:
            out, vae_out, clip_out, model_2_out, info = memory_plan_workflow_io.memory_plan_workflow(
                model, vae, latent, plan_for, vram_gb, ram_gb, disk_gb, allow_fp8, prefer, width, height, frames,
                clip=clip, model_2=model_2)
            text = memory_plan_workflow_io.format_workflow_plan(info)
        rep = report.build_report("Memory Plan", comfy_integration.loaded_models())
        rep["memory_plan"] = {k: v for k, v in info.items() if k != "applied"}
        return io.NodeOutput(out, vae_out, clip_out, model_2_out,
                             ui={"memorykit_report": [badge.with_badge(rep)], "text": [text]})
