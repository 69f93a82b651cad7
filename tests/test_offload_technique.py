"""Group offloading, technique layer (``memorykit.offload``), in-process on the generated models.

Equivalence: with onload = offload = cpu the diffusion model's output equals the plain model's
bit for bit. The cases cover every pair of option values (offload mode × target × budget, and
each of those × model) on the SD1.5-, Wan- and Flux-shaped models built by ComfyUI's own
classes. The Flux model is expensive (seconds per forward), so it gets two cases; its block
lists hold one block each, so its block_level group sizes 1/2/all would be the same grouping.
After removal every weight is back exactly as loaded (values compared with the model file).
"""
from __future__ import annotations

import os

import pytest
import torch


# (model, offload_type, num_blocks_per_group, offload_to, budget): all pairs covered, see module doc.
ALL = 1000
# The cpu target streams through the event ring (memorykit scheduler, the default) unless the
# case names diffusers; disk always goes through diffusers' hooks.
CASES = [
    ("sd15", "block_level", 1, "cpu", None), ("sd15", "block_level", 2, "disk", "partial"),
    ("sd15", "block_level", ALL, "disk", None), ("sd15", "leaf_level", 1, "cpu", "partial"),
    ("wan", "block_level", 1, "disk", "partial"), ("wan", "block_level", 2, "cpu", None),
    ("wan", "block_level", ALL, "cpu", "partial"), ("wan", "leaf_level", 1, "disk", None),
    ("flux", "block_level", 1, "cpu", "partial"), ("flux", "leaf_level", 1, "disk", None),
    ("flux", "leaf_level", 1, "cpu", None),
    ("sd15", "leaf_level", 1, "cpu", None, "diffusers"), ("wan", "block_level", 2, "cpu", "partial", "diffusers"),
]
CASES = [c if len(c) == 6 else c + ("memorykit",) for c in CASES]


@pytest.mark.parametrize("key,offload_type,n,target,budget,scheduler", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}-{c[4] or 'stream_all'}-{c[5]}" for c in CASES])
def test_offloaded_output_is_bit_exact_and_removal_restores(loaded, tmp_path, key, offload_type, n, target, budget,
                                                            scheduler):
    from comfyui_memorykit.memorykit import offload
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions, plan_offload
    m = loaded(key)
    opts = GroupOffloadOptions(offload_type=offload_type, num_blocks_per_group=n, offload_to=target,
                               scheduler=scheduler)
    lists = m.block_lists()
    budget_bytes = None
    if budget == "partial":  # the remainder, the buffers and about half of the blocks
        full = plan_offload(m.dm, opts, None, lists)
        budget_bytes = full.footprint_bytes + full.streamed_bytes // 2
    h = offload.apply_group_offload(m.dm, "cpu", "cpu", options=opts, budget_bytes=budget_bytes,
                                    block_lists=lists, disk_folder=tmp_path, disk_tag=key)
    try:
        plan = h.plan
        assert plan.streamed_blocks, "nothing streamed: the case tests nothing"
        if budget == "partial":
            assert plan.resident_blocks and plan.footprint_bytes <= budget_bytes
        forwards = 1 if key == "flux" else 2
        for _ in range(forwards):
            assert torch.equal(m.forward(), m.reference)
        fig = offload.offload_figures(h)
        assert fig["forwards"] == forwards and fig["groups"] > 0
        assert fig["scheduler"] == ("memorykit" if target == "disk" or scheduler == "memorykit" else "diffusers")
        if fig["scheduler"] == "memorykit":  # the ring really copied: every streamed byte at least once
            assert fig["copied_bytes"] >= plan.streamed_bytes > 0
        assert fig["pinned_host_bytes"] == 0 and fig["h2d_bytes_per_forward"] == 0  # onload = offload = cpu
        if target == "disk":
            assert fig["disk_bytes"] >= plan.streamed_bytes and os.listdir(tmp_path) == [os.path.basename(h.disk_dir)]
            assert os.listdir(h.disk_dir) == [".memorykit-owner.json"]  # the weights' file has no name
            assert fig["disk_read_bytes_per_forward"] == plan.streamed_bytes
        else:
            assert fig["disk_bytes"] == 0 and os.listdir(tmp_path) == []
    finally:
        offload.remove_group_offload(h)
    assert os.listdir(tmp_path) == []
    m.assert_restored()
    if key != "flux":
        assert torch.equal(m.forward(), m.reference)


