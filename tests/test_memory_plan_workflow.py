"""Memory Plan for the whole workflow: text encoder, one or two diffusion models and the VAE planned
together.

The grid (Flux 2 [dev]; Wan 2.2 14B two experts + UMT5-XXL; 8/12/16/24 GiB VRAM × 16/32/64 GiB RAM,
given figures: 25 GB/s PCIe, 3 GB/s NVMe, 110 TFLOP/s, 200 GiB disk; components from core's classes
on the meta device, bf16, ``tests/harness/workflow_plans.py``) checked against first principles
(G = GiB, V = VRAM − 0.8 G core reserve; A1 = a step's activations with cond and uncond one after
the other; ring = 2 largest blocks; the remainder outside the blocks stays in VRAM when streaming):

- bytes = 2 × parameters: Mistral Small 3 24B 22.9 B → 42.66 G, Flux 2 [dev] 32.2 B → 60.02 G, a Wan
  2.2 expert 14.3 B → 26.62 G, UMT5-XXL 5.68 B → 10.58 G. fp8 stores the blocks' Linear weights in
  1 byte: about half (UMT5 0.59: its 256k-token embedding, 2 G, keeps bf16).
- no diffusion model fits resident anywhere (W + A1 > V at 24 GiB: 60.0 and 26.6 G > 23.2 G), so each
  streams. The smallest VRAM a bf16 stream needs is remainder + ring + A1: Flux 2 1.52 + 3.66 + 2.34 =
  7.52 G, Wan 0.00 + 1.31 + 5.90 = 7.21 G, both above V = 7.2 G at 8 GiB; in fp8 it fits, but fp8 keeps
  the loaded bf16 weights and adds the fp8 copies in RAM (Flux 2 60.0 + 29.5 G, each Wan expert
  26.6 + 13.1 G): more than 64 GiB → every 8 GiB cell is an error naming RAM.
- from 12 GiB the bf16 streams fit. RAM decides RAM versus disk: streaming from RAM holds W, so Flux 2's
  model streams from RAM only with 64 GiB (60.0 G; its text encoder, 42.7 G, then streams from disk);
  one Wan expert streams from RAM with 64 GiB at 12 GiB VRAM (26.6 + the text encoder's fp8 14.9 G
  + the other expert's ring and remainder), never both (53.2 G + the text encoder > 64 G).
- the text encoder: UMT5 fp8 (6.27 G + 0.08 G) fits V from 12 GiB and is cheapest per prompt; with 16
  GiB RAM its fp8 copies (10.58 + 4.31 G at rest) do not fit next to the experts' disk rings, so it
  streams from disk (12 GiB) or stays bf16 resident (16, 24 GiB: 10.66 G ≤ V, 10.58 G at rest).
  Mistral (42.7 G) never fits V: it streams, from disk (RAM holds only its ring).
- Wan at 24 GiB / 64 GiB: one expert fp8 resident (13.53 + 5.90 ≤ 23.2 G; 39.7 G RAM at rest), the
  other streams from disk (its ring), the text encoder fp8: 56 G.
"""
from __future__ import annotations

import pytest
from harness import paths, workflow_plans

D, R, F, L = "disk stream", "RAM stream", "fp8 resident", "resident"
E = "error"
EXPECTED = {  # (workflow, VRAM) → picks (text encoder / diffusion model(s)) for RAM 16 / 32 / 64 GiB
    ("flux2_dev", 8): (E, E, E), ("flux2_dev", 12): ((D, D), (D, D), (D, R)),
    ("flux2_dev", 16): ((D, D), (D, D), (D, R)), ("flux2_dev", 24): ((D, D), (D, D), (D, R)),
    ("wan22_14b", 8): (E, E, E), ("wan22_14b", 12): ((D, D, D), (F, D, D), (F, R, D)),
    ("wan22_14b", 16): ((L, D, D), (F, D, D), (F, D, D)), ("wan22_14b", 24): ((L, D, D), (F, D, D), (F, F, D)),
}
G = 2 ** 30


@pytest.fixture(scope="module")
def grid(comfy):
    if not paths.one_version_only():
        pytest.skip("plans from given figures on meta-device models: the same grid on both versions (checked: "
                    "scripts/memory_plan_workflows.py writes the same file under 0.3.75); runs once, on 0.33")
    comps = {w: workflow_plans.components(w) for w in workflow_plans.WORKFLOWS}
    return comps, workflow_plans.grid(comps)


def test_component_bytes_from_first_principles(grid):
    comps, _ = grid
    params = {"Mistral Small 3 24B": 22.9e9, "Flux2": 32.2e9, "WAN21": 14.29e9, "UMT5-XXL": 5.68e9}
    for w in ("flux2_dev", "wan22_14b"):
        for c, c8 in zip(comps[w], comps[f"{w}_fp8"]):
            if c.role == "VAE":
                continue
            f = c.figures
            assert f.weight_bytes == pytest.approx(2 * params[f.label], rel=0.01), c.name  # bf16: 2 bytes/parameter
            assert 0.5 <= f.fp8_bytes / f.weight_bytes <= 0.6, c.name  # fp8 halves what it casts
            assert c8.figures.weight_bytes == f.fp8_bytes and c8.figures.fp8_bytes is None  # the fp8 file: no second cast
    flux_dm = comps["flux2_dev"][1].figures
    wan_dm = comps["wan22_14b"][1].figures
    for f in (flux_dm, wan_dm):  # bf16 streaming's least VRAM is above 8 GiB's usable 7.2 GiB
        assert f.other_bytes + 2 * max(f.block_bytes) + f.activation_min_bytes > 7.2 * G
        assert f.weight_bytes + f.fp8_added > 64 * G / 2  # fp8 in RAM: two of these, or one + its text encoder, > 64


