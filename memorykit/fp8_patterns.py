"""Which layers FP8 Layerwise Cast stores in float8: skip patterns and the layer plan.

Plain torch (no ComfyUI import). The default patterns are written in ComfyUI's module names
(relative to ``model.diffusion_model``), one set per architecture family, detected from what the
diffusion model is — the names of its top-level modules (:data:`FAMILY_SIGNATURES`) — not its
class name (AuraFlow's class is named ``MMDiT``, like SD3's, and has other module names);
diffusers' own defaults (``pos_embed``, ``norm``, ``proj_in``...) use diffusers' names and miss
most of these layers.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from . import validation, stored_parts

CASTABLE_TYPES = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
HIGH_PRECISION = (torch.float32, torch.float16, torch.bfloat16)

# ---------------------------------------------------------------------------------------------
# Default skip patterns, in ComfyUI's module names (relative to ``model.diffusion_model``).
# Each entry: (regex searched in the module name, category). Categories: "embedding",
# "modulation", "in/out projection". Norm layers are not Linear/Conv in these models, so they
# are never cast; the "norm" pattern catches the few Linear layers that live inside a norm
# (e.g. Qwen-Image's ``norm_out.linear``, an AdaLN modulation).
# ---------------------------------------------------------------------------------------------
COMMON_SKIPS = (
    (r"norm", "norm"),
    (r"embed", "embedding"),
    (r"(^|\.)pos_", "embedding"),
)
FAMILY_SKIPS: dict[str, tuple[tuple[str, str], ...]] = {
    # SD1.x / SD2.x / SDXL UNet (comfy.ldm.modules.diffusionmodules.openaimodel.UNetModel)
    "unet": (
        (r"^time_embed\.", "embedding"), (r"^label_emb\.", "embedding"),
        (r"\.emb_layers\.", "modulation"),
        (r"^input_blocks\.0\.0$", "in/out projection"), (r"^out\.", "in/out projection"),
    ),
    # Flux / Flux-Kontext / Chroma / HunyuanVideo (comfy.ldm.flux, chroma, hunyuan_video)
    "flux": (
        (r"^(time_in|vector_in|guidance_in|distilled_guidance_layer)\.", "embedding"),
        (r"(_mod\.|modulation)", "modulation"),
        (r"^(img_in|txt_in)(\.|$)", "in/out projection"),
        (r"^final_layer\.", "in/out projection"),
    ),
    # Wan 2.x (comfy.ldm.wan.model.WanModel and variants)
    "wan": (
        (r"^(text_embedding|time_embedding|img_emb)\.", "embedding"),
        (r"^time_projection\.", "modulation"),
        (r"^patch_embedding$", "in/out projection"), (r"^head\.", "in/out projection"),
    ),
    # SD3 / SD3.5 MMDiT (comfy.ldm.modules.diffusionmodules.mmdit)
    "mmdit": (
        (r"^(t_embedder|y_embedder|context_embedder|x_embedder)\.", "embedding"),
        (r"adaLN_modulation", "modulation"),
        (r"^final_layer\.", "in/out projection"),
    ),
    # Qwen-Image (comfy.ldm.qwen_image)
    "qwen_image": (
        (r"^time_text_embed\.", "embedding"),
        (r"(img_mod|txt_mod)\.", "modulation"),
        (r"^(img_in|txt_in|proj_out)$", "in/out projection"),
    ),
    # LTX-Video (comfy.ldm.lightricks)
    "ltxv": (
        (r"^(adaln_single|caption_projection)\.", "modulation"),
        (r"^(patchify_proj|proj_out)$", "in/out projection"),
    ),
    # Lumina 2 / NextDiT (comfy.ldm.lumina)
    "lumina": (
        (r"^(t_embedder|cap_embedder|x_embedder)(\.|$)", "embedding"),
        (r"adaLN_modulation", "modulation"),
        (r"^final_layer\.", "in/out projection"),
    ),
    # AuraFlow (comfy.ldm.aura.mmdit.MMDiT): modC/modX/modCX in the blocks, modF global.
    "auraflow": (
        (r"^(t_embedder|cond_seq_linear|init_x_linear)(\.|$)", "embedding"),
        (r"(^|\.)mod(C|X|CX|F)\.", "modulation"),
        (r"^final_linear$", "in/out projection"),
    ),
    # Text encoders (a CLIP's encoders: CLIP-L/G, T5, UMT5, Llama, Qwen, Gemma, Mistral, ...): the
    # token/position embeddings (COMMON_SKIPS; T5's ``shared``), norms and the final projection.
    "text_encoder": (
        (r"(^|\.)shared$", "embedding"),
        (r"(^|\.)(ln_|layernorm|layer_norm)", "norm"),
        (r"(text_projection|lm_head|(^|\.)proj_out$|(^|\.)final_proj)", "final projection"),
    ),
    # Anything else: the usual names of input/output projections.
    "generic": (
        (r"^(img_in|txt_in|x_embedder|patch_embed|patch_embedding|proj_in|proj_out|conv_in|conv_out)(\.|$)",
         "in/out projection"),
        (r"^(final_layer|head|out)\.", "in/out projection"),
        (r"(modulation|adaLN)", "modulation"),
    ),
}
# Family by what the model is: the top-level modules (children and parameters of the diffusion
# model) every model of the family has; the first match wins (order matters: SD3 and AuraFlow
# both have an ``x_embedder``/``t_embedder``, Qwen-Image and LTXV both ``transformer_blocks``).
FAMILY_SIGNATURES: tuple[tuple[str, frozenset[str]], ...] = (
    ("unet", frozenset({"input_blocks", "middle_block", "output_blocks"})),
    ("auraflow", frozenset({"double_layers", "single_layers", "init_x_linear", "modF"})),
    ("mmdit", frozenset({"joint_blocks", "x_embedder"})),
    ("flux", frozenset({"double_blocks", "single_blocks", "img_in"})),   # Flux, Flux 2, Chroma, HunyuanVideo (1.5)
    ("qwen_image", frozenset({"transformer_blocks", "img_in", "txt_in", "time_text_embed"})),
    ("ltxv", frozenset({"transformer_blocks", "patchify_proj"})),
    ("wan", frozenset({"blocks", "patch_embedding", "head"})),
    ("lumina", frozenset({"layers", "x_embedder", "cap_embedder"})),
)
# The block lists of each family (top-level names): modulation inside them is cast under ``auto``.
FAMILY_BLOCKS = {
    "unet": "", "flux": "double_blocks|single_blocks", "wan": "blocks", "mmdit": "joint_blocks",
    "qwen_image": "transformer_blocks", "ltxv": "transformer_blocks", "lumina": "layers|noise_refiner|context_refiner",
    "auraflow": "double_layers|single_layers", "text_encoder": "layers|block",
    "generic": "blocks|layers|transformer_blocks|double_blocks|single_blocks|joint_blocks",
}
PRESETS = ("auto", "auto_keep_block_modulation", "auto_fp8_modulation", "none")


def detect_family(module: torch.nn.Module) -> str:
    """Architecture family of a diffusion model from the names of its top-level modules and
    parameters (see :data:`FAMILY_SIGNATURES`); ``"generic"`` when none matches."""
    names = {n for n, _ in module.named_children()} | {n for n, _ in module.named_parameters(recurse=False)}
    return next((fam for fam, need in FAMILY_SIGNATURES if need <= names), "generic")


def _outside_blocks(pattern: str, blocks: str) -> str:
    """``pattern`` restricted to names outside the top-level ``blocks`` lists (a regex)."""
    return rf"^(?!(?:{blocks})\.).*?(?:{pattern})" if blocks else pattern


def default_skip_patterns(family: str, preset: str = "auto") -> list[tuple[str, str]]:
    """(pattern, category) pairs kept in the compute dtype for ``family`` under ``preset``.

    ``auto``: norms, embeddings, in/out projections, and the modulation layers outside the
    blocks (global conditioning: final-layer AdaLN, Chroma's approximator, AuraFlow's modF); the
    modulation inside the blocks is cast (it is 27-33 % of the block weights of Flux, SD3.5,
    Qwen-Image and HunyuanVideo; keeping it left those at 0.64-0.71x of bf16).
    ``auto_keep_block_modulation``: all modulation kept (the default before block modulation went to float8).
    ``auto_fp8_modulation``: no modulation kept. ``none``: nothing. Raises ValueError for an
    unknown family or preset.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown skip preset {preset!r}; expected one of {PRESETS}")
    if family not in FAMILY_SKIPS:
        raise ValueError(f"unknown architecture family {family!r}; expected one of {sorted(FAMILY_SKIPS)}")
    if preset == "none":
        return []
    pats = list(COMMON_SKIPS) + list(FAMILY_SKIPS[family])
    if preset == "auto_fp8_modulation":
        pats = [(p, c) for p, c in pats if c != "modulation"]
    elif preset == "auto":
        blocks = FAMILY_BLOCKS.get(family, "")
        pats = [(_outside_blocks(p, blocks), "modulation outside the blocks") if c == "modulation" else (p, c)
                for p, c in pats]
    return pats


