"""The techniques on every text encoder of the tested ComfyUI (the text-encoder zoo,
``tests/harness/te_zoo.py``), in-process, through the public API
(``memorykit.comfy_integration.text_encoder``) and core's encode path
(``CLIP.tokenize`` / ``encode_from_tokens``, which loads the CLIP's patcher through
``load_model_gpu``), each against the plain CLIP's conditioning:

- Text Encoder Device (cpu): bit-exact;
- Group Offload (Text Encoder) to disk, block_level and leaf_level (the event ring streams from an
  unnamed file, as on a GPU; on the CPU its copies are memcpys): bit-exact;
- FP8 Layerwise Cast (Text Encoder), e4m3 per-tensor, preset auto: finite, relative L2 error of
  the conditioning below :data:`FP8_MAX_REL`; weight bytes saved recorded.

The input CLIP is never changed, and after ComfyUI unloads the text encoder its weights are as
built (values, device, no hook). Full-size configurations are built on the meta device and
checked for block coverage (the share of weights Group Offload can stream). The table of
figures is printed at the end (JSON to ``$MEMORYKIT_TE_ZOO_TABLE`` when set).
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from harness import paths, te_formats, te_zoo

FP8_MAX_REL = 0.08  # relative L2 error of the conditioning; measured 0.01-0.04 on the zoo (docs/text-encoders.md)
_FIGURES: dict[str, dict[str, str]] = {}


class Encoder:
    def __init__(self, name: str):
        self.name = name
        self.clip = te_zoo.build(name)
        self.csm = self.clip.cond_stage_model
        self.reference = te_zoo.encode(self.clip)
        assert torch.isfinite(self.reference["cond"]).all() and self.reference["cond"].std() > 0, name
        self.snapshot = {k: v.clone() for k, v in self.csm.state_dict().items()}
        self.nbytes = sum(t.numel() * t.element_size() for t in self.snapshot.values())

    def assert_restored(self) -> None:
        import comfy.model_management as mm
        mm.unload_all_models()
        now = self.csm.state_dict()
        assert now.keys() == self.snapshot.keys()
        for k, v in self.snapshot.items():
            assert now[k].device.type == "cpu" and torch.equal(now[k], v), k
        for n, m in self.csm.named_modules():
            assert not m._forward_pre_hooks and not m._forward_hooks, n


def _record(enc: Encoder, case: str, text: str) -> None:
    _FIGURES.setdefault(enc.name, {})[case] = text


def _exact(enc: Encoder, case: str, out: dict) -> None:
    for k in ("cond", "pooled_output"):
        ref, got = enc.reference[k], out[k]
        if ref is None:
            assert got is None, (case, k)
            continue
        same = torch.equal(got, ref)
        if not same:
            _record(enc, case, f"{k} max abs {float((got.float() - ref.float()).abs().max()):.3g}")
        assert same, f"{enc.name} {case}: {k} differs from the plain text encoder's"
    _record(enc, case, "exact")


@pytest.fixture(scope="module", params=te_zoo.ENCODERS)
def enc(request, comfy):
    reason = te_zoo.available(request.param) or te_zoo.SPECS[request.param].tiny
    if reason:
        pytest.skip(reason)
    e = Encoder(request.param)
    yield e
    import comfy.model_management as mm
    mm.unload_all_models()


def test_device_cpu_is_exact(enc, ci):
    out_clip, info = ci.text_encoder_device(enc.clip, "cpu")
    assert out_clip is not enc.clip and out_clip.patcher is not enc.clip.patcher
    assert enc.clip.patcher.get_attachment(ci.TE_DEVICE_KEY) is None  # the input is not changed
    assert info["device"] == "cpu"
    _exact(enc, "device cpu", te_zoo.encode(out_clip))
    enc.assert_restored()


LEAF_LEVEL = {"clip_l", "t5xxl", "qwen3_4b", "byt5_qwen25_7b"}  # leaf_level on a few (time); block_level on all


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_group_offload_disk_is_exact(enc, ci, tmp_path, offload_type):
    if offload_type == "leaf_level" and enc.name not in LEAF_LEVEL:
        pytest.skip("leaf_level runs on " + ", ".join(sorted(LEAF_LEVEL)) + " only (suite time)")
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    s = ci.GroupOffloadSettings(GroupOffloadOptions(offload_type=offload_type, offload_to="disk"),
                                disk_folder=str(tmp_path))
    out_clip, info = ci.text_encoder_group_offload(enc.clip, s)
    assert enc.clip.patcher.get_attachment(ci.GROUP_OFFLOAD_KEY) is None
    streamed = info["streamed_bytes_per_prompt"]
    assert streamed > 0 and set(info["plan"]) == {n for n, _ in ci.encoder_roots(enc.csm)}
    out = te_zoo.encode(out_clip)
    assert ci.group_offload_applied(enc.csm)
    _exact(enc, f"offload disk {offload_type}", out)
    _record(enc, f"streamed/prompt {offload_type}", f"{streamed / enc.nbytes:.0%}")
    enc.assert_restored()
    assert not list(tmp_path.iterdir()), "the offload folder is left behind"


def test_fp8_within_tolerance(enc, ci):
    out_clip, info = ci.text_encoder_fp8(enc.clip, "float8_e4m3fn", "per-tensor", "auto")
    assert enc.clip.patcher.get_attachment(ci.FP8_ATTACHMENT) is None
    out = te_zoo.encode(out_clip)
    ref, got = enc.reference["cond"].float(), out["cond"].float()
    assert torch.isfinite(got).all()
    rel = float((got - ref).norm() / ref.norm())
    saved = 1 - info["weight_bytes_after"] / info["weight_bytes_before"]
    _record(enc, "fp8 e4m3 rel L2", f"{rel:.4f}")
    _record(enc, "fp8 bytes saved", f"{saved:.0%}")
    assert info["cast_layers"] > 0
    assert rel < FP8_MAX_REL, f"{enc.name}: fp8 relative error {rel:.4f}"
    enc.assert_restored()


def test_fp8_then_group_offload_is_fp8_exactly(enc, ci, tmp_path):
    """FP8 Layerwise Cast (Text Encoder) → Group Offload (Text Encoder): the float8 layers stream
    (half the bytes) and the conditioning equals FP8's alone, bit for bit (two encoders: Flux)."""
    if enc.name != "flux_clip_l_t5":
        pytest.skip("runs on flux_clip_l_t5 only (suite time)")
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    cast, _ = ci.text_encoder_fp8(enc.clip)
    ref = te_zoo.encode(cast)
    s = ci.GroupOffloadSettings(GroupOffloadOptions(offload_to="disk"), disk_folder=str(tmp_path))
    both, info = ci.text_encoder_group_offload(cast, s)
    out = te_zoo.encode(both)
    assert torch.equal(out["cond"], ref["cond"]) and torch.equal(out["pooled_output"], ref["pooled_output"])
    _, plain = ci.text_encoder_group_offload(enc.clip, s)
    assert info["streamed_bytes_per_prompt"] < plain["streamed_bytes_per_prompt"]
    _record(enc, "fp8 + offload disk", "exact vs fp8")
    enc.assert_restored()


