"""Hostile inputs and faults, in-process (issue 23, "Nothing lost, round 2"): each test names the
item it covers. Technique-level cases use the pack's ``memorykit`` package imported by file
(``memorykit_tech``); node-level ones the real ComfyUI in this process. The server cases
(hangs, output nodes, NaN through JSON) are in ``test_hostile_inputs_server.py``."""
from __future__ import annotations

import json
import math
import os
import subprocess

import pytest
import torch

from harness import paths
from harness.tmpfs import small_tmpfs

paths.technique_package()
from memorykit_tech import leftovers, sharded, sharded_save, validation  # noqa: E402

INDEX = "model.safetensors.index.json"


def _tree(folder) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _hf_checkpoint(folder, n: int = 3) -> dict:
    """A sharded checkpoint written by huggingface_hub itself (not by the pack)."""
    from huggingface_hub import save_torch_state_dict
    sd = {f"w{i}": torch.full((40, 40), float(i)) for i in range(n)}
    folder.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(sd, str(folder), max_shard_size="10KB")
    return sd


# -- item 1: a pattern with exponential backtracking is matched in linear time ------------------

def test_item1_catastrophic_pattern_is_matched_in_linear_time():
    """``(\\w+\\.?)+Z`` took exponential time per module name in ``re`` with the GIL held (the
    server stopped answering). The skip-pattern matcher is an automaton: the same result as
    ``re.search`` on short names, and a long name costs no more than a few milliseconds."""
    import re
    pat = validation.compile_pattern(r"(\w+\.?)+Z")
    for name in ("a.Z", "output_blocks.1.0", "x" * 5 + "Z"):
        assert pat.search(name) == bool(re.search(r"(\w+\.?)+Z", name))
    # re.search needs ~2^40 steps on this 200-character name (it never returned); the automaton
    # takes one step per character.
    assert pat.search("output_blocks.2.1.transformer_blocks.0.attn1.to_q" * 4) is False
    for bad, why in ((r"(a)\1", "backreferences"), (r"(?=a)b", "lookahead"), (r"\bproj", "word boundaries")):
        with pytest.raises(ValueError, match=f"extra_skip_patterns: pattern .* uses {why}"):
            validation.compile_pattern(bad)



def test_probe_automaton_agrees_with_re_search_on_random_names():
    """The skip-pattern automaton answers as ``re.search`` for every supported element
    (classes with ranges and negation, categories, anchors, bounded repeats, empty branches,
    non-greedy quantifiers, named characters) on random short names. ``$`` matches at the end
    and before a final newline in ``re`` (``\\Z`` only at the end): ``a$`` on ``'a\\n'`` was
    False in the automaton before."""
    import random
    import re
    rng = random.Random(0)
    alphabet = "ab._019Z \n-\u00e9\u0663"
    pats = [r"^a$", r"a$", r"a\Z", r"\Aa", r"^$", r"$", r"[a-c]", r"[^a-c0-9]", r"[^\d]", r"[\w.]", r"[^\W_]", r"\d+",
            r"\D\w\.\d", r"\s\S+", r"a{2,5}", r"a{0,300}b", r"(a|)b$", r"a*?b", r"a+?$", r"\N{LATIN SMALL LETTER E WITH ACUTE}",
            r"^.*$", r"a.b", r"[]a]", r"[^]a]", r"(a*)*$", r"(a$|b)", r"a\n?$", r"a$\n", r"[0-9]{1,3}$", r"\n\Z"]
    for p in pats:
        pat = validation.compile_pattern(p)
        for _ in range(300):
            name = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
            assert pat.search(name) == bool(re.search(p, name)), (p, name)


# -- round 3, item 1: a text field that becomes work is bounded; the module loop can be stopped --

def test_round3_item1_patterns_are_bounded_deduplicated_and_interruptible(fp8):
    """One pattern on 80 000 lines (1.1 MB) held the worker for 250 s; 10 000 distinct patterns
    48 s. The field is bounded in characters and distinct patterns, duplicates are kept once, and
    the loop over modules runs the caller's interrupt check before each module."""
    import time
    t0 = time.process_time()  # this process's CPU time: other work on the machine does not count
    with pytest.raises(ValueError, match=r"^extra_skip_patterns is 1,120,000 characters long; at most 65,536"):
        fp8.parse_patterns("blocks\\.0\\.zz\n" * 80_000)
    assert time.process_time() - t0 < 1.0  # refused before any pattern is compiled (0.07 s measured)
    assert fp8.parse_patterns("blocks\\.0\\.zz\n" * 4000) == [r"blocks\.0\.zz"]  # 56 000 characters: one pattern
    with pytest.raises(ValueError, match=r"^extra_skip_patterns holds 201 distinct patterns; at most 200"):
        fp8.parse_patterns("\n".join(f"blocks\\.{i}\\.zz" for i in range(201)))
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(50)])
    seen = []

    def check():
        seen.append(1)
        if len(seen) == 10:
            raise InterruptedError("cancelled")

    with pytest.raises(InterruptedError):
        fp8.plan_layers(model, fp8.parse_patterns(r"blocks\.0\.zz"), check=check)
    assert len(seen) == 10


