"""Disk offload (Group Offload, Balanced Device Map) never leaves the plain model depending on the
pack's files (issue 23 items 4, 5, 8; issue 24's disk part), in-process with a real ComfyUI.

The offloaded weights live in a file without a name (``memorykit/offload_store.py``), streamed
by the event ring (Group Offload) or handed to accelerate as views of its mapping (device map):
removing the offload folder changes nothing, the shared module holds the real values between
forwards (what a save reads), and removal restores them. NextDiT (Z-Image, Lumina 2) and Cosmos
Predict2 read their ``q_norm``/``k_norm`` weights without calling the norms (ComfyUI 0.33):
leaf_level to disk was NaN there with diffusers' hooks; the ring keeps such weights resident.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors import safe_open

from harness import zoo

NORM_READERS = ["z_image", "lumina2", "cosmos_predict2"]


def _go_settings(ci, folder, offload_type="leaf_level"):
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    return ci.GroupOffloadSettings(GroupOffloadOptions(offload_type=offload_type, offload_to="disk"),
                                   disk_folder=str(folder))


@pytest.mark.parametrize("name", NORM_READERS)
def test_leaf_level_to_disk_equals_plain_on_models_that_read_norm_weights(ci, tmp_path, name):
    import comfy.model_management as mm
    why = zoo.available(name)
    if why:
        pytest.skip(why)
    plain = zoo.build(name)
    args = zoo.inputs(name, plain.model)
    ref = zoo.forward(plain, name, args)
    n, _ = ci.prepare_group_offload(plain, _go_settings(ci, tmp_path))
    mm.load_models_gpu([n])
    try:
        out = zoo.forward(n, name, args)
        diff = (out - ref).abs().max().item()
        print(f"{name} leaf_level disk: max abs diff vs plain {diff}")
        assert torch.equal(out, ref), f"{name}: max abs difference {diff} (NaN: {out.isnan().any().item()})"
    finally:
        mm.unload_all_models()
    assert torch.equal(zoo.forward(plain, name, args), ref)
    assert os.listdir(tmp_path) == []


def test_group_offload_disk_weights_do_not_depend_on_the_folder(ci, loaded, tmp_path):
    """The folder is deleted while the offload is applied (a ComfyUI start wiping its temp
    folder, a user emptying it): the offloaded forward, the weights a save reads, the restore
    and the plain model afterwards are all the real ones (was: FileNotFoundError, then NaN)."""
    from comfyui_memorykit.memorykit import offload
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    m = loaded("wan")
    h = offload.apply_group_offload(m.dm, "cpu", "cpu", options=GroupOffloadOptions(offload_to="disk"),
                                    block_lists=m.block_lists(), disk_folder=tmp_path, disk_tag="wan")
    try:
        assert torch.equal(m.forward(), m.reference)
        shutil.rmtree(h.disk_dir)
        assert os.listdir(tmp_path) == []
        with safe_open(str(m.path), framework="pt") as f:  # what a save of the placed model reads
            for k, v in m.dm.state_dict().items():
                assert torch.equal(v, f.get_tensor(k)), k
        assert torch.equal(m.forward(), m.reference)
    finally:
        offload.remove_group_offload(h)
    m.assert_restored()
    assert torch.equal(m.forward(), m.reference)


def test_device_map_disk_weights_do_not_depend_on_the_folder(comfy, loaded, tmp_path):
    """Balanced Device Map's disk entries: no ``.dat`` file to remove or truncate; deleting the
    offload folder while mapped leaves the forward and the restore exact."""
    from comfyui_memorykit.memorykit import device_dispatch
    m = loaded("wan")
    before = {k: v.clone() for k, v in m.dm.state_dict().items()}
    handle = device_dispatch.dispatch_device_map(m.dm, {"": "disk"}, str(tmp_path))
    try:
        shutil.rmtree(handle.offload_dir)
        assert torch.equal(m.forward(), m.reference)
    finally:
        handle.remove()
    assert all(torch.equal(v, before[k]) for k, v in m.dm.state_dict().items())
    assert os.listdir(tmp_path) == []
    assert torch.equal(m.forward(), m.reference)


def test_default_disk_folder_is_not_comfyui_temp_folder(ci):
    """ComfyUI empties its temp folder at every start (a second server beside a running one
    deleted the first one's offload files): the default lives in the pack's state directory."""
    import folder_paths
    path = ci.offload_patcher.usable_disk_folder("")  # the default, created where a disk is used
    assert os.path.isdir(path) and path == ci.offload_patcher.default_disk_folder()
    temp = os.path.abspath(folder_paths.get_temp_directory())
    assert not os.path.abspath(path).startswith(temp + os.sep) and os.path.abspath(path) != temp
    assert os.path.abspath(path).startswith(os.path.abspath(folder_paths.get_user_directory()) + os.sep)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _restore_growth(remove, before: int) -> int:
    """How far the RSS rose above ``before`` while ``remove()`` ran (sampled in a thread)."""
    import threading
    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
    t = threading.Thread(target=watch)
    t.start()
    try:
        remove()
    finally:
        done.set()
        t.join()
    return max(peak[0], _rss_bytes()) - before


@pytest.mark.core_independent
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the RSS from /proc (Linux)")
@pytest.mark.parametrize("placement", ["group_offload", "device_map"])
def test_removing_a_disk_placement_holds_the_weights_once(comfy, tmp_path, placement):
    """Removing a disk placement (Group Offload to disk, Balanced Device Map with disk) reads the
    weights back into RAM: the RSS stays at the model's size as loaded, not twice it (the pages of
    the file mapping read for the copies are dropped as they are copied: counted too, they made a
    2 GiB model's removal peak 2 GiB above plain)."""
    from comfyui_memorykit.memorykit import device_dispatch, offload
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Linear(1024, 1024, bias=False) for _ in range(48))  # 4 MiB each
    model = torch.nn.Module()
    model.blocks = blocks
    size = sum(p.numel() * p.element_size() for p in blocks.parameters())  # 192 MiB
    ref = [p.detach().clone() for p in blocks.parameters()]
    before = _rss_bytes()  # the model in RAM, as loaded
    if placement == "group_offload":
        h = offload.apply_group_offload(model, "cpu", "cpu", options=GroupOffloadOptions(offload_to="disk"),
                                        block_lists=[("blocks", list(blocks.named_children()))],
                                        disk_folder=tmp_path, disk_tag="rss")
        remove = lambda: offload.remove_group_offload(h)  # noqa: E731
    else:
        h = device_dispatch.dispatch_device_map(model, {f"blocks.{i}": "disk" for i in range(48)}, str(tmp_path),
                                                main_device="cpu")
        remove = h.remove
    x = torch.randn(2, 1024)
    with torch.no_grad():
        for b in blocks:
            x = b(x)  # every weight read through the mapping once, as in sampling
    grown = _restore_growth(remove, before)
    print(f"{placement} from disk, removal: RSS peak {grown / 2**20:.0f} MiB above the model as loaded, for {size / 2**20:.0f} MiB of weights")
    assert all(torch.equal(p, r) for p, r in zip(blocks.parameters(), ref))
    assert grown < 0.5 * size, f"RSS rose {grown / 2**20:.0f} MiB above the model as loaded, restoring {size / 2**20:.0f} MiB"
    assert os.listdir(tmp_path) == []


