"""Memory Plan's decisions for full-size models on the meta device (Flux.1-dev, Wan 2.1 14B, SDXL)
× VRAM 8/12/16/24/80 GiB × RAM 16/32/64 GiB, planned from given figures (PCIe 4.0 25 GB/s, NVMe
3 GB/s, 110 TFLOP/s), checked against picks worked out from first principles; the table is the
one printed in docs/memory-plan.md.

The first principles (G = GiB; W weights, W8 after fp8, A activations of one step from core's
memory_required, cond+uncond batched, A1 with them one after the other; V = VRAM − 0.8 G core
reserve; ring = 2 largest blocks):
- resident ("as loaded") when W + A1 ≤ V: SDXL (4.78 + 0.26 G) everywhere, Flux (22.17 + 0.99 =
  23.16 G) from 24 GiB, Wan (26.62 + 11.79 G) at 80 GiB. Resident RAM while sampling is none
  (core moves the weights to the GPU), so 16 GiB RAM does not stop it.
- fp8 resident when W8 + A1 ≤ V, the fp8 copies of the cast layers (W − W8: their bf16 bytes
  halve) fit in RAM next to the loaded weights, and it beats streaming: Flux at 16 GiB (11.15 +
  0.99 ≤ 15.2 G; the auto preset casts the blocks' modulation too) needs 22.17 + 11.03 = 33.2 G
  RAM → only with 64; Wan at 24 GiB (13.53 + 5.90 ≤ 23.2 G) needs 26.62 + 13.09 = 39.7 G → only
  with 64. The cast costs
  W8 / 270 GB/s (0.05 s) while the bf16 stream costs ×1.15 of a compute-bound step: fp8 wins.
- otherwise stream from RAM when W fits in RAM (Flux 22.17 G, Wan 26.62 G: 32 and 64 GiB), from
  disk when it does not (16 GiB). Flux and Wan are compute-bound at these sizes (Flux 1024²: 1.77 s
  compute vs ≤ 0.78 s transfer; Wan 480p×81: 17 s vs ≤ 2 s), so fp8 + stream only adds the cast
  and full precision streams.
- Wan at 8 GiB: A1 + ring = 5.90 + 1.31 G > 7.2 G in bf16 (0.01 G short); fp8's ring (0.66 G)
  fits, but fp8 needs W + fp8 copies = 39.7 G of RAM: only 64 GiB works; 16 and 32 GiB are errors naming VRAM and RAM.
"""
from __future__ import annotations

import re

import pytest
from harness import meta_models, paths

# Latents: Flux 1024² (16 × 128²), Wan 832×480×81 frames (16 × 21 × 60 × 104), SDXL 1024² (4 × 128²).
LATENTS = {"flux_dev": [1, 16, 128, 128], "wan_14b": [1, 16, 21, 60, 104], "sdxl": [1, 4, 128, 128]}
VRAM, RAM = (8, 12, 16, 24, 80), (16, 32, 64)
D, R, F, L, E = "stream from disk", "stream from RAM", "fp8 resident", "as loaded", "ERROR"
EXPECTED = {  # (model, VRAM GiB) → picks for RAM 16 / 32 / 64 GiB (see the module docstring)
    ("flux_dev", 8): (D, R, R), ("flux_dev", 12): (D, R, R), ("flux_dev", 16): (D, R, F),
    ("flux_dev", 24): (L, L, L), ("flux_dev", 80): (L, L, L),
    ("wan_14b", 8): (E, E, "fp8 + stream from RAM"), ("wan_14b", 12): (D, R, R), ("wan_14b", 16): (D, R, R),
    ("wan_14b", 24): (D, R, F), ("wan_14b", 80): (L, L, L),
    **{("sdxl", v): (L, L, L) for v in VRAM},
}
DISK_GB = 200


@pytest.fixture(scope="module")
def figures(comfy):
    from comfyui_memorykit.memorykit.comfy_integration import memory_plan_io as io
    return {k: io.model_figures(meta_models.meta_patcher(k), LATENTS[k]) for k in LATENTS}


