"""FP8 Layerwise Cast, technique layer on plain tensors/modules, and the node's errors."""
from __future__ import annotations

import pytest
import torch
from harness import comfy_env, models as hmodels
from harness.fp8_checks import cast, rel

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2



# ---------------------------------------------------------------------------------------------
# Technique layer (plain torch)
# ---------------------------------------------------------------------------------------------
def test_quantize_stores_one_byte_and_scaling_lowers_error(fp8):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=gen) * 0.02
    w[3] = 0.0  # an all-zero output row gets scale 1, not 0/0
    errs = {}
    for scaling in fp8.SCALINGS:
        q, s = fp8.quantize_weight(w, E4M3, scaling)
        assert q.dtype == E4M3 and q.element_size() == 1 and q.shape == w.shape
        assert fp8.param_bytes(q) == w.numel()
        assert s is None if scaling == "none" else s.dtype == torch.float32
        if scaling == "per-output-channel":
            assert s.shape == (256, 1) and float(s[3]) == 1.0
        errs[scaling] = rel(fp8.dequantize_weight(q, s), w)
    # std-0.02 weights sit near e4m3's subnormal range (< 2^-6): a scale moves them out of it.
    assert errs["per-tensor"] < errs["none"] and errs["per-output-channel"] < errs["none"], errs
    assert errs["per-tensor"] < 0.05, errs


def test_quantize_saturates_instead_of_nan(fp8):
    w = torch.tensor([[1e6, -1e6, 0.5, 1e-9]])
    for dtype in (E4M3, E5M2):
        q, _ = fp8.quantize_weight(w, dtype, "none")
        back = q.float()
        assert torch.isfinite(back).all()
        assert float(back[0, 0]) == fp8.FP8_MAX[dtype] and float(back[0, 1]) == -fp8.FP8_MAX[dtype]


def test_parse_patterns_and_errors(fp8):
    assert fp8.parse_patterns("a\\.b, c$\n# comment\n\n  d  ") == ["a\\.b", "c$", "d"]
    with pytest.raises(ValueError, match=r"invalid skip pattern 'blocks\.\('"):
        fp8.parse_patterns("ok\nblocks.(")
    with pytest.raises(ValueError, match="unknown skip preset"):
        fp8.default_skip_patterns("flux", "everything")


def _meta_model(kind: str) -> torch.nn.Module:
    import comfy.ops
    ops = comfy.ops.disable_weight_init
    with torch.device("meta"):
        if kind == "flux":
            from comfy.ldm.flux.model import Flux
            return Flux(operations=ops, **hmodels.FLUX_PARAMS, **comfy_env.flux_version_params())
        if kind == "wan":
            from comfy.ldm.wan.model import WanModel
            return WanModel(model_type="t2v", dim=128, ffn_dim=256, num_heads=1, num_layers=1, in_dim=16,
                            out_dim=16, text_dim=4096, operations=ops)
        from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
        return UNetModel(**hmodels.sd15_unet_config(), operations=ops)


@pytest.mark.parametrize("kind, family, kept, cast_", [
    ("flux", "flux",
     ["img_in", "txt_in", "time_in.in_layer", "vector_in.out_layer", "guidance_in.in_layer",
      "final_layer.linear", "final_layer.adaLN_modulation.1"],
     ["double_blocks.0.img_attn.qkv", "double_blocks.0.txt_mlp.2", "single_blocks.0.linear1",
      "single_blocks.0.linear2", "double_blocks.0.img_mod.lin", "double_blocks.0.txt_mod.lin",
      "single_blocks.0.modulation.lin"]),
    ("wan", "wan",
     ["patch_embedding", "text_embedding.0", "time_embedding.2", "time_projection.1", "head.head"],
     ["blocks.0.self_attn.q", "blocks.0.cross_attn.o", "blocks.0.ffn.0"]),
    ("unet", "unet",
     ["time_embed.0", "input_blocks.0.0", "input_blocks.1.0.emb_layers.1", "out.2"],
     ["input_blocks.1.0.in_layers.2", "input_blocks.1.1.proj_in",
      "middle_block.1.transformer_blocks.0.attn2.to_k", "output_blocks.0.0.skip_connection"]),
])
def test_default_skips_per_family(comfy, fp8, kind, family, kept, cast_):
    m = _meta_model(kind)
    assert fp8.detect_family(m) == family
    plan = fp8.plan_layers(m, fp8.default_skip_patterns(family))
    assert set(kept) <= set(plan.kept), set(kept) - set(plan.kept)
    assert set(cast_) <= set(plan.cast), set(cast_) - set(plan.cast)
    keep = fp8.plan_layers(m, fp8.default_skip_patterns(family, "auto_keep_block_modulation"))
    lean = fp8.plan_layers(m, fp8.default_skip_patterns(family, "auto_fp8_modulation"))
    block_mod = {k for k, why in keep.kept.items() if "(modulation)" in why} - set(plan.kept)
    assert block_mod == ({"double_blocks.0.img_mod.lin", "double_blocks.0.txt_mod.lin",
                          "single_blocks.0.modulation.lin"} if family == "flux" else set()), block_mod
    assert not any("(modulation)" in why for why in lean.kept.values())
    assert set(plan.cast) <= set(lean.cast)
    assert set(fp8.plan_layers(m, []).cast) == set(plan.cast) | set(plan.kept)


