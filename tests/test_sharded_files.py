"""Sharded checkpoints, technique layer (no ComfyUI): index validation, every bad-input and
security case with its error, memory-mapped loading, and Save Sharded's writer.

Small checkpoints are written into tmp_path with huggingface_hub / safetensors directly (not
with the code under test), then damaged.
"""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from harness import paths

pytestmark = pytest.mark.core_independent  # runs on the ComfyUI 0.33 suite only

paths.technique_package()
from memorykit_tech import memory, sharded, sharded_save  # noqa: E402

Err = sharded.ShardedCheckpointError
INDEX = "model.safetensors.index.json"


def _state_dict(n: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"blocks.{i}.weight": torch.randn(64, 64, generator=g) for i in range(n)} | {"bias": torch.randn(7, generator=g)}


def _checkpoint(folder: Path, n: int = 6) -> Path:
    """3+ shards + index written by huggingface_hub (16 KB tensors, 40 KB shards)."""
    from huggingface_hub import save_torch_state_dict
    folder.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(_state_dict(n), str(folder), max_shard_size="40KB")
    assert len(set(json.loads((folder / INDEX).read_text())["weight_map"].values())) >= 3
    return folder


def _index(folder: Path) -> dict:
    return json.loads((folder / INDEX).read_text())


def _write_index(folder: Path, data: dict) -> None:
    (folder / INDEX).write_text(json.dumps(data, indent=2))


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return _checkpoint(tmp_path / "model")


def _raises(path, *needles: str) -> str:
    with pytest.raises(Err) as ei:
        sharded.load_state_dict(path)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, msg
    return msg


# -- the good case -----------------------------------------------------------------------------

def test_valid_checkpoint_loads_exactly_and_memory_mapped(ckpt):
    idx = sharded.read_index(ckpt)
    assert len(idx.shards) >= 3 and idx.total_size == idx.nbytes == sum(t.nbytes for t in _state_dict().values())
    calls = []
    sd, meta = sharded.load_state_dict(idx, progress=lambda d, t: calls.append((d, t)))
    ref = _state_dict()
    assert sd.keys() == ref.keys() and all(torch.equal(sd[k], ref[k]) for k in ref)
    assert calls == [(i + 1, len(idx.shards)) for i in range(len(idx.shards))]
    assert meta == {}  # huggingface_hub writes only {"format": "pt"}, which is not passed on
    assert sharded.find_index(ckpt / INDEX) == ckpt / INDEX  # the index file itself works too


def test_loading_adds_no_anonymous_memory(tmp_path):
    """Tensors are views of the mmapped shards: RssAnon grows by far less than their 64 MB."""
    from huggingface_hub import save_torch_state_dict
    folder = tmp_path / "big"
    folder.mkdir()
    save_torch_state_dict({f"w{i}": torch.ones(4096, 1024) for i in range(4)}, str(folder), max_shard_size="20MB")
    before = memory.host_memory().rss_anon_bytes
    sd, _ = sharded.load_state_dict(folder)
    assert float(sum(t.sum() for t in sd.values())) == 4 * 4096 * 1024  # every page touched
    assert memory.host_memory().rss_anon_bytes - before < 16 * 2**20


def test_listing_folders_and_index_files(tmp_path):
    _checkpoint(tmp_path / "a")
    _checkpoint(tmp_path / "sub" / "b")
    two = _checkpoint(tmp_path / "two")
    (two / "model.fp16.safetensors.index.json").write_text((two / INDEX).read_text())
    (tmp_path / "single.safetensors").write_bytes(b"")
    assert sharded.list_sharded(tmp_path) == ["a", "sub/b", "two/model.fp16.safetensors.index.json", f"two/{INDEX}"]
    assert sharded.list_sharded(tmp_path / "missing") == []
    (tmp_path / "sub" / "loop").symlink_to(tmp_path, target_is_directory=True)  # a cycle ends the walk
    (tmp_path / ".a.partial-1234").mkdir()                                     # unfinished saves are hidden
    _checkpoint(tmp_path / ".a.partial-1234" / "x")
    assert sharded.list_sharded(tmp_path) == ["a", "sub/b", "two/model.fp16.safetensors.index.json", f"two/{INDEX}"]


# -- bad input: each case its own test, a clear error naming the file/key, nothing returned --

def test_missing_shard(ckpt):
    victim = sorted(set(_index(ckpt)["weight_map"].values()))[1]
    (ckpt / victim).unlink()
    _raises(ckpt, "missing", victim)


