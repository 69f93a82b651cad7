"""A text-encoder zoo: tiny instances of the text encoders the tested ComfyUI builds.

Each entry is a real ``comfy.sd.CLIP`` built from core's own classes: the ``clip`` and
``tokenizer`` classes ``comfy.sd.load_text_encoder_state_dicts`` picks for that encoder, made
tiny through core's own config override (``model_options["<name>_model_config"]``: width,
depth, heads; the vocabulary keeps its real size so the real tokenizer's ids fit). The model is
built on the meta device, parts of fixed size (Qwen2.5-VL's vision tower) are replaced by tiny
ones of the same class, then materialised on the CPU in float32 with every tensor
initialised (finite, std 0.02, deterministic per entry). One prompt is encoded through
``CLIP.tokenize`` / ``encode_from_tokens`` (core's path, as CLIPTextEncode).

Public names:

- ``ENCODERS``: entry names, fixed order; ``available(name, tokenizer=True) -> str | None`` (None:
  buildable here); ``SPECS[name].tiny``: why an entry is checked full-size only, or None.
- ``build(name, full_size=False) -> comfy.sd.CLIP``: tiny (cpu) or full-size on the meta device.
- ``encode(clip) -> dict``: ``{"cond": Tensor, "pooled_output": Tensor | None}`` for :data:`PROMPT`.
"""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

import torch

PROMPT = "a lighthouse on a cliff at dawn, oil painting"
_LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 1, "num_key_value_heads": 1}
_CLIP = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 3,
         "projection_dim": 32}
_T5 = {"d_model": 32, "d_ff": 64, "d_kv": 16, "num_heads": 2, "num_layers": 2}


@dataclasses.dataclass(frozen=True)
class Spec:
    clip: Callable      # () -> the CLIP model class (core's, as load_text_encoder_state_dicts picks it)
    tokenizer: str | Callable  # "module:Class" under comfy, or () -> the class
    configs: dict       # model_name -> tiny config override
    post_build: Callable | None = None  # (cond_stage_model) -> None: shrink fixed-size parts (tiny only)
    tokenizer_data: str | None = None   # "spiece" / "tekken": the tokenizer model a checkpoint carries
    tiny: str | None = None  # why no tiny instance is built (the entry is checked full-size only), or None


_TOKENIZER_DATA: dict[str, object] = {}


def _spiece_model() -> bytes:
    """A small SentencePiece model trained here (what UMT5 / Gemma checkpoints carry as
    ``spiece_model``; the real ones are not in ComfyUI's tree)."""
    import io

    import sentencepiece as spm
    text = [PROMPT, "the quick brown fox jumps over the lazy dog", "oil painting of a lighthouse at dawn",
            "a cliff by the sea with waves and birds", "0123456789 abcdefghijklmnopqrstuvwxyz"] * 20
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=out, vocab_size=400,
                                   model_type="bpe", character_coverage=1.0, minloglevel=2,
                                   byte_fallback=True, pad_id=0, unk_id=3, bos_id=2, eos_id=1)
    return out.getvalue()


def _tekken_model() -> bytes:
    """A byte-level Tekken vocabulary (what Mistral checkpoints carry as ``tekken_model``)."""
    import base64
    import json
    specials = [{"rank": i, "token_str": s, "is_control": True}
                for i, s in enumerate(["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[PAD]"] +
                                      [f"<SPECIAL_{i}>" for i in range(7, 16)])]
    vocab = [{"rank": i, "token_bytes": base64.b64encode(bytes([i])).decode(), "token_str": None} for i in range(256)]
    return json.dumps({"config": {"default_vocab_size": 256 + len(specials), "pattern": ".", "num_vocab_tokens": 256},
                       "vocab": vocab, "special_tokens": specials}).encode()


def tokenizer_data(kind: str | None) -> dict:
    if kind is None:
        return {}
    if kind not in _TOKENIZER_DATA:
        _TOKENIZER_DATA[kind] = _spiece_model() if kind == "spiece" else _tekken_model()
    key = "spiece_model" if kind == "spiece" else "tekken_model"
    return {key: _TOKENIZER_DATA[kind]}


