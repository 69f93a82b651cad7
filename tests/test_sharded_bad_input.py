"""Hostile input to the sharded nodes through a real ComfyUI server gets a clear error that names
the field and says what to fix, never a bare Python exception (issue 14, item 12), and leaves
no file behind."""
from __future__ import annotations

import json
import shutil

import pytest
import torch


def _load_prompt(name: str) -> dict:
    return {"1": {"class_type": "MemoryKitShardedCheckpointLoader", "inputs": {"model_name": name,
                                                                              "weight_dtype": "default"}},
            "2": {"class_type": "MemoryKitMemoryReport", "inputs": {"value": ["1", 0], "label": "", "reset_peak": False}}}


def _error(res) -> str:
    assert res.status == "error", f"expected an error, got {res.status}"
    return res.error["exception_message"]


@pytest.fixture
def bad_checkpoint(server):
    """``make(name, edit)``: a small 3-shard checkpoint under the server's models/unet whose
    index text is replaced by ``edit(index_dict)`` (a str)."""
    from huggingface_hub import save_torch_state_dict
    root = server.base / "models" / "unet"
    made = []

    def make(name: str, edit) -> str:
        folder = root / name
        folder.mkdir(parents=True)
        made.append(folder)
        save_torch_state_dict({f"w{i}": torch.ones(40, 40) for i in range(3)}, str(folder), max_shard_size="10KB")
        index = folder / "model.safetensors.index.json"
        index.write_text(edit(json.loads(index.read_text())))
        return name

    yield make
    for f in made:
        shutil.rmtree(f, ignore_errors=True)


def _list_value(d):
    d["weight_map"]["w1"] = [d["weight_map"]["w1"]]
    return json.dumps(d)


def _infinite_total(d):
    return json.dumps(d).replace(str(d["metadata"]["total_size"]), "Infinity")


@pytest.mark.parametrize("name,edit,needles", [
    ("mk_bad_list_value", _list_value, ["weight_map['w1']", "JSON list", "file name"]),
    ("mk_bad_deep", lambda d: "[" * 100_000 + "]" * 100_000, ["nested too deeply", "weight_map"]),
    ("mk_bad_total_inf", _infinite_total, ["metadata.total_size", "Infinity", "set it to"]),
])
def test_bad_index_is_a_clear_error(server, bad_checkpoint, name, edit, needles):
    msg = _error(server.run(_load_prompt(bad_checkpoint(name, edit))))
    for n in needles:
        assert n in msg, msg
    for raw in ("unhashable", "RecursionError", "OverflowError", "cannot convert float"):
        assert raw not in msg, msg


def _save(name: str, size: str = "40MB") -> dict:
    return {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "mk_sd15_tiny.safetensors"}},
            "20": {"class_type": "MemoryKitSaveSharded", "inputs": {"model": ["1", 0], "name": name,
                                                                   "max_shard_size": size, "overwrite": False}}}


@pytest.mark.parametrize("name,size,needles", [
    ("mk_test_huge", "1e400GB", ["max_shard_size '1e400GB'", "e.g. '5GB'"]),
    ("mk_test\x00nul", "40MB", ["name", "control character", "remove it"]),
    (".mk_test_hidden", "40MB", ["starts with '.'", "never list", "remove the leading '.'"]),
    ("sub/.hidden", "40MB", ["starts with '.'"]),
    ("x" * 256, "40MB", ["256 bytes", "shorten it"]),
])
def test_bad_save_input_is_a_clear_error(server, name, size, needles):
    root = server.base / "models" / "diffusion_models"
    before = sorted(p.name for p in root.iterdir())
    try:
        msg = _error(server.run(_save(name, size)))
        for n in needles:
            assert n in msg, msg
        assert sorted(p.name for p in root.iterdir()) == before
    finally:  # the shared models folder: remove whatever a failing run created
        for p in root.iterdir():
            if p.name not in before:
                shutil.rmtree(p, ignore_errors=True)


def test_longest_legal_save_name_saves(server):
    """A 250-character name is legal: the hidden temporary folder must not exceed the file
    system's name limit either (it was '.<name>.partial-xxxxxxxx', 268 bytes)."""
    name = "m" * 250
    root = server.base / "models" / "diffusion_models"
    try:
        res = server.run(_save(name, "1GB"))
        assert res.status == "success", res.error
        assert (root / name / "model.safetensors.index.json").is_file()
        assert not [p for p in root.iterdir() if p.name.startswith(".")], "temporary folder left behind"
    finally:
        shutil.rmtree(root / name, ignore_errors=True)