def test_tensor_in_index_absent_from_its_shard(ckpt):
    data = _index(ckpt)
    data["weight_map"]["blocks.99.weight"] = next(iter(data["weight_map"].values()))
    _write_index(ckpt, data)
    _raises(ckpt, "blocks.99.weight", "does not hold it")


def test_same_tensor_in_two_shards(ckpt):
    wm = _index(ckpt)["weight_map"]
    first, other = sorted(set(wm.values()))[:2]
    key = next(k for k, f in wm.items() if f == first)
    keys_other = [k for k, f in wm.items() if f == other]
    from safetensors.torch import load_file
    tensors = load_file(str(ckpt / other))
    tensors[key] = torch.zeros(64, 64)
    save_file(tensors, str(ckpt / other))
    assert set(keys_other) < set(tensors)
    _raises(ckpt, key, "two shards", first, other)


def test_shard_with_tensor_not_in_index(ckpt):
    data = _index(ckpt)
    dropped = "blocks.2.weight"
    shard = data["weight_map"].pop(dropped)
    _write_index(ckpt, data)
    _raises(ckpt, dropped, shard, "does not")


def test_total_size_disagrees(ckpt):
    data = _index(ckpt)
    data["metadata"]["total_size"] += 4
    _write_index(ckpt, data)
    _raises(ckpt, "total_size", str(data["metadata"]["total_size"]))


@pytest.mark.parametrize("damage", ["truncated_header", "truncated_data", "garbage_header", "header_too_large"])
def test_corrupted_shard(ckpt, damage):
    victim = ckpt / sorted(set(_index(ckpt)["weight_map"].values()))[-1]
    raw = victim.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    raw = {"truncated_header": raw[: 8 + n // 2],
           "truncated_data": raw[:-100],
           "garbage_header": raw[:8] + b"\x00not json" + raw[17:],
           "header_too_large": (2**40).to_bytes(8, "little") + raw[8:]}[damage]
    victim.write_bytes(raw)
    _raises(ckpt, victim.name, "not a valid safetensors file")


def test_corrupted_last_shard_loads_nothing(ckpt):
    """Validation covers every shard before the first tensor is read (no half-loaded model)."""
    victim = ckpt / sorted(set(_index(ckpt)["weight_map"].values()))[-1]
    victim.write_bytes(victim.read_bytes()[:-1])
    calls = []
    with pytest.raises(Err, match=victim.name):
        sharded.load_state_dict(ckpt, progress=lambda d, t: calls.append(d))
    assert calls == []


def test_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    _raises(tmp_path / "empty", "empty", "empty")


def test_folder_without_index(tmp_path):
    folder = tmp_path / "noindex"
    folder.mkdir()
    save_file({"a": torch.ones(2)}, str(folder / "weights.safetensors"))
    _raises(folder, "no '*.safetensors.index.json'", "weights.safetensors")


def test_unsharded_hugging_face_folder_is_one_shard(tmp_path):
    """A Hugging Face repository's text_encoder/ as downloaded (model.safetensors, no index; its
    fp16 variant beside it) is listed as a folder and loads as one shard, the same tensors."""
    sd = _state_dict()
    folder = tmp_path / "sd15" / "text_encoder"
    folder.mkdir(parents=True)
    save_file(sd, str(folder / "model.safetensors"))
    save_file({k: v.half() for k, v in sd.items()}, str(folder / "model.fp16.safetensors"))
    assert sharded.list_sharded(tmp_path) == ["sd15/text_encoder"]
    index = sharded.read_index(folder)
    assert [s.name for s in index.shards] == ["model.safetensors"] and set(index.weight_map) == set(sd)
    assert index.nbytes == sum(t.numel() * t.element_size() for t in sd.values())
    got, _ = sharded.load_state_dict(index)
    assert set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd)


def test_two_indexes_in_one_folder(ckpt):
    (ckpt / "model.fp16.safetensors.index.json").write_text((ckpt / INDEX).read_text())
    _raises(ckpt, "2 indexes", INDEX, "model.fp16.safetensors.index.json", "choose one index file")


def test_invalid_index_json(ckpt):
    (ckpt / INDEX).write_text('{"weight_map": {"a": ')
    _raises(ckpt, INDEX, "not a valid JSON index")