def _attr(path: str):
    mod, _, name = path.partition(":")
    return getattr(importlib.import_module(f"comfy.{mod}"), name)


def _call(path: str, **kw):
    return lambda: _attr(path)(**kw)


def _tiny_visual(csm) -> None:
    """Qwen2.5-VL's vision tower has a fixed width (1280, 32 blocks): a 2-block one of width 32."""
    from comfy.text_encoders import qwen_vl
    for m in list(csm.modules()):
        tr = getattr(m, "transformer", None)
        vis = getattr(tr, "visual", None)
        if vis is None:
            continue
        kw = dict(hidden_size=32, output_hidden_size=tr.model.config.hidden_size if hasattr(tr.model, "config") else 32,
                  device="meta", dtype=torch.float32, ops=m.operations)
        try:
            tr.visual = qwen_vl.Qwen2VLVisionTransformer(num_layers=2, num_heads=2, intermediate_size=64, **kw)
        except TypeError:
            tr.visual = qwen_vl.Qwen2VLVisionTransformer(**kw)


def _tiny_byt5(csm) -> None:
    """HunyuanImage's ByT5 reads its config from a file and takes the Qwen entry's override
    (it shares the model options): a tiny T5 of the same class and vocabulary instead."""
    import json
    import os

    import comfy.text_encoders.hunyuan_image as hi
    from comfy.text_encoders.t5 import T5
    _tiny_visual(csm)
    enc = csm.byt5_small
    with open(os.path.join(os.path.dirname(hi.__file__), "byt5_config_small_glyph.json")) as f:
        cfg = dict(json.load(f), **_T5)
    enc.transformer = T5(cfg, torch.float32, "meta", enc.operations)
    enc.num_layers = enc.transformer.num_layers


def _tiny_vision(csm) -> None:
    """Qwen3.5's and Qwen3-VL's vision towers have fixed sizes (0.3-0.4 B): 2-block ones of
    width 32, same classes."""
    for m in list(csm.modules()):
        tr = getattr(m, "transformer", None)
        vis = getattr(tr, "visual", None)
        if vis is None:
            continue
        mod = importlib.import_module(type(vis).__module__)
        out = tr.model.config.hidden_size if hasattr(tr.model, "config") else 32
        if hasattr(mod, "QWEN35_VISION_DEFAULTS"):
            cfg = dict(mod.QWEN35_VISION_DEFAULTS)
        else:
            cfg = {**mod.QWEN3VL_VISION_COMMON, **mod.QWEN3VL_VISION[tr.model_type], "deepstack_visual_indexes": [0, 1]}
        cfg.update(hidden_size=32, num_heads=2, intermediate_size=64, depth=2, out_hidden_size=out)
        tr.visual = type(vis)(cfg, device="meta", dtype=torch.float32, ops=m.operations)