def test_budget_that_fits_everything_streams_nothing(loaded, tmp_path):
    from comfyui_memorykit.memorykit import offload
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    m = loaded("wan")
    h = offload.apply_group_offload(m.dm, "cpu", options=GroupOffloadOptions(offload_to="disk"),
                                    budget_bytes=1 << 40, disk_folder=tmp_path)
    try:
        assert h.plan.streamed_blocks == [] and h.plan.streamed_bytes == 0 and h.plan.buffer_bytes == 0
        assert torch.equal(m.forward(), m.reference)
        fig = offload.offload_figures(h)
        assert fig["groups"] == 0 and fig["forwards"] == 1 and fig["disk_bytes"] == 0
        assert os.listdir(tmp_path) == []
    finally:
        offload.remove_group_offload(h)
    m.assert_restored()


def test_block_level_refuses_blocks_that_bypass_their_forward(loaded, tmp_path):
    """ComfyUI's UNet runs the layers of its TimestepEmbedSequential containers without calling
    the container's forward: with diffusers' own block rule those blocks would run on offloaded
    (here: placeholder) weights. The first forward detects it and raises a clear error."""
    from comfyui_memorykit.memorykit import offload
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    m = loaded("sd15")
    h = offload.apply_group_offload(m.dm, "cpu", "cpu", options=GroupOffloadOptions(offload_to="disk"),
                                    disk_folder=tmp_path)  # default (diffusers) block lists
    try:
        with pytest.raises(RuntimeError, match="leaf_level"):
            m.forward()
    finally:
        offload.remove_group_offload(h)
    m.assert_restored()
    assert torch.equal(m.forward(), m.reference)


def test_apply_twice_refused_and_remove_idempotent(loaded, tmp_path):
    from comfyui_memorykit.memorykit import offload
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    m = loaded("wan")
    opts = GroupOffloadOptions(offload_to="disk")
    h = offload.apply_group_offload(m.dm, "cpu", options=opts, disk_folder=tmp_path)
    try:
        with pytest.raises(ValueError, match="already"):
            offload.apply_group_offload(m.dm, "cpu", options=opts, disk_folder=tmp_path)
    finally:
        offload.remove_group_offload(h)
        offload.remove_group_offload(h)
    m.assert_restored()


def test_invalid_options_are_refused_with_the_option_named(loaded, tmp_path):
    from comfyui_memorykit.memorykit import offload
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    m = loaded("wan")
    for opts, word in [(GroupOffloadOptions(record_stream=True), "record_stream"),
                       (GroupOffloadOptions(use_stream=True), "use_stream"),
                       (GroupOffloadOptions(offload_type="layer"), "offload_type"),
                       (GroupOffloadOptions(num_blocks_per_group=0), "num_blocks_per_group"),
                       (GroupOffloadOptions(offload_to="disk"), "disk_folder")]:
        with pytest.raises(ValueError, match=word):
            offload.apply_group_offload(m.dm, "cpu", options=opts)
    m.assert_restored()


def test_disk_folder_checks_name_the_problem(comfy, tmp_path):
    from comfyui_memorykit.memorykit.offload import check_disk_folder
    with pytest.raises(RuntimeError, match="does not exist"):
        check_disk_folder(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(RuntimeError, match="not a folder"):
        check_disk_folder(tmp_path / "file")
    with pytest.raises(RuntimeError, match=r"GiB free.*need"):
        check_disk_folder(tmp_path, need_bytes=1 << 60)
    assert check_disk_folder(tmp_path, need_bytes=1 << 20) == str(tmp_path)
    assert os.listdir(tmp_path) == ["file"]  # the writability probe left nothing behind


def test_spread_order_places_resident_blocks_evenly(comfy):
    from comfyui_memorykit.memorykit.offload_plan import spread_order
    for n in range(1, 40):
        order = spread_order(n)
        assert sorted(order) == list(range(n)) and order[0] == 0
    assert spread_order(8)[:4] == [0, 4, 2, 6]
