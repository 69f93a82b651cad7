"""Balanced Device Map with ``disk`` entries against a hostile user or a faulty machine: a forward
that raises half-way, removal twice and a second dispatch (the page-dropping forward hooks never
stack), tied weights and a buffer on disk, the offload folder made read-only after dispatch;
in-process, bit-exact against the plain module, no hook or file left."""
from __future__ import annotations

import os
import subprocess

import pytest
import torch


class _Fault(RuntimeError):
    pass


def _hooks(module) -> dict:
    """name → (forward pre-hooks, forward hooks) of every submodule that has any."""
    return {n: (len(m._forward_pre_hooks), len(m._forward_hooks)) for n, m in module.named_modules()
            if m._forward_pre_hooks or m._forward_hooks}


def _no_trace(module):
    assert _hooks(module) == {}
    assert not any(hasattr(m, "_hf_hook") or "forward" in m.__dict__ for m in module.modules())
    assert "hf_device_map" not in module.__dict__


class _Block(torch.nn.Module):
    def __init__(self, n=64):
        super().__init__()
        self.lin = torch.nn.Linear(n, n)
        self.norm = torch.nn.LayerNorm(n)

    def forward(self, x):
        return self.norm(self.lin(x)) + x


class _Net(torch.nn.Module):
    def __init__(self, n=64, depth=4):
        super().__init__()
        self.proj = torch.nn.Linear(n, n)
        self.blocks = torch.nn.ModuleList(_Block(n) for _ in range(depth))
        self.head = torch.nn.Linear(n, n)
        self.register_buffer("shift", torch.randn(n))

    def forward(self, x):
        x = self.proj(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x) + self.shift


def _net(seed=0):
    torch.manual_seed(seed)
    return _Net()


DISK_MAP = {"proj": "cpu", "blocks.0": "cpu", "blocks.1": "disk", "blocks.2": "disk", "blocks.3": "disk",
            "head": "disk", "shift": "disk"}


def _values(module):
    return {n: t.detach().clone() for n, t in list(module.named_parameters()) + list(module.named_buffers())}


def _net_with_reference():
    """A fresh net, its values, an input and the plain output for it."""
    net = _net()
    values = _values(net)
    x = torch.randn(3, 64)
    with torch.no_grad():
        ref = net(x)
    return net, values, x, ref


def _restored(module, values, folder):
    """The module holds its values as before, carries nothing of the map, and no file is left."""
    _same(module, values)
    _no_trace(module)
    assert os.listdir(folder) == []


def _same(module, values):
    now = _values(module)
    assert now.keys() == values.keys()
    for n, v in values.items():
        assert now[n].device == v.device and torch.equal(now[n], v), n


@pytest.mark.core_independent
def test_a_forward_that_raises_half_way_leaves_the_disk_map_exact(comfy, tmp_path):
    """A block raises inside its forward (its disk weights loaded, its page hook not run): the
    next forward is exact, removal restores every value, no hook or file is left."""
    from comfyui_memorykit.memorykit import device_dispatch
    net, values, x, ref = _net_with_reference()
    h = device_dispatch.dispatch_device_map(net, DISK_MAP, str(tmp_path), main_device="cpu")
    calls = []

    def fault(*_):
        if not calls:
            calls.append(1)
            raise _Fault("injected")
    inner = net.blocks[2].norm.register_forward_hook(fault)
    try:
        with torch.no_grad(), pytest.raises(_Fault):
            net(x)
        inner.remove()
        with torch.no_grad():
            assert torch.equal(net(x), ref)
    finally:
        inner.remove()
        h.remove()
    _restored(net, values, tmp_path)


@pytest.mark.core_independent
def test_removing_twice_and_dispatching_again_never_stacks_page_hooks(comfy, tmp_path):
    from comfyui_memorykit.memorykit import device_dispatch
    net, values, x, ref = _net_with_reference()
    counts = []
    for _ in range(3):
        h = device_dispatch.dispatch_device_map(net, DISK_MAP, str(tmp_path), main_device="cpu")
        counts.append(_hooks(net))
        with torch.no_grad():
            assert torch.equal(net(x), ref)
        h.remove()
        h.remove()
        _no_trace(net)
    assert counts[0] == counts[1] == counts[2]
    assert all(v == (0, 1) for v in counts[0].values()), counts[0]
    _same(net, values)
    assert os.listdir(tmp_path) == []


