"""FP8 Layerwise Cast and Group Offload compose, in either order (issue 4 / issue 3).

Through a real ComfyUI server on the CPU: fp8 → Group Offload (disk target) and Group Offload →
fp8 each give latents bit-identical to the fp8 model without offload; the offload files hold
the fp8 bytes (float8 storage is what is kept on disk and streamed)."""
from __future__ import annotations

import os

import torch

from test_group_offload_server import go, latents, offload_dirs, wan_prompt, wait_until

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


def _offload_file_tensors(folder):
    """(dtype → element count, total bytes) of every tensor in a model's offload files."""
    from safetensors import safe_open
    counts, total = {}, 0
    (d,) = offload_dirs(folder)
    for f in (folder / d).iterdir():
        if f.suffix != ".safetensors":
            continue
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                t = sf.get_tensor(k)
                counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
                total += t.numel() * t.element_size()
    return counts, total


def test_offload_files_hold_fp8_bytes(server, tmp_path, fixture_models):
    """While an fp8 → Group Offload model is loaded, its disk files (what is kept off the
    device and streamed) hold the cast layers in float8: 1 byte per parameter, 3 bytes per
    parameter fewer than the plain fp32 model's files."""
    found = {}
    for name in ("plain", "fp8"):
        folder = tmp_path / name
        folder.mkdir()
        extra = {"f8": fp8(["1", 0])} if name == "fp8" else {}
        model = go(["f8", 0] if name == "fp8" else ["1", 0], folder)
        res = server.run(wan_prompt({name: model}, steps=1, extra=extra))
        assert res.status == "success", res.error
        found[name] = _offload_file_tensors(folder)
        server.free(unload_models=True)
        assert wait_until(lambda: os.listdir(folder) == [], timeout=60), os.listdir(folder)
    (plain_counts, plain_bytes), (fp8_counts, fp8_bytes) = found["plain"], found["fp8"]
    n_fp8 = fp8_counts.get(torch.float8_e4m3fn, 0)
    assert torch.float8_e4m3fn not in plain_counts and n_fp8 > 0, fp8_counts
    # Per-tensor scales add a few fp32 scalars; everything else is the same tensors.
    saved = plain_bytes - fp8_bytes
    assert abs(saved - 3 * n_fp8) <= 4 * 256, (saved, n_fp8)