def test_round3_item1_other_text_fields_are_bounded():
    from memorykit_tech import device_map, report
    for call, needle in ((lambda: device_map.parse_max_memory("cpu=1GiB," * 1000), r"^max_memory is 9,000 characters"),
                         (lambda: device_map.parse_custom_device_map("{" + " " * 2**20 + "}"), r"^custom_device_map is"),
                         (lambda: sharded_save.parse_size("1" * 10**6 + "GB"), r"^max_shard_size is 1,000,002"),
                         (lambda: report.build_report("x" * 10**6, []), r"^label is 1,000,000 characters")):
        with pytest.raises(ValueError, match=needle):
            call()


# -- item 6: a comma inside a regex does not split it ------------------------------------------

def test_item6_comma_inside_a_quantifier_is_not_a_separator(fp8):
    assert fp8.parse_patterns(r"blocks\.{0,1}0\.") == [r"blocks\.{0,1}0\."]
    assert fp8.parse_patterns(r"a\.b, [,;]x, (p|q){1,2}r" + "\n# note\nlast\\,one") == \
        [r"a\.b", "[,;]x", "(p|q){1,2}r", r"last\,one"]
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([torch.nn.ModuleDict({"proj": torch.nn.Linear(4, 4)}) for _ in range(2)])
    plan = fp8.plan_layers(model, fp8.parse_patterns(r"blocks\.{0,1}0\."))
    assert plan.kept == {"blocks.0.proj": r"blocks\.{0,1}0\."} and plan.cast == ["blocks.1.proj"]


# -- item 3: overwrite never replaces a checkpoint the pack did not write ----------------------

