"""Every core path that reads a cast layer's weight gets the real (scaled) weight (issue 19).

Where the running ComfyUI has core's ``QuantizedTensor``, FP8 Layerwise Cast's Linear layers are
core's mixed-precision Linear holding one, so a path that bypasses the layer's forward and calls
``comfy.ops.cast_bias_weight(layer, x)`` itself (0.38's fp16-accumulate shortcut in
``linear_input_act``, CUDA-only; dynamic VRAM's staging) receives the dequantised weight — by
construction, shown here on the CPU: on the Wan fixture (its FFN output projection goes through
``comfy.ops.linear_input_act`` on 0.33), with ``torch.backends.cuda.matmul.allow_fp16_accumulation``
set where this torch has it, the output equals the run without it, and ``cast_bias_weight`` on
every core-path layer returns float8 value × scale.
"""
from __future__ import annotations

import pytest
import torch
from harness.fp8_checks import cast, load_and_forward, rel, wan_model_and_inputs

E4M3 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def wan(comfy, fixture_models):
    yield wan_model_and_inputs(fixture_models)
    import comfy.model_management as mm
    mm.unload_all_models()


def test_cast_bias_weight_returns_the_scaled_weight(ci, wan):
    import comfy.ops
    import comfy.quant_ops
    plain, args, kwargs = wan
    if ci.compat.core_fp8_format(E4M3) is None:
        pytest.skip("this ComfyUI has no QuantizedTensor: MemoryKit's cast layers are used")
    model, info = cast(ci, plain)
    assert info["core_layers"] > 0 and "QuantizedTensor" in info["path"], info["path"]
    load_and_forward(model, *args, **kwargs)
    n = 0
    with torch.inference_mode():
        for name, m in model.model.diffusion_model.named_modules():
            if not ci.fp8_core.is_core_layer(m):
                continue
            x = torch.zeros(1, m.in_features)
            w, _ = comfy.ops.cast_bias_weight(m, x)
            # 0.3.75 hands back the dequantised weight; 0.33 the QuantizedTensor itself when its dtype
            # (the compute dtype) already matches, which every torch op dequantises (and 0.38's
            # fp16 shortcut skips): either way float8 value × scale.
            if isinstance(w, comfy.quant_ops.QuantizedTensor):
                w = w.dequantize()
            expected = ci.fp8_core.storage_tensor(m).float() * ci.fp8_core.weight_scale(m).float()
            assert type(w) is torch.Tensor and torch.equal(w, expected), name
            n += 1
    assert n == info["core_layers"]


def test_fp16_accumulation_flag_and_linear_input_act(ci, wan):
    import comfy.ops
    plain, args, kwargs = wan
    model, info = cast(ci, plain)
    ref = load_and_forward(plain, *args, **kwargs)
    out = load_and_forward(model, *args, **kwargs)
    flag = getattr(torch.backends.cuda.matmul, "allow_fp16_accumulation", None)
    if flag is not None:
        torch.backends.cuda.matmul.allow_fp16_accumulation = True
    try:
        out_flag = load_and_forward(model, *args, **kwargs)
        if hasattr(comfy.ops, "linear_input_act"):  # 0.33+: the FFN output projection's path
            ffn = model.model.diffusion_model.blocks[0].ffn
            x = torch.randn(2, 5, ffn[0].in_features)
            with torch.inference_mode():
                got = comfy.ops.linear_input_act(ffn[2], ffn[0](x), "gelu_tanh")
                want = ffn[2](torch.nn.functional.gelu(ffn[0](x), approximate="tanh"))
            assert torch.equal(got, want)
    finally:
        if flag is not None:
            torch.backends.cuda.matmul.allow_fp16_accumulation = flag
    print(f"\nWan FP8 ({info['path']}): vs plain {rel(out, ref):.4f}; with fp16 accumulation flag "
          f"{'set' if flag is not None else 'absent'}: identical={torch.equal(out_flag, out)}")
    assert torch.equal(out_flag, out)
    assert rel(out, ref) < 0.05
