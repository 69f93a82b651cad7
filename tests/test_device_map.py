"""Balanced Device Map, in-process: planning (vs accelerate) and bad input.

Planning uses models built from ComfyUI's own classes on the meta device at full size
(Flux-dev shape: 19 double + 38 single blocks, 11.9 B params; Wan 2.1 14B shape: 40 layers,
dim 5120), with budgets for GPUs this machine does not have — accelerate plans for them with a
warning. Execution is tested in test_device_map_run.py (in-process) and
test_device_map_server.py (through the server).
"""
from __future__ import annotations

import os

import pytest
import torch

from harness.meta_models import BLOCK_CLASSES as BLOCKS, meta_patcher

GIB = 2 ** 30
TWO_GPUS = "cuda:0=24GiB, cuda:1=24GiB, cpu=64GiB"
BUDGETS = {  # max_memory text → the same budgets as accelerate takes them
    TWO_GPUS: {0: 24 * GIB, 1: 24 * GIB, "cpu": 64 * GIB},
    "cuda:0=16GiB, cuda:1=16000MB, cpu=64GiB": {0: 16 * GIB, 1: 16 * 10 ** 9, "cpu": 64 * GIB},
}


@pytest.fixture(scope="module")
def node(comfy):
    from comfyui_memorykit.nodes.device_map import BalancedDeviceMap
    return BalancedDeviceMap


@pytest.fixture(scope="module")
def metas(comfy):
    return {k: meta_patcher(k) for k in BLOCKS}


def run_node(node, model, strategy="balanced", max_memory="auto", offload_folder="", custom=""):
    out = node.execute(model, strategy, max_memory, offload_folder, custom)
    return out.result[0], out.ui["memorykit_report"][0], out.ui["text"][0]


def accelerate_map(module, strategy: str, budgets: dict, no_split: list[str]) -> dict:
    """What accelerate gives for diffusers' ``device_map=strategy`` (diffusers' _determine_device_map)."""
    from accelerate.utils import get_balanced_memory, get_max_memory, infer_auto_device_map
    if strategy == "sequential":
        mm = get_max_memory(dict(budgets))
    else:
        mm = get_balanced_memory(module, max_memory=dict(budgets), no_split_module_classes=no_split,
                                 low_zero=strategy == "balanced_low_0")
    planned = dict(infer_auto_device_map(module, max_memory=mm, no_split_module_classes=no_split))
    # except that what lies outside every block is never offloaded: accelerate's cpu entries
    # under a GPU main device go to that device (memorykit.device_map.resident_remainder)
    from comfyui_memorykit.memorykit.device_map import model_blocks
    blocks = model_blocks(module)  # the pack's one block rule (the blocks Group Offload streams)
    main = next((d for d in planned.values() if d not in ("cpu", "disk")), "cpu")
    return {k: main if d in ("cpu", "disk") and main != "cpu" and not any(k == b or k.startswith(b + ".") for b in blocks)
            else d for k, d in planned.items()}


def assert_blocks_whole(module, device_map: dict, block_classes: list[str]):
    blocks = [n for n, m in module.named_modules() if type(m).__name__ in block_classes]
    assert blocks
    for key in device_map:
        inside = [b for b in blocks if key.startswith(b + ".")]
        assert not inside, f"map entry {key!r} splits block {inside[0]!r}"
    # every block is placed by exactly one entry (itself or an ancestor)
    for b in blocks:
        owners = [k for k in device_map if k == "" or b == k or b.startswith(k + ".")]
        assert len(owners) == 1, (b, owners)


