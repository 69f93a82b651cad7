"""Memory Plan inside ComfyUI: measure the machine and the MODEL, plan (:mod:`memorykit.memory_plan`),
apply the pick with the code the individual nodes use (FP8 Layerwise Cast's
:func:`.fp8_patcher.fp8_layerwise_cast`, Group Offload's :func:`.offload_patcher.prepare_group_offload`),
and hand a VAE that decodes in the planned tiles (a copy; the input VAE is not changed).

Measured once per server process and cached (:func:`bandwidths`): pinned host→device bandwidth
(a timed copy, CUDA only), the offload folder's disk read speed (a timed read of a file with no
name, flushed from the page cache; nothing is left if the process is killed), sustained matmul throughput. Free VRAM/RAM/disk
are read on every run (they change between runs).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import shutil
import time

import comfy.model_management as mm
import torch

from .. import fp8
from .. import memory_plan as mp
from .. import validation
from . import placement
from ..offload_plan import GroupOffloadOptions
from ..offload_store import disk_read_speed
from .compat import is_dynamic, patcher_free_memory
from .fp8_patcher import FP8_ATTACHMENT, fp8_layerwise_cast, model_compute_dtype
from .gguf_weights import gguf_model_description
from .offload_patcher import (
    GroupOffloadSettings,
    comfy_block_lists,
    prepare_group_offload,
)
from .cleanup import usable_disk_folder
from .model_view import own_module

_log = logging.getLogger("MemoryKit")
_CACHE: dict[str, dict] = {}
PROBE_BYTES = 64 << 20  # timed copy / read size: large enough to reach full speed on PCIe and NVMe


def _timed(fn, repeat: int = 3) -> float:
    fn()  # warm-up
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def _h2d_bandwidth(device: torch.device) -> float:
    """Host→device copy speed as Group Offload streams: from pinned memory, or from pageable
    memory under ``--disable-pinned-memory`` (then nothing is page-locked)."""
    from .compat import pinned_memory_disabled
    src = torch.empty(PROBE_BYTES, dtype=torch.uint8)
    if not pinned_memory_disabled():
        src = src.pin_memory()
    dst = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=device)

    def copy_():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
    return PROBE_BYTES / _timed(copy_)  # both buffers are freed on return


def _disk_read(folder: str) -> float:
    """Read speed of ``folder``'s disk (:func:`memorykit.offload_store.disk_read_speed`: a file
    with no name, so a kill while measuring leaves nothing)."""
    return disk_read_speed(folder, PROBE_BYTES, lambda fn: _timed(fn, repeat=1))


def _flops(device: torch.device) -> float:
    n = 2048 if device.type == "cuda" else 256
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)

    def mm_():
        for _ in range(4):
            a @ a
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return 4 * 2 * n ** 3 / _timed(mm_)


def bandwidths(device, disk_folder: str) -> dict:
    """``{h2d_bytes_per_s, disk_read_bytes_per_s, flops_per_s}`` for ``device`` and the disk of
    ``disk_folder``, measured once per process (cached by device and folder). Without CUDA the
    host→device figure is None (no bus to cross). A folder that cannot take the read probe
    (a full or read-only disk) gets :data:`memorykit.memory_plan.DEFAULT_DISK_READ`, not cached."""
    device = torch.device(device)
    key = f"{device}|{os.path.realpath(disk_folder) if disk_folder else ''}"
    if key not in _CACHE:
        h2d = _h2d_bandwidth(device) if device.type == "cuda" else None
        try:
            disk = _disk_read(disk_folder) if disk_folder else mp.DEFAULT_DISK_READ  # no folder: no disk plan
        except OSError as e:
            _log.warning("Memory Plan: cannot measure the disk of %s (%s); assuming %.1f GB/s",
                         disk_folder, e, mp.DEFAULT_DISK_READ / 1e9)
            return {"h2d_bytes_per_s": h2d, "disk_read_bytes_per_s": mp.DEFAULT_DISK_READ,
                    "flops_per_s": _flops(device)}
        _CACHE[key] = {"h2d_bytes_per_s": h2d, "disk_read_bytes_per_s": disk, "flops_per_s": _flops(device)}
        _log.info("Memory Plan: measured %s", _CACHE[key])
    return dict(_CACHE[key])


def _cpu_bytes(patcher) -> int:
    dm = patcher.model
    return sum(t.numel() * t.element_size() for t in list(dm.parameters()) + list(dm.buffers()) if t.device.type == "cpu")


def measure_machine(patcher, disk_folder: str = "") -> mp.Machine:
    """This machine as ComfyUI sees it for ``patcher``'s model: free VRAM (:func:`patcher_free_memory`,
    which counts what dynamic VRAM can evict), RAM free plus what the model already holds in RAM,
    free disk in the offload folder (0 when it is unusable: see :func:`_measure`), and the cached
    :func:`bandwidths`."""
    return _measure(patcher, disk_folder)[0]


def _measure(patcher, disk_folder: str) -> tuple[mp.Machine, str | None]:
    """:func:`measure_machine` and, when the offload folder is unusable (the one check,
    :func:`.cleanup.usable_disk_folder`), why: then no disk is planned with."""
    dev = torch.device(patcher.load_device)
    try:
        folder, problem = usable_disk_folder(disk_folder), None
    except RuntimeError as e:  # no disk to plan with; plans in RAM/VRAM are still made
        folder, problem = None, str(e)
        _log.warning("Memory Plan: %s", e)
    b = bandwidths(dev, folder)
    gpu = dev.type == "cuda"
    return mp.Machine(
        vram_bytes=patcher_free_memory(patcher, dev) if gpu else 0,
        ram_bytes=int(mm.get_free_memory(torch.device("cpu"))) + _cpu_bytes(patcher),
        disk_bytes=shutil.disk_usage(folder).free if folder else 0,
        h2d_bytes_per_s=b["h2d_bytes_per_s"] or mp.DEFAULT_H2D,
        disk_read_bytes_per_s=b["disk_read_bytes_per_s"], flops_per_s=b["flops_per_s"],
        reserve_vram_bytes=int(mm.minimum_inference_memory()) if gpu else 0,
        dynamic_vram=is_dynamic(patcher), source="measured"), problem


def given_machine(vram_gb: float, ram_gb: float, disk_gb: float, dynamic_vram: bool = False) -> mp.Machine:
    """Another machine from its figures (GiB): bandwidths and throughput are the defaults of
    :mod:`memorykit.memory_plan` (a PCIe 4.0 card, an NVMe SSD). Raises ValueError naming the
    field for a NaN, infinite, negative or (``ram_gb``) zero figure."""
    for name, v in (("vram_gb", vram_gb), ("ram_gb", ram_gb), ("disk_gb", disk_gb)):
        validation.finite_number(v, name)  # NaN passes every comparison below
        if v < 0:
            raise ValueError(f"{name} must be ≥ 0 GiB, got {v}")
    if ram_gb <= 0:
        raise ValueError("ram_gb must be > 0: the RAM of the machine to plan for, in GiB")
    g = 2 ** 30
    return mp.Machine(int(vram_gb * g), int(ram_gb * g), int(disk_gb * g), dynamic_vram=dynamic_vram and vram_gb > 0,
                      source="given")


def latent_shape(latent: dict | None, patcher, width: int, height: int, frames: int) -> list[int]:
    """The latent the sampler will see: the LATENT's ``samples`` shape when wired, else one item
    of ``width``×``height`` (``frames`` for video models) in the model's latent format. Raises
    ValueError for a LATENT of batch 0. A 4-D LATENT for a model with 3-D latents gets a time
    axis of 1, as core's sampler adds it (comfy/sample.py ``fix_empty_latent_channels``)."""
    fmt = patcher.model.latent_format
    if latent is not None and isinstance(latent.get("samples"), torch.Tensor):
        shape = list(latent["samples"].shape)
        validation.nonempty_batch(shape, "latent", "LATENT")
        if getattr(fmt, "latent_dimensions", 2) == 3 and len(shape) == 4:
            shape.insert(2, 1)
        return shape
    ch = int(getattr(fmt, "latent_channels", 4))
    s = int(getattr(fmt, "spacial_downscale_ratio", 8))
    if getattr(fmt, "latent_dimensions", 2) == 3:
        t = int(getattr(fmt, "temporal_downscale_ratio", 4))
        return [1, ch, (max(1, frames) - 1) // t + 1, height // s, width // s]
    return [1, ch, height // s, width // s]


def _patch_area(dm) -> int:
    p = getattr(dm, "patch_size", None)
    if isinstance(p, int):
        return p * p
    if isinstance(p, (tuple, list)):
        return int(math.prod(p))
    # UNets: most parameters sit at the level 4× down (SDXL: 1024² → latent 128² → 32²), 1/16 of
    # the latent positions: 2 · 2.6e9 · 1024 ≈ 5.3 TFLOP per SDXL forward at 1024².
    return 16


def _activation_bytes(patcher, run_shape: list[int]) -> int | None:
    """Core's ``BaseModel.memory_required(run_shape)`` on a CUDA load device; elsewhere (the
    CPU, a plan for another machine) the same formula's branch for PyTorch/xformers flash
    attention, the one core takes on every CUDA GPU (comfy/model_base.py: latent area × dtype size
    × 0.01 × ``memory_usage_factor`` MiB); None when the model has neither."""
    bm = patcher.model
    if not hasattr(bm, "memory_required"):
        return None
    if torch.device(patcher.load_device).type == "cuda":
        return int(bm.memory_required(run_shape))
    factor = getattr(bm, "memory_usage_factor", None)
    if factor is None:
        return None
    dtype = (getattr(bm, "get_dtype_inference", None) or bm.get_dtype)()
    area = run_shape[0] * math.prod(run_shape[2:])
    return int(area * mm.dtype_size(dtype) * 0.01 * factor * (1 << 20))


def model_figures(patcher, shape: list[int]) -> mp.ModelFigures:
    """``patcher``'s diffusion model as :class:`memorykit.memory_plan.ModelFigures`: blocks as
    Group Offload streams them (:func:`comfy_block_lists`), the layers FP8 Layerwise Cast would
    cast (its ``auto`` skip preset), activations from core's ``memory_required`` for the batch
    core samples (cond + uncond: ``2 × batch``, comfy/sampler_helpers.py), FLOPs ≈ 2 × parameters
    × tokens (latent positions / patch area) × that batch."""
    dm = own_module(patcher)  # not another loaded clone's patches (FP8 layers) applied to the shared model
    lists = comfy_block_lists(dm)
    batch = 2 * shape[0]
    run_shape = [batch] + list(shape[1:])
    act = _activation_bytes(patcher, run_shape)
    cast = set()
    # not through FP8 Layerwise Cast already, not GGUF (already quantized: FP8 Layerwise Cast refuses it)
    if patcher.get_attachment(FP8_ATTACHMENT) is None and gguf_model_description(patcher) is None:
        cast = set(fp8.plan_layers(dm, fp8.default_skip_patterns(fp8.detect_family(dm), "auto")).cast)
    # parameters counted by their logical shape (a GGUF weight's tensor_shape; its bytes are counted as stored)
    params = sum(math.prod(getattr(p, "tensor_shape", p.shape)) for p in dm.parameters())
    tokens = math.prod(shape[2:]) / _patch_area(dm)
    dtype = str(model_compute_dtype(patcher)).replace("torch.", "")
    label = type(patcher.model).__name__
    figs = mp.module_figures(dm, lists, cast or None, label, dtype, act, 2.0 * params * tokens * batch)
    return dataclasses.replace(figs, activation_min_bytes=_activation_bytes(patcher, list(shape)))


def plan_tiles(vae, machine: mp.Machine, shape: list[int]) -> tuple[int | None, str]:
    """Tile size for decoding ``shape`` with ``vae`` on ``machine`` (see
    :func:`memorykit.memory_plan.choose_tile`); cost per latent pixel = core's
    ``memory_used_decode`` for a 16×16 tile / 256, the cost model Tiled VAE uses. Raises
    ValueError naming the vae when it decodes latents of other dimensions than ``shape``'s. A
    VAE that Tiled VAE does not cut (1-D audio latents, an extra 1-D channel) is left whole."""
    from .tiled_vae_io import vae_shape
    vae.throw_exception_if_invalid()
    name = type(vae.first_stage_model).__name__
    if vae.latent_dim not in (2, 3) or vae.extra_1d_channel is not None:
        return None, (f"VAE: {name} has {vae.latent_dim}-D latents, which Tiled VAE does not cut: "
                      "decoded whole by core's VAE Decode, no tiles.")
    if len(shape) != vae.latent_dim + 2:
        raise ValueError(f"vae: this VAE ({name}) decodes {vae.latent_dim}-D latents, "
                         f"the latent {shape} has {len(shape) - 2}: connect the VAE made for this model")
    from .vae_defer import deferral
    why = deferral(vae, "decode")
    if why:  # tiles itself, or cannot be tiled from outside: decoded by core's VAE Decode
        return None, f"VAE: {name} is not tiled by MemoryKit ({why}): decoded by core's VAE Decode, no tiles."
    vs = vae_shape(vae)
    frames = shape[2] if len(shape) == 5 else None
    probe = [1, vs.latent_channels] + ([frames] if frames else []) + [16, 16]
    per = vae.memory_used_decode(probe, vae.vae_dtype) / 256.0
    hw = (int(shape[-2]), int(shape[-1]))
    if machine.gpu:
        return mp.choose_tile(machine.vram_bytes, int(vae.patcher.model_size()), 0.0, per, hw, vs.spatial_factor,
                              machine.reserve_vram_bytes)
    return mp.choose_tile(int(0.9 * machine.ram_bytes), 0, 0.0, per, hw, vs.spatial_factor, 0)


class PlannedVAE:
    """Mixed into a copy of a ``comfy.sd.VAE`` (class swap, as Group Offload makes its patcher):
    ``decode``/``encode`` run Tiled VAE Decode/Encode's own tiling (:mod:`.tiled_vae_io`: seams
    blended, the VAE's causal time cache and shared statistics kept) at the planned tile, so a
    plain VAE Decode downstream tiles as planned; a Tiled VAE Decode/Encode downstream caps its
    ``tile_size`` at it. A VAE that Tiled VAE does not tile (``vae_defer.deferral``: it tiles
    itself, or LTX 2.4's diffusion decoder) decodes/encodes as before."""

    memorykit_tile_px: int = 512
    memorykit_overlap_px: int = 64

    def _planned_options(self):
        from .tiled_vae_io import TiledVAEOptions
        return TiledVAEOptions(tile_px=self.memorykit_tile_px, overlap_px=self.memorykit_overlap_px)

    def decode(self, samples_in, *args, **kwargs):
        from .vae_defer import deferral
        if deferral(self, "decode"):
            return super().decode(samples_in, *args, **kwargs)
        from .tiled_vae_io import tiled_vae_decode
        images, _ = tiled_vae_decode(self, samples_in, self._planned_options())
        if samples_in.ndim == 5:  # core's VAE.decode keeps [B, T, H, W, C] for video
            images = images.reshape((samples_in.shape[0], -1) + tuple(images.shape[-3:]))
        return images

    def encode(self, pixel_samples, *args, **kwargs):
        from .vae_defer import deferral
        if deferral(self, "encode"):
            return super().encode(pixel_samples, *args, **kwargs)
        from .tiled_vae_io import tiled_vae_encode
        return tiled_vae_encode(self, pixel_samples, self._planned_options())[0]


def plan_noting_disk(make_plan, disk_problem: str | None):
    """``make_plan()``, with why no disk was planned with (a blocked offload folder) as the plan's
    first reason, or appended to the PlanError when no plan fits."""
    try:
        plan = make_plan()
    except mp.PlanError as e:
        if disk_problem:
            raise mp.PlanError(f"{e} (No disk was planned with: {disk_problem})") from None
        raise
    if disk_problem:
        plan.reasons.insert(0, f"No disk was planned with: {disk_problem}")
    return plan


def planned_vae(vae, tile_px: int | None):
    """``vae`` itself when ``tile_px`` is None, else a shallow copy (same weights and patcher)
    whose decode/encode tile at ``tile_px`` and which carries ``memorykit_tile_px``."""
    if tile_px is None:
        return vae
    n = copy.copy(vae)
    base = next(c for c in type(vae).__mro__ if not issubclass(c, PlannedVAE))
    n.__class__ = type(f"Planned{base.__name__}", (PlannedVAE, base), {})
    n.memorykit_tile_px = int(tile_px)
    n.memorykit_overlap_px = min(64, int(tile_px) // 4)
    return n


def apply_plan(model, plan: mp.Plan, disk_folder: str = ""):
    """Apply ``plan.pick`` to ``model``: FP8 Layerwise Cast (defaults: float8_e4m3fn, per-tensor
    scale, auto skip preset) and/or Group Offload (block_level, use_stream, RAM or disk, the
    planned budget when the plan was measured here, else auto). Returns ``(MODEL, applied)``:
    ``applied`` lists the infos of the nodes' own functions. The offload's run reports are not
    sent to the node: its badge stays the plan's."""
    pick, out, applied = plan.pick, model, {}
    if pick.fp8:
        out, applied["fp8"] = fp8_layerwise_cast(out)
    if pick.offload_to is not None:
        opts = GroupOffloadOptions(offload_type="block_level", num_blocks_per_group=1, use_stream=True,
                                   offload_to=pick.offload_to)
        budget = pick.vram_budget_bytes if plan.machine.source == "measured" and plan.machine.gpu else 0
        out, applied["group_offload"] = prepare_group_offload(out, GroupOffloadSettings(
            options=opts, vram_budget_bytes=int(budget), disk_folder=disk_folder))
        if out is not model:  # a clone of this node's: messages downstream name Memory Plan, the node in the graph
            out.set_attachments(placement.PLANNED_KEY, pick.name)
    return out, applied


def memory_plan(model, vae=None, latent=None, plan_for: str = "this machine", vram_gb: float = 12.0,
                ram_gb: float = 32.0, disk_gb: float = 100.0, allow_fp8: bool = True, prefer: str = "speed",
                width: int = 1024, height: int = 1024, frames: int = 81, disk_folder: str = ""):
    """The Memory Plan node: ``(MODEL, VAE or None, info)``. ``info``: the plan's dict, its text
    table and sentences, ``applied`` (the FP8 / Group Offload infos). Raises
    :class:`memorykit.memory_plan.PlanError` before anything is applied when nothing fits, and
    ValueError for a bad option."""
    if plan_for not in ("this machine", "given figures"):
        raise ValueError(f"plan_for must be 'this machine' or 'given figures', got {plan_for!r}")
    placed = placement.placed_by(model)
    if placed:  # its candidates (Group Offload to RAM or disk) would be refused at apply
        raise ValueError(f"model: this MODEL comes through {placed}, which already decides where the weights live. "
                         f"Connect Memory Plan to the loader (or LoRA loader) directly, or use {placed} alone.")
    machine, disk_problem = (_measure(model, disk_folder) if plan_for == "this machine"
                             else (given_machine(vram_gb, ram_gb, disk_gb), None))
    shape = latent_shape(latent, model, width, height, frames)
    figures = model_figures(model, shape)
    plan = plan_noting_disk(lambda: mp.make_plan(machine, figures, mp.PlanOptions(allow_fp8=allow_fp8, prefer=prefer)),
                            disk_problem)
    if vae is not None:
        plan.tile_px, sentence = plan_tiles(vae, machine, shape)
        plan.reasons.insert(-1, sentence)
    out, applied = apply_plan(model, plan, disk_folder)
    info = plan.as_dict() | {"latent_shape": shape, "applied": applied, "table": plan.table(),
                             "badge": plan.badge()}
    return out, (planned_vae(vae, plan.tile_px) if vae is not None else None), info


def format_plan(info: dict) -> str:
    """The report text: machine, the candidates table, one sentence per decision."""
    m = info["machine"]
    g = 2 ** 30
    head = (f"Memory Plan for {info['model']['label']} ({info['model']['weight_bytes'] / g:.2f} GiB "
            f"{info['model']['dtype']}, latent {info['latent_shape']}) on {m['source']} figures: "
            f"VRAM {m['vram_bytes'] / g:.2f} GiB, RAM {m['ram_bytes'] / g:.2f} GiB, disk {m['disk_bytes'] / g:.1f} GiB, "
            f"host→device {m['h2d_bytes_per_s'] / 1e9:.1f} GB/s, disk read {m['disk_read_bytes_per_s'] / 1e9:.1f} GB/s, "
            f"{m['flops_per_s'] / 1e12:.1f} TFLOP/s")
    return "\n".join([head, info["table"]] + [f"- {r}" for r in info["reasons"]])