def test_item3_overwrite_refuses_a_huggingface_checkpoint(tmp_path):
    folder = tmp_path / "hf_model"
    _hf_checkpoint(folder)
    names = sorted(p.name for p in folder.iterdir())
    assert INDEX in names and "model-00001-of-00003.safetensors" in names  # exactly a save's file names
    before = _tree(folder)
    with pytest.raises(FileExistsError, match=r"not a sharded checkpoint written by Save Sharded.*marker"):
        sharded_save.save_sharded({"x": torch.ones(3)}, folder, overwrite=True)
    assert _tree(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_model"]  # no temporary folder left


def test_item3_an_earlier_save_is_recognised_by_its_marker(tmp_path):
    folder = tmp_path / "ours"
    sharded_save.save_sharded({"x": torch.ones(3)}, folder)
    marker = json.loads((folder / ".memorykit-save.json").read_text())
    assert marker["files"] == sorted(["model-00001-of-00001.safetensors", INDEX])
    (folder / "notes.txt").write_text("mine")
    sharded_save.save_sharded({"y": torch.ones(2)}, folder, overwrite=True)
    assert torch.equal(sharded.load_state_dict(folder)[0]["y"], torch.ones(2))
    assert (folder / "notes.txt").read_text() == "mine"
    # Without its marker (as a save of an earlier pack version) the folder is refused, with the way out.
    (folder / ".memorykit-save.json").unlink()
    before = _tree(folder)
    with pytest.raises(FileExistsError, match="delete or move it yourself"):
        sharded_save.save_sharded({"z": torch.ones(1)}, folder, overwrite=True)
    assert _tree(folder) == before


def test_round3_item2_user_files_under_the_saved_names_are_not_replaced(tmp_path):
    """Round 3, item 2: the user empties a saved folder with ``rm F/*`` (the hidden marker stays)
    and puts another checkpoint there under the same names; overwrite refused it by name only
    and replaced the user's shards and index. The marker records each file's size and mtime."""
    folder = tmp_path / "F"
    sharded_save.save_sharded({"x": torch.ones(3)}, folder)
    for p in folder.iterdir():
        if p.name != ".memorykit-save.json":
            p.unlink()
    _hf_checkpoint(folder, n=2)  # model-0000{1,2}-of-00002.safetensors + model.safetensors.index.json
    (folder / "model-00001-of-00001.safetensors").write_bytes(b"the user's own file")  # a name the marker lists
    before = _tree(folder)
    with pytest.raises(FileExistsError, match=r"model-00001-of-00001.safetensors.* not the files? Save Sharded wrote"):
        sharded_save.save_sharded({"y": torch.ones(2)}, folder, overwrite=True)
    assert _tree(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["F"]
    # the same size, another time (rewritten in place) is refused too; the pack's own files still overwrite
    sharded_save.save_sharded({"x": torch.ones(3)}, tmp_path / "G")
    shard = tmp_path / "G" / "model-00001-of-00001.safetensors"
    sharded_save.save_sharded({"y": torch.ones(2)}, tmp_path / "G", overwrite=True)
    data = shard.read_bytes()
    shard.write_bytes(data)
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    with pytest.raises(FileExistsError, match="size or modification time differs"):
        sharded_save.save_sharded({"z": torch.ones(1)}, tmp_path / "G", overwrite=True)
    assert shard.read_bytes() == data


# -- item 9: a corrupted leftovers list is recovered, not an error -----------------------------

def test_item9_non_utf8_leftovers_list_is_recovered(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    good = {"path": str(tmp_path / "gone"), "pid": 1, "boot_id": "another-boot"}
    (state / leftovers.LIST_NAME).write_bytes(b"\xff\xfe\x80 not utf-8 \xc3\x28\n" + json.dumps(good).encode() + b"\n")
    leftovers.configure(state)
    try:
        path = leftovers.make_folder("memorykit-offload-T-", tmp_path)  # raised UnicodeDecodeError
        text = (state / leftovers.LIST_NAME).read_text(encoding="utf-8")  # rewritten as valid UTF-8
        assert path in text and "not utf-8" not in text
        leftovers.remove_folder(path)
        assert leftovers.remove_stale() == []  # the good entry's folder does not exist: dropped, nothing deleted
    finally:
        leftovers.configure(None)


# -- item 10: bad shard names and a dangling index are clear errors ----------------------------

@pytest.mark.parametrize("bad_name,needle", [
    ("model-00001\x00-of-00003.safetensors", "control character"),
    ("m" * 300 + "-00001.safetensors", "bytes long"),
])
def test_item10_bad_shard_name_is_a_clear_error(tmp_path, bad_name, needle):
    folder = tmp_path / "ckpt"
    _hf_checkpoint(folder)
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"]["w1"] = bad_name
    (folder / INDEX).write_text(json.dumps(index))
    with pytest.raises(sharded.ShardedCheckpointError, match=needle) as e:
        sharded.read_index(folder)
    assert "fix the index" in str(e.value)


def test_item10_dangling_index_symlink_is_a_clear_error(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / INDEX).symlink_to(tmp_path / "elsewhere" / INDEX)
    assert sharded.list_sharded(tmp_path) == ["ckpt"]
    with pytest.raises(sharded.ShardedCheckpointError, match="is a symlink to .*which does not exist"):
        sharded.read_index(folder)


def test_item2_fifo_and_device_index_are_refused_before_reading(tmp_path):
    """(The server case, a FIFO blocking the worker for ever, is in the server tests.)"""
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / INDEX)
    zero = tmp_path / "zero"
    zero.mkdir()
    (zero / INDEX).symlink_to("/dev/zero")
    big = tmp_path / "big"
    big.mkdir()
    with open(big / INDEX, "wb") as f:
        f.truncate(sharded.MAX_INDEX_BYTES + 1)  # sparse: no disk used
    for folder, needle in ((fifo, "a FIFO"), (zero, "a character device"), (big, "MiB is read")):
        with pytest.raises(sharded.ShardedCheckpointError, match=needle):
            sharded.read_index(folder)


# -- item 11: Save Sharded's destination problems are clear errors before any write -------------

def _remount_ro(path) -> None:
    r = subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")


def test_item11_read_only_folder(tmp_path):
    with small_tmpfs(tmp_path / "ro", "4m") as ro:
        _remount_ro(ro)
        with pytest.raises(OSError, match=r"name: .*read-only"):
            sharded_save.save_sharded({"x": torch.ones(3)}, ro / "model")
        assert list(ro.iterdir()) == []


def test_item11_full_disk_is_refused_before_writing(tmp_path):
    with small_tmpfs(tmp_path / "full", "1m") as full:
        sd = {f"w{i}": torch.ones(256, 256) for i in range(4)}  # 1 MiB of tensors on a 1 MiB disk
        with pytest.raises(OSError, match="not enough free space") as e:
            sharded_save.save_sharded(sd, full / "model", max_shard_size="300KB")
        assert e.value.errno == 28  # ENOSPC, raised by the check: nothing was written
        assert list(full.iterdir()) == []


def test_item11_a_file_in_the_way_and_a_path_over_path_max(tmp_path):
    (tmp_path / "afile").write_text("user data")
    with pytest.raises(ValueError, match=r"name: 'afile' in the name is an existing file"):
        sharded_save.save_sharded({"x": torch.ones(3)}, tmp_path / "afile" / "model")
    with pytest.raises(ValueError, match=r"name: .*bytes long; this file system allows paths up to"):
        sharded_save.save_sharded({"x": torch.ones(3)}, tmp_path.joinpath(*["d" * 200] * 25))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


# -- items 12, 13: Tiled VAE's numbers and batch; temporal fields only where they matter --------

TILE_DEFAULTS = {"tile_size": 64, "overlap": 16, "temporal_size": 64, "temporal_overlap": 8, "memory_budget_gb": 0.0,
                 "shared_norm_stats": True, "global_context": True}


@pytest.fixture(scope="module")
def vaes(comfy, fixture_models):
    import comfy.sd
    import comfy.utils
    sd = comfy.utils.load_torch_file(str(fixture_models["sd15"]))
    sd_vae = comfy.sd.VAE(sd={k[len("first_stage_model."):]: v for k, v in sd.items()
                              if k.startswith("first_stage_model.")})
    return {"sd": sd_vae, "wan": comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(fixture_models["wan_vae"])))}


