"""Save Sharded's ``overwrite`` through a real ComfyUI server: it replaces only what an earlier
save wrote (the index and the shards it names), keeps every other file of the folder, and
refuses a folder that holds no such checkpoint, naming what is there (issue 14, item 2)."""
from __future__ import annotations

import json
import shutil
import uuid

import pytest


def _save(name: str, size: str, overwrite: bool) -> dict:
    return {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "mk_sd15_tiny.safetensors"}},
            "20": {"class_type": "MemoryKitSaveSharded", "inputs": {"model": ["1", 0], "name": name,
                                                                   "max_shard_size": size, "overwrite": overwrite}}}


def _tree(folder) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def user_folder(server):
    name = f"mk_user_model_{uuid.uuid4().hex[:8]}"
    yield name
    root = server.base / "models" / "diffusion_models"
    shutil.rmtree(root / name, ignore_errors=True)
    for left in root.glob(f".{name}.*"):
        shutil.rmtree(left, ignore_errors=True)


def test_overwrite_keeps_the_users_other_files(server, user_folder):
    root = server.base / "models" / "diffusion_models"
    folder = root / user_folder
    res = server.run(_save(user_folder, "40MB", False))
    assert res.status == "success", res.error
    old_shards = set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(old_shards) >= 3
    (folder / "README.txt").write_text("my notes")
    (folder / "other").mkdir()
    (folder / "other" / "data.bin").write_bytes(b"\x00" * 10)
    shutil.copytree(folder, folder / "variant_b", ignore=shutil.ignore_patterns("README.txt", "other", "variant_b"))
    ours = ("model", ".memorykit-save.json")  # what the save wrote (its marker lists the rest)
    keep = {k: v for k, v in _tree(folder).items() if not k.startswith(ours)}
    assert "variant_b/model.safetensors.index.json" in keep

    res = server.run(_save(user_folder, "1GB", True))
    assert res.status == "success", res.error
    after = _tree(folder)
    assert {k: v for k, v in after.items() if not k.startswith(ours)} == keep  # nothing else touched
    assert sorted(k for k in after if k.startswith("model")) == ["model-00001-of-00001.safetensors",
                                                                 "model.safetensors.index.json"]
    assert not list(root.glob(f".{user_folder}.*")), "temporary folders left behind"


def test_overwrite_refuses_a_folder_that_is_not_a_save(server, user_folder):
    folder = server.base / "models" / "diffusion_models" / user_folder
    folder.mkdir()
    (folder / "README.txt").write_text("my notes")
    (folder / "weights.safetensors").write_bytes(b"not ours")
    before = _tree(folder)
    res = server.run(_save(user_folder, "40MB", True))
    assert res.status == "error"
    msg = res.error["exception_message"]
    assert "README.txt" in msg and "weights.safetensors" in msg and "not a sharded checkpoint" in msg, msg
    assert _tree(folder) == before
