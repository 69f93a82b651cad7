"""Memory Plan on the CPU with the small generated models: each candidate, applied with the
nodes' own code, holds the bytes the plan predicted (tracked tensor bytes, within 10 %), runs a
forward without failing for memory, and the VAE output decodes in the planned tiles."""
from __future__ import annotations

import pytest
import torch


def _tensor_bytes(ts) -> int:
    seen, n = set(), 0
    for t in ts:
        t = getattr(t, "_qdata", t)  # core's QuantizedTensor (FP8's core path): its float8 data has the storage
        key = t.untyped_storage().data_ptr() if t.device.type == "cpu" and t.numel() else id(t)
        if key not in seen:
            seen.add(key)
            n += t.untyped_storage().nbytes() if t.numel() else 0
    return n


def _held_by_model(patcher) -> int:
    """CPU tensor bytes the model holds: its tree as ComfyUI runs it, the object patches and the
    layers they replaced (kept for the input MODEL), each storage once."""
    dm = patcher.model.diffusion_model
    ts = [t for t in list(dm.parameters()) + list(dm.buffers()) if t.device.type == "cpu"]
    for obj in list(patcher.object_patches.values()) + list(patcher.object_patches_backup.values()):
        if isinstance(obj, torch.nn.Module):
            ts += [t for t in list(obj.parameters()) + list(obj.buffers()) if t.device.type == "cpu"]
    return _tensor_bytes(ts)


@pytest.fixture(scope="module")
def io(comfy):
    from comfyui_memorykit.memorykit.comfy_integration import memory_plan_io
    return memory_plan_io


@pytest.mark.parametrize("key", ["sd15", "wan"])
def test_each_candidate_holds_what_it_predicted(comfy, io, loaded, key, tmp_path):
    import comfy.model_management as mm
    from comfyui_memorykit.memorykit import memory_plan as mp
    lm = loaded(key)
    shape = [1] + list(lm.args[0].shape[1:])
    figures = io.model_figures(lm.patcher, shape)
    machine = io.measure_machine(lm.patcher, str(tmp_path))
    assert not machine.gpu and machine.ram_bytes > figures.weight_bytes
    plan = mp.make_plan(machine, figures)
    names = {c.name for c in plan.candidates}
    assert {"as loaded", "fp8 resident", "stream from disk"} <= names, names
    w = figures.weight_bytes
    assert abs(_held_by_model(lm.patcher) - w) <= 0.1 * w  # the figures read the model right
    for cand in plan.candidates:
        assert cand.fits, (cand.name, cand.short)
        plan.pick = cand
        out, _ = io.apply_plan(lm.patcher, plan, str(tmp_path))
        try:
            mm.load_models_gpu([out])
            held = _held_by_model(out)
            if cand.offload_to == "disk":  # the disk store (a file with no name); RAM keeps the staging copies
                from comfyui_memorykit.memorykit.comfy_integration.offload_patcher import group_offload_state_info
                disk = group_offload_state_info(out.model)["figures"]["disk_bytes"]
                assert abs(disk - cand.disk_bytes) <= 0.1 * cand.disk_bytes + (64 << 10), (cand.name, disk, cand.disk_bytes)
                # RAM: diffusers' disk groups keep uninitialised placeholders of every streamed tensor
                # (address space, pages never touched), so tracked tensor bytes cannot show the saving.
            else:  # RAM held: the loaded weights (+ the fp8 copies); the peak adds activations or scratch
                want = w + (figures.fp8_added if cand.fp8 else 0)
                assert abs(held - want) <= 0.1 * want, (cand.name, held, want)
            with torch.no_grad():
                y = out.model.diffusion_model(*lm.args, **lm.kwargs)
            assert torch.isfinite(y).all()
            if not cand.fp8:
                assert torch.equal(y, lm.reference), cand.name
        finally:
            mm.unload_all_models()
            del out
    lm.assert_restored()