def parse_patterns(text: str) -> list[str]:
    """Skip patterns from the ``extra_skip_patterns`` text (see :func:`validation.split_patterns`:
    one per line, or separated by commas outside brackets/braces/parentheses; ``#`` lines
    ignored). Each is checked by :func:`validation.compile_pattern` (Python regex syntax without
    backreferences/lookarounds, matched in linear time). Raises ValueError naming the field and
    the first invalid pattern."""
    return validation.parse_patterns(text, "extra_skip_patterns")


@dataclass
class LayerPlan:
    """Which layers are cast. ``cast``: module names to store in float8; ``kept``: name →
    reason (the matching skip pattern, or why the layer cannot be cast); ``as_stored``: the kept
    layers whose weights the file already stores quantized or in its own per-layer format (core's
    quantized layers, scaled-fp8 layers, float8 weights, a mixed file's bf16 layers) — when
    nothing else is left to cast, the model is already what FP8 Layerwise Cast would make."""

    cast: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    as_stored: list[str] = field(default_factory=list)


def plan_layers(module: torch.nn.Module, skip_patterns: Iterable[str | tuple[str, str]],
                get_module: Callable[[str, torch.nn.Module], torch.nn.Module] | None = None,
                check: Callable[[], None] | None = None) -> LayerPlan:
    """Split the Linear/Conv1d/2d/3d layers of ``module`` into cast and kept.

    A layer is kept when a pattern (``re.search`` semantics on its dotted name; a ``str`` is a
    user's pattern, matched in linear time by :func:`validation.compile_pattern`, a
    ``(pattern, reason)`` pair a preset's, matched by ``re``) matches, when its weight
    is not float32/float16/bfloat16 (already quantised, e.g. core's fp8 weight dtype), or when
    it holds parameters/buffers other than ``weight``/``bias`` (e.g. core's scaled-fp8 ops).
    Layers that are no torch Linear/Conv are not cast; listed as kept when their weight is
    quantised, or high precision in a Linear-like layer (``in_features``: the layers a
    per-layer "mixed" fp8 checkpoint deliberately left in bf16).
    ``get_module(name, module)`` may map a module found in the tree to the one to inspect
    (ComfyUI: the original behind an object patch). ``check()`` runs before each module (ComfyUI:
    its interrupt check, so Cancel stops a long plan).
    """
    # A user's pattern (a plain string, from parse_patterns) is matched by the bounded-time
    # automaton; a preset's (a (pattern, reason) pair written in this module, some with
    # lookaheads the automaton refuses) by ``re``: fixed, reviewed patterns cannot backtrack badly.
    compiled = [(validation.compile_pattern(p, "extra_skip_patterns").search, p) if isinstance(p, str)
                else (functools.partial(re.search, p[0]), f"{p[0]} ({p[1]})") for p in skip_patterns]
    plan = LayerPlan()
    for name, m in module.named_modules():
        if check is not None:
            check()
        if get_module is not None:
            m = get_module(name, m)
        if not name:
            continue
        if not isinstance(m, CASTABLE_TYPES):
            w = m._parameters.get("weight")
            if w is not None and stored_parts.is_quantized(w):  # core's quantized layers are no nn.Linear
                plan.kept[name] = f"already quantised ({stored_parts.describe(w)}): left as stored"
                plan.as_stored.append(name)
            elif (w is not None and hasattr(m, "in_features") and type(w.data) is torch.Tensor
                  and w.dtype in HIGH_PRECISION):  # a Linear of the loader's own kind, e.g. a mixed-format file's bf16 layer
                plan.kept[name] = (f"left in {str(w.dtype).replace('torch.', '')} by the checkpoint's per-layer "
                                   "format: left as stored")
                plan.as_stored.append(name)
            continue
        why = next((w for search, w in compiled if search(name)), None)
        if why is None:
            extra = [k for k in list(m._parameters) + list(m._buffers)
                     if k not in ("weight", "bias") and getattr(m, k, None) is not None]
            w = getattr(m, "weight", None)
            if extra:
                why = f"holds {extra} (already a quantised/scaled layer)"
            elif not isinstance(w, torch.Tensor) or type(w.data) is not torch.Tensor:
                why = "weight is not a plain tensor"
            elif w.dtype not in HIGH_PRECISION:
                why = f"weight already {str(w.dtype).replace('torch.', '')}"
            if why is not None:
                plan.as_stored.append(name)
        if why is None:
            plan.cast.append(name)
        else:
            plan.kept[name] = why
    return plan




