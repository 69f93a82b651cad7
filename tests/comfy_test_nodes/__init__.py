"""Test-only ComfyUI nodes for MemoryKit's test suite and demo. Never shipped with the pack.

- ``MemoryKitTestWanTextEncode``: Wan conditioning (context dim 4096) from a text, made
  deterministically from the text's hash. Wan's real text encoder (UMT5-XXL, ≈5.7 B params)
  is too big for CPU tests; the diffusion model only needs a tensor of the right shape.
- ``MemoryKitTestFluxTextEncode``: Flux conditioning (T5 context dim 4096 + CLIP-L pooled 768)
  from a text's hash, for the same reason (T5-XXL is ≈4.7 B params).
- ``MemoryKitTestSaveTensor``: writes an IMAGE / LATENT / CONDITIONING (first cond and its
  pooled output) / tensor to ``output/`` as safetensors so tests can compare raw values (PNG
  output is 8-bit).
"""
import hashlib
import os

import torch
from comfy_api.latest import ComfyExtension, io

import folder_paths


class WanTextEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="MemoryKitTestWanTextEncode", display_name="[test] Wan Text Encode (fake)",
            category="MemoryKit/testing",
            inputs=[io.String.Input("text", multiline=True, default="", tooltip="Text to hash."),
                    io.Int.Input("tokens", default=16, min=1, max=512, tooltip="Sequence length.")],
            outputs=[io.Conditioning.Output()],
        )

    @classmethod
    def execute(cls, text: str, tokens: int = 16):
        seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
        gen = torch.Generator().manual_seed(seed)
        cond = torch.randn((1, tokens, 4096), generator=gen) * 0.5
        return io.NodeOutput([[cond, {}]])


class FluxTextEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="MemoryKitTestFluxTextEncode", display_name="[test] Flux Text Encode (fake)",
            category="MemoryKit/testing",
            inputs=[io.String.Input("text", multiline=True, default="", tooltip="Text to hash."),
                    io.Int.Input("tokens", default=16, min=1, max=512, tooltip="Sequence length."),
                    io.Float.Input("guidance", default=3.5, min=0.0, max=100.0, tooltip="Flux guidance.")],
            outputs=[io.Conditioning.Output()],
        )

    @classmethod
    def execute(cls, text: str, tokens: int = 16, guidance: float = 3.5):
        seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
        gen = torch.Generator().manual_seed(seed)
        cond = torch.randn((1, tokens, 4096), generator=gen) * 0.5
        pooled = torch.randn((1, 768), generator=gen) * 0.5
        return io.NodeOutput([[cond, {"pooled_output": pooled, "guidance": guidance}]])


class SaveTensor(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="MemoryKitTestSaveTensor", display_name="[test] Save Tensor", category="MemoryKit/testing",
            is_output_node=True,
            inputs=[io.AnyType.Input("value", tooltip="IMAGE, LATENT or tensor."),
                    io.String.Input("filename_prefix", default="mk_tensor", tooltip="File name prefix.")],
            outputs=[],
        )

    @classmethod
    def validate_inputs(cls, input_types):
        return True

    @classmethod
    def execute(cls, value, filename_prefix: str = "mk_tensor"):
        from safetensors.torch import save_file
        tensors = {}
        if isinstance(value, list):  # CONDITIONING: [[cond, {"pooled_output": ..., ...}], ...]
            t = value[0][0]
            if value[0][1].get("pooled_output") is not None:
                tensors["pooled_output"] = value[0][1]["pooled_output"].detach().float().cpu().contiguous()
        else:
            t = value["samples"] if isinstance(value, dict) else value
        out_dir = folder_paths.get_output_directory()
        i = 0
        while os.path.exists(os.path.join(out_dir, f"{filename_prefix}_{i:05d}.safetensors")):
            i += 1
        name = f"{filename_prefix}_{i:05d}.safetensors"
        tensors["value"] = t.detach().float().cpu().contiguous()
        save_file(tensors, os.path.join(out_dir, name))
        return io.NodeOutput(ui={"tensors": [{"filename": name, "subfolder": "", "type": "output"}]})


class TestNodes(ComfyExtension):
    async def get_node_list(self):
        return [WanTextEncode, FluxTextEncode, SaveTensor]


async def comfy_entrypoint():
    return TestNodes()
