"""Sharded Checkpoint Loader, Sharded Text Encoder Loader and Save Sharded (V3 schemas + one call)."""
from __future__ import annotations

from comfy_api.latest import io

from ..memorykit import comfy_integration as ci

_SHARD_RULES = ("Every shard is checked against the index before anything is loaded; shard names that leave the "
                "folder and pickle files (.bin/.pt/.ckpt) are refused.")


class ShardedCheckpointLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="MemoryKitShardedCheckpointLoader",
            display_name="Sharded Checkpoint Loader",
            category="MemoryKit",
            description=(
                "Loads a diffusion model stored as safetensors shards with an index "
                "(*.safetensors.index.json, as diffusers/transformers/huggingface_hub write them) from "
                "models/diffusion_models, one shard at a time, memory-mapped: no merged copy needed. "
                "Diffusers key names (Flux, SD3, AuraFlow, PixArt, UNets) are converted by ComfyUI's own "
                "loader, so the MODEL is the same as Load Diffusion Model gives for one file. " + _SHARD_RULES),
            inputs=[
                io.Combo.Input("model_name", options=ci.sharded_choices("diffusion_models"),
                               tooltip="A folder under models/diffusion_models holding one *.safetensors.index.json "
                                       "and its shards (or an index file, where a folder holds several)."),
                io.Combo.Input("weight_dtype", options=ci.WEIGHT_DTYPES, default="default",
                               tooltip="Storage dtype of the weights, as in Load Diffusion Model: 'default' keeps "
                                       "ComfyUI's choice; fp8 types halve memory (e4m3fn_fast also computes in "
                                       "fp8 on GPUs that support it)."),
            ],
            outputs=[io.Model.Output(tooltip="The diffusion model.")],
        )

    @classmethod
    def execute(cls, model_name: str, weight_dtype: str = "default") -> io.NodeOutput:
        path = ci.resolve_sharded("diffusion_models", model_name)
        model, info = ci.load_sharded_diffusion_model(path, weight_dtype)
        return io.NodeOutput(model, ui=ci.sharded_ui("Sharded Checkpoint Loader", info))


class ShardedTextEncoderLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="MemoryKitShardedTextEncoderLoader",
            display_name="Sharded Text Encoder Loader",
            category="MemoryKit",
            description=(
                "Loads a text encoder (CLIP-L/G, T5-XXL, UMT5, Llama, ...) stored as safetensors shards with an "
                "index from models/text_encoders, one shard at a time, memory-mapped; the CLIP is the same as "
                "Load CLIP gives for one file. " + _SHARD_RULES),
            inputs=[
                io.Combo.Input("text_encoder_name", options=ci.sharded_choices("text_encoders"),
                               tooltip="A folder under models/text_encoders holding one *.safetensors.index.json "
                                       "and its shards (or an index file, where a folder holds several), or a "
                                       "Hugging Face text_encoder/ folder saved in one model.safetensors."),
                io.Combo.Input("type", options=ci.text_encoder_types(), default="stable_diffusion",
                               tooltip="Which model the encoder is for, as in Load CLIP (stable_diffusion: CLIP-L; "
                                       "wan: UMT5-XXL; sd3/mochi: T5-XXL; ...)."),
                io.Combo.Input("device", options=["default", "cpu"], default="default", optional=True,
                               tooltip="'cpu' keeps the text encoder on the CPU (saves VRAM; encoding is slower)."),
            ],
            outputs=[io.Clip.Output(tooltip="The text encoder.")],
        )

    @classmethod
    def execute(cls, text_encoder_name: str, type: str = "stable_diffusion", device: str = "default") -> io.NodeOutput:
        path = ci.resolve_sharded("text_encoders", text_encoder_name)
        clip, info = ci.load_sharded_text_encoder(path, type, device)
        return io.NodeOutput(clip, ui=ci.sharded_ui("Sharded Text Encoder Loader", info))


class SaveSharded(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="MemoryKitSaveSharded",
            display_name="Save Sharded",
            category="MemoryKit",
            description=(
                "Saves a MODEL's diffusion-model weights (ComfyUI key names, LoRA and other patches merged, as "
                "ComfyUI's ModelSave saves them) into models/diffusion_models/<name>/ as safetensors shards plus "
                "model.safetensors.index.json, named as huggingface_hub names them. Free space is checked first; "
                "written to a temporary folder and renamed at the end, so a failed or interrupted save leaves "
                "nothing behind. Load the result "
                "with Sharded Checkpoint Loader."),
            is_output_node=True,
            inputs=[
                io.Model.Input("model", tooltip="The model to save."),
                io.String.Input("name", default="sharded_model",
                                tooltip="Folder to create under models/diffusion_models (sub-folders with '/'; "
                                        "no '..')."),
                io.String.Input("max_shard_size", default="5GB",
                                tooltip="Largest shard, in huggingface_hub's units: KB, MB, GB, TB (powers of 10; "
                                        "'5GB' = 5·10⁹ bytes). A single tensor larger than this gets its own shard."),
                io.Boolean.Input("overwrite", default=False,
                                 tooltip="Replace a model an earlier Save Sharded wrote into this folder, recognised "
                                         "by the marker file it writes (.memorykit-save.json), never by file names: "
                                         "only the files that marker lists are replaced (after the new ones are "
                                         "complete); other files stay. A folder without the marker (e.g. a "
                                         "huggingface_hub checkpoint, or a save by a MemoryKit older than the marker) "
                                         "is refused: delete or move it yourself. Off: an existing folder is an error."),
            ],
            outputs=[],
        )

    @classmethod
    def execute(cls, model, name: str = "sharded_model", max_shard_size: str = "5GB",
                overwrite: bool = False) -> io.NodeOutput:
        info = ci.save_model_sharded(model, name, max_shard_size, overwrite)
        return io.NodeOutput(ui=ci.sharded_ui("Save Sharded", info))