def test_item12_nan_budget_and_empty_batch_are_refused(vaes):
    from comfyui_memorykit.nodes.tiled_vae import TiledVAEDecode, TiledVAEEncode
    z = {"samples": torch.randn(1, 4, 8, 8)}
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="memory_budget_gb is .*not a finite number"):
            TiledVAEDecode.execute(z, vaes["sd"], **dict(TILE_DEFAULTS, memory_budget_gb=bad))
    with pytest.raises(ValueError, match="samples: the LATENT holds no items"):
        TiledVAEDecode.execute({"samples": torch.randn(0, 4, 8, 8)}, vaes["sd"], **TILE_DEFAULTS)
    with pytest.raises(ValueError, match="pixels: the IMAGE holds no items"):
        TiledVAEEncode.execute(torch.rand(0, 64, 64, 3), vaes["sd"], **TILE_DEFAULTS)
    # a 0-sized side: refused by the same rule, naming the field (it said "input of size (0, 8)")
    with pytest.raises(ValueError, match=r"^samples: the LATENT has a dimension of size 0 \(shape \(1, 4, 0, 8\)\)"):
        TiledVAEDecode.execute({"samples": torch.randn(1, 4, 0, 8)}, vaes["sd"], **TILE_DEFAULTS)
    with pytest.raises(ValueError, match=r"^pixels: the IMAGE has a dimension of size 0"):
        TiledVAEEncode.execute(torch.rand(1, 0, 64, 3), vaes["sd"], **TILE_DEFAULTS)


@pytest.mark.parametrize("which,shape", [("sd", (1, 4, 8, 8)), ("wan", (1, 16, 2, 4, 4))])
def test_item13_temporal_fields_are_ignored_where_time_is_not_cut(vaes, which, shape):
    """An image VAE has no time; Wan's VAE runs time causally with its cache: temporal_size 1
    (with the default temporal_overlap 8) does nothing there and is not refused."""
    from comfyui_memorykit.nodes.tiled_vae import TiledVAEDecode
    with torch.inference_mode():
        out = TiledVAEDecode.execute({"samples": torch.randn(shape)}, vaes[which],
                                     **dict(TILE_DEFAULTS, temporal_size=1))
    images = out.args[0]
    assert images.shape[-1] == 3 and torch.isfinite(images).all()


def test_item13_temporal_fields_are_still_checked_where_time_is_cut():
    from memorykit_tech import tiled_vae as tv
    cut = tv.VAEShape(latent_channels=16, spatial_factor=8, time_factor=4, causal_time=True, time_cache=False)
    with pytest.raises(ValueError, match="temporal_overlap"):
        tv.make_plan(cut, "decode", (3, 8, 8), 64, 16, temporal_size=1, temporal_overlap=8)