def decision_table(figures) -> str:
    """The Markdown table of docs/memory-plan.md: each cell the pick (and GiB streamed per step)."""
    from comfyui_memorykit.memorykit import memory_plan as mp
    from comfyui_memorykit.memorykit.comfy_integration import memory_plan_io as io
    rows = ["| model | VRAM | RAM 16 GiB | RAM 32 GiB | RAM 64 GiB |", "|---|---|---|---|---|"]
    for f in figures.values():
        for v in VRAM:
            cells = []
            for r in RAM:
                try:
                    p = mp.make_plan(io.given_machine(v, r, DISK_GB), f).pick
                    cells.append(p.name + (f" ({p.streamed_bytes / 2**30:.1f} GiB/step)" if p.streamed_bytes else ""))
                except mp.PlanError as e:
                    cells.append("error: " + "; ".join(re.findall(r"(?:VRAM|RAM|disk) short by [\d.]+ (?:GiB|MiB|KiB|bytes)", str(e))))
            rows.append(f"| {f.label} {f.weight_bytes / 2**30:.1f} GiB | {v} GiB | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def test_decisions_match_first_principles(figures):
    from comfyui_memorykit.memorykit import memory_plan as mp
    from comfyui_memorykit.memorykit.comfy_integration import memory_plan_io as io
    wrong = []
    for (k, v), picks in EXPECTED.items():
        for r, want in zip(RAM, picks):
            try:
                plan = mp.make_plan(io.given_machine(v, r, DISK_GB), figures[k])
                got = plan.pick.name
                assert plan.pick.fits and plan.reasons[-1].startswith(f"Pick: {got}")
            except mp.PlanError as e:
                got = E
                assert "short by" in str(e) and "GiB" in str(e)
            if got != want:
                wrong.append(f"{k} {v} GiB VRAM / {r} GiB RAM: {got}, expected {want}")
    assert not wrong, "\n".join(wrong)


def test_error_names_what_is_short_and_by_how_much(figures):
    from comfyui_memorykit.memorykit import memory_plan as mp
    from comfyui_memorykit.memorykit.comfy_integration import memory_plan_io as io
    with pytest.raises(mp.PlanError, match=r"no way to run WAN21 \(26\.62 GiB of weights\).*VRAM short by 8\.50 MiB"):
        mp.make_plan(io.given_machine(8, 32, DISK_GB), figures["wan_14b"])


def test_prefer_memory_and_allow_fp8(figures):
    from comfyui_memorykit.memorykit import memory_plan as mp
    from comfyui_memorykit.memorykit.comfy_integration import memory_plan_io as io
    m = io.given_machine(24, 64, DISK_GB)
    speed = mp.make_plan(m, figures["flux_dev"])
    memory = mp.make_plan(m, figures["flux_dev"], mp.PlanOptions(prefer="memory"))
    assert speed.pick.name == L
    # least VRAM among plans within 1.5× of the fastest: fp8 halves what streams, so it hides under compute
    assert memory.pick.name == "fp8 + stream from RAM" and memory.pick.peak_vram_bytes < speed.pick.peak_vram_bytes / 2
    assert memory.pick.est_s <= mp.MEMORY_SLOWDOWN * speed.pick.est_s
    no8 = mp.make_plan(io.given_machine(16, 64, DISK_GB), figures["flux_dev"], mp.PlanOptions(allow_fp8=False))
    assert no8.pick.name == R and not any(c.fp8 for c in no8.candidates)
    assert any("allow_fp8 off" in r for r in no8.reasons)
    # every sentence names numbers; the badge is the pick and the tiles
    assert all(re.search(r"\d", r) for r in memory.reasons)
    assert memory.badge()[0].startswith("fp8 + stream ") and memory.badge()[0].endswith("/step from RAM")


def test_dynamic_vram_leaves_residency_to_core(figures):
    from comfyui_memorykit.memorykit import memory_plan as mp
    from comfyui_memorykit.memorykit.comfy_integration import memory_plan_io as io
    plan = mp.make_plan(io.given_machine(12, 64, DISK_GB, dynamic_vram=True), figures["flux_dev"])
    assert {c.residency for c in plan.candidates if c.offload_to is None} == {"core dynamic VRAM"}
    assert plan.reasons[0].startswith("ComfyUI's dynamic VRAM manages this model")
    short_ram = mp.make_plan(io.given_machine(12, 16, DISK_GB, dynamic_vram=True), figures["flux_dev"])
    assert short_ram.pick.offload_to == "disk"  # RAM short: disk versus RAM is the plan's to choose


def test_docs_print_the_decision_table(figures):
    doc = (paths.REPO / "docs" / "memory-plan.md").read_text()
    table = decision_table(figures)
    assert table in doc, "docs/memory-plan.md's decision table is out of date; the current one:\n" + table
