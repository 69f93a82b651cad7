"""Diffusion models loaded by ComfyUI in-process, with fixed inputs and their plain output:
the reference the offloading tests compare against bit for bit."""
from __future__ import annotations

import torch

from . import comfy_env


def _inputs(key: str) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(1234)
    if key == "sd15":
        return (torch.randn(1, 4, 8, 8, generator=g), torch.tensor([500.0])), \
            {"context": torch.randn(1, 77, 768, generator=g)}
    if key == "wan":
        return (torch.randn(1, 16, 3, 8, 8, generator=g), torch.tensor([500.0]),
                torch.randn(1, 8, 4096, generator=g)), {}
    return (torch.randn(1, 16, 16, 16, generator=g), torch.tensor([0.5]), torch.randn(1, 8, 4096, generator=g)), \
        {"y": torch.randn(1, 768, generator=g), "guidance": torch.tensor([3.5])}


class Loaded:
    """A diffusion model loaded by ComfyUI, its inputs and its plain output."""

    def __init__(self, key: str, path):
        import comfy.sd
        self.key, self.path = key, path
        self.patcher = comfy.sd.load_diffusion_model(str(path))
        self.dm = self.patcher.model.diffusion_model
        self.args, self.kwargs = _inputs(key)
        self.aligned = {id(t) for t in self.tensors() if t.data_ptr() % 64 == 0}
        self.reference = self.forward()

    def forward(self) -> torch.Tensor:
        with torch.no_grad():
            return self.dm(*self.args, **self.kwargs)

    def tensors(self):
        return list(self.dm.parameters()) + list(self.dm.buffers())

    def block_lists(self):
        from comfyui_memorykit.memorykit import comfy_integration
        return comfy_integration.comfy_block_lists(self.dm)

    def assert_restored(self) -> None:
        """Weights as loaded: values equal the file's, on the CPU, unpinned, aligned as before;
        no hook, instance ``forward`` or registry left on any submodule."""
        from safetensors import safe_open
        prefix = "model.diffusion_model." if self.key == "sd15" else ""
        with safe_open(str(self.path), framework="pt") as f:
            names = set(f.keys())
            for k, v in self.dm.state_dict().items():
                assert torch.equal(v, f.get_tensor(comfy_env.file_key(prefix + k, names)).to(v.dtype)), k
        for t in self.tensors():
            assert t.device.type == "cpu" and not t.is_pinned()
            assert id(t) not in self.aligned or t.data_ptr() % 64 == 0
        for name, m in self.dm.named_modules():
            assert "forward" not in m.__dict__ and "_diffusers_hook" not in m.__dict__, name
            assert not m._forward_pre_hooks and not m._forward_hooks, name
        assert "memorykit_streamed_0" not in dict(self.dm.named_children())