# -- round 3, item 6: the default offload folder is checked once, only where a disk is used ------

@pytest.fixture
def default_offload_blocked(comfy, tmp_path):
    """``block(kind)``: a file or a dangling symlink where the default offload folder
    (``user/__memorykit/offload``) goes, in a user directory of this test (ComfyUI's own
    ``folder_paths.set_user_directory``; the shared tree's is put back afterwards)."""
    import folder_paths
    from comfyui_memorykit.memorykit.comfy_integration import cleanup
    before = folder_paths.get_user_directory()
    folder_paths.set_user_directory(str(tmp_path / "user"))

    def block(kind: str):
        from pathlib import Path
        path = Path(cleanup.default_disk_folder())
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "file":
            path.write_text("not a folder")
        else:
            path.symlink_to(path.parent / "gone-away")
        return path

    try:
        yield block
    finally:
        folder_paths.set_user_directory(before)


@pytest.mark.parametrize("kind,why", [("file", "is a file, not a folder"), ("symlink", "is a symlink to .*gone-away', which does not exist")])
def test_round3_item6_blocked_default_offload_folder(loaded, default_offload_blocked, kind, why):
    """A file or a dangling symlink at the default offload folder made Group Offload (disk),
    Balanced Device Map (cpu=4MiB, disk; 8 MiB for this model) and every Memory Plan fail with a raw FileExistsError,
    also a "this machine" plan that uses no disk. The folder is checked only where a disk is
    used, and the message names the field and the folder."""
    from comfyui_memorykit.memorykit.comfy_integration import device_map_patcher, memory_plan_io, offload_patcher
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    path = default_offload_blocked(kind)
    model = loaded("sd15").patcher
    settings = offload_patcher.GroupOffloadSettings(options=GroupOffloadOptions(offload_to="disk"))
    with pytest.raises(RuntimeError, match=rf"^disk_folder is empty, so the default offload folder is used, and "
                                           rf"'{path}' {why}: remove or fix it, or give a folder in disk_folder"):
        offload_patcher.prepare_group_offload(model, settings)
    with pytest.raises(RuntimeError, match=rf"^offload_folder is empty, .*'{path}' {why}"):
        device_map_patcher.device_map_model(model, "balanced", "cpu=8MiB, disk")
    # no disk used: no check, no error
    device_map_patcher.device_map_model(model, "balanced", "cpu=64GiB")
    out, _, info = memory_plan_io.memory_plan(model, plan_for="this machine")
    assert info["machine"]["disk_bytes"] == 0 and f"No disk was planned with: disk_folder is empty" in info["reasons"][0]
    assert info["pick"] != "stream from disk"
    assert os.path.lexists(path) and not os.path.isdir(path)  # the user's file or link is left as it was


# -- round 3, item 7: the smallest tile a VAE can decode is the floor of tile_size ---------------

def test_round3_item7_ltxv_tile_below_two_latent_px_is_refused_naming_the_floor(comfy):
    """LTX-Video (32x) with tile_size 32 or 40 px (one latent px) failed with a raw "Padding size
    should be less than the corresponding input dimension" (its decoder pads by reflection); core's
    VAE Decode of the same latent works. Refused now, naming the floor; 64 px decodes."""
    from harness import vae_zoo
    from comfyui_memorykit.nodes.tiled_vae import TiledVAEDecode
    vae = vae_zoo.build("ltxv")
    z = {"samples": torch.randn(1, vae.latent_channels, 2, 3, 3, generator=torch.Generator().manual_seed(0))}
    opts = dict(TILE_DEFAULTS, overlap=0)
    for tile in (32, 40):
        with pytest.raises(ValueError, match=rf"^tile_size \({tile} px\) is below the smallest tile this VAE can "
                                             r"decode: 64 px \(2 latent px at its 32x compression.*give tile_size 64 or more"):
            TiledVAEDecode.execute(z, vae, **dict(opts, tile_size=tile))
    with torch.inference_mode():
        images = TiledVAEDecode.execute(z, vae, **dict(opts, tile_size=64)).args[0]
    assert images.shape[1:3] == (96, 96) and torch.isfinite(images).all()


# -- round 3, item 8: sizes in a unit that fits; the reserve and the node named as the graph has them