class _Tied(torch.nn.Module):
    def __init__(self, n=64):
        super().__init__()
        self.a = torch.nn.Linear(n, n)
        self.b = torch.nn.Linear(n, n)
        self.b.weight = self.a.weight  # tied
        self.c = torch.nn.Linear(n, n)
        self.c.register_buffer("scale", torch.rand(n) + 0.5)

    def forward(self, x):
        return self.c(self.b(torch.relu(self.a(x)))) * self.c.scale


@pytest.mark.core_independent
@pytest.mark.parametrize("where", ["both_disk", "one_disk"])
def test_tied_weights_and_a_buffer_on_disk(comfy, tmp_path, where):
    """One weight shared by two entries (both on disk: accelerate looked the second name up in a
    state dict that listed it once, the forward raised KeyError and removal left it on ``meta``),
    and a buffer mapped to disk: exact over two forwards, the tied weight written once and tied
    again after removal, every value back."""
    from comfyui_memorykit.memorykit import device_dispatch
    torch.manual_seed(0)
    net = _Tied()
    values = _values(net)
    x = torch.randn(3, 64)
    with torch.no_grad():
        ref = net(x)
    m = {"a": "disk", "b": "disk" if where == "both_disk" else "cpu", "c": "disk"}
    on_disk = [net.a.weight, net.a.bias, net.c.weight, net.c.bias, net.c.scale] + \
        ([net.b.bias] if where == "both_disk" else [])
    h = device_dispatch.dispatch_device_map(net, m, str(tmp_path), main_device="cpu")
    try:
        assert h.disk_bytes == sum(t.numel() * t.element_size() for t in on_disk)
        with torch.no_grad():
            out1, out2 = net(x), net(x)
    finally:
        h.remove()
    assert torch.equal(out1, ref) and torch.equal(out2, ref)
    assert net.a.weight is net.b.weight, "the tie is broken after removal"
    _restored(net, values, tmp_path)