SPECS: dict[str, Spec] = {
    "clip_l": Spec(lambda: _attr("sd1_clip:SD1ClipModel"), "sd1_clip:SD1Tokenizer", {"clip_l": _CLIP}),
    "sdxl_clip_l_g": Spec(lambda: _attr("sdxl_clip:SDXLClipModel"), "sdxl_clip:SDXLTokenizer",
                          {"clip_l": _CLIP, "clip_g": dict(_CLIP, num_hidden_layers=3)}),
    "t5xxl": Spec(_call("text_encoders.sd3_clip:sd3_clip", clip_l=False, clip_g=False, t5=True),
                  "text_encoders.sd3_clip:SD3Tokenizer", {"t5xxl": _T5}),
    "flux_clip_l_t5": Spec(_call("text_encoders.flux:flux_clip"), "text_encoders.flux:FluxTokenizer",
                           {"clip_l": _CLIP, "t5xxl": _T5}),
    "umt5xxl": Spec(_call("text_encoders.wan:te"), "text_encoders.wan:WanT5Tokenizer", {"umt5xxl": _T5},
                    tokenizer_data="spiece"),
    "qwen25_7b_vl": Spec(_call("text_encoders.qwen_image:te"), "text_encoders.qwen_image:QwenImageTokenizer",
                         {"qwen25_7b": dict(_LLAMA, num_hidden_layers=2)}, _tiny_visual),
    "qwen25_3b": Spec(_call("text_encoders.omnigen2:te"), "text_encoders.omnigen2:Omnigen2Tokenizer",
                      {"qwen25_3b": dict(_LLAMA, num_hidden_layers=2)}),
    "qwen3_4b": Spec(_call("text_encoders.z_image:te"), "text_encoders.z_image:ZImageTokenizer",
                     {"qwen3_4b": dict(_LLAMA, num_hidden_layers=3)}),
    "gemma2_2b": Spec(_call("text_encoders.lumina2:te"), "text_encoders.lumina2:LuminaTokenizer",
                      {"gemma2_2b": dict(_LLAMA, num_hidden_layers=3)}, tokenizer_data="spiece"),
    "gemma3_4b": Spec(_call("text_encoders.lumina2:te", model_type="gemma3_4b"), "text_encoders.lumina2:NTokenizer",
                      {"gemma3_4b": dict(_LLAMA, num_hidden_layers=3)}, tokenizer_data="spiece"),
    "llama3_8b_clip_l": Spec(_call("text_encoders.hunyuan_video:hunyuan_video_clip"),
                             "text_encoders.hunyuan_video:HunyuanVideoTokenizer",
                             {"clip_l": _CLIP, "llama": dict(_LLAMA, num_hidden_layers=4)}),
    "mistral3_24b": Spec(_call("text_encoders.flux:flux2_te"), "text_encoders.flux:Flux2Tokenizer",
                         {"mistral3_24b": dict(_LLAMA, num_hidden_layers=31)}, tokenizer_data="tekken"),
    "byt5_qwen25_7b": Spec(_call("text_encoders.hunyuan_image:te", byt5=True),
                           "text_encoders.hunyuan_image:HunyuanImageTokenizer",
                           {"qwen25_7b": dict(_LLAMA, num_hidden_layers=4),
                            }, _tiny_byt5),
    # Text encoders of newer cores (0.33): skipped where the core lacks their classes.
    "qwen3_8b_klein": Spec(_call("text_encoders.flux:klein_te", model_type="qwen3_8b"), "text_encoders.flux:KleinTokenizer8B",
                           {"qwen3_8b": dict(_LLAMA, num_hidden_layers=28)},
                           tiny="it taps layers 9/18/27 over 512 tokens (slow even tiny); Qwen3 runs tiny as qwen3_4b"),
    "qwen3_2b_ovis": Spec(_call("text_encoders.ovis:te"), "text_encoders.ovis:OvisTokenizer",
                          {"qwen3_2b": dict(_LLAMA, num_hidden_layers=2)}),
    "qwen3_06b_anima": Spec(_call("text_encoders.anima:te"), "text_encoders.anima:AnimaTokenizer",
                            {"qwen3_06b": dict(_LLAMA, num_hidden_layers=2)}),
    "gemma3_12b_ltx": Spec(_call("text_encoders.lt:gemma3_te"), "text_encoders.lt:Gemma3_12BTokenizer", {},
                           tokenizer_data="spiece",
                           tiny="its vision tower and projector have fixed sizes (0.4 B); Gemma 3 runs tiny as gemma3_4b"),
    "qwen35_2b": Spec(_call("text_encoders.qwen35:te", model_type="qwen35_2b"),
                      lambda: _attr("text_encoders.qwen35:tokenizer")(model_type="qwen35_2b"),
                      {"qwen35_2b": dict(_LLAMA, num_hidden_layers=4)}, _tiny_vision),
    "qwen3vl_4b": Spec(_call("text_encoders.qwen3vl:te", model_type="qwen3vl_4b"),
                       lambda: _attr("text_encoders.qwen3vl:tokenizer")(model_type="qwen3vl_4b"),
                       {"qwen3vl_4b": dict(_LLAMA, num_hidden_layers=3)}, _tiny_vision),
    "t5gemma": Spec(lambda: _attr("text_encoders.sa3:SAT5GemmaModel"), "text_encoders.sa3:SAT5GemmaTokenizer", {},
                    tokenizer_data="spiece", tiny="its config class takes no overrides (0.28 B at any setting)"),
    "jina_clip_2": Spec(lambda: _attr("text_encoders.jina_clip_2:JinaClip2TextModelWrapper"),
                        "text_encoders.jina_clip_2:JinaClip2TokenizerWrapper",
                        {"jina_clip_2": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
                                         "num_hidden_layers": 2}}),
}
ENCODERS = tuple(SPECS)