@pytest.mark.parametrize("name", te_zoo.ENCODERS)
def test_full_size_block_coverage(comfy, ci, fp8, name):
    """The real configuration (meta device): Group Offload finds each encoder's layer list,
    and the blocks hold most of the weights outside the vocabulary embedding."""
    if not paths.one_version_only():
        pytest.skip("full-size configurations are checked on the 0.33 suite only (suite time)")
    reason = te_zoo.available(name, tokenizer=False)
    if reason:
        pytest.skip(reason)
    clip = te_zoo.build(name, full_size=True)
    roots = ci.encoder_roots(clip.cond_stage_model)
    assert roots, name
    parts = []
    for rname, root in roots:
        lists = ci.encoder_block_lists(root)
        assert lists, f"{name}/{rname}: no block list"
        in_blocks = {id(t) for _, bl in lists for _, b in bl for t in b.parameters()}
        total = sum(p.numel() for p in root.parameters())
        emb = sum(m.weight.numel() for m in root.modules() if isinstance(m, torch.nn.Embedding))
        blocks = sum(p.numel() for p in root.parameters() if id(p) in in_blocks)
        share = blocks / max(1, total - emb)
        plan = fp8.plan_layers(root, fp8.default_skip_patterns("text_encoder", "auto"))
        cast = sum(root.get_submodule(n).weight.numel() for n in plan.cast)
        parts.append(f"{rname} {total / 1e9:.2f}B params, streamable {blocks / total:.0%}, "
                     f"fp8 saves {cast / 2 / total:.0%} of bf16")
        assert share > 0.8, f"{name}/{rname}: blocks hold only {share:.0%} of the non-embedding weights"
    _FIGURES.setdefault(name, {})["full size"] = "; ".join(parts)


