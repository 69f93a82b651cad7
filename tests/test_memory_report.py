"""Memory Report through the server, and the example workflows end to end (as the demo runs them)."""
from __future__ import annotations

import pytest

from harness import examples


@pytest.mark.parametrize("name", examples.example_names())
def test_example_workflow_runs(server, object_info, name, fixture_models):
    if examples.unavailable(name):
        pytest.skip(examples.unavailable(name))
    r = examples.run_example(server, name, object_info)
    assert r["status"] == "success", r["error"]
    assert r["files"] and all(f.exists() and f.stat().st_size > 0 for f in r["files"])
    assert r["reports"], "no MemoryKit node reported"


def test_memory_report_has_plausible_numbers(server, object_info, fixture_models):
    r = examples.run_example(server, "memory_report_sd15", object_info)
    assert r["status"] == "success", r["error"]
    reports = sorted(r["reports"].values(), key=lambda rep: rep["time"])
    assert [rep["label"] for rep in reports] == ["after sampling", "after VAE decode"]
    ckpt_bytes = fixture_models["sd15"].stat().st_size
    for rep in reports:
        h = rep["host"]
        # A ComfyUI process with torch and a loaded model holds hundreds of MiB at least.
        assert 200 * 2**20 < h["rss_bytes"] <= h["rss_peak_bytes"] < 20 * 2**30
        assert h["rss_anon_bytes"] <= h["rss_bytes"]
        assert rep["cuda"] == [] or all(d["peak_allocated_bytes"] >= d["allocated_bytes"] for d in rep["cuda"])
    after_sampling = reports[0]
    names = [m["name"] for m in after_sampling["models"]]
    assert "BaseModel" in names, names  # the SD1.5 UNet ComfyUI loaded for sampling
    unet = next(m for m in after_sampling["models"] if m["name"] == "BaseModel")
    # The UNet is part of the fp16 checkpoint file and is loaded at fp16 or fp32.
    assert 0 < unet["size_bytes"] < 2 * ckpt_bytes
    assert unet["loaded_bytes"] <= unet["size_bytes"]
    # which memory path ComfyUI has it on (on the CPU: fully loaded; dynamic VRAM needs a GPU)
    assert unet["memory_path"] in ("fully loaded", "lowvram (partially loaded)", "dynamic VRAM", "not loaded")
    if not any(rep["cuda"] for rep in reports):
        assert unet["memory_path"] == "fully loaded"
    # The text shown in the UI summarises the same figures.
    text = r["result"].outputs[next(iter(r["reports"]))]["text"][0]
    assert "RAM:" in text and "BaseModel" in text