# -- planning ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(BLOCKS))
@pytest.mark.parametrize("budget", sorted(BUDGETS))
@pytest.mark.parametrize("strategy", ["balanced", "balanced_low_0", "sequential"])
def test_plan_equals_accelerate_and_keeps_blocks_whole(node, metas, kind, budget, strategy):
    """accelerate's plan, with what lies outside the blocks kept on the main device."""
    patcher = metas[kind]
    clone, rep, text = run_node(node, patcher, strategy, budget)
    dm = patcher.model.diffusion_model
    expected = accelerate_map(dm, strategy, BUDGETS[budget], BLOCKS[kind])
    assert rep["device_map"] == expected
    names = [n for n, _ in dm.named_modules()]
    assert list(rep["device_map"]) == sorted(expected, key=names.index)  # listed in module order
    assert rep["no_split_module_classes"] == BLOCKS[kind]
    assert rep["split_blocks"] == []
    assert_blocks_whole(dm, rep["device_map"], BLOCKS[kind])
    used_gpus = sorted({v for v in expected.values() if isinstance(v, int)})
    assert rep["missing_devices"] == [f"cuda:{i}" for i in used_gpus if i >= torch.cuda.device_count()]
    assert sum(rep["bytes_per_device"].values()) == sum(t.numel() * t.element_size() for t in dm.state_dict().values())
    # the input is not changed; the clone carries the plan
    assert clone is not patcher and clone.model is patcher.model
    assert patcher.get_attachment("memorykit_device_map") is None
    assert clone.get_attachment("memorykit_device_map").device_map == expected
    assert "cuda:" in text and "blocks kept whole" in text


def test_two_gpu_strategies_differ_as_documented(node, metas):
    """The README's 2 x 24 GiB figures for the Flux-dev shape (22.2 GiB of bf16 weights)."""
    maps = {s: run_node(node, metas["flux_dev"], s, TWO_GPUS)[1] for s in ("balanced", "balanced_low_0", "sequential")}
    per = {s: r["bytes_per_device"] for s, r in maps.items()}
    assert set(per["balanced"]) == {"cuda:0", "cuda:1"}
    assert abs(per["balanced"]["cuda:0"] - per["balanced"]["cuda:1"]) < 0.25 * sum(per["balanced"].values())
    assert set(per["balanced_low_0"]) == {"cuda:1"}  # everything fits on GPU 1: GPU 0 stays empty
    assert set(per["sequential"]) == {"cuda:0"}      # fills GPU 0 first, and the model fits


def test_auto_on_this_machine_plans_only_present_devices(node, comfy):
    import comfy.sd
    from harness import paths
    mp = comfy.sd.load_diffusion_model(str(paths.MODELS / "diffusion_models" / "mk_wan21_tiny.safetensors"))
    _, rep, _ = run_node(node, mp, "balanced", "auto")
    present = {"cpu"} | {f"cuda:{i}" for i in range(torch.cuda.device_count())}
    assert set(rep["bytes_per_device"]) <= present and rep["missing_devices"] == []


# -- bad input -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_memory, words", [
    ("gpu:0=20GiB, cuda:1=22GiB", ["unknown device", "gpu:0"]),
    ("cuda:0=20GX, cuda:1=22GiB", ["20GX", "not valid"]),
    ("cuda:0=lots", ["lots", "not valid"]),
    ("cuda:0", ["no size"]),
    ("cuda:0=20GiB, cuda:0=10GiB", ["cuda:0 twice"]),
    ("cpu=1e400GiB", ["max_memory", "1e400GiB", "not valid"]),  # issue 14, item 12: was OverflowError
    ("cpu=1e30GiB", ["max_memory", "1e30GiB", "too large"]),
])
def test_bad_max_memory_is_a_clear_error(node, metas, max_memory, words):
    with pytest.raises(ValueError) as e:
        run_node(node, metas["flux_dev"], "balanced", max_memory)
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("strategy", ["balanced", "sequential"])
def test_budget_too_small_for_the_largest_block(node, metas, strategy):
    with pytest.raises(ValueError) as e:
        run_node(node, metas["flux_dev"], strategy, "cuda:0=200MiB, cuda:1=200MiB")
    msg = str(e.value)
    assert "too small" in msg and "largest block" in msg and "no budget holds it" in msg
    assert "single_blocks." in msg or "double_blocks." in msg  # names the block
    # with disk allowed, the same budgets plan (weights stream from files)
    _, rep, _ = run_node(node, metas["flux_dev"], strategy, "cuda:0=200MiB, cuda:1=200MiB, disk")
    assert "disk" in rep["device_map"].values()


