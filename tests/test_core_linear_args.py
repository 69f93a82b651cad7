"""The pack's own layers take core's newest Linear call arguments and apply them as core does.

Core after 0.38 calls a Linear with ``input_act`` / ``act_weight`` / ``act_eps`` / ``residual`` /
``residual_scale`` (``comfy.ops.linear_input_act``: ``residual + residual_scale · linear(act(x))``)
and skips a layer's forward in its fused shortcuts unless the layer sets ``comfy_force_forward``.
The tested cores do not pass these arguments, so the layers FP8 Layerwise Cast builds (MemoryKit's
cast layers on a Linear and a Conv, and core's mixed-precision Linear with MemoryKit's LoRA mixin
where this core has ``QuantizedTensor``) are called directly, with each argument, and compared with
the same math on a plain Linear holding the dequantised weight. An argument they do not know
raises instead of being dropped. One forward of a 16×8 layer per case.
"""
from __future__ import annotations

import pytest
import torch

E4M3 = torch.float8_e4m3fn
IN, OUT = 16, 8


def _weights(seed: int, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.2


@pytest.fixture(scope="module")
def layers(ci, fp8):
    """``{kind: (layer, plain Linear with the same real weight)}`` for each layer kind the pack builds."""
    import comfy.ops
    from comfyui_memorykit.memorykit.comfy_integration import fp8_core, fp8_patcher
    orig = comfy.ops.manual_cast.Linear(IN, OUT)
    with torch.no_grad():
        orig.weight.copy_(_weights(1, OUT, IN))
        orig.bias.copy_(_weights(2, OUT))
    q, s = fp8.quantize_weight(orig.weight.detach(), E4M3, "per-tensor", power_of_two=True)
    plain = torch.nn.Linear(IN, OUT)
    with torch.no_grad():
        plain.weight.copy_(q.float() * s.float())
        plain.bias.copy_(orig.bias)
    out = {"memorykit": (fp8_patcher._fp8_layer(orig, q, s, orig.bias.detach().clone()), plain)}
    fmt = ci.compat.core_fp8_format(E4M3)
    if fmt is not None:
        out["core"] = (fp8_core.build_layer(orig, q, s, orig.bias.detach().clone(), fmt[0], torch.float32,
                                            False, "unmerged"), plain)
    return out


def _swiglu(x):
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _cases():
    x = _weights(3, 2, 5, IN)
    x2 = _weights(4, 2, 5, 2 * IN)
    nw = 1 + _weights(5, IN)
    res, scale = _weights(6, 2, 5, OUT), _weights(7, OUT)
    return [
        ("plain", x, {}, lambda lin: lin(x)),
        ("gelu_tanh", x, {"input_act": "gelu_tanh"},
         lambda lin: lin(torch.nn.functional.gelu(x, approximate="tanh"))),
        ("swiglu", x2, {"input_act": "swiglu"}, lambda lin: lin(_swiglu(x2))),
        ("rms_norm tensor", x, {"input_act": "rms_norm", "act_weight": nw, "act_eps": 1e-5},
         lambda lin: lin(_rms(x, nw, 1e-5))),
        ("rms_norm module", x, {"input_act": "rms_norm", "act_weight": "module"},
         lambda lin: lin(_rms(x, nw, 1e-6))),
        ("residual", x, {"residual": res, "residual_scale": scale}, lambda lin: res + scale * lin(x)),
        ("residual unscaled", x, {"residual": res}, lambda lin: res + lin(x)),
        ("all", x2, {"input_act": "swiglu", "residual": res, "residual_scale": scale},
         lambda lin: res + scale * lin(_swiglu(x2))),
    ]


def _norm_module(nw):
    import comfy.ops
    norm = comfy.ops.manual_cast.RMSNorm(IN, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(nw)
    return norm


@pytest.mark.parametrize("kind", ["memorykit", "core"])
def test_layer_applies_each_linear_argument_as_core(layers, kind):
    if kind not in layers:
        pytest.skip("this ComfyUI has no QuantizedTensor layout for float8_e4m3fn: no core-path layer")
    layer, plain = layers[kind]
    assert layer.comfy_force_forward is True  # core's fused shortcuts call this forward
    with torch.inference_mode():
        for name, x, kwargs, ref in _cases():
            if kwargs.get("act_weight") == "module":
                kwargs = dict(kwargs, act_weight=_norm_module(1 + _weights(5, IN)))
            got, want = layer(x, **kwargs), ref(plain)
            assert got.shape == want.shape, name
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (name, (got - want).abs().max().item())
            assert torch.equal(got, layer(x, **kwargs)), name


def test_unknown_arguments_raise(layers, fp8):
    import comfy.ops
    from comfyui_memorykit.memorykit.comfy_integration import fp8_patcher
    x = _weights(3, 2, IN)
    for layer, _ in layers.values():
        with pytest.raises(TypeError, match="input_act_scale"):
            layer(x, input_act_scale=2.0)
        with pytest.raises(ValueError, match="'relu2'"):
            layer(x, input_act="relu2")
    conv = comfy.ops.manual_cast.Conv2d(4, 4, 3, padding=1)
    with torch.no_grad():
        conv.weight.copy_(_weights(8, 4, 4, 3, 3))
        conv.bias.zero_()
    q, s = fp8.quantize_weight(conv.weight.detach(), E4M3, "per-tensor")
    layer = fp8_patcher._fp8_layer(conv, q, s, conv.bias.detach().clone())
    assert layer.comfy_force_forward is True
    img = _weights(9, 1, 4, 6, 6)
    with torch.inference_mode():
        want = torch.nn.functional.conv2d(img, q.float() * s.float(), None, padding=1)
        assert torch.allclose(layer(img), want, atol=1e-6)
        with pytest.raises(TypeError, match="input_act"):
            layer(img, input_act="swiglu")


def test_core_linear_input_act_calls_the_layer(layers):
    """Where this core has ``comfy.ops.linear_input_act`` (0.33: ``(linear, x, input_act)``), core's
    own entry gives what the layer's keyword gives."""
    import comfy.ops
    if not hasattr(comfy.ops, "linear_input_act"):
        pytest.skip("this ComfyUI has no comfy.ops.linear_input_act (before 0.33)")
    x2 = _weights(4, 2, 5, 2 * IN)
    with torch.inference_mode():
        for layer, _ in layers.values():
            assert torch.equal(comfy.ops.linear_input_act(layer, x2, "swiglu"), layer(x2, input_act="swiglu"))