def coverage(module: torch.nn.Module, plan: LayerPlan, family: str | None = None) -> dict:
    """How much of ``module``'s weights ``plan`` casts, in bytes (tensor sizes only: works on the
    meta device). Returns ``total_bytes`` (every parameter), ``cast_bytes`` (weights of the cast
    layers), ``block_bytes`` (parameters under the family's top-level block lists,
    :data:`FAMILY_BLOCKS`), ``block_cast_bytes``, ``cast_share`` / ``block_cast_share`` (0-1),
    ``kept_layers`` (count) and ``family``."""
    family = family or detect_family(module)
    blocks = FAMILY_BLOCKS.get(family) or FAMILY_BLOCKS["generic"]
    in_block = rf"^(?:{blocks})\."
    size = {n: p.numel() * p.element_size() for n, p in module.named_parameters()}
    cast = {f"{name}.weight" for name in plan.cast}
    total = sum(size.values())
    block = sum(b for n, b in size.items() if re.match(in_block, n))
    cast_b = sum(size.get(n, 0) for n in cast)
    block_cast = sum(size.get(n, 0) for n in cast if re.match(in_block, n))
    return {"family": family, "total_bytes": total, "cast_bytes": cast_b, "block_bytes": block,
            "block_cast_bytes": block_cast, "cast_share": cast_b / max(1, total),
            "block_cast_share": block_cast / max(1, block), "kept_layers": len(plan.kept)}