@pytest.mark.core_independent
def test_offload_folder_made_read_only_after_dispatch(comfy, tmp_path):
    """The offload folder becomes read-only after dispatch (a read-only bind mount over it: even
    root cannot write there): the forward and the restore read the real weights; the folder the
    pack could not delete stays on its list of leftovers and goes as soon as it can."""
    from comfyui_memorykit.memorykit import device_dispatch, leftovers
    parent = tmp_path / "offload"
    parent.mkdir()
    net, values, x, ref = _net_with_reference()
    h = device_dispatch.dispatch_device_map(net, DISK_MAP, str(parent), main_device="cpu")
    r = subprocess.run(f"mount --bind {parent} {parent} && mount -o remount,bind,ro {parent}", shell=True,
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        h.remove()
        pytest.skip(f"cannot make a read-only bind mount here (needs root): {r.stderr.strip()}")
    try:
        with pytest.raises(OSError):
            (parent / "probe").write_text("x")
        with torch.no_grad():
            assert torch.equal(net(x), ref)
        h.remove()
    finally:
        subprocess.run(["umount", str(parent)], check=True)
    _same(net, values)
    _no_trace(net)
    folder = os.path.abspath(h.offload_dir)
    assert os.listdir(parent) == [os.path.basename(folder)]
    assert folder in leftovers._mine, "a folder the pack could not delete was taken off its list of leftovers"
    assert leftovers.remove_folder(folder)  # what SIGTERM or the next start does
    assert os.listdir(parent) == [] and folder not in leftovers._mine


# In ComfyUI (both versions): the Wan fixture through the Balanced Device Map node, sampled by core.
WAN_MAP = "cpu=4MiB, disk"


@pytest.fixture(scope="module")
def wan(comfy, fixture_models):
    import comfy.model_management as mm
    import comfy.sd
    mm.unload_all_models()
    m = comfy.sd.load_diffusion_model(str(fixture_models["wan"]))
    g = torch.Generator().manual_seed(1)
    conds = [[torch.randn(1, 16, 4096, generator=g) * 0.5, {}]], [[torch.randn(1, 16, 4096, generator=g) * 0.5, {}]]
    yield m, conds, _sample(m, conds)
    mm.unload_all_models()


def _sample(model, conds, steps=1):
    import comfy.sample
    latent = torch.zeros(1, 16, 2, 8, 8)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        return comfy.sample.sample(model, noise, steps, 4.0, "euler", "simple", conds[0], conds[1], latent,
                                   disable_pbar=True, seed=5)


def _map(model, folder, budget=WAN_MAP):
    from comfyui_memorykit.nodes.device_map import BalancedDeviceMap
    return BalancedDeviceMap.execute(model, "sequential", budget, str(folder), "").result[0]


def test_sampling_that_raises_in_a_disk_block_then_runs_exact_and_unloads_clean(wan, tmp_path):
    """A block on disk raises half-way through sampling (its weights onloaded, its hooks' post
    steps not run): the next prompt on the same loaded map is exact, and ComfyUI's unload leaves
    no hook on any module, no file, every weight as loaded."""
    import comfy.model_management as mm
    from comfyui_memorykit.memorykit.comfy_integration import placement
    m, conds, ref = wan
    dm = m.model.diffusion_model
    values = _values(dm)
    clone = _map(m, tmp_path)
    plan = clone.get_attachment(placement.DEVICE_MAP_ATTACHMENT).device_map
    disk_block = next(k for k, v in plan.items() if v == "disk" and k.startswith("blocks."))
    calls = []

    def fault(*_):
        if not calls:
            calls.append(1)
            raise _Fault("injected")
    mm.load_models_gpu([clone])
    inner = dm.get_submodule(disk_block).self_attn.register_forward_hook(fault)
    try:
        with pytest.raises(_Fault):
            _sample(clone, conds)
    finally:
        inner.remove()
    assert calls and placement.applied(m.model) is not None
    hooks = _hooks(dm)
    assert torch.equal(_sample(clone, conds), ref)
    assert _hooks(dm) == hooks
    mm.unload_all_models()
    assert placement.applied(m.model) is None
    _restored(dm, values, tmp_path)


def test_maps_replacing_each_other_never_stack_page_hooks(wan, tmp_path):
    """Two Balanced Device Map clones of one model (different maps) loaded in turn, the first
    again, then unloaded: each load carries one map's hooks only, exact each time; none left."""
    import comfy.model_management as mm
    m, conds, ref = wan
    dm = m.model.diffusion_model
    a, b = _map(m, tmp_path), _map(m, tmp_path, "cpu=2MiB, disk")
    seen = []
    for clone in (a, b, a):
        assert torch.equal(_sample(clone, conds), ref)
        seen.append(_hooks(dm))
        assert all(v == (0, 1) for v in seen[-1].values()), seen[-1]
        assert len(os.listdir(tmp_path)) == 1
    assert seen[0] == seen[2] and seen[0] != seen[1]
    mm.unload_all_models()
    mm.unload_all_models()
    _no_trace(dm)
    assert os.listdir(tmp_path) == []


def _rss_file() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the RSS from /proc (Linux)")
def test_fp8_scaled_model_sampled_from_a_disk_map_maps_one_block_at_a_time(comfy, tmp_path):
    """Comfy-Org's fp8_scaled file as core 0.33 loads it (``QuantizedTensor`` layers, placed as their
    stored parts) with half its blocks on disk: two sampling steps equal the plain model's, and the
    disk file's pages mapped while sampling stay at about one block (the largest), not every
    weight read so far; unloading leaves no hook and no file."""
    import threading

    import comfy.model_management as mm
    import comfy.sample
    import comfy.sd
    from harness import quant_models
    from test_quantized_weights import _is_033, both_tiers, stored_bytes

    from comfyui_memorykit.memorykit.comfy_integration import placement
    if not _is_033():
        pytest.skip("ComfyUI 0.3.75 loads fp8_scaled files as plain float8 tensors (its exactness with a disk map "
                    "is checked in test_quantized_weights.py)")

    def unload():
        with torch.inference_mode():
            mm.unload_all_models()
    unload()
    with torch.inference_mode():  # as the server runs Load Diffusion Model
        m = comfy.sd.load_diffusion_model(str(quant_models.ensure_sd15("legacy")))
    g = torch.Generator().manual_seed(3)
    pos, neg = [[torch.randn(1, 77, 768, generator=g), {}]], [[torch.randn(1, 77, 768, generator=g), {}]]

    def sample(model):  # cfg 1: one forward per step
        latent = torch.zeros(1, 4, 8, 8)
        noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(5))
        with torch.inference_mode():
            return comfy.sample.sample(model, noise, 2, 1.0, "euler", "simple", pos, neg, latent,
                                       disable_pbar=True, seed=5)
    try:
        ref = sample(m)
        dm = m.model.diffusion_model
        clone = _map(m, tmp_path, both_tiers(dm))
        disk = [k for k, v in clone.get_attachment(placement.DEVICE_MAP_ATTACHMENT).device_map.items() if v == "disk"]
        largest = max(stored_bytes(dm.get_submodule(k)) for k in disk)
        with torch.inference_mode():
            mm.load_models_gpu([clone])
        on_disk = placement.applied(m.model).handle.disk_bytes
        peak, done = [0], threading.Event()

        def watch():
            while not done.wait(0.0002):
                peak[0] = max(peak[0], _rss_file())
        before = _rss_file()
        t = threading.Thread(target=watch)
        t.start()
        try:
            out = sample(clone)
        finally:
            done.set()
            t.join()
        grown = max(peak[0], _rss_file()) - before
        print(f"[figures] fp8_scaled disk map: {len(disk)} disk entries, {on_disk / 2**20:.1f} MiB on disk (largest "
              f"{largest / 2**20:.1f} MiB); disk pages mapped grew {grown / 2**20:.1f} MiB over 2 sampling steps")
        assert torch.equal(out, ref), f"max abs diff {(out - ref).abs().max().item()}"
        assert grown < largest + 0.15 * on_disk, "the disk file's pages read stay mapped while sampling"
        unload()
        assert os.listdir(tmp_path) == []
        _no_trace(dm)
    finally:
        unload()