@pytest.mark.parametrize("custom, words", [
    ('{"img_in": "cuda:0", "double_blocks": "cuda:0", "single_blocks": "cuda:1", "final_layer": "cuda:1"}',
     ["leaves out", "time_in", "txt_in"]),
    ('{"": "cpu", "double_blocks.99": "disk"}', ["double_blocks.99", "not a module"]),
    ('{"imgin": "cpu"}', ["'imgin'", "not a module", "img_in"]),
    ('{"": "gpu1"}', ["unknown device", "gpu1"]),
    ('{"": "cpu",}', ["not valid JSON"]),
    ('{"": "cpu", "final_layer": "disk"}', ["overlap"]),
    ('{"a": ' * 100_000 + '"cpu"' + "}" * 100_000, ["custom_device_map", "nested"]),  # issue 14, item 12: was RecursionError
    ("[" * 100_000 + "]" * 100_000, ["custom_device_map", "nested"]),
])
def test_bad_custom_map_is_a_clear_error(node, metas, custom, words):
    with pytest.raises(ValueError) as e:
        run_node(node, metas["flux_dev"], custom=custom)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_custom_map_is_taken_as_given(node, metas):
    dm = metas["flux_dev"].model.diffusion_model
    names = [n for n, c in dm.named_children() if len(c.state_dict())]
    custom = {n: ("cuda:1" if n in ("single_blocks", "final_layer") else "cuda:0") for n in names}
    import json
    _, rep, text = run_node(node, metas["flux_dev"], custom=json.dumps(custom))
    assert rep["device_map"] == {n: (1 if v == "cuda:1" else 0) for n, v in custom.items()}
    assert rep["strategy"] is None and rep["max_memory"] is None and "custom device map" in text


def test_unet_refuses_a_split_across_gpus(node, comfy, fixture_models):
    import comfy.sd
    out = comfy.sd.load_checkpoint_guess_config(str(fixture_models["sd15"]), output_vae=False, output_clip=False)
    with pytest.raises(ValueError, match="skip connections"):
        run_node(node, out[0], "sequential", "cuda:0=40MiB, cuda:1=1GiB")
    _, rep, _ = run_node(node, out[0], "sequential", "cuda:0=60MiB, cpu=1GiB")  # one GPU + cpu is fine
    assert set(rep["device_map"].values()) == {0, "cpu"}


@pytest.mark.core_independent
def test_a_failure_inside_dispatch_reaches_the_caller_with_the_module_as_it_was(comfy, tmp_path):
    """accelerate refusing a map inside ``dispatch_model`` (here one that leaves a layer out) reaches
    the caller as accelerate's error, and the host's out-of-memory rule (``is_oom``) turns what it
    counts into the message that names the fix; either way the module is as it was and no file is left.
    (The error used to be a NameError from the out-of-memory check.)"""
    from comfyui_memorykit.memorykit import device_dispatch
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    ref = {k: v.clone() for k, v in m.state_dict().items()}
    incomplete = {"0": "disk"}
    with pytest.raises(ValueError, match="does not give any device"):
        device_dispatch.dispatch_device_map(m, incomplete, str(tmp_path), main_device="cpu")
    with pytest.raises(RuntimeError, match="out of memory while placing the device map.*lower max_memory"):
        device_dispatch.dispatch_device_map(m, incomplete, str(tmp_path), main_device="cpu", is_oom=lambda e: True)
    assert not device_dispatch.is_dispatched(m) and os.listdir(tmp_path) == []
    assert all(torch.equal(v, ref[k]) and v.device.type == "cpu" for k, v in m.state_dict().items())
