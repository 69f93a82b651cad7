"""Hugging Face cache snapshots (``models--org--name/snapshots/<rev>/``, every file a symlink into
``../../blobs/``) load with Sharded Checkpoint Loader; links that leave the repository's own
``blobs/`` are still refused (issue 14, item 13)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness import paths

paths.technique_package()
from memorykit_tech import sharded  # noqa: E402


def hf_cache_repo(cache: Path, repo: str, source: Path, rev: str = "0123abcd") -> Path:
    """Lay ``source``'s files out as huggingface_hub's cache does: blobs named by hash,
    snapshot entries relative symlinks ``../../blobs/<hash>``. Returns the snapshot folder."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / rev
    (root / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(rev)
    for f in sorted(source.iterdir()):
        blob = root / "blobs" / hashlib.sha256(f.name.encode()).hexdigest()
        try:
            os.link(f, blob)
        except OSError:
            shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    return snap


@pytest.fixture
def small(tmp_path) -> Path:
    from huggingface_hub import save_torch_state_dict
    src = tmp_path / "src"
    src.mkdir()
    save_torch_state_dict({f"w{i}": torch.full((40, 40), float(i)) for i in range(3)}, str(src), max_shard_size="10KB")
    return src


def test_cache_snapshot_loads(tmp_path, small):
    snap = hf_cache_repo(tmp_path / "hub", "org/name", small)
    assert sharded.list_sharded(tmp_path / "hub") == ["models--org--name/snapshots/0123abcd"]
    sd, _ = sharded.load_state_dict(snap)
    assert sorted(sd) == ["w0", "w1", "w2"] and float(sd["w2"][0, 0]) == 2.0


def test_cache_snapshot_link_to_another_repository_is_refused(tmp_path, small):
    snap = hf_cache_repo(tmp_path / "hub", "org/name", small)
    other = hf_cache_repo(tmp_path / "hub", "org/other", small)
    shard = sorted(json.loads((snap / "model.safetensors.index.json").read_text())["weight_map"].values())[0]
    (snap / shard).unlink()
    (snap / shard).symlink_to(os.path.relpath(os.path.realpath(other / shard), snap))
    with pytest.raises(sharded.ShardedCheckpointError, match="outside the folder"):
        sharded.load_state_dict(snap)


@pytest.mark.parametrize("where", ["outside", "blobs_of_non_cache"])
def test_other_escapes_stay_refused(tmp_path, small, where):
    snap = hf_cache_repo(tmp_path / "hub", "org/name", small)
    shard = sorted(json.loads((snap / "model.safetensors.index.json").read_text())["weight_map"].values())[0]
    if where == "outside":
        target = tmp_path / "elsewhere.safetensors"
    else:  # a folder merely named blobs next to a folder that is not a cache repository
        (tmp_path / "plain" / "blobs").mkdir(parents=True)
        target = tmp_path / "plain" / "blobs" / "x"
    shutil.copyfile(os.path.realpath(snap / shard), target)
    (snap / shard).unlink()
    (snap / shard).symlink_to(target)
    with pytest.raises(sharded.ShardedCheckpointError, match="outside the folder"):
        sharded.load_state_dict(snap)


def test_cache_snapshot_through_the_server(server, fixture_models):
    """The SD1.5 UNet's shards as a cache repository under models/unet: listed and loaded, the
    same model as the plain sharded folder (equal sampled latents)."""
    hub = server.base / "models" / "unet" / "hub"
    hf_cache_repo(hub, "mk/sd15-tiny", Path(fixture_models["sd15_unet_sharded"]))
    choice = "hub/models--mk--sd15-tiny/snapshots/0123abcd"

    def prompt(name, prefix):
        return {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "mk_sd15_tiny.safetensors"}},
                "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a lighthouse", "clip": ["1", 1]}},
                "5": {"class_type": "MemoryKitShardedCheckpointLoader", "inputs": {"model_name": name,
                                                                                  "weight_dtype": "default"}},
                "10": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
                "11": {"class_type": "KSampler", "inputs": {"model": ["5", 0], "seed": 3, "steps": 1, "cfg": 1.0,
                                                           "sampler_name": "euler", "scheduler": "normal",
                                                           "positive": ["2", 0], "negative": ["2", 0],
                                                           "latent_image": ["10", 0], "denoise": 1.0}},
                "12": {"class_type": "MemoryKitTestSaveTensor", "inputs": {"value": ["11", 0], "filename_prefix": prefix}}}

    def latent(res):
        assert res.status == "success", res.error
        f = res.outputs["12"]["tensors"][0]
        return load_file(str(server.base / "output" / f["filename"]))["value"]

    try:
        assert choice in server.object_info()["MemoryKitShardedCheckpointLoader"]["input"]["required"][
            "model_name"][1]["options"]
        out = latent(server.run(prompt(choice, "hf_cache")))
        ref = latent(server.run(prompt(Path(fixture_models["sd15_unet_sharded"]).name, "hf_plain")))
        assert torch.equal(out, ref)
    finally:
        server.free()
        shutil.rmtree(hub, ignore_errors=True)
