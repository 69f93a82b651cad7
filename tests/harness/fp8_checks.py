"""Shared checks for the FP8 Layerwise Cast tests: forwards through ComfyUI's loader path,
the node call, and "the shared module is unchanged" against the model file."""
from __future__ import annotations

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def load_and_forward(patcher, *args, **kwargs) -> torch.Tensor:
    """Load ``patcher`` the way sampling does (``load_models_gpu``), run one apply_model."""
    import comfy.model_management as mm
    with torch.inference_mode():
        mm.load_models_gpu([patcher])
        return patcher.model.apply_model(*args, **kwargs).float()


def wan_model_and_inputs(fixture_models) -> tuple:
    """The Wan fixture loaded by core's loader and inputs for one ``apply_model``:
    ``(patcher, args, kwargs)`` (seed 1: 3 latent frames of 16², sigma 0.6, 16 text tokens)."""
    import comfy.sd
    with torch.inference_mode():
        plain = comfy.sd.load_diffusion_model(str(fixture_models["wan"]))
    gen = torch.Generator().manual_seed(1)
    args = (torch.randn(1, 16, 3, 16, 16, generator=gen), torch.tensor([0.6]))
    kwargs = {"c_crossattn": torch.randn(1, 16, 4096, generator=gen) * 0.5}
    return plain, args, kwargs


def cast(ci, model, storage="float8_e4m3fn", compute="auto", scaling="per-tensor", preset="auto", extra="",
         fp8_matmul=False, lora_mode="unmerged"):
    with torch.inference_mode():
        return ci.fp8_layerwise_cast(model, storage, compute, scaling, preset, extra, fp8_matmul, lora_mode)


def dequantised_weights(ci, patcher) -> dict:
    """name → float32 real values (float8 value × scale) of the weight of every cast layer of the
    loaded FP8 ``patcher``'s diffusion model (core's QuantizedTensor layers and MemoryKit's own)."""
    from comfyui_memorykit.memorykit.comfy_integration.fp8_patcher import layer_scale
    out = {}
    for name, m in patcher.model.diffusion_model.named_modules():
        if not hasattr(m, "_mk_original"):
            continue
        if ci.fp8_core.is_core_layer(m):
            w, s = ci.fp8_core.storage_tensor(m), ci.fp8_core.weight_scale(m)
        else:
            w, s = m.weight, layer_scale(m)
        out[f"{name}.weight"] = w.float() * (1.0 if s is None else s.float())
    return out


def with_weights(patcher, weights: dict):
    """``patcher`` (a freshly loaded model no other patcher shares) with its diffusion model's
    ``weights`` (name → tensor) copied into the parameters; returns it."""
    with torch.inference_mode():
        for name, p in patcher.model.diffusion_model.named_parameters():
            if name in weights:
                p.copy_(weights[name])
    return patcher


def fingerprint(module: torch.nn.Module) -> dict:
    """name → (module object, parameter object, dtype) of every parameter."""
    return {f"{name}.{pname}": (m, p, p.dtype)
            for name, m in module.named_modules() for pname, p in m.named_parameters(recurse=False)}


def read_tensors(file):
    """Yield (key, tensor) from a safetensors file with plain reads, one tensor at a time (no
    mmap: a 2 GB file would otherwise stay in this process's resident set)."""
    import json
    import struct
    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        for key, meta in header.items():
            start, end = meta["data_offsets"]
            f.seek(8 + n + start)
            data = bytearray(f.read(end - start))
            if meta["dtype"] in dtypes:
                yield key, torch.frombuffer(data, dtype=dtypes[meta["dtype"]]).reshape(meta["shape"])


def assert_unchanged(before: dict, module: torch.nn.Module, file, prefix: str = "", same_params: bool = True) -> None:
    """The shared module holds the same module (and parameter) objects as ``before`` and every
    parameter still equals, bit for bit, the tensor in the model ``file`` it was loaded from.
    ``same_params=False`` where core's LoRA patched the shared module: its unpatch puts the
    restored tensor back in a new Parameter object."""
    after = fingerprint(module)
    assert after.keys() == before.keys()
    for k, (m, p, dtype) in before.items():
        m2, p2, dtype2 = after[k]
        assert m2 is m and (p2 is p or not same_params) and dtype2 == dtype, f"{k}: the shared module was changed"
    from safetensors import safe_open

    from . import comfy_env
    seen = set()
    with safe_open(str(file), framework="pt") as f:
        names = set(f.keys())
    by_file_key = {comfy_env.file_key(prefix + k, names): k for k in after}  # the file's name of each parameter
    for key, t in read_tensors(file):
        k = by_file_key.get(key)
        if k is not None:
            assert torch.equal(after[k][1].detach(), t.to(after[k][2])), f"{k}: weight values changed"
            seen.add(k)
    assert seen == set(after), set(after) - seen