def test_planned_vae_decodes_in_tiles_without_changing_the_input(comfy, io, fixture_models):
    import comfy.sd
    import comfy.utils
    from comfyui_memorykit.memorykit import memory_plan as mp
    vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(fixture_models["wan_vae"])))
    z = torch.randn(1, 16, 2, 16, 16, generator=torch.Generator().manual_seed(3))
    tile, sentence = io.plan_tiles(vae, mp.Machine(vram_bytes=0, ram_bytes=1 << 40, disk_bytes=0), list(z.shape))
    assert tile is None and "no tiles" in sentence  # a terabyte of RAM: whole
    whole = vae.memory_used_decode([1, 16, 2, 16, 16], vae.vae_dtype)  # Tiled VAE's cost model: ∝ latent pixels
    ram = int(whole / 2 / 0.9)  # half the whole image's cost: 64 px tiles (a quarter) fit, 128 px do not
    tile, sentence = io.plan_tiles(vae, mp.Machine(vram_bytes=0, ram_bytes=ram, disk_bytes=0), list(z.shape))
    assert tile == 64 and "tiles of 64 px" in sentence, sentence
    out = io.planned_vae(vae, 64)
    assert out is not vae and type(vae) is comfy.sd.VAE and not hasattr(vae, "memorykit_tile_px")
    assert out.first_stage_model is vae.first_stage_model and out.memorykit_tile_px == 64
    from comfyui_memorykit.memorykit.comfy_integration import tiled_vae_io as tvi
    with torch.inference_mode():  # as ComfyUI runs nodes (0.33's tiled 3-D decode writes in place)
        planned = out.decode(z)  # VAE Decode on the planned VAE: Tiled VAE's tiling at the planned tile
        tiled, _ = tvi.tiled_vae_decode(vae, z, tvi.TiledVAEOptions(tile_px=64, overlap_px=16))
        assert planned.shape == (1,) + tuple(tiled.shape) and torch.equal(planned[0], tiled)
        # Tiled VAE Decode on the planned VAE caps its 512 px tile_size at the planned 64 px
        capped, _ = tvi.tiled_vae_decode(out, z, tvi.TiledVAEOptions(tile_px=512, overlap_px=64))
        assert torch.equal(capped, tiled)
        whole = vae.decode(z)
        assert not torch.equal(whole.reshape(tiled.shape), tiled)  # it really tiled
    assert io.planned_vae(out, 128).memorykit_tile_px == 128 and out.memorykit_tile_px == 64


def test_fp8_plan_process_ram_matches_prediction(comfy, io, loaded, tmp_path):
    """Process RAM (VmHWM) while FP8 is applied and the model runs: the peak above the RSS before
    is the fp8 copies the plan predicted (Flux-shaped model, 0.55 B parameters: big enough that
    the allocator's noise is small), within 10 % of the predicted peak RAM."""
    import gc

    import comfy.model_management as mm
    from comfyui_memorykit.memorykit import memory_plan as mp
    from comfyui_memorykit.memorykit.memory import host_memory, reset_host_peak
    lm = loaded("flux")
    figures = io.model_figures(lm.patcher, [1] + list(lm.args[0].shape[1:]))
    plan = mp.make_plan(io.measure_machine(lm.patcher, str(tmp_path)), figures)
    plan.pick = next(c for c in plan.candidates if c.name == "fp8 resident")
    gc.collect()
    if not reset_host_peak():
        pytest.skip("this kernel does not let the RSS high-water mark be reset (/proc/self/clear_refs)")
    rss0 = host_memory().rss_bytes
    out, _ = io.apply_plan(lm.patcher, plan, str(tmp_path))
    try:
        mm.load_models_gpu([out])
        with torch.no_grad():
            assert torch.isfinite(out.model.diffusion_model(*lm.args, **lm.kwargs)).all()
        grown = host_memory().rss_peak_bytes - rss0
    finally:
        mm.unload_all_models()
        del out
        gc.collect()
    predicted = plan.pick.peak_ram_bytes  # loaded weights (in rss0) + fp8 copies + max(activations, scratch)
    print(f"fp8 plan: predicted peak RAM {predicted / 2**20:.0f} MiB = weights {figures.weight_bytes / 2**20:.0f} + "
          f"fp8 copies {figures.fp8_added / 2**20:.0f} + max(activations {figures.activations / 2**20:.0f}, "
          f"quantising scratch {figures.fp8_work_bytes / 2**20:.0f}); measured "
          f"weights + RSS growth {(figures.weight_bytes + grown) / 2**20:.0f} MiB (growth {grown / 2**20:.0f} MiB)")
    assert abs(figures.weight_bytes + grown - predicted) <= 0.1 * predicted