_AVAILABLE: dict[tuple, str | None] = {}
_TOKENIZERS: dict[str, object] = {}


def _tokenizer(name: str):
    """The tokenizer of entry ``name``, made once (loading a real tokenizer takes seconds; a CLIP
    only reads it, and core's ``CLIP.clone`` shares it the same way)."""
    if name not in _TOKENIZERS:
        spec = SPECS[name]
        cls = spec.tokenizer() if callable(spec.tokenizer) else _attr(spec.tokenizer)
        _TOKENIZERS[name] = cls(tokenizer_data=tokenizer_data(spec.tokenizer_data))
    return _TOKENIZERS[name]


def available(name: str, tokenizer: bool = True) -> str | None:
    """None when this ComfyUI has the classes of ``name`` and (``tokenizer``) its tokenizer can
    be made here (some trees lack a tokenizer file, some tokenizers need another transformers
    version or Tekken format), else why not. The full-size check needs no tokenizer."""
    key = (name, tokenizer)
    if key not in _AVAILABLE:
        spec = SPECS[name]
        try:
            spec.clip()
            if tokenizer:
                _tokenizer(name)
            _AVAILABLE[key] = None
        except (ImportError, AttributeError, TypeError, KeyError, ValueError, OSError) as e:
            _AVAILABLE[key] = f"this ComfyUI cannot build the {name} text encoder here ({type(e).__name__}: {e})"
    return _AVAILABLE[key]


def _init_(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, t in list(module.named_parameters()) + list(module.named_buffers()):
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype) * 0.02)


def build(name: str, full_size: bool = False, config: dict | None = None):
    """A ``comfy.sd.CLIP`` of entry ``name``: tiny on the CPU (float32, initialised), or with
    ``full_size`` the real configuration on the meta device (no memory; for coverage only).
    ``config`` updates each tiny config (e.g. a wider MLP)."""
    import comfy.sd
    spec = SPECS[name]
    cpu, meta = torch.device("cpu"), torch.device("meta")
    opts = {"load_device": cpu, "offload_device": cpu, "initial_device": meta, "dtype": torch.float32}
    if not full_size:
        for model_name, cfg in spec.configs.items():
            opts[f"{model_name}_model_config"] = dict(cfg, **(config or {}))
    holder = type("ClipTarget", (), {})()  # core's ClipTarget: a plain holder of these three
    holder.clip, holder.params = spec.clip(), {}
    holder.tokenizer = lambda embedding_directory=None, tokenizer_data=None, **kw: None if full_size else _tokenizer(name)
    clip = comfy.sd.CLIP(holder, model_options=opts)
    if full_size:
        return clip
    csm = clip.cond_stage_model
    if spec.post_build is not None:
        spec.post_build(csm)
    csm.to_empty(device=cpu)
    _init_(csm, sum(name.encode()))
    clip.patcher.size = 0  # recomputed from the materialised weights
    return clip


def encode(clip) -> dict:
    """Core's encode of :data:`PROMPT` (as CLIPTextEncode): ``{"cond", "pooled_output"}``."""
    tokens = clip.tokenize(PROMPT)
    with torch.no_grad():
        out = clip.encode_from_tokens(tokens, return_pooled=True, return_dict=True)
    return {"cond": out["cond"], "pooled_output": out.get("pooled_output")}
