"""CLIP → CLIP nodes: the techniques on a text encoder (schemas + thin calls into
``memorykit.comfy_integration.text_encoder``)."""
from __future__ import annotations

from comfy_api.latest import io

from ..memorykit import badge, fp8, report
from ..memorykit.comfy_integration import FP8_LORA_MODES, loaded_models
from ..memorykit.comfy_integration import text_encoder as te
from .group_offload import _offload_inputs, _settings

_CLIP_IN = ("The text encoder (from Load CLIP, DualCLIPLoader, Load Checkpoint, ...). It is not changed: "
            "the output is a copy carrying the technique.")
_PER_PROMPT = ("A text encoder runs once per prompt (once per 77-token chunk for CLIP-L/G), not once per "
               "sampling step, so what it streams is paid once per prompt.")


def _ui(label: str, kind: str, info: dict) -> dict:
    rep = report.build_report(label, loaded_models())
    rep["text_encoder"] = {"technique": kind, **{k: v for k, v in info.items() if k != "kept_layers"}}
    return {"memorykit_report": [badge.with_badge(rep)], "text": [te.format_text_encoder_info(kind, info)]}


class TextEncoderGroupOffload(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="MemoryKitTextEncoderGroupOffload",
            display_name="Group Offload (Text Encoder)",
            category="MemoryKit",
            description=("Keeps the text encoder's weights in CPU RAM (or on disk) and streams its layers to the "
                         "GPU while a prompt is encoded, so a text encoder larger than free VRAM runs next to a "
                         "resident diffusion model. Under a VRAM budget as many layers as fit stay resident. The "
                         "conditioning equals the plain text encoder's. " + _PER_PROMPT + " Embeddings and the "
                         "layers outside the blocks stay resident. Without a GPU, offload_to=cpu passes the text "
                         "encoder through unchanged; offload_to=disk saves RAM."),
            inputs=[io.Clip.Input("clip", tooltip=_CLIP_IN)] + _offload_inputs("whole encoder layers"),
            outputs=[io.Clip.Output(tooltip="The text encoder, loaded group-offloaded when a prompt is encoded.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, clip, **options) -> io.NodeOutput:
        out, info = te.text_encoder_group_offload(clip, _settings(cls.hidden.unique_id, **options))
        return io.NodeOutput(out, ui=_ui("Group Offload (Text Encoder)", "group_offload", info))


class TextEncoderFp8(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="MemoryKitTextEncoderFp8",
            display_name="FP8 Layerwise Cast (Text Encoder)",
            category="MemoryKit",
            description=("Stores the text encoder's Linear weights in float8 (1 byte per weight), about halving a "
                         "bf16/fp16 text encoder's memory, and computes each layer in the precision the text "
                         "encoder already uses. Embeddings, norms and the final projection stay in high precision "
                         "(skip_preset). The conditioning differs from the plain one by float8 rounding (about 1-3 % "
                         "relative). Put it before Group Offload (Text Encoder) to stream half the bytes."),
            inputs=[
                io.Clip.Input("clip", tooltip=_CLIP_IN),
                io.Combo.Input("storage_dtype", options=list(fp8.STORAGE_DTYPES), default="float8_e4m3fn",
                               tooltip="float8_e4m3fn: more precise (the usual choice). float8_e5m2: wider range, "
                                       "coarser."),
                io.Combo.Input("scaling", options=list(fp8.SCALINGS), default="per-tensor",
                               tooltip="Scale weights into float8's range before rounding. none: plain cast. "
                                       "per-tensor: one scale per layer. per-output-channel: one per output row."),
                io.Combo.Input("skip_preset", options=list(te.TE_SKIP_PRESETS), default="auto",
                               tooltip="auto: keep the token/position embeddings, norms and the final projection "
                                       "(text_projection, lm_head) in high precision. none: cast every Linear."),
                io.String.Input("extra_skip_patterns", default="", multiline=True,
                                tooltip="More layers to keep: Python regular expressions searched in the module "
                                        "names, e.g. 'layers\\.0\\.' (one per line; lines starting with # are "
                                        "ignored)."),
                io.Combo.Input("lora_mode", options=list(FP8_LORA_MODES), default="unmerged", optional=True,
                               tooltip="How a CLIP LoRA reaches the float8 weights. unmerged: added per encode in "
                                       "the compute precision. merged: merged and re-quantised once at load."),
            ],
            outputs=[io.Clip.Output(tooltip="The text encoder with float8 weight storage.")],
        )

    @classmethod
    def execute(cls, clip, storage_dtype: str = "float8_e4m3fn", scaling: str = "per-tensor",
                skip_preset: str = "auto", extra_skip_patterns: str = "", lora_mode: str = "unmerged") -> io.NodeOutput:
        out, info = te.text_encoder_fp8(clip, storage_dtype, scaling, skip_preset, extra_skip_patterns, lora_mode)
        return io.NodeOutput(out, ui=_ui("FP8 Layerwise Cast (Text Encoder)", "fp8", info))


class TextEncoderDevice(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="MemoryKitTextEncoderDevice",
            display_name="Text Encoder Device",
            category="MemoryKit",
            description=("Runs the whole text encoder on another device: cpu (no VRAM used, slower encode) or a "
                         "second GPU (cuda:1), while the diffusion model stays where it is. The conditioning is "
                         "what the same weights give on that device. " + _PER_PROMPT),
            inputs=[
                io.Clip.Input("clip", tooltip=_CLIP_IN),
                io.String.Input("device", default="cpu",
                                tooltip="cpu, or cuda:N for GPU number N (cuda:0 is the first). A GPU this machine "
                                        "does not have is an error."),
            ],
            outputs=[io.Clip.Output(tooltip="The text encoder, loaded on that device when a prompt is encoded.")],
        )

    @classmethod
    def execute(cls, clip, device: str = "cpu") -> io.NodeOutput:
        out, info = te.text_encoder_device(clip, device)
        return io.NodeOutput(out, ui=_ui("Text Encoder Device", "device", info))