def _rss_file_bytes() -> int:
    """The file-backed part of the RSS (pages of mapped files: the disk store's mapping among them)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile:"))


@pytest.mark.core_independent
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the RSS from /proc (Linux)")
@pytest.mark.parametrize("placement", ["group_offload", "device_map"])
def test_sampling_from_a_disk_placement_maps_one_block_at_a_time(comfy, tmp_path, placement):
    """While a model placed on disk runs, the pages read from the disk file are let go after each
    block: the RSS holds about one block of the file, not every weight read so far (counted in
    the RSS, the whole model would be back after one step, and the placement would save nothing)."""
    from comfyui_memorykit.memorykit import device_dispatch, offload
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Linear(1024, 1024, bias=False) for _ in range(48))  # 4 MiB each
    model = torch.nn.Module()
    model.blocks = blocks
    size = sum(p.numel() * p.element_size() for p in blocks.parameters())  # 192 MiB
    x0 = torch.randn(2, 1024)
    with torch.no_grad():
        ref = x0
        for b in blocks:
            ref = b(ref)
    if placement == "group_offload":
        h = offload.apply_group_offload(model, "cpu", "cpu", options=GroupOffloadOptions(offload_to="disk"),
                                        block_lists=[("blocks", list(blocks.named_children()))],
                                        disk_folder=tmp_path, disk_tag="rss")
        remove = lambda: offload.remove_group_offload(h)
    else:
        h = device_dispatch.dispatch_device_map(model, {f"blocks.{i}": "disk" for i in range(48)}, str(tmp_path),
                                                main_device="cpu")
        remove = h.remove
    try:
        before, peak = _rss_file_bytes(), 0
        with torch.no_grad():
            for _ in range(2):  # two steps
                x = x0
                for b in blocks:
                    x = b(x)
                    peak = max(peak, _rss_file_bytes())
        grown = peak - before
        print(f"{placement} from disk, sampling: file pages mapped grew {grown / 2**20:.0f} MiB for {size / 2**20:.0f} MiB of weights")
        assert torch.equal(x, ref)
        assert grown < 0.25 * size, f"{grown / 2**20:.0f} MiB of the disk file stayed mapped ({size / 2**20:.0f} MiB of weights)"
    finally:
        remove()
    assert os.listdir(tmp_path) == []