def test_index_listing_a_tensor_twice(ckpt):
    text = (ckpt / INDEX).read_text()
    first_entry = text.split('"weight_map": {')[1].split("\n")[1]
    (ckpt / INDEX).write_text(text.replace(first_entry, first_entry + "\n" + first_entry))
    _raises(ckpt, "listed twice", "blocks.0.weight")


def test_index_without_weight_map(ckpt):
    _write_index(ckpt, {"metadata": {"total_size": 1}})
    _raises(ckpt, "no 'weight_map'")


# -- security ------------------------------------------------------------------------------------

def _retarget(folder: Path, new_name: str) -> str:
    """Point every tensor of the first shard at ``new_name``; returns the old shard name."""
    data = _index(folder)
    old = sorted(set(data["weight_map"].values()))[0]
    data["weight_map"] = {k: (new_name if f == old else f) for k, f in data["weight_map"].items()}
    _write_index(folder, data)
    return old


def test_shard_name_with_dotdot_is_refused(ckpt, tmp_path):
    old = _retarget(ckpt, "../outside.safetensors")
    os.replace(ckpt / old, tmp_path / "outside.safetensors")  # a valid shard exists there
    _raises(ckpt, "'../outside.safetensors'", "outside the folder", "refused")


def test_absolute_shard_name_is_refused(ckpt, tmp_path):
    old = sorted(set(_index(ckpt)["weight_map"].values()))[0]
    target = tmp_path / "abs.safetensors"
    os.replace(ckpt / old, target)
    _retarget(ckpt, str(target))
    _raises(ckpt, str(target), "outside the folder", "refused")


def test_symlink_out_of_the_folder_is_refused(ckpt, tmp_path):
    old = sorted(set(_index(ckpt)["weight_map"].values()))[0]
    target = tmp_path / "elsewhere.safetensors"
    os.replace(ckpt / old, target)
    (ckpt / old).symlink_to(target)
    _raises(ckpt, old, "symlink", str(target), "refused")


def test_symlink_inside_the_folder_is_allowed(ckpt):
    old = sorted(set(_index(ckpt)["weight_map"].values()))[0]
    os.replace(ckpt / old, ckpt / "real.safetensors")
    (ckpt / old).symlink_to(ckpt / "real.safetensors")
    sd, _ = sharded.load_state_dict(ckpt)
    assert set(sd) == set(_state_dict())


