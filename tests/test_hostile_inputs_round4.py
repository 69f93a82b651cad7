"""Hostile inputs, round 4, in-process (round 1-3: ``test_hostile_inputs.py``; server cases:
``test_hostile_inputs_server.py``). Each test names what a user did and what went wrong before.

- A folder field (Group Offload's ``disk_folder``, Balanced Device Map's ``offload_folder``, the
  text-encoder offload's) holding NUL or an unpaired surrogate (JSON ``\\u0000`` / ``\\ud800``),
  a path longer than the file system allows, a file on its way or a symlink loop said
  "does not exist: create it or choose another folder" (it cannot be created): now each says
  what is wrong, naming the field, and a 5000-character path is not printed whole.
- Text Encoder Device on a CLIP loaded by city96's CLIPLoaderGGUF (its ``GGUFModelPatcher``)
  raised ``TypeError: ModelPatcher.load() got multiple values for argument
  'force_patch_weights'`` at the first encode (the device patcher passed core's arguments by
  position to a ``load(*args, force_patch_weights=..., **kwargs)``).
"""
from __future__ import annotations

import os

import pytest
import torch

from harness import gguf_pack, paths

paths.technique_package()
from memorykit_tech import offload  # noqa: E402


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


@pytest.mark.skipif(gguf_pack.available() is not None and not os.environ.get("REQUIRE_COMFYUI_033"),
                    reason=f"GGUF models cannot be tested here: {gguf_pack.available()}")
def test_round4_text_encoder_device_on_a_clip_from_the_gguf_loader(comfy):
    """A tiny CLIP-L built as ``CLIPLoaderGGUF.load_patcher`` builds one (city96's GGMLOps
    layers loaded from a state dict, then ``GGUFModelPatcher.clone`` of core's patcher), then Text Encoder Device (cpu):
    the conditioning is the plain GGUF CLIP's bit for bit, and the input CLIP keeps its patcher
    class and weights."""
    import comfy.model_management as mm

    from comfyui_memorykit.memorykit.comfy_integration import text_encoder as te
    from harness import te_zoo
    gnodes = gguf_pack.load_in_process()
    if te_zoo.available("clip_l"):
        pytest.skip(te_zoo.available("clip_l"))
    weights = te_zoo.build("clip_l").cond_stage_model.state_dict()
    clip = te_zoo.build("clip_l", model_options={"custom_operations": gnodes.GGMLOps})
    clip.load_sd(weights, full_model=True)  # GGMLOps layers take their weights from a state dict
    clip.patcher = gnodes.GGUFModelPatcher.clone(clip.patcher)
    cls = type(clip.patcher)

    def encode(c):
        out = te_zoo.encode(c)["cond"]
        mm.unload_all_models()
        return out

    try:
        reference = encode(clip)
        snapshot = {k: v.clone() for k, v in clip.cond_stage_model.state_dict().items()}
        placed, info = te.text_encoder_device(clip, "cpu")
        assert info["device"] == "cpu"
        assert torch.equal(encode(placed), reference)
        assert type(clip.patcher) is cls
        now = clip.cond_stage_model.state_dict()
        assert all(torch.equal(now[k], v) for k, v in snapshot.items())
        assert torch.equal(encode(clip), reference)
    finally:
        mm.unload_all_models()
