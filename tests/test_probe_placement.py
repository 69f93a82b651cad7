"""Probe findings on stacking placement techniques, in-process with the tiny Wan model."""
from __future__ import annotations

import pytest


def test_probe_device_map_then_group_offload_is_refused_naming_both_nodes(comfy, loaded, tmp_path):
    """Balanced Device Map, then Group Offload (directly or as Memory Plan's 'stream from disk'):
    was 'this MODEL uses DeviceMapModelPatcher (from another custom node)'; the pack's own node is
    named now, as the other order names Group Offload."""
    from comfyui_memorykit.memorykit.comfy_integration import device_map_patcher, offload_patcher
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    lm = loaded("wan")
    mapped, _, _ = device_map_patcher.device_map_model(lm.patcher, "balanced", "cpu=3MiB, disk", str(tmp_path))
    settings = offload_patcher.GroupOffloadSettings(
        options=GroupOffloadOptions(offload_type="block_level", num_blocks_per_group=1, use_stream=False,
                                    offload_to="disk"), disk_folder=str(tmp_path))
    with pytest.raises(ValueError, match="Group Offload: this MODEL comes through Balanced Device Map"):
        offload_patcher.prepare_group_offload(mapped, settings)
    lm.assert_restored()


def test_probe_memory_plan_after_a_placement_node_is_refused_naming_it(comfy, loaded, tmp_path):
    """Memory Plan after Balanced Device Map or Group Offload: its candidates (Group Offload to RAM
    or disk) were refused only at apply, after a plan was chosen and shown; now the plan itself is
    refused, naming the node (and the attachment keys are the ones the placement nodes set)."""
    from comfyui_memorykit.memorykit.comfy_integration import (
        device_map_patcher,
        memory_plan_io,
        offload_patcher,
        placement,
    )
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    assert set(placement.PLACED_BY) == {offload_patcher.GROUP_OFFLOAD_KEY, device_map_patcher.DEVICE_MAP_ATTACHMENT}
    lm = loaded("wan")
    mapped, _, _ = device_map_patcher.device_map_model(lm.patcher, "balanced", "cpu=3MiB, disk", str(tmp_path))
    offloaded, _ = offload_patcher.prepare_group_offload(lm.patcher, offload_patcher.GroupOffloadSettings(
        options=GroupOffloadOptions(offload_type="block_level", num_blocks_per_group=1, use_stream=False,
                                    offload_to="disk"), disk_folder=str(tmp_path)))
    for model, node in ((mapped, "Balanced Device Map"), (offloaded, "Group Offload")):
        with pytest.raises(ValueError, match=f"^model: this MODEL comes through {node}, .*Connect Memory Plan"):
            memory_plan_io.memory_plan(model, None, None, "given figures", width=64, height=64, frames=5)
    assert placement.placed_by(lm.patcher) is None
    lm.assert_restored()