def teardown_module(module):
    if not _FIGURES:
        return
    print("\ntext-encoder zoo:")
    for name, row in _FIGURES.items():
        print(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in row.items()))
    path = os.environ.get("MEMORYKIT_TE_ZOO_TABLE")
    if path:
        with open(path, "w") as f:
            json.dump(_FIGURES, f, indent=1)


def test_quantized_tensor_text_encoder(comfy, ci, tmp_path):
    """An fp8_scaled text encoder on a core with ``QuantizedTensor`` layers (what core builds from
    such a file): Text Encoder Device places it as it is (exact); Group Offload (Text Encoder)
    streams its stored bytes (exact), and FP8 Layerwise Cast (Text Encoder) casts
    only the plain layers (the quantized one is kept, never quantised twice)."""
    from comfyui_memorykit.memorykit import fp8 as mkfp8
    from comfyui_memorykit.memorykit.comfy_integration import compat
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    fmt = compat.core_fp8_format(torch.float8_e4m3fn)
    if fmt is None or te_zoo.available("qwen3_4b"):
        pytest.skip("this ComfyUI has no QuantizedTensor float8 layout")
    clip = te_zoo.build("qwen3_4b")
    root = clip.cond_stage_model.qwen3_4b.transformer.model.layers[0].mlp
    w = root.up_proj.weight.detach()
    q, s = mkfp8.quantize_weight(w, torch.float8_e4m3fn, "per-tensor")
    root.up_proj = compat.core_fp8_linear(q, s.float().reshape(()), None, fmt[0], torch.float32, True)
    assert type(root.up_proj.weight.data) is not torch.Tensor
    ref = te_zoo.encode(clip)
    placed, _ = ci.text_encoder_device(clip, "cpu")
    out = te_zoo.encode(placed)
    assert torch.equal(out["cond"], ref["cond"])
    s_ = ci.GroupOffloadSettings(GroupOffloadOptions(offload_to="disk"), disk_folder=str(tmp_path))
    offloaded, _ = ci.text_encoder_group_offload(clip, s_)  # the stored float8 bytes and scale stream: exact
    assert torch.equal(te_zoo.encode(offloaded)["cond"], ref["cond"])
    mm_unload()
    cast, info = ci.text_encoder_fp8(clip)
    done = cast.patcher.get_attachment(ci.FP8_ATTACHMENT)["cast"]
    assert info["cast_layers"] > 0 and not any(n.endswith("layers.0.mlp.up_proj") for n in done)
    assert torch.isfinite(te_zoo.encode(cast)["cond"]).all()
    mm_unload()


def mm_unload() -> None:
    import comfy.model_management as mm
    mm.unload_all_models()


# -- Formats users download: fp8_scaled (core's QuantizedTensor / 0.3.75's scaled-fp8 ops) and GGUF ----------

