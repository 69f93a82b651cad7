"""Core's switches and helpers the pack follows: ``--disable-pinned-memory`` (the event ring then
copies from pageable memory, the badge says so, diffusers' pinning stream path is refused), the
ring's page-locked bytes counted where core counts its own, and core's out-of-memory test.
No model: the decisions, read where the pack makes them. Page-locking itself needs a GPU."""
from __future__ import annotations

import dataclasses

import pytest
import torch


def test_disable_pinned_memory_is_followed(ci, monkeypatch):
    from comfy.cli_args import args

    from comfyui_memorykit.memorykit import badge
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    monkeypatch.setattr(args, "disable_pinned_memory", False)
    assert ci.compat.pinned_memory_disabled() is False
    monkeypatch.setattr(args, "disable_pinned_memory", True)
    assert ci.compat.pinned_memory_disabled() is True
    opts = GroupOffloadOptions(use_stream=True, page_lock=False)
    opts.validate()  # the event ring streams from pageable memory
    with pytest.raises(ValueError, match="pinned memory is disabled.*scheduler memorykit"):
        dataclasses.replace(opts, scheduler="diffusers").validate()
    info = {"plan": {"resident_bytes": 1 << 20, "streamed_bytes": 1 << 20}, "notes": [ci.compat.PAGEABLE_NOTE]}
    assert "pageable copies" in badge.badge_figures({"group_offload": info})


def test_pinned_bytes_counted_where_core_counts(ci):
    import comfy.model_management as mm
    if not isinstance(getattr(mm, "TOTAL_PINNED_MEMORY", None), int):
        pytest.skip("this ComfyUI keeps no count of pinned memory")
    before = mm.TOTAL_PINNED_MEMORY
    ci.compat.count_pinned(3 << 20)
    assert mm.TOTAL_PINNED_MEMORY == before + (3 << 20)
    ci.compat.count_pinned(-(3 << 20))
    assert mm.TOTAL_PINNED_MEMORY == before


def test_is_oom_follows_core(ci):
    assert ci.compat.is_oom(torch.OutOfMemoryError("CUDA out of memory"))
    assert not ci.compat.is_oom(RuntimeError("shape mismatch"))
