"""The CPU peak-memory meter behind the Tiled VAE budget (``memorykit/peak_memory.py``).

It relies on PyTorch keeping one Python object per storage (a weak reference to it lives as
long as the storage): these tests fail if that changes."""
from __future__ import annotations

import gc

import pytest
import torch


# torch storages only: no ComfyUI code runs (checked once, on the newest core)
pytestmark = pytest.mark.core_independent


@pytest.fixture(scope="module")
def pm(comfy):
    from comfyui_memorykit.memorykit import peak_memory
    return peak_memory


def test_live_bytes_count_each_new_storage_once_until_it_is_freed(pm):
    old = torch.randn(64, 64)
    with pm.LiveTensorBytes("cpu") as meter:
        a = torch.empty(1000, dtype=torch.float32)
        assert meter.live == meter.peak == 4000
        view = a[10:]
        del a
        gc.collect()
        assert meter.live == 4000, "a view keeps its storage alive"
        del view
        assert meter.live == 0 and meter.peak == 4000
        t = old.t()  # a view of a tensor from before the mode: no new memory
        assert meter.live == 0
        prod = old @ old
        assert meter.live == 64 * 64 * 4
        meter.reset_peak()
        del prod, t
        assert meter.live == 0 and meter.peak == 64 * 64 * 4


def test_peak_bytes_of_a_call_counts_its_intermediates(pm):
    x = torch.randn(1, 8, 32, 32)

    def two_steps():
        y = x * 2          # 32 KiB
        z = y + 1          # 32 KiB, y still alive
        del y
        return z.sum()

    with torch.inference_mode():
        assert pm.peak_bytes(two_steps, "cpu") == 2 * 8 * 32 * 32 * 4