class FormatEncoder:
    """A zoo encoder loaded from a file of ``fmt`` (:mod:`harness.te_formats`), its plain
    conditioning and its stored weights (type, GGUF type, stored bytes) as loaded."""

    def __init__(self, name: str, fmt: str):
        self.name, self.fmt = name, fmt
        self.clip = te_formats.build(name, fmt)
        self.csm = self.clip.cond_stage_model
        self.reference = te_zoo.encode(self.clip)
        assert torch.isfinite(self.reference["cond"]).all() and self.reference["cond"].std() > 0
        self.snapshot = {n: self._stored(p) for n, p in self.csm.named_parameters()}
        self.classes = {n: type(m) for n, m in self.csm.named_modules()}

    @staticmethod
    def _stored(p):
        from comfyui_memorykit.memorykit import stored_parts
        return (type(p).__name__, str(getattr(p, "tensor_type", "")),
                [x.detach().as_subclass(torch.Tensor).clone() for x in stored_parts.parts(p)])

    def stored_bytes(self) -> int:
        from comfyui_memorykit.memorykit import stored_parts
        return sum(stored_parts.stored_nbytes(p) for p in self.csm.parameters())

    def assert_restored(self) -> None:
        import comfy.model_management as mm
        mm.unload_all_models()
        for n, p in self.csm.named_parameters():
            kind, gtype, parts = self.snapshot[n]
            now = self._stored(p)
            assert now[:2] == (kind, gtype), n
            assert all(a.device.type == "cpu" and torch.equal(a, b) for a, b in zip(now[2], parts)), n
        for n, m in self.csm.named_modules():
            assert type(m) is self.classes[n] and "_memorykit_weight_parts" not in m.__dict__, n
            assert not m._forward_pre_hooks and not m._forward_hooks, n

    def exact(self, case: str, out: dict) -> None:
        same = torch.equal(out["cond"], self.reference["cond"])
        _record_format(self, case, "exact" if same else
                       f"max abs {float((out['cond'].float() - self.reference['cond'].float()).abs().max()):.3g}")
        assert same, f"{self.name} {self.fmt} {case}: the conditioning differs from the plain loaded encoder's"


def _record_format(e: FormatEncoder, case: str, text: str) -> None:
    _FIGURES.setdefault(f"{e.name} [{e.fmt}]", {})[case] = text


@pytest.fixture(scope="module", params=te_formats.CASES,
                ids=lambda p: f"{p[0]}-{p[1]}")
def fenc(request, comfy):
    name, fmt = request.param
    reason = te_zoo.available(name) or te_formats.unavailable(fmt)
    if reason:
        pytest.skip(reason)
    e = FormatEncoder(name, fmt)
    yield e
    mm_unload()


def test_format_device_is_exact(fenc, ci):
    placed, _ = ci.text_encoder_device(fenc.clip, "cpu")
    assert type(placed.clone().patcher) is type(placed.patcher), "a clone (a LoRA loader after it) keeps the device"
    mm_unload()  # loaded by the node's own patcher, as the first prompt after the loader does
    fenc.exact("device cpu", te_zoo.encode(placed))
    fenc.assert_restored()


def test_format_group_offload_disk_streams_the_stored_bytes(fenc, ci, tmp_path):
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    kind = "leaf_level" if fenc.fmt == "gguf_q4_k" else "block_level"
    s = ci.GroupOffloadSettings(GroupOffloadOptions(offload_type=kind, offload_to="disk"), disk_folder=str(tmp_path))
    out_clip, info = ci.text_encoder_group_offload(fenc.clip, s)
    from comfyui_memorykit.memorykit import offload_plan
    streamed = info["streamed_bytes_per_prompt"]
    stored = fenc.stored_bytes()
    blocks = [b for _, r in ci.encoder_roots(fenc.csm) for _, bl in ci.encoder_block_lists(r) for _, b in bl]
    in_blocks = offload_plan.tensor_bytes(offload_plan.module_tensors(torch.nn.ModuleList(blocks)))
    # what streams is the stored bytes of the blocks (leaf_level: of their layers; norms stay), never a dequantised copy
    assert (streamed == in_blocks) if kind == "block_level" else (0.9 * in_blocks < streamed < in_blocks)
    out = te_zoo.encode(out_clip)
    st = ci.offload_patcher._offload_state(fenc.csm)
    subclasses = any(kind != "Parameter" for kind, _, _ in fenc.snapshot.values())  # 0.3.75's fp8: plain float8
    assert st is not None and any("streamed as stored" in n for n in st.notes) == subclasses, st and st.notes
    copied = sum(h.ring.figures()["streamed_bytes"] for h in st.handles if h.ring is not None)
    assert copied >= streamed, (copied, streamed)
    fenc.exact(f"offload disk {kind}", out)
    _record_format(fenc, "streamed/prompt", f"{streamed} (the blocks' stored bytes) of {stored} stored bytes")
    fenc.assert_restored()
    assert not list(tmp_path.iterdir()), "the offload folder is left behind"