class _Trap:
    """Unpickling this creates a marker file: proof that a pickle was (not) loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".ckpt"])
def test_pickle_shard_is_never_unpickled(ckpt, tmp_path, suffix):
    marker = tmp_path / "unpickled"
    name = f"pytorch_model-00001-of-00003{suffix}"
    (ckpt / name).write_bytes(pickle.dumps(_Trap(marker)))
    _retarget(ckpt, name)
    _raises(ckpt, name, "pickle", "never unpickled")
    assert not marker.exists()


def test_pickle_only_folder_is_refused(tmp_path):
    folder = tmp_path / "pickles"
    folder.mkdir()
    marker = tmp_path / "unpickled"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_Trap(marker)))
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"a": "pytorch_model.bin"}}))
    _raises(folder, "pickle", "pytorch_model.bin", "never unpickled")
    _raises(folder / "pytorch_model.bin.index.json", "pickle", "never unpickled")
    assert not marker.exists()


def test_non_safetensors_shard_is_refused(ckpt):
    (ckpt / "weights.npz").write_bytes(b"PK")
    _retarget(ckpt, "weights.npz")
    _raises(ckpt, "weights.npz", "not a .safetensors file")


# -- Save Sharded's writer ---------------------------------------------------------------------

@pytest.mark.parametrize("text", ["5GB", "5gb", " 1.5GB ", "800MB", "10KB", "2TB", "0.5MB"])
def test_parse_size_matches_huggingface_hub(text):
    from huggingface_hub.serialization._base import parse_size_to_int
    assert sharded_save.parse_size(text) == parse_size_to_int(text)


@pytest.mark.parametrize("text", ["5GiB", "5", "GB", "-1GB", "0MB", "lots"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="max_shard_size"):
        sharded_save.parse_size(text)


def test_save_writes_huggingface_layout_and_round_trips(tmp_path):
    sd = _state_dict(8)
    sd["tied"] = sd["blocks.0.weight"]           # shares memory: saved as a copy, not dropped
    sd["view"] = sd["blocks.1.weight"][:, :8]    # non-contiguous view
    calls = []
    info = sharded_save.save_sharded(sd, tmp_path / "out", max_shard_size="40KB", metadata={"note": "x"},
                                     progress=lambda d, t: calls.append((d, t)))
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    n = info["shards"]
    shards = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert n >= 3 and files == sorted([INDEX, ".memorykit-save.json"] + shards)
    marker = json.loads((tmp_path / "out" / ".memorykit-save.json").read_text())
    assert marker["files"] == sorted([INDEX] + shards)  # what a later overwrite may replace
    assert calls == [(i, n) for i in range(1, n + 1)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left
    index = _index(tmp_path / "out")
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in sd.values()) and index["metadata"]["note"] == "x"
    loaded, meta = sharded.load_state_dict(tmp_path / "out")
    assert loaded.keys() == sd.keys() and all(torch.equal(loaded[k], sd[k]) for k in sd)
    assert meta == {"note": "x"}


def test_save_aligns_tensors_so_loaded_weights_compute_as_in_memory(tmp_path):
    """Loaded tensors are views of the mapped shard; safetensors.torch.save_file would put
    ``b.weight`` right after the 12-byte ``a.bias`` (4-byte aligned), and the CPU's batch-1
    Linear on a weight that is not 16-byte aligned differs from the in-memory one by about 1e-8
    (how an FP8 model saved by Save Sharded reloaded 2.4e-8 off the live one). Save Sharded's
    shards start every tensor whose size allows it 64-byte aligned: the reload is bit-exact."""
    g = torch.Generator().manual_seed(3)
    sd = {"a.bias": torch.randn(3, generator=g), "a.weight_scale": torch.tensor(0.5),
          "b.weight": torch.randn(128, 256, generator=g), "c.weight": torch.randn(256, 128, generator=g).half(),
          "d.weight": torch.randn(128, 64, generator=g).to(torch.float8_e4m3fn)}
    sharded_save.save_sharded(sd, tmp_path / "out", max_shard_size="1GB", metadata={"note": "x"})
    loaded, meta = sharded.load_state_dict(tmp_path / "out")
    assert meta == {"note": "x"} and loaded.keys() == sd.keys()
    for k, t in sd.items():
        assert loaded[k].dtype == t.dtype and torch.equal(loaded[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k
        if t.nbytes % 64 == 0:
            assert loaded[k].data_ptr() % 64 == 0, (k, loaded[k].data_ptr() % 64)
    x = torch.randn(1, 256, generator=g)
    assert torch.equal(torch.nn.functional.linear(x, loaded["b.weight"]), torch.nn.functional.linear(x, sd["b.weight"]))


def test_save_matches_huggingface_hub_plan(tmp_path):
    """Same shard plan and index as huggingface_hub.save_torch_state_dict for the same input."""
    from huggingface_hub import save_torch_state_dict
    sd = _state_dict(8)
    (tmp_path / "hf").mkdir()
    save_torch_state_dict(sd, str(tmp_path / "hf"), max_shard_size="40KB")
    sharded_save.save_sharded(sd, tmp_path / "ours", max_shard_size="40KB")
    assert _index(tmp_path / "ours") == _index(tmp_path / "hf")


def test_save_refuses_to_overwrite_and_replaces_when_asked(tmp_path):
    dest = tmp_path / "out"
    sharded_save.save_sharded(_state_dict(8), dest, max_shard_size="40KB")
    before = {p.name: p.stat().st_mtime_ns for p in dest.iterdir()}
    with pytest.raises(FileExistsError, match="already exists"):
        sharded_save.save_sharded({"x": torch.ones(1)}, dest)
    assert {p.name: p.stat().st_mtime_ns for p in dest.iterdir()} == before
    info = sharded_save.save_sharded({"x": torch.ones(3)}, dest, overwrite=True)
    assert info["files"] == ["model-00001-of-00001.safetensors"]  # one shard: still indexed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert torch.equal(sharded.load_state_dict(dest)[0]["x"], torch.ones(3))


def test_failed_save_leaves_nothing(tmp_path):
    def boom(done, total):
        if done == 2:
            raise KeyboardInterrupt("interrupted")   # as an interrupt between shards
    with pytest.raises(KeyboardInterrupt):
        sharded_save.save_sharded(_state_dict(8), tmp_path / "out", max_shard_size="40KB", progress=boom)
    assert list(tmp_path.iterdir()) == []


def test_save_rejects_non_tensors(tmp_path):
    with pytest.raises(ValueError, match="'meta' is a dict"):
        sharded_save.save_sharded({"a": torch.ones(1), "meta": {}}, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
