"""The plain model never depends on the pack's disk files, and saving a placed model saves the
real weights (issue 23 items 4, 5, 7, 8, 11), through a real ComfyUI server (Wan fixture, CPU).

Group Offload (disk) and Balanced Device Map (disk) keep the offloaded weights in a file that has
no name (``memorykit/offload_store.py``): deleting the offload folder while the model is loaded
changes nothing. Before: the offloaded rerun failed (FileNotFoundError), then the plain model
"succeeded" with NaN; Save Sharded wrote uninitialised placeholders (Group Offload) or failed
(``Cannot copy out of meta tensor``, device map); Group Offload → Balanced Device Map broke the
plain model of the same loader (``Tensor on device meta``).
"""
from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from test_group_offload_server import go, latents, wan_prompt

WAN_DISK_DM = {"strategy": "sequential", "max_memory": "cpu=4MiB, disk", "custom_device_map": ""}


def _seeded(p: dict, seed: int) -> dict:
    for k, node in p.items():
        if k.startswith("ks_"):
            node["inputs"]["seed"] = seed
    return p


def _dm(model_ref, folder) -> dict:
    return {"class_type": "MemoryKitBalancedDeviceMap",
            "inputs": {**WAN_DISK_DM, "offload_folder": str(folder), "model": model_ref}}


def _ok(res) -> None:
    assert res.status == "success", res.error and res.error.get("exception_message")


def _pack_dirs(folder: Path, prefix: str) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.startswith(prefix)) if folder.is_dir() else []


@pytest.fixture(scope="module")
def plain8(server, fixture_models):
    """Plain Wan latents with seed 8 (the reruns after the folder is gone use it)."""
    return latents(server, server.run(_seeded(wan_prompt({"plain": ["1", 0]}), 8)))["plain"]


@pytest.fixture()
def saved(server):
    names = []
    yield names
    for name in names:
        shutil.rmtree(server.base / "models" / "diffusion_models" / name, ignore_errors=True)


def _assert_saved_equals_file(server, name: str, fixture_models) -> None:
    folder = server.base / "models" / "diffusion_models" / name
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    with safe_open(str(fixture_models["wan"]), framework="pt") as ref:
        want = {k: ref.get_tensor(k) for k in ref.keys()}
    got = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / shard), framework="pt") as f:
            got.update({k: f.get_tensor(k) for k in f.keys()})
    prefix = "model.diffusion_model."
    got = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in got.items()}
    assert set(want) <= set(got)
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{len(bad)} of {len(want)} saved tensors differ from the model file, e.g. {bad[:3]}"


def test_offload_folder_deleted_while_loaded_then_offloaded_and_plain_runs_are_right(server, plain8):
    """Items 5 and 8: the default disk folder (under ComfyUI's user directory, not its temp
    folder) is emptied while the offloaded model is loaded; both reruns are right."""
    res = server.run(wan_prompt({"plain": ["1", 0], "offload": go(["1", 0], "")}))
    got = latents(server, res)
    assert torch.equal(got["offload"], got["plain"])
    parent = Path(res.outputs["m_offload"]["memorykit_report"][0]["group_offload"]["disk_folder"])
    dirs = _pack_dirs(parent, "memorykit-offload-")
    assert dirs
    for d in dirs:
        shutil.rmtree(d)
    again = server.run(_seeded(wan_prompt({"offload": go(["1", 0], "")}), 8))
    assert torch.equal(latents(server, again)["offload"], plain8)
    plain = latents(server, server.run(_seeded(wan_prompt({"plain": ["1", 0]}), 8)))["plain"]
    assert torch.isfinite(plain).all() and torch.equal(plain, plain8)
    assert parent.resolve().is_relative_to((server.base / "user").resolve()), parent


def test_device_map_disk_folder_deleted_while_loaded_then_runs_are_right(server, plain8, tmp_path):
    """Item 8: Balanced Device Map (disk) had ``.dat`` files a user could delete or truncate."""
    p = wan_prompt({"dm": _dm(["1", 0], tmp_path)})
    assert torch.isfinite(latents(server, server.run(p))["dm"]).all()
    dirs = _pack_dirs(tmp_path, "memorykit-devicemap-")
    assert dirs
    for d in dirs:
        shutil.rmtree(d)
    again = server.run(_seeded(wan_prompt({"dm": _dm(["1", 0], tmp_path)}), 8))
    assert torch.equal(latents(server, again)["dm"], plain8)
    plain = latents(server, server.run(_seeded(wan_prompt({"plain": ["1", 0]}), 8)))["plain"]
    assert torch.equal(plain, plain8)
    server.free(unload_models=True, wait=True)


def test_save_sharded_of_placed_models_saves_the_real_weights(server, saved, fixture_models, tmp_path):
    """Items 4 and 11: Save Sharded of a Group Offload (disk) MODEL in the sampler's workflow and
    after an earlier prompt loaded it, and of a Balanced Device Map (disk) MODEL after sampling."""
    tag = uuid.uuid4().hex[:8]
    saved += [f"mk_test_go_same_{tag}", f"mk_test_go_after_{tag}", f"mk_test_dm_after_{tag}"]

    def save(model_ref, name):
        return {"class_type": "MemoryKitSaveSharded",
                "inputs": {"model": model_ref, "name": name, "max_shard_size": "2MB", "overwrite": False}}

    p = wan_prompt({"offload": go(["1", 0], tmp_path)}, extra={"sv": save(["m_offload", 0], saved[0])})
    res = server.run(p)
    _ok(res)
    _assert_saved_equals_file(server, saved[0], fixture_models)
    q = wan_prompt({"offload": go(["1", 0], tmp_path)}, extra={"sv": save(["m_offload", 0], saved[1])})
    del q["save_offload"], q["ks_offload"]  # the same (cached) Group Offload MODEL, loaded by the last prompt
    res = server.run(q)
    _ok(res)
    _assert_saved_equals_file(server, saved[1], fixture_models)
    r = wan_prompt({"dm": _dm(["1", 0], tmp_path)})
    _ok(server.run(r))
    r2 = wan_prompt({"dm": _dm(["1", 0], tmp_path)}, extra={"sv": save(["m_dm", 0], saved[2])})
    del r2["save_dm"], r2["ks_dm"]
    res = server.run(r2)
    _ok(res)
    _assert_saved_equals_file(server, saved[2], fixture_models)
    server.free(unload_models=True, wait=True)


def test_group_offload_then_device_map_is_refused_and_the_loader_still_works(server, plain8, tmp_path):
    """Item 7: Group Offload (disk) → Balanced Device Map in one chain is a clear error; then the
    plain model and a device map of the same loader are right (were: ``Tensor on device meta``)."""
    p = wan_prompt({"both": _dm(["gox", 0], tmp_path)}, extra={"gox": go(["1", 0], tmp_path)})
    res = server.run(p)
    assert res.status == "error"
    assert res.error["node_type"] == "MemoryKitBalancedDeviceMap"
    assert "Group Offload" in res.error["exception_message"]
    plain = latents(server, server.run(_seeded(wan_prompt({"plain": ["1", 0]}), 8)))["plain"]
    assert torch.equal(plain, plain8)
    dm = latents(server, server.run(_seeded(wan_prompt({"dm": _dm(["1", 0], tmp_path)}), 8)))["dm"]
    assert torch.equal(dm, plain8)
    server.free(unload_models=True, wait=True)