@pytest.mark.core_independent
def test_a_folder_of_the_user_at_the_offload_folder_path_is_never_deleted(comfy, tmp_path):
    """The offload folder is deleted after dispatch and the user makes a folder of their own under
    the same name: the forward and the removal are exact, and the removal leaves the user's
    folder and its files alone (it is not the pack's: no marker of this process)."""
    import shutil

    from comfyui_memorykit.memorykit import device_dispatch, leftovers
    net, values, x, ref = _net_with_reference()
    h = device_dispatch.dispatch_device_map(net, DISK_MAP, str(tmp_path), main_device="cpu")
    folder = h.offload_dir
    try:
        shutil.rmtree(folder)
        os.mkdir(folder)
        with open(os.path.join(folder, "mine.txt"), "w") as f:
            f.write("the user's")
        with torch.no_grad():
            assert torch.equal(net(x), ref)
    finally:
        h.remove()
    _same(net, values)
    _no_trace(net)
    assert os.listdir(folder) == ["mine.txt"], "the removal deleted a folder the pack did not write"
    assert os.path.abspath(folder) not in leftovers._mine  # not listed as a leftover either


@pytest.mark.core_independent
def test_a_transposed_weight_on_disk_keeps_its_layout(comfy, tmp_path):
    """A weight stored transposed (a non-contiguous Parameter, as ``assign=True`` loads leave
    some): the CPU's GEMM rounds a transposed operand differently, so the disk copy must keep the
    strides: the mapped forward and the model after removal equal the plain one bit for bit."""
    from comfyui_memorykit.memorykit import device_dispatch
    net = _net()
    with torch.no_grad():
        net.blocks[2].lin.weight = torch.nn.Parameter(net.blocks[2].lin.weight.t().contiguous().t())
    assert not net.blocks[2].lin.weight.is_contiguous()
    values = _values(net)
    stride = net.blocks[2].lin.weight.stride()
    x = torch.randn(3, 64)
    with torch.no_grad():
        ref = net(x)
    h = device_dispatch.dispatch_device_map(net, DISK_MAP, str(tmp_path), main_device="cpu")
    try:
        with torch.no_grad():
            out = net(x)
    finally:
        h.remove()
    assert torch.equal(out, ref), f"max abs diff {(out - ref).abs().max().item()}"
    assert net.blocks[2].lin.weight.stride() == stride
    with torch.no_grad():
        assert torch.equal(net(x), ref)
    _same(net, values)
    assert os.listdir(tmp_path) == []


