"""Free Memory through the real server: a Memory Report placed after it reports no model loaded."""
from __future__ import annotations

import uuid

import pytest


def _prompt(text: str, unload_models: bool) -> dict:
    """Load the SD1.5 checkpoint, encode a text (ComfyUI loads the CLIP model to do it), report,
    Free Memory, report again. The unique text keeps ComfyUI's cache from skipping the encode."""
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "mk_sd15_tiny.safetensors"}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": text, "clip": ["1", 1]}},
        "3": {"class_type": "MemoryKitMemoryReport", "inputs": {"value": ["2", 0], "label": "before", "reset_peak": False}},
        "4": {"class_type": "MemoryKitFreeMemory", "inputs": {"value": ["3", 0], "unload_models": unload_models,
                                                              "empty_cache": True}},
        "5": {"class_type": "MemoryKitMemoryReport", "inputs": {"value": ["4", 0], "label": "after", "reset_peak": False}},
    }


@pytest.mark.parametrize("unload_models", [True, False])
def test_memory_report_after_free_memory(server, fixture_models, unload_models):
    res = server.run(_prompt(f"a lighthouse {uuid.uuid4().hex}", unload_models), timeout=300)
    assert res.status == "success", res.error
    before = res.outputs["3"]["memorykit_report"][0]
    freed = res.outputs["4"]["memorykit_report"][0]
    after = res.outputs["5"]["memorykit_report"][0]
    held_before = [m["name"] for m in before["models"]]
    assert "SD1ClipModel" in held_before, held_before  # the encode loaded the text encoder
    if unload_models:
        assert after["models"] == [], after["models"]
        assert freed["models"] == []
        # Free Memory names what it unloaded: every model held before it ran.
        assert sorted(freed["unloaded_models"]) == sorted(held_before)
        clip = next(m for m in before["models"] if m["name"] == "SD1ClipModel")
        assert freed["unloaded_bytes"] >= clip["loaded_bytes"] > 0
        assert "Unloaded: " in res.outputs["4"]["text"][0] and "SD1ClipModel" in res.outputs["4"]["text"][0]
    else:
        # Caches emptied only: the models stay loaded.
        assert [m["name"] for m in after["models"]] == held_before
        assert freed["unloaded_models"] == [] and freed["unloaded_bytes"] == 0
    assert freed["freed_vram_bytes"] >= 0 and freed["released_cache_bytes"] >= 0
    # Passthrough: the conditioning reached the end of the chain (the last report ran on it).
    assert after["label"] == "after"


def test_report_and_free_memory_run_again_on_an_unchanged_queue(server, fixture_models):
    """Queued twice unchanged, ComfyUI reuses the loader and the encode (cached) but runs
    Memory Report and Free Memory again: memory changes between runs when the inputs do not.
    (Their fingerprint was ``math.nan``, one shared object: ComfyUI's cache matched it by
    identity and reused the first run's report and skipped the unload.)"""
    prompt = _prompt(f"queued twice {uuid.uuid4().hex}", True)
    first = server.run(prompt, timeout=300)
    second = server.run(prompt, timeout=300)
    assert first.status == second.status == "success", (first.error, second.error)
    cached = {str(n) for kind, msg in second.messages if kind == "execution_cached" for n in msg.get("nodes", [])}
    assert {"1", "2"} <= cached, cached
    assert not cached & {"3", "4", "5"}, f"Memory Report / Free Memory reused from the cache: {cached}"
    for nid in ("3", "4", "5"):
        assert second.outputs[nid]["memorykit_report"][0]["time"] > first.outputs[nid]["memorykit_report"][0]["time"]


def test_free_memory_output_is_its_input(comfy):
    """In-process: the node returns its input object itself, for any type."""
    from comfyui_memorykit.nodes.free_memory import FreeMemory
    marker = object()
    out = FreeMemory.execute(marker, unload_models=False, empty_cache=False)
    assert out.args[0] is marker
    rep = out.ui["memorykit_report"][0]
    assert rep["unloaded_models"] == [] and rep["label"] == "Free Memory"
