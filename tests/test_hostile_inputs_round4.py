"""Hostile inputs, round 4, in-process (round 1-3: ``test_hostile_inputs.py``; server cases:
``test_hostile_inputs_server.py``). Each test names what a user did and what went wrong before.

- A folder field (Group Offload's ``disk_folder``, Balanced Device Map's ``offload_folder``, the
  text-encoder offload's) holding NUL or an unpaired surrogate (JSON ``\\u0000`` / ``\\ud800``),
  a path longer than the file system allows or a file on its way said "does not exist: create
  it or choose another folder" (it cannot be created), a symlink loop "is a symlink to ...,
  which does not exist" (it does): now each says
  what is wrong, naming the field, and a 5000-character path is not printed whole.
(Text Encoder Device on a CLIP from city96's CLIPLoaderGGUF raised ``TypeError: ModelPatcher.load()
got multiple values for argument 'force_patch_weights'``: fixed with the same test landing at the
same time, ``test_text_encoders.py::test_format_device_is_exact``.)
"""
from __future__ import annotations

import os
import shutil

import pytest

from harness import paths
from harness.tmpfs import small_tmpfs

paths.technique_package()
from memorykit_tech import offload  # noqa: E402

INDEX = "model.safetensors.index.json"


@pytest.mark.core_independent
@pytest.mark.parametrize("case,needle", [
    ("nul", r"character 4 \('\\x00'\) cannot be part of a path: remove it"),
    ("surrogate", r"character 2 \('\\ud800'\) cannot be part of a path: remove it"),
    ("too_long", r"\.\.\. \(5\d\d\d characters\) is longer than the file system allows .*choose a shorter path"),
    ("file_on_the_way", r"has a file, not a folder, on its way: fix the path"),
    ("symlink_loop", r"goes through a loop of symlinks: fix the links"),
])
def test_round4_a_folder_that_cannot_exist_says_why(tmp_path, case, needle):
    (tmp_path / "afile").write_text("user data")
    os.symlink(tmp_path / "loop_b", tmp_path / "loop_a")
    os.symlink(tmp_path / "loop_a", tmp_path / "loop_b")
    folder = {"nul": "off\x00load", "surrogate": "a\ud800b", "too_long": str(tmp_path / ("d" * 5000)),
              "file_on_the_way": str(tmp_path / "afile" / "offload"), "symlink_loop": str(tmp_path / "loop_a")}[case]
    with pytest.raises(RuntimeError, match=r"^disk_folder .*" + needle) as err:
        offload.check_disk_folder(folder, what="disk_folder")
    msg = str(err.value)
    assert "create it" not in msg and len(msg) < 400, msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "loop_a", "loop_b"]
    assert (tmp_path / "afile").read_text() == "user data"


def test_round4_folder_fields_of_the_nodes_name_themselves(comfy, tmp_path):
    """The same check behind each node's field (one model, no forward: refused before planning)."""
    import comfy.sd

    from comfyui_memorykit.memorykit import comfy_integration as ci
    from comfyui_memorykit.nodes import group_offload as gon
    from harness import models
    plain = comfy.sd.load_diffusion_model(str(models.ensure_models()["wan"]))
    bad = str(tmp_path) + "/\x00"
    with pytest.raises(RuntimeError, match=r"^offload_folder .*cannot be part of a path"):
        ci.device_map_model(plain, "balanced", "cpu=3MiB, disk", bad)
    settings = gon._settings("1", offload_type="block_level", num_blocks_per_group=1, vram_budget_gb=0.0,
                             use_stream=False, record_stream=False, low_cpu_mem_usage=False, offload_to="disk",
                             disk_folder=bad)
    with pytest.raises(RuntimeError, match=r"^disk_folder .*cannot be part of a path"):
        ci.prepare_group_offload(plain, settings)
    assert os.listdir(tmp_path) == []


@pytest.mark.core_independent
def test_round4_overwrite_through_a_symlink_to_another_disk(tmp_path):
    """A saved checkpoint moved to another disk and linked back under its name (a models folder
    spread over drives), saved again with overwrite: it said ``[Errno 18] Invalid cross-device
    link`` (the old files were moved aside into a folder beside the link, on the first disk).
    Now the new checkpoint replaces the old one where the link points, the link stays, and
    nothing is left on either disk."""
    import torch

    from memorykit_tech import sharded, sharded_save
    models = tmp_path / "models"
    models.mkdir()
    with small_tmpfs(tmp_path / "big_drive", "70m") as drive:
        sharded_save.save_sharded({"w": torch.ones(64, 64), "b": torch.zeros(8)}, models / "mk", max_shard_size="8KB")
        shutil.move(models / "mk", drive / "mk")  # copy2: sizes and times as the save's marker lists them
        (models / "mk").symlink_to(drive / "mk")
        new = {"w": torch.full((64, 64), 2.0), "b": torch.ones(8)}
        sharded_save.save_sharded(new, models / "mk", max_shard_size="8KB", overwrite=True)
        assert (models / "mk").is_symlink() and sorted(p.name for p in models.iterdir()) == ["mk"]
        assert sorted(p.name for p in drive.iterdir()) == ["mk"]
        got = sharded.load_state_dict(models / "mk" / INDEX)[0]
        assert got.keys() == new.keys() and all(torch.equal(got[k], v) for k, v in new.items())