def _result(out):
    return out[0] if isinstance(out, tuple) else out.result[0]


def test_core_readers_of_a_loaded_disk_map_get_the_real_weights(wan, tmp_path):
    """While a Balanced Device Map with disk is loaded (it stays loaded between prompts), core's
    nodes that read its weights get the real ones, not the map's ``meta`` placeholders (was:
    "Cannot copy out of meta tensor"): Save Checkpoint's ``save_checkpoint`` writes what the plain
    model's save writes, and ModelMergeSimple with it as ``model2`` samples as the plain merge.
    Afterwards the map runs exact again and unloads clean."""
    import comfy.model_management as mm
    import comfy.sd
    import comfy.utils
    from comfy_extras.nodes_model_merging import ModelMergeSimple
    m, conds, ref = wan
    dm = m.model.diffusion_model
    values = _values(dm)
    with torch.inference_mode():
        comfy.sd.save_checkpoint(str(tmp_path / "plain.safetensors"), m)
    merged_ref = _sample(_result(ModelMergeSimple().merge(m, m.clone(), 0.3)), conds)
    mm.unload_all_models()
    folder = tmp_path / "offload"
    folder.mkdir()
    clone = _map(m, folder)
    assert torch.equal(_sample(clone, conds), ref)  # loaded: disk entries are placeholders now
    sd = {k[len("diffusion_model."):]: v for k, v in clone.model_state_dict("diffusion_model.").items()}
    assert {n for n, _ in dm.named_parameters()} <= sd.keys()  # Extract LoRA, a ControlNet "difference" read it
    assert all(torch.equal(v, values[k]) for k, v in sd.items())
    assert torch.equal(_sample(clone, conds), ref)
    with torch.inference_mode():
        comfy.sd.save_checkpoint(str(tmp_path / "mapped.safetensors"), clone)
    want = comfy.utils.load_torch_file(str(tmp_path / "plain.safetensors"))
    got = comfy.utils.load_torch_file(str(tmp_path / "mapped.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert torch.equal(_sample(_result(ModelMergeSimple().merge(m, clone, 0.3)), conds), merged_ref)
    assert torch.equal(_sample(clone, conds), ref)
    mm.unload_all_models()
    _same(dm, values)
    _no_trace(dm)
    assert os.listdir(folder) == []


def test_unloading_between_sampling_steps_then_sampling_on(wan, tmp_path):
    """Everything is unloaded between two steps of a sampling that uses the map (a node or an
    extension freeing memory from a step callback): the steps after run on the plain model, the
    result equals the plain sampling, nothing of the map is left, and the map loads again exact."""
    import comfy.model_management as mm
    import comfy.sample
    m, conds, _ = wan
    dm = m.model.diffusion_model
    values = _values(dm)
    latent = torch.zeros(1, 16, 2, 8, 8)

    def run(model, callback=None):
        noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(5))
        with torch.inference_mode():
            return comfy.sample.sample(model, noise, 2, 4.0, "euler", "simple", conds[0], conds[1], latent,
                                       disable_pbar=True, seed=5, callback=callback)
    ref = run(m)
    clone = _map(m, tmp_path)
    freed = []

    def free(step, *_):
        if step == 0:
            mm.unload_all_models()
            freed.append(_hooks(dm))
    assert torch.equal(run(clone, free), ref)
    assert freed == [{}] and os.listdir(tmp_path) == []
    assert torch.equal(run(clone), ref)
    mm.unload_all_models()
    _restored(dm, values, tmp_path)


@pytest.mark.core_independent
def test_a_folder_whose_tracking_failed_is_still_removed_by_its_creator(comfy, tmp_path):
    """The marker could not be written (a full disk) after the folder was made: the creator's
    removal still deletes the folder and what was half written in it."""
    from comfyui_memorykit.memorykit import leftovers
    folder = tmp_path / "memorykit-devicemap-x"
    folder.mkdir()
    (folder / leftovers.MARKER).write_text('{"pid": ')  # cut off by the full disk
    assert leftovers.remove_folder(folder)
    assert os.listdir(tmp_path) == []