def test_fp8_files_fit_where_bf16_does_not(grid):
    """Loaded from fp8 files, the ring and remainder are half as large and no bf16 copy stays in RAM:
    the fp8 stream fits 8 GiB's 7.2 GiB usable (Flux 2 1.52 + 1.83 + 2.34 G: its remainder outside the blocks keeps bf16; Wan 0.00 + 0.65 + 5.90 G),
    so every cell of the fp8 grids has a plan."""
    from comfyui_memorykit.memorykit import memory_plan as mp
    comps, plans = grid
    for w in ("flux2_dev_fp8", "wan22_14b_fp8"):
        f = comps[w][1].figures
        assert f.fp8_bytes is None and f.other_bytes + 2 * max(f.block_bytes) + f.activation_min_bytes <= 7.2 * G
        assert not [k for k, p in plans.items() if k[0] == w and isinstance(p, mp.PlanError)]


def test_decisions_match_first_principles(grid):
    from comfyui_memorykit.memorykit import memory_plan as mp
    _, plans = grid
    wrong = []
    for (w, v), picks in EXPECTED.items():
        for r, want in zip(workflow_plans.RAM_GB, picks):
            p = plans[(w, v, r)]
            if isinstance(p, mp.PlanError):
                got = E
                assert "RAM short by" in str(p) and "The largest is the" in str(p)
            else:
                got = tuple(workflow_plans.SHORT[d.pick.name] for d in p.decisions if d.component.role != "VAE")
                assert p.peak_ram_bytes <= r * G and p.peak_vram_bytes <= (v - 0.8) * G + 1 and p.disk_bytes <= 200 * G
                assert len(p.reasons) == 1 + len(p.decisions) and all(d.sentence for d in p.decisions)
            if got != want:
                wrong.append(f"{w} {v} GiB VRAM / {r} GiB RAM: {got}, expected {want}")
    assert not wrong, "\n".join(wrong)


def test_ram_arithmetic_and_monotonic(grid):
    """Peak RAM = max over components j of (j's RAM while running + every other's RAM at rest) + 0
    (checked by summing the decisions), and more VRAM or RAM never makes a prompt slower or a
    fitting workflow an error (time within 1 %: disk budgets are offered in 2 GiB steps)."""
    from comfyui_memorykit.memorykit import memory_plan as mp
    _, plans = grid
    for key, p in plans.items():
        if isinstance(p, mp.PlanError):
            continue
        rest = [d.ram_rest_bytes for d in p.decisions]
        assert p.peak_ram_bytes == max(d.pick.peak_ram_bytes + sum(rest) - d.ram_rest_bytes for d in p.decisions)
        w, v, r = key
        for bigger in ((w, v, r * 2), (w, v + 4 if v < 16 else v + 8, r)):
            q = plans.get(bigger)
            if q is not None:
                assert not isinstance(q, mp.PlanError), (key, bigger)
                assert q.seconds_per_prompt <= 1.01 * p.seconds_per_prompt, (key, bigger)  # disk budgets: 2 GiB steps


def test_results_file_is_current_and_docs_quote_it(grid):
    comps, plans = grid
    text = workflow_plans.markdown(comps, plans)
    results = paths.REPO / "benchmarks" / "results" / "memory_plan_workflows.md"
    assert results.read_text().strip() == text.strip(), "run scripts/memory_plan_workflows.py"
    doc = (paths.REPO / "docs" / "memory-plan.md").read_text()
    for line in text.splitlines():
        if line.startswith(("| 8 GiB", "| 16 GiB")):
            assert line in doc, "docs/memory-plan.md quotes benchmarks/results/memory_plan_workflows.md: " + line


def test_sentences_name_the_decision_and_why(grid):
    _, plans = grid
    p = plans[("flux2_dev", 16, 32)]
    te = p.decision("text encoder")
    assert te.sentence.startswith("text encoder (Mistral Small 3 24B, 42.66 GiB bfloat16): stream from disk, ")
    assert "read from disk once per text" in te.sentence and "why: RAM (32.00 GiB) cannot also hold" in te.sentence
    assert p.reasons[0].startswith("Whole workflow: peak VRAM")


def _encode(clip, text="a red fox"):
    return clip.encode_from_tokens(clip.tokenize(text), return_pooled=True)