@pytest.mark.parametrize("field", ["vram_gb", "ram_gb", "disk_gb"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_probe_given_figures_nan_or_inf_name_the_field(comfy, io, field, bad):
    """NaN passes ComfyUI's min/max checks (every comparison is false); a NaN or infinite figure
    was a bare 'cannot convert float NaN to integer' (OverflowError for inf) before."""
    figs = {"vram_gb": 12.0, "ram_gb": 32.0, "disk_gb": 100.0} | {field: bad}
    with pytest.raises(ValueError, match=f"^{field} is {bad!r}, not a finite number"):
        io.given_machine(**figs)


def test_probe_empty_latent_is_refused(comfy, io, loaded):
    """A LATENT of batch 0 was planned ('as loaded', activations and FLOPs of nothing) before;
    it is refused as every node refuses an empty batch (validation.nonempty_batch)."""
    lm = loaded("wan")
    with pytest.raises(ValueError, match=r"^latent: the LATENT holds no items \(shape \(0, 16, 2, 8, 8\)\)"):
        io.latent_shape({"samples": torch.zeros(0, 16, 2, 8, 8)}, lm.patcher, 64, 64, 5)
    assert io.latent_shape({"samples": torch.zeros(2, 16, 2, 8, 8)}, lm.patcher, 64, 64, 5) == [2, 16, 2, 8, 8]
    # a LATENT with a 0-sized side was planned (activations of nothing) before
    with pytest.raises(ValueError, match=r"^latent: the LATENT has a dimension of size 0 \(shape \(1, 16, 2, 0, 8\)\)"):
        io.latent_shape({"samples": torch.zeros(1, 16, 2, 0, 8)}, lm.patcher, 64, 64, 5)


def _wan_vae(fixture_models):
    import comfy.sd
    import comfy.utils
    return comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(fixture_models["wan_vae"])))


def test_probe_image_latent_for_a_video_latent_model(comfy, io, loaded, fixture_models):
    """A 4-D LATENT (Empty SD3 Latent Image, as Qwen-Image workflows use) for a model with 3-D
    latents: core's sampler adds the time axis (comfy/sample.py fix_empty_latent_channels), and so
    does the plan. With the VAE wired this was an IndexError in the VAE's cost formula before."""
    lm = loaded("wan")
    shape = io.latent_shape({"samples": torch.zeros(1, 16, 8, 8)}, lm.patcher, 64, 64, 5)
    assert shape == [1, 16, 1, 8, 8]
    _, vae, info = io.memory_plan(lm.patcher, _wan_vae(fixture_models), {"samples": torch.zeros(1, 16, 8, 8)},
                                  "given figures")
    assert info["latent_shape"] == [1, 16, 1, 8, 8] and vae is not None


def test_probe_vae_of_another_latent_kind_is_a_clear_error(comfy, io, loaded, fixture_models):
    """A video VAE wired with an image model (or a 6-D LATENT): an IndexError in core's
    ``memory_used_decode`` before; now a ValueError naming the vae and the dimensions."""
    lm = loaded("sd15")
    with pytest.raises(ValueError, match=r"^vae: .*3-D latents.*the latent \[1, 4, 8, 8\] has 2"):
        io.memory_plan(lm.patcher, _wan_vae(fixture_models), None, "given figures", width=64, height=64)


def test_probe_audio_vae_is_left_whole(comfy, io):
    """Stable Audio's VAE (1-D latents, built on the meta device: only its geometry is read):
    the plan leaves it untiled and says so. Before, Tiled VAE's 'handles image and video VAEs'
    error stopped the whole plan of an audio model whose VAE was wired."""
    import comfy.ldm.audio.autoencoder as ae
    import comfy.sd
    from comfyui_memorykit.memorykit import memory_plan as mp
    with torch.device("meta"):
        sd = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in ae.AudioOobleckVAE().state_dict().items()}
        vae = comfy.sd.VAE(sd=sd)
    assert vae.latent_dim == 1
    for shape in ([1, 64, 215], [1, 64, 128, 128]):  # the LATENT, or width × height when none is wired
        tile, sentence = io.plan_tiles(vae, mp.Machine(vram_bytes=0, ram_bytes=1 << 30, disk_bytes=0), shape)
        assert tile is None and "no tiles" in sentence and "1-D" in sentence, sentence
    assert io.planned_vae(vae, tile) is vae


def test_probe_full_offload_disk_does_not_stop_a_plan(comfy, io, loaded, tmp_path):
    """The disk read probe writes 64 MiB into the offload folder: on a disk with less free the
    whole plan was a bare 'OSError: No space left on device', though nothing needed the disk.
    Now the disk's speed is the default figure (not cached: measured again once there is room),
    the plan runs, and nothing is left in the folder."""
    from harness.tmpfs import small_tmpfs
    from comfyui_memorykit.memorykit import memory_plan as mp
    lm = loaded("sd15")
    with small_tmpfs(tmp_path / "full", "16m") as full:
        out, _, info = io.memory_plan(lm.patcher, plan_for="this machine", width=64, height=64, disk_folder=str(full))
        assert info["pick"] == "as loaded" and info["machine"]["disk_read_bytes_per_s"] == mp.DEFAULT_DISK_READ
        assert list(full.iterdir()) == []
        assert not any(str(full) in k for k in io._CACHE)