def test_round3_item8_sizes_are_printed_in_a_unit_that_fits(tmp_path):
    from memorykit_tech import units
    assert [units.size_text(n) for n in (0, 12, 3 * 2**10, 10.2 * 2**20, 512 * 2**20, 2**30 - 2**19, 26.62 * 2**30)] == \
        ["0 bytes", "12 bytes", "3.00 KiB", "10.2 MiB", "512 MiB", "1024 MiB", "26.62 GiB"]
    with small_tmpfs(tmp_path / "full", "1m") as full:  # Save Sharded, nearly full disk
        with pytest.raises(OSError, match=r"needs 1.00 MiB .*, \d+(\.\d+)? (KiB|MiB) are free") as e:
            sharded_save.save_sharded({"w": torch.ones(512, 512)}, full / "model")
        assert "0.00 GiB" not in str(e.value)


def test_round3_item8_memory_plan_names_the_reserve_and_the_node(loaded, tmp_path):
    """Given VRAM at or below core's 0.8 GiB reserve said "VRAM short by 0.00 GiB"; Balanced
    Device Map after a Memory Plan that streams from disk was refused naming Group Offload, a
    node the graph does not have."""
    from comfyui_memorykit.memorykit import memory_plan as mp
    from comfyui_memorykit.memorykit.comfy_integration import device_map_patcher, memory_plan_io
    model = loaded("sd15").patcher
    for vram in (0.5, 0.8):
        with pytest.raises(mp.PlanError) as e:
            memory_plan_io.memory_plan(model, plan_for="given figures", vram_gb=vram, ram_gb=0.001, disk_gb=0,
                                       width=64, height=64)
        msg = str(e.value)
        assert f"the VRAM given ({vram:.2f} GiB) is at or below core's 0.80 GiB reserve" in msg, msg
        assert "0.00 GiB" not in msg, msg
    out, _, info = memory_plan_io.memory_plan(model, plan_for="given figures", vram_gb=0, ram_gb=0.05, disk_gb=10, allow_fp8=False,
                                              width=64, height=64, disk_folder=str(tmp_path))
    assert info["pick"] == "stream from disk", info["reasons"]
    with pytest.raises(ValueError, match=r"^Balanced Device Map: this MODEL comes through Memory Plan \(its pick streams "
                                         r"the weights from RAM or disk\).*or use Memory Plan alone") as e:
        device_map_patcher.device_map_model(out, "balanced", "auto")
    assert "Group Offload" not in str(e.value)


# -- round 3, item 3: a node inspects its MODEL's own modules, not another clone's patches --------

def test_round3_item3_inspection_ignores_another_loaded_clones_fp8_layers(loaded):
    """After an FP8 prompt the FP8 clone stays loaded and its float8 layers sit in the model the
    clones share: Memory Plan read them as "already float8" (its pick changed with what ran
    before; a plan queued after an FP8 prompt sampled the wrong model), and FP8 Layerwise Cast saw
    nothing left to cast. Every inspecting node reads the MODEL's own modules."""
    import comfy.model_management as mm
    from comfyui_memorykit.memorykit.comfy_integration import device_map_patcher, fp8_patcher, memory_plan_io
    from comfyui_memorykit.memorykit.comfy_integration.model_view import own_module
    model = loaded("sd15").patcher
    shape = [1, 4, 8, 8]
    fresh = memory_plan_io.model_figures(model, shape)
    _, fresh_info = fp8_patcher.fp8_layerwise_cast(model)
    fresh_map = device_map_patcher.device_map_model(model, "balanced", "cpu=64GiB")[1]["bytes_per_device"]
    other, _ = fp8_patcher.fp8_layerwise_cast(model)
    mm.load_models_gpu([other])  # its float8 layers are now applied to the shared modules
    try:
        applied = [k for k in other.object_patches if k in other.object_patches_backup]
        assert applied and model.model.diffusion_model.get_submodule(applied[0][len("diffusion_model."):]) \
            is other.object_patches[applied[0]]
        assert memory_plan_io.model_figures(model, shape) == fresh
        again, info = fp8_patcher.fp8_layerwise_cast(model)
        assert (info["cast_layers"], info["weight_bytes_after"]) == (fresh_info["cast_layers"], fresh_info["weight_bytes_after"])
        assert device_map_patcher.device_map_model(model, "balanced", "cpu=64GiB")[1]["bytes_per_device"] == fresh_map
        view = own_module(model)
        assert view is not model.model.diffusion_model and \
            view.get_submodule(applied[0][len("diffusion_model."):]) is other.object_patches_backup[applied[0]]
    finally:
        mm.unload_all_models()
    assert own_module(model) is model.model.diffusion_model  # nothing applied: the tree itself

