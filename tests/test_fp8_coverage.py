"""FP8 Layerwise Cast's skip presets on full-size models (meta device: sizes only, no memory).

Issue 24: presets are chosen by what a model is (its module names), not its class name —
AuraFlow's class is named ``MMDiT`` like SD3's and used to get SD3's patterns, so its input/output
projections and modulation went to float8. The ``auto`` preset keeps what must stay in high
precision (norms, embeddings, in/out projections, modulation outside the blocks) and casts
≥ 90 % of the block weights of every transformer model (SD3.5 Large, Qwen-Image, HunyuanVideo
and 1.5 were at 66-71 % with the blocks' modulation kept). The figures are the table in
docs/fp8-layerwise-cast.md.
"""
from __future__ import annotations

import pytest
from harness import meta_models

MODELS = ["flux_dev", "wan_14b", *meta_models.FULL_SIZE]
FAMILY = {"flux_dev": "flux", "wan_14b": "wan", "sd35_large": "mmdit", "qwen_image": "qwen_image",
          "hunyuan_video": "flux", "hunyuan_video15": "flux", "auraflow": "auraflow"}


@pytest.mark.parametrize("name", MODELS)
def test_auto_preset_casts_the_blocks_and_keeps_the_rest(comfy, fp8, name):
    dm = meta_models.meta_diffusion_model(name)
    if dm is None:
        pytest.skip(f"this ComfyUI has no {name}")
    family = fp8.detect_family(dm)
    assert family == FAMILY[name], (type(dm).__name__, family)
    plan = fp8.plan_layers(dm, fp8.default_skip_patterns(family))
    c = fp8.coverage(dm, plan, family)
    old = fp8.coverage(dm, fp8.plan_layers(dm, fp8.default_skip_patterns(family, "auto_keep_block_modulation")), family)
    print(f"\n{name} ({type(dm).__name__}, {family}): {c['total_bytes'] / 2**30:.2f} GiB bf16; cast {100 * c['cast_share']:.1f} % "
          f"of bytes, {100 * c['block_cast_share']:.1f} % of block bytes, {c['kept_layers']} layers kept "
          f"(blocks' modulation kept: {100 * old['cast_share']:.1f} %, {old['kept_layers']} kept)")
    assert c["block_cast_share"] >= 0.90 and c["cast_share"] >= 0.90, c
    kept = set(plan.kept)
    assert not any(k.split(".")[0] in FAMILY_BLOCK_ROOTS.get(family, ()) for k in kept), kept
    if name == "auraflow":  # what SD3's patterns let go to float8
        assert {"init_x_linear", "cond_seq_linear", "final_linear", "modF.1"} <= kept, kept


# Top-level block lists per family: nothing in them is kept by auto.
FAMILY_BLOCK_ROOTS = {"flux": ("double_blocks", "single_blocks"), "wan": ("blocks",), "mmdit": ("joint_blocks",),
                      "qwen_image": ("transformer_blocks",), "auraflow": ("double_layers", "single_layers")}