def test_format_ram_event_ring_is_exact(fenc, ci):
    """The RAM target's event ring (what a GPU streams from; on the CPU its copies are memcpys)
    on the encoder's stored weights, GGUF ones decomposed as the node's patcher does."""
    if fenc.name != "qwen3_4b" or fenc.fmt == "gguf_f16":
        pytest.skip("runs on qwen3_4b fp8_scaled_mixed and gguf_q4_k only (suite time; the disk case streams all)")
    from comfyui_memorykit.memorykit import offload, weight_parts
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    te_zoo.encode(fenc.clip)  # loaded by ComfyUI as for a prompt; the ring goes on the loaded encoder
    tokens = fenc.clip.tokenize(te_zoo.PROMPT)
    ((_, root),) = ci.encoder_roots(fenc.csm)
    parts = weight_parts.decompose(root)
    h = offload.apply_group_offload(root, "cpu", "cpu", options=GroupOffloadOptions(offload_to="cpu"),
                                    budget_bytes=0, block_lists=ci.encoder_block_lists(root))
    try:
        with torch.no_grad():
            cond = fenc.csm.encode_token_weights(tokens)[0]
        assert h.ring.figures()["streamed_bytes"] >= h.plan.streamed_bytes > 0
    finally:
        offload.remove_group_offload(h)
        parts.restore()
    fenc.exact("offload ram ring", {"cond": cond})
    fenc.assert_restored()


def test_format_fp8_leaves_stored_layers(fenc, ci):
    """FP8 Layerwise Cast (Text Encoder): a GGUF encoder passes through unchanged, saying why; an
    fp8_scaled encoder's quantized layers kept as stored (the encoder passes through unchanged when
    nothing else is left to cast)."""
    cast, info = ci.text_encoder_fp8(fenc.clip)
    if info.get("passed_through"):
        # GGUF; fp8_scaled legacy: every block Linear is fp8; mixed (0.33): its bf16 layers are core's mixed-precision layers too
        assert cast is fenc.clip and info["cast_layers"] == 0
        want = "'clip' comes from a GGUF file" if fenc.fmt.startswith("gguf") else "'clip' is already stored quantized"
        assert want in info["passed_through"] and "passed through unchanged" in ci.format_text_encoder_info("fp8", info)
        _record_format(fenc, "fp8", "passed through unchanged: already quantized (said so)")
        fenc.assert_restored()
        return
    assert info["stored_quantized"] > 0 and "left as stored" in ci.format_text_encoder_info("fp8", info)
    done = cast.patcher.get_attachment(ci.FP8_ATTACHMENT)["cast"]
    quantized = {n for n, m in fenc.csm.named_modules() if type(getattr(m, "weight", None)).__name__ == "QuantizedTensor"}
    assert quantized and not quantized & set(done), "a layer stored quantized was quantized again"
    got, ref = te_zoo.encode(cast)["cond"].float(), fenc.reference["cond"].float()
    rel = float((got - ref).norm() / ref.norm())
    _record_format(fenc, "fp8", f"{len(done)} bf16 layers cast, {info['stored_quantized']} kept; rel L2 {rel:.4f}")
    assert rel < FP8_MAX_REL
    fenc.assert_restored()


def test_format_memory_plan_counts_stored_bytes(fenc, ci):
    """Memory Plan (whole workflow) sizes the text encoder at the bytes it stores and offers no
    fp8 for one that is already quantized (every Linear of these files is stored quantized, or
    left in bf16 by the file's own per-layer format, which FP8 Layerwise Cast leaves as stored;
    a GGUF file's F16 Linears are GGUF's: FP8 passes the encoder through)."""
    from comfyui_memorykit.memorykit import memory_plan as mp
    from comfyui_memorykit.memorykit import memory_plan_workflow as wf
    from comfyui_memorykit.memorykit.comfy_integration import (
        memory_plan_workflow_io as wio,
    )
    f = wio.clip_figures(fenc.clip)
    assert sum(f.block_bytes) + f.other_bytes == fenc.stored_bytes()
    assert f.fp8_block_bytes is None, "fp8 offered for a text encoder stored quantized"
    plan = wf.plan_workflow(mp.Machine(vram_bytes=8 << 30, ram_bytes=1 << 35, disk_bytes=1 << 36),
                            [wf.Component("text encoder", "text encoder", f)])
    assert not plan.decisions[0].pick.fp8
    _record_format(fenc, "memory plan", f"{sum(f.block_bytes) + f.other_bytes} stored bytes, no fp8")
