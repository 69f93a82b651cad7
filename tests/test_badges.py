"""The badge's headline figures (memorykit/badge.py) per technique: the right figures, right units.

Reports are shaped as the nodes send them (fields copied from real runs of the example
workflows); no ComfyUI needed.
"""
from __future__ import annotations

import pytest

from harness import paths

pytestmark = pytest.mark.core_independent  # runs on the ComfyUI 0.33 suite only
from harness.badges import badge_matches, bad_figures, split_badge

badge = paths.technique_package() and __import__("memorykit_tech.badge", fromlist=["badge"])

HOST = {"rss_bytes": 1_500_000_000, "rss_anon_bytes": 1_000_000_000, "rss_peak_bytes": 2_018_634_547}
CUDA = [{"device": "cuda:0", "allocated_bytes": 1, "peak_allocated_bytes": int(1.1 * 2**30), "reserved_bytes": 2,
         "total_bytes": 150 * 2**30}]


def rep(cuda=False, **fields):
    return {"label": "x", "time": 0.0, "host": HOST, "cuda": CUDA if cuda else [], "models": [], **fields}


CASES = {
    "fp8": (rep(fp8={"weight_bytes_before": 103_165_776, "weight_bytes_after": 38_285_136, "cast_layers": 60,
                     "kept_layers": [{"name": "out.2", "reason": "x"}] * 9}),
            ["98.4 → 36.5 MiB (−63 %)", "60 layers fp8", "9 kept"]),
    "fp8_gib": (rep(fp8={"weight_bytes_before": 103_079_215, "weight_bytes_after": 38_654_705, "cast_layers": 1,
                         "kept_layers": []}) | {"fp8": {"weight_bytes_before": int(0.096 * 2**30),
                                                        "weight_bytes_after": int(0.036 * 2**30) + 1,
                                                        "cast_layers": 1, "kept_layers": []}},
                ["98.3 → 36.9 MiB (−62 %)", "1 layers fp8", "0 kept"]),
    "fp8_core": (rep(fp8={"weight_bytes_before": 103_165_776, "weight_bytes_after": 38_285_136, "cast_layers": 60,
                          "core_layers": 40, "kept_layers": []}),
                 ["98.4 → 36.5 MiB (−63 %)", "60 layers fp8 (core)", "0 kept"]),
    "group_offload_planned": (rep(group_offload={
        "status": "planned (applied when sampling loads the model)", "options": {"offload_to": "disk"},
        "plan": {"resident_bytes": 0, "streamed_bytes": 103_157_776, "footprint_bytes": 13_529_600}}),
        ["resident 0 B", "streams 98.4 MiB/forward from disk", "needs 12.9 MiB", "planned"]),
    "group_offload_run": (rep(cuda=True, group_offload={
        "status": "applied", "options": {"offload_to": "cpu"},
        "figures": {"resident_bytes": int(0.4 * 2**30) + 1, "streamed_bytes": int(1.2 * 2**30), "footprint_bytes": 1},
        "run": {"forwards": 4, "seconds": 2.5, "bytes_moved": 4 * int(1.2 * 2**30), "peak_vram_bytes": int(1.1 * 2**30)}}),
        ["streams 1.20 GiB/forward", "peak 1.10 GiB", "resident 409.6 MiB", "4 forwards in 2.5 s"]),
    # after a run that reported its steps (2 forwards per step: cond and uncond): per step, and no plan figure
    "group_offload_run_steps": (rep(cuda=True, group_offload={
        "status": "applied", "options": {"offload_to": "disk"},
        "figures": {"resident_bytes": 0, "streamed_bytes": int(1.2 * 2**30), "footprint_bytes": 1},
        "run": {"forwards": 8, "steps": 4, "seconds": 2.5, "bytes_moved": 8 * int(1.2 * 2**30),
                "peak_vram_bytes": int(1.1 * 2**30)}}),
        ["streams 2.40 GiB/step from disk", "peak 1.10 GiB", "resident 0 B", "4 steps in 2.5 s"]),
    # after a run on a CPU (no VRAM peak): the RAM peak, never the plan's "needs"
    "group_offload_run_cpu": (rep(group_offload={
        "status": "applied", "options": {"offload_to": "cpu"},
        "figures": {"resident_bytes": 0, "streamed_bytes": 1_000_000, "footprint_bytes": 13_529_600},
        "run": {"forwards": 4, "steps": 4, "seconds": 0.5, "bytes_moved": 4_000_000, "peak_vram_bytes": None}}),
        ["streams 976.6 KiB/step", "RAM peak 1.88 GiB", "resident 0 B", "4 steps in 0.50 s"]),
    # one step (the first of two experts): "1 step", not "1 steps"
    "group_offload_run_one_step": (rep(group_offload={
        "status": "applied", "options": {"offload_to": "disk"},
        "figures": {"resident_bytes": 0, "streamed_bytes": 1_000_000, "footprint_bytes": 1},
        "run": {"forwards": 2, "steps": 1, "seconds": 0.5, "bytes_moved": 2_000_000, "peak_vram_bytes": None}}),
        ["streams 1.9 MiB/step from disk", "RAM peak 1.88 GiB", "resident 0 B", "1 step in 0.50 s"]),
    "tiled_vae": (rep(cuda=True, tiled_vae={"plan": {"tiles_per_axis": [3, 3]}, "tile_px": [112, 112], "seconds": 39.5}),
                  ["3×3 tiles", "VRAM peak 1.10 GiB", "112×112 px", "39.5 s"]),
    "tiled_vae_video": (rep(tiled_vae={"plan": {"tiles_per_axis": [1, 3, 3]}, "tile_px": [56, 56], "seconds": 0.4}),
                        ["3×3 tiles", "RAM peak 1.88 GiB", "56×56 px", "0.40 s"]),
    "sharded": (rep(sharded={"index": "/abs/path/model.safetensors.index.json", "shards": 3, "tensors": 168,
                             "total_bytes": 51_578_888, "seconds": 4.59}),
                ["3 shards", "49.2 MiB", "4.6 s", "168 tensors"]),
    "device_map_gpus": (rep(cuda=True, device_map={"blocks": "cuda:0"},
                            bytes_per_device={"cuda:0": int(10.8 * 2**30), "cuda:1": int(11.3 * 2**30)}),
                        ["cuda:0 10.8", "cuda:1 11.3 GiB"]),
    "device_map_mixed": (rep(bytes_per_device={"cpu": 2_790_912, "disk": 900}), ["cpu 2.7 MiB", "disk 900 B"]),
    "free_memory_cpu": (rep(unloaded_models=["SD1"], unloaded_bytes=103_165_776, freed_vram_bytes=0,
                            released_cache_bytes=0), ["unloaded 98.4 MiB", "RAM peak 1.88 GiB"]),
    "memory_report_cpu": (rep(), ["RAM peak 1.88 GiB", "0 models loaded"]),
    "memory_report_gpu": (rep(cuda=True), ["VRAM peak 1.10 GiB", "RAM peak 1.88 GiB", "0 models loaded"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_headline_figures_and_units(case):
    report, expected = CASES[case]
    figs = badge.badge_figures(report)
    assert figs == expected
    assert not bad_figures(figs), bad_figures(figs)
    assert badge.with_badge(dict(report))["badge"] == expected


def test_counts_and_seconds_are_not_bytes():
    figs = badge.badge_figures(CASES["sharded"][0])
    assert not any(f.endswith(" B") and not f[0].isdigit() for f in figs)
    assert bad_figures(["shards 3 B"]) == ["shards 3 B"] and bad_figures(["seconds 4.59 B"]) == ["seconds 4.59 B"]


def test_badge_text_matching():
    figs = ["3 shards", "49.2 MiB", "4.6 s"]
    assert badge_matches("3 shards · 49.2 MiB · 4.6 s", figs)
    assert badge_matches("3 shards · +2", figs)
    assert badge_matches("3 sh… · +2", figs)
    assert badge_matches("cached · 3 shards · 49.2 MiB · +1", figs)
    assert split_badge("cached · 3 shards · +2") == (True, ["3 shards"], 2)
    assert not badge_matches("3 shards · +1", figs)
    assert not badge_matches("49.2 MiB · +2", figs)