def test_node_plans_text_encoder_and_two_experts(comfy, fixture_models):
    """The node with clip and model_2 wired (the tiny Wan 2.2 experts, SD1.5's CLIP-L, the Wan VAE) on
    a machine where the text encoder does not fit VRAM whole: four outputs in order (MODEL, VAE, CLIP,
    MODEL_2), one sentence per component, the workflow's peaks; the CLIP it hands on encodes as the
    input does (allow_fp8 off: streamed, bit-exact; fp8 on a CLIP is checked by the text-encoder tests),
    the input unchanged. Without
    clip and model_2 the node plans one model as before and the new outputs are None."""
    import comfy.sd
    import comfy.utils
    from comfyui_memorykit.nodes.memory_plan import MemoryPlan
    from harness import wan22_models
    experts = wan22_models.ensure_wan22_experts()
    high = comfy.sd.load_diffusion_model(str(experts["high"]))
    low = comfy.sd.load_diffusion_model(str(experts["low"]))
    clip = comfy.sd.load_checkpoint_guess_config(str(fixture_models["sd15"]), output_vae=False,
                                                 output_clipvision=False)[1]
    vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(fixture_models["wan_vae"])))
    ref = _encode(clip)
    res = MemoryPlan.execute(high, "given figures", False, "speed", 1.0, 8.0, 10.0, 64, 64, 5, vae=vae, clip=clip,
                             model_2=low)
    model, vae_out, clip_out, model_2 = res.result
    rep = res.ui["memorykit_report"][0]["memory_plan"]
    names = [d["component"] for d in rep["workflow"]["decisions"]]
    assert names == ["text encoder", "diffusion model (high noise)", "diffusion model 2 (low noise)", "VAE"]
    te = rep["workflow"]["decisions"][0]
    assert te["pick"] != "as loaded", te  # CLIP-L (0.23 GiB fp16 / 0.46 fp32) does not fit 0.2 GiB usable whole
    assert te["sentence"].startswith("text encoder (SD1ClipModel") and "why: " in te["sentence"]
    assert rep["workflow"]["peak_ram_bytes"] <= 8 * G and rep["badge"][0].startswith("TE: ")
    from harness.badges import bad_figures
    assert not bad_figures(rep["badge"]), rep["badge"]
    assert model is not None and model_2 is not None and vae_out is not None and clip_out is not None
    text = res.ui["text"][0]
    assert "planned but not applied" not in text  # the text-encoder techniques apply the CLIP's pick
    assert not te["fp8"] and te["offload_to"] in ("cpu", "disk")  # allow_fp8 off: streaming, bit-exact
    assert torch_equal(_encode(clip_out)[0], ref[0])
    assert torch_equal(_encode(clip)[0], ref[0])  # the input CLIP still encodes as before
    old = MemoryPlan.execute(high, "given figures", True, "speed", 24.0, 64.0, 100.0, 64, 64, 5)
    assert len(old.result) == 4 and old.result[2] is None and old.result[3] is None
    assert "table" in old.ui["memorykit_report"][0]["memory_plan"]


def test_plan_error_names_the_component(comfy, fixture_models):
    from comfyui_memorykit.memorykit import memory_plan as mp
    from comfyui_memorykit.memorykit import memory_plan_workflow as wf
    comps = [wf.Component("text encoder", "text encoder", mp.ModelFigures((G // 8,) * 8, G // 8, label="T5",
                                                                           activation_bytes=0)),
             wf.Component("diffusion model", "diffusion model", mp.ModelFigures((G,) * 20, G // 2, label="DiT",
                                                                                 activation_bytes=G))]
    m = mp.Machine(vram_bytes=int(1.5 * G), ram_bytes=64 * G, disk_bytes=100 * G)
    with pytest.raises(mp.PlanError, match=r"^Memory Plan: diffusion model \(DiT, 20\.50 GiB\) does not fit 1\.50 GiB "
                       r"of VRAM in any way.*VRAM short by 2\.80 GiB"):
        wf.plan_workflow(m, comps)
    m = mp.Machine(vram_bytes=12 * G, ram_bytes=4 * G, disk_bytes=10 * G)
    with pytest.raises(mp.PlanError, match=r"disk short by [\d.]+ GiB.*The largest is the diffusion model \(DiT"):
        wf.plan_workflow(m, comps)


def torch_equal(a, b) -> bool:
    import torch
    return torch.equal(a, b)


def test_dynamic_vram_leaves_residency_to_core_for_every_model(comfy):
    from comfyui_memorykit.memorykit import memory_plan as mp
    from comfyui_memorykit.memorykit import memory_plan_workflow as wf
    comps = [wf.Component("text encoder", "text encoder", mp.ModelFigures((G // 4,) * 8, G // 4, label="T5",
                                                                           activation_bytes=0)),
             wf.Component("diffusion model", "diffusion model", mp.ModelFigures((G // 2,) * 20, G // 2, label="DiT",
                                                                                 activation_bytes=G))]
    plan = wf.plan_workflow(mp.Machine(8 * G, 64 * G, 100 * G, dynamic_vram=True), comps)
    assert {d.pick.residency for d in plan.decisions} == {"core dynamic VRAM"}
    assert plan.reasons[0].startswith("ComfyUI's dynamic VRAM manages the models")
