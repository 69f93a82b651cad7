"""One block rule for both placements: on zoo architectures (PixArt Sigma, whose ``t_block`` is a
``Sequential``; SDXL, whose UNet layers sit in ``TimestepEmbedSequential``s; Wan 2.1; Stable Cascade,
lists of lists), the blocks Balanced Device Map keeps whole are the blocks Group Offload streams,
what it offloads lies inside them, and what lies outside them is Group Offload's remainder.
Planning only (no forward; the zoo's exactness tests run both placements)."""
from __future__ import annotations

import os

import pytest

from harness import zoo

ARCHS = ["pixart_sigma", "sdxl", "wan21", "stable_cascade_c"]


@pytest.mark.parametrize("name", ARCHS)
def test_both_placements_see_the_same_blocks(comfy, name, tmp_path):
    from comfyui_memorykit.memorykit import comfy_integration as ci
    from comfyui_memorykit.memorykit.comfy_integration import placement
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    if zoo.available(name):
        pytest.skip(zoo.available(name))
    patcher = zoo.build(name)
    dm = patcher.model.diffusion_model
    streamed = [qn for _, items in ci.comfy_block_lists(dm) for qn, _ in items]  # what Group Offload streams
    _, info = ci.prepare_group_offload(patcher, ci.GroupOffloadSettings(GroupOffloadOptions(offload_to="disk"),
                                                                        disk_folder=str(tmp_path)))
    plan = info["plan"]
    assert plan["resident_blocks"] + plan["streamed_blocks"] == len([b for b in streamed
                                                                     if dm.get_submodule(b).state_dict()])
    sd = dm.state_dict()
    nbytes = {k: t.numel() * t.element_size() for k, t in sd.items()}

    def in_block(key: str) -> bool:
        return any(key.startswith(b + ".") for b in streamed)

    outside = sum(b for k, b in nbytes.items() if not in_block(k))
    assert outside == plan["remainder_bytes"]
    cpu = outside + (sum(nbytes.values()) - outside) // 2  # the remainder and about half the blocks
    _, rep, _ = ci.device_map_model(patcher, "balanced", f"cpu={cpu}, disk", str(tmp_path))
    assert rep["blocks"] == streamed == placement.comfy_block_names(dm)
    assert rep["split_blocks"] == []
    assert set(rep["bytes_per_device"]) == {"cpu", "disk"}, rep["bytes_per_device"]
    on_disk = [k for k in sd for e, d in rep["device_map"].items() if d == "disk" and (e == "" or k.startswith(e + "."))]
    assert on_disk and all(in_block(k) for k in on_disk), [k for k in on_disk if not in_block(k)]
    for b in (b for b in streamed if dm.get_submodule(b).state_dict()):  # each block with weights placed whole
        owners = [e for e in rep["device_map"] if e == "" or b == e or b.startswith(e + ".")]
        assert len(owners) == 1, (b, owners)
    assert os.listdir(tmp_path) == []
