"""FP8 Layerwise Cast keeps a LoRA's effect (issue 19): the SD1.5 test UNet (weights std 0.02),
a rank-4 LoRA whose up and down matrices are N(0, 0.3²) on every attention and feed-forward Linear
of the transformer blocks (alpha = rank: ΔW ≈ 9 × the weight std at strength 1), default node
settings, strengths 0.5, 1.0 and 2.0, LoRA before and after the node.

Measured per LoRA'd layer (the output of each of the UNet's attention/feed-forward Linear layers
for the same input): its error against plain + LoRA stays within 2 × FP8's own error (the same
layer, FP8 vs plain, no LoRA) in the default ``unmerged`` mode; ``merged`` (merge, re-quantise) is
printed beside it. End to end this LoRA makes the random UNet chaotic (at strength 1 it moves the
output by ~80 %, and FP8's own 6 % rounding perturbation is amplified ~9×, whichever mode), so the
whole-model figures are printed, not bounded. A strength change after the node reuses the float8
tensors (no re-quantisation), and LoRA before / after the node give identical outputs.
"""
from __future__ import annotations

import pytest
import torch
from harness import loras
from harness.fp8_checks import cast, load_and_forward, rel

STRENGTHS = (0.5, 1.0, 2.0)


@pytest.fixture(scope="module")
def sd15(comfy, fixture_models):
    import nodes
    loras.ensure_big_lora()
    with torch.inference_mode():
        plain = nodes.CheckpointLoaderSimple().load_checkpoint("mk_sd15_tiny.safetensors")[0]
    gen = torch.Generator().manual_seed(2)
    args = (torch.randn(1, 4, 16, 16, generator=gen), torch.tensor([500.0]))
    kwargs = {"c_crossattn": torch.randn(1, 77, 768, generator=gen)}
    yield plain, args, kwargs
    import comfy.model_management as mm
    mm.unload_all_models()


def _lora(m, strength):
    import nodes
    with torch.inference_mode():
        return nodes.LoraLoaderModelOnly().load_lora_model_only(m, loras.BIG_LORA_NAME, strength)[0]


def _layer_outputs(model, *args, **kwargs) -> tuple[torch.Tensor, dict]:
    """Load ``model``, run it; return its output and name → output of every LoRA'd Linear for a
    fixed input (the layer as loaded: float8 + per-forward LoRA, or merged)."""
    out = load_and_forward(model, *args, **kwargs)
    gen = torch.Generator().manual_seed(9)
    outs = {}
    with torch.inference_mode():
        for name, m in model.model.diffusion_model.named_modules():
            if loras.BIG_TARGETS.search(name):
                x = torch.randn(2, 7, m.weight.shape[1], generator=gen)
                outs[name] = m(x).float()
    return out, outs


def _err(outs: dict, ref: dict) -> float:
    """Error norm over every LoRA'd layer's output (absolute, summed in quadrature)."""
    return float(sum(((outs[k] - ref[k]) ** 2).sum() for k in ref) ** 0.5)


def _float8_data(ci, model) -> dict:
    """name → where the float8 data of each cast layer of the loaded ``model`` lives."""
    return {n: ci.fp8_core.storage_tensor(m).untyped_storage().data_ptr()
            for n, m in model.model.diffusion_model.named_modules() if hasattr(m, "_mk_original")}


def test_lora_keeps_its_effect_at_every_strength_in_both_orders(ci, sd15):
    plain, args, kwargs = sd15
    ref, ref_layers = _layer_outputs(plain, *args, **kwargs)
    fp8_model, info = cast(ci, plain)
    merged_model = cast(ci, plain, lora_mode="merged")[0]
    out, layers = _layer_outputs(fp8_model, *args, **kwargs)
    own, own_model = _err(layers, ref_layers), rel(out, ref)
    print(f"\n{info['path']}; FP8 alone vs plain: LoRA'd layers' error {own:.4f}, model output {own_model:.4f}")
    data = None
    for s in STRENGTHS:
        lora_ref, lora_layers = _layer_outputs(_lora(plain, s), *args, **kwargs)
        after = _lora(fp8_model, s)                                  # FP8 Layerwise Cast, then LoRA
        out_after, layers_after = _layer_outputs(after, *args, **kwargs)
        now = _float8_data(ci, after)
        if data is not None:  # a strength change reuses the float8 tensors of the cached FP8 model
            assert now == data, "float8 tensors were re-quantised"
        data = now
        out_before, layers_before = _layer_outputs(cast(ci, _lora(plain, s))[0], *args, **kwargs)  # LoRA, then FP8
        out_merged, layers_merged = _layer_outputs(_lora(merged_model, s), *args, **kwargs)
        a, b, m = (_err(x, lora_layers) for x in (layers_after, layers_before, layers_merged))
        print(f"strength {s}: LoRA'd layers' error after node {a / own:.2f}x FP8's own, before node {b / own:.2f}x, "
              f"merged {m / own:.2f}x; model output vs plain + LoRA: unmerged {rel(out_after, lora_ref):.4f} "
              f"(before node {rel(out_before, lora_ref):.4f}), merged {rel(out_merged, lora_ref):.4f}; "
              f"the LoRA moves the output by {rel(lora_ref, ref):.4f}")
        assert torch.equal(out_after, out_before)
        assert a <= 2 * own and b <= 2 * own, (s, a / own, b / own)
        assert a < m


def test_bad_lora_mode_is_refused(ci, sd15):
    with pytest.raises(ValueError, match="lora_mode"):
        cast(ci, sd15[0], lora_mode="sideways")
