"""FP8 Layerwise Cast and Group Offload compose, in either order (issue 4 / issue 3).

Through a real ComfyUI server on the CPU: fp8 → Group Offload (disk target) and Group Offload →
fp8 each give latents bit-identical to the fp8 model without offload; the disk store holds
the fp8 bytes (float8 storage is what is kept on disk and streamed)."""
from __future__ import annotations

import os

import torch

from harness.ws import WsListener
from test_group_offload_server import go, latents, wan_prompt, wait_until

FP8 = {"storage_dtype": "float8_e4m3fn", "compute_dtype": "auto", "fp8_matmul": False, "scaling": "per-tensor",
       "skip_preset": "auto", "extra_skip_patterns": ""}


def fp8(model_ref) -> dict:
    return {"class_type": "MemoryKitFp8LayerwiseCast", "inputs": {**FP8, "model": model_ref}}


def test_fp8_and_group_offload_compose_in_either_order(server, tmp_path, fixture_models):
    folder = tmp_path / "offload"
    folder.mkdir()
    extra = {"f8": fp8(["1", 0]), "go_first": go(["1", 0], folder)}
    branches = {
        "fp8": ["f8", 0],
        "fp8_then_offload": go(["f8", 0], folder),
        "offload_then_fp8": fp8(["go_first", 0]),
        "plain": ["1", 0],
    }
    res = server.run(wan_prompt(branches, extra=extra))
    lat = latents(server, res)
    assert not torch.equal(lat["fp8"], lat["plain"]), "fp8 did not change the output: the cast did not happen"
    assert torch.equal(lat["fp8_then_offload"], lat["fp8"])
    assert torch.equal(lat["offload_then_fp8"], lat["fp8"])
    err = float((lat["fp8"] - lat["plain"]).norm() / lat["plain"].norm())
    assert err < 0.2, err


def _streamed_bytes(ws, node: str) -> int:
    """Bytes the applied offload streams from disk (the run report Group Offload sends after
    sampling): the disk store holds exactly these tensors, in a file that has no name."""
    run = ws.wait_for(lambda m: m.get("type") == "executed" and m["data"].get("node") == node
                      and m["data"]["output"]["memorykit_report"][0]["group_offload"]["status"] == "applied")
    fig = run["data"]["output"]["memorykit_report"][0]["group_offload"]["figures"]
    assert fig["disk_bytes"] >= fig["streamed_bytes"] > 0
    return fig["streamed_bytes"]


def test_offload_files_hold_fp8_bytes(server, tmp_path, fixture_models):
    """While an fp8 → Group Offload model is loaded, what it keeps on disk and streams holds the
    cast layers in float8: 1 byte per parameter, 3 bytes per parameter fewer than the plain fp32
    model's."""
    streamed, cast_params = {}, 0
    for name in ("plain", "fp8"):
        folder = tmp_path / name
        folder.mkdir()
        extra = {"f8": fp8(["1", 0])} if name == "fp8" else {}
        model = go(["f8", 0] if name == "fp8" else ["1", 0], folder)
        with WsListener(server) as ws:
            res = server.run(wan_prompt({name: model}, steps=1, extra=extra))
            assert res.status == "success", res.error
            streamed[name] = _streamed_bytes(ws, f"m_{name}")
        if name == "fp8":
            cast_params = res.outputs["f8"]["memorykit_report"][0]["fp8"]["cast_params"]
        server.free(unload_models=True)
        assert wait_until(lambda: os.listdir(folder) == [], timeout=60), os.listdir(folder)
    assert cast_params > 0
    # Per-tensor scales add a few fp32 scalars; everything else is the same tensors.
    saved = streamed["plain"] - streamed["fp8"]
    assert abs(saved - 3 * cast_params) <= 4 * 256, (saved, cast_params)
