"""FP8 Layerwise Cast node: MODEL → MODEL with float8 weight storage (schema + thin call)."""
from __future__ import annotations

from comfy_api.latest import io

from ..memorykit import badge, comfy_integration, fp8, report


class Fp8LayerwiseCast(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="MemoryKitFp8LayerwiseCast",
            display_name="FP8 Layerwise Cast",
            category="MemoryKit",
            description=(
                "Stores the diffusion model's Linear/Conv weights in float8 (1 byte per weight) and computes "
                "each layer in bf16/fp16/fp32, about halving weight memory. Works on any MODEL (also from Load "
                "Checkpoint). Sensitive layers (norms, embeddings, input/output projections, the modulation "
                "outside the blocks; see skip_preset) stay in high precision. The input MODEL is not changed; LoRA works before or after this node. "
                "Reports weight bytes before/after and the layers kept."
            ),
            inputs=[
                io.Model.Input("model", tooltip="The model to store in float8. Connect it straight from the "
                               "loader (or after LoRA loaders); use one FP8 Layerwise Cast per model."),
                io.Combo.Input("storage_dtype", options=list(fp8.STORAGE_DTYPES), default="float8_e4m3fn",
                               tooltip="float8_e4m3fn: 3 mantissa bits, range ±448 (more precise, the usual "
                               "choice). float8_e5m2: 2 mantissa bits, range ±57344 (coarser, wider range)."),
                io.Combo.Input("compute_dtype", options=["auto"] + list(fp8.COMPUTE_DTYPES), default="auto",
                               tooltip="Dtype each layer computes in after casting its weight up. auto: what "
                               "ComfyUI already uses for this model. A dtype the device cannot compute in is "
                               "refused with an error."),
                io.Boolean.Input("fp8_matmul", default=False,
                                 tooltip="Multiply Linear layers on float8 tensor cores (NVIDIA compute "
                                 "capability 8.9+: RTX 40xx, L4/L40, H100/H200) instead of casting weights "
                                 "up: faster, slightly less precise (activations are rounded to float8 per "
                                 "token). Needs float8_e4m3fn; refused with an error on other GPUs."),
                io.Combo.Input("scaling", options=list(fp8.SCALINGS), default="per-tensor",
                               tooltip="Scale weights into float8's range before rounding, so small weights do "
                               "not fall into its coarse subnormal range. none: plain cast (like core's fp8 "
                               "weight_dtype). per-tensor: one scale per layer. per-output-channel: one per "
                               "output row (best for weights with outlier channels)."),
                io.Combo.Input("skip_preset", options=list(fp8.PRESETS), default="auto",
                               tooltip="Layers kept in high precision, by architecture (recognised by its module "
                               "names: SD/SDXL UNet, Flux/Chroma/HunyuanVideo, Wan, SD3, AuraFlow, Qwen-Image, LTXV, "
                               "Lumina; generic names otherwise). auto: norms, embeddings, in/out projections and the "
                               "modulation outside the blocks; the blocks' own modulation goes to float8 (~0.51x bf16 "
                               "weight memory on Flux, SD3.5, Qwen-Image, HunyuanVideo). auto_keep_block_modulation: "
                               "the blocks' modulation kept too (~0.64-0.71x). auto_fp8_modulation: no modulation "
                               "kept. none: cast every Linear/Conv."),
                io.String.Input("extra_skip_patterns", default="", multiline=True,
                                tooltip="More layers to keep: Python regular expressions searched in ComfyUI's "
                                "module names, e.g. 'double_blocks\\.0\\.' or 'attn.*\\.proj$'. One per line, or "
                                "several on a line separated by commas outside (), [] and {} ('blocks\\.{0,1}0' "
                                "stays whole; '\\,' is a literal comma). Lines starting with # are ignored. "
                                "Matched in linear time, so backreferences, lookarounds, \\b and inline flags "
                                "are refused."),
                io.Combo.Input("lora_mode", options=list(comfy_integration.FP8_LORA_MODES), default="unmerged", optional=True,
                               tooltip="How a LoRA (before or after this node) reaches the float8 weights. "
                               "unmerged: the LoRA delta is added per forward in the compute dtype to the "
                               "dequantised weight (output error stays FP8's own; costs one rank-r matmul and "
                               "one weight-sized temporary per patched layer per step, and turns off float8 "
                               "matmul on those layers). merged: the LoRA is merged into the weight and "
                               "re-quantised once at load (no per-step cost; the error grows with the merged "
                               "weight, several times FP8's own for a strong LoRA)."),
            ],
            outputs=[io.Model.Output(display_name="MODEL", tooltip="The model with float8 weight storage.")],
        )

    @classmethod
    def execute(cls, model, storage_dtype: str = "float8_e4m3fn", compute_dtype: str = "auto",
                fp8_matmul: bool = False, scaling: str = "per-tensor", skip_preset: str = "auto",
                extra_skip_patterns: str = "", lora_mode: str = "unmerged") -> io.NodeOutput:
        out, info = comfy_integration.fp8_layerwise_cast(model, storage_dtype, compute_dtype, scaling,
                                                         skip_preset, extra_skip_patterns, fp8_matmul, lora_mode)
        rep = report.build_report("FP8 Layerwise Cast", comfy_integration.loaded_models())
        rep["fp8"] = info
        return io.NodeOutput(out, ui={"memorykit_report": [badge.with_badge(rep)], "text": [comfy_integration.format_fp8_info(info)]})