@pytest.mark.parametrize("fp8_matmul", [False, True])
def test_apply_fp8_layerwise_on_a_plain_module(fp8, fp8_matmul):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(8 * 16, 32),
                              torch.nn.GELU(), torch.nn.Linear(32, 4))
    x = torch.randn(2, 3, 4, 4)
    torch.set_grad_enabled(False)
    ref = net(x)
    layers = list(net)
    h = fp8.apply_fp8_layerwise(net, E4M3, torch.float32, "per-output-channel", skip_patterns=[r"^4$"],
                                fp8_matmul=fp8_matmul)
    assert h.plan.cast == ["0", "2"] and list(h.plan.kept) == ["4"]
    assert net[0].weight.dtype == E4M3 and net[4] is layers[4]
    assert h.bytes_after < h.bytes_before
    assert rel(net(x), ref) < (0.08 if fp8_matmul else 0.05)
    h.restore()
    assert all(a is b for a, b in zip(net, layers)) and torch.equal(net(x), ref)
    torch.set_grad_enabled(True)


def test_errors_say_what_to_fix(ci, fp8, comfy, fixture_models):
    import comfy.sd
    with torch.inference_mode():
        plain = comfy.sd.load_diffusion_model(str(fixture_models["wan"]))
    with pytest.raises(ValueError, match=r"invalid skip pattern '\['"):
        cast(ci, plain, extra="blocks\n[")
    with pytest.raises(ValueError, match="no layer of this wan model left to cast"):
        cast(ci, plain, extra=".*")
    model, _ = cast(ci, plain)
    with pytest.raises(ValueError, match="already went through FP8 Layerwise Cast"):
        cast(ci, model)
    with pytest.raises(ValueError, match="fp8_matmul needs storage_dtype float8_e4m3fn"):
        cast(ci, plain, storage="float8_e5m2", fp8_matmul=True)
    with pytest.raises(ValueError, match="scaling must be one of"):
        cast(ci, plain, scaling="per-row")
    with pytest.raises(ValueError, match="device meta cannot store float8_e4m3fn weights and compute in float16"):
        fp8.check_dtypes("meta", E4M3, torch.float16)


@pytest.mark.core_independent
def test_layers_a_file_already_stores_quantized_are_one_list(fp8):
    """``plan.as_stored``: the layers kept because the file already stores them quantized — a float8
    weight (an fp8 e4m3fn checkpoint) and a scaled-fp8 layer (ComfyUI before 0.33 holds fp8_scaled
    files so: a float8 weight plus a ``scale_weight``) — not those a skip pattern keeps. FP8
    Layerwise Cast passes a model through unchanged when these are all that is left, on every core."""
    m = torch.nn.Module()
    m.plain, m.fp8, m.scaled, m.skipped = (torch.nn.Linear(8, 8) for _ in range(4))
    m.fp8.weight.data = m.fp8.weight.data.to(torch.float8_e4m3fn)
    m.scaled.weight.data = m.scaled.weight.data.to(torch.float8_e4m3fn)
    m.scaled.register_buffer("scale_weight", torch.ones(()))
    plan = fp8.plan_layers(m, [("^skipped$", "kept by a pattern")])
    assert plan.cast == ["plain"] and sorted(plan.as_stored) == ["fp8", "scaled"]
    assert "skipped" in plan.kept and "skipped" not in plan.as_stored
