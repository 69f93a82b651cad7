"""Memory Plan through a real ComfyUI server: the Wan 2.2 template (one plan for both experts, the
VAE and the latent; its text encoder is the harness's stand-in, so the plan sees no clip) and the
Flux 2 [dev] one (diffusion model + VAE, on ComfyUI 0.33) run end
to end on the generated stand-ins, each Memory Plan reports its decisions, sentences and badge; a plan
that cannot fit fails before anything is loaded, naming what is short. (The SD1.5 template runs in the demo and the browser tests, which run every example.)"""
from __future__ import annotations

import pytest
from harness import examples
from harness.badges import bad_figures


@pytest.mark.parametrize("name", ["memory_plan_wan22_16gb_vram_32gb_ram", "memory_plan_flux2_dev_16gb_vram_64gb_ram"])
def test_template_runs_with_memory_plan(server, object_info, fixture_models, name):
    if examples.unavailable(name):
        pytest.skip(examples.unavailable(name))
    out = examples.run_example(server, name, object_info)
    assert out["status"] == "success", out["error"]
    assert out["files"], "no output written"
    prompt = examples.load_example(name, object_info)
    plans = [nid for nid, n in prompt.items() if n["class_type"] == "MemoryKitMemoryPlan"]
    assert plans
    for nid in plans:
        rep = out["reports"][nid]["memory_plan"]
        assert out["reports"][nid]["badge"] == rep["badge"] and not bad_figures(rep["badge"])
        text = out["result"].outputs[nid]["text"][0]
        if "workflow" in rep:  # the whole workflow: one decision and one sentence per component wired
            assert "Memory Plan for the workflow" in text
            got = [d["component"] for d in rep["workflow"]["decisions"]]
            want = (["diffusion model (high noise)", "diffusion model 2 (low noise)"] if "model_2" in prompt[nid]["inputs"]
                    else ["diffusion model"]) + (["VAE"] if "vae" in prompt[nid]["inputs"] else [])
            assert got == want, got
            assert all(d["sentence"] in text for d in rep["workflow"]["decisions"])
        else:
            assert rep["pick"] in {c["name"] for c in rep["candidates"]}
            assert any(c["fits"] for c in rep["candidates"]) and rep["reasons"][-1].startswith("Pick: ")
            assert "Memory Plan for" in text and rep["table"] in text
        if name.startswith("memory_plan_wan22"):
            assert rep["machine"]["source"] == "given" and rep["machine"]["vram_bytes"] == 16 * 2**30
            assert "workflow" in rep and rep["machine"]["ram_bytes"] == 32 * 2**30
        if name.startswith("memory_plan_flux2"):
            assert rep["machine"]["source"] == "given" and rep["machine"]["vram_bytes"] == 16 * 2**30
            assert rep["machine"]["ram_bytes"] == 64 * 2**30  # no clip in the test (substituted): one model + VAE


def test_a_plan_that_cannot_fit_is_an_error_before_loading(server, fixture_models):
    prompt = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "mk_wan21_tiny.safetensors", "weight_dtype": "default"}},
        "2": {"class_type": "MemoryKitMemoryPlan", "inputs": {
            "model": ["1", 0], "plan_for": "given figures", "allow_fp8": True, "prefer": "speed", "vram_gb": 2.0,
            "ram_gb": 1.0, "disk_gb": 0.0, "width": 16384, "height": 16384, "frames": 4096}},
        "3": {"class_type": "MemoryKitTestSaveTensor", "inputs": {"value": ["2", 0], "filename_prefix": "mp_never"}},
    }
    res = server.run(prompt)
    assert res.status == "error"
    msg = res.error["exception_message"]
    assert "no way to run WAN21" in msg and "VRAM short by" in msg, msg
