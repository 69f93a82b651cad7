"""Memory Plan: choose the memory techniques for one machine and one model, from bytes and bandwidth.

Plain Python (torch only for reading module sizes); knows nothing of ComfyUI. Inputs are
figures: :class:`Machine` (free VRAM, RAM the model may hold, free disk, host→device and disk
read bandwidth, compute throughput), :class:`ModelFigures` (bytes per block and outside blocks,
in the model's dtype and after fp8 storage, an activation estimate, FLOPs per step) and
:class:`PlanOptions`. :func:`make_plan` predicts every candidate — nothing, FP8 Layerwise Cast,
Group Offload from RAM under a budget, FP8 + Group Offload, Group Offload to disk (under
ComfyUI's dynamic VRAM: core's own residency, with or without fp8, or disk when RAM is short) —
and picks one, with one sentence per decision naming the figures that decided it. A plan
nothing fits raises :class:`PlanError` naming what is short and by how much.

A *step* is one call of the diffusion model (cond and uncond batched, as ComfyUI does): every
streamed byte crosses the bus once per step. Sizes are bytes, times seconds, GiB = 2**30 bytes.

Every constant names its source: this project's measurements (H200, 2026-11-30, "Measured
anchors" in docs/memory-plan.md and docs/benchmarks.md), published figures, or core ComfyUI's
own rule.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from .memory_plan_choice import MEMORY_SLOWDOWN, MIN_STREAM_BLOCKS, STREAM_OVERHEAD, PlanError, choose  # noqa: F401
from .offload_plan import RING_GROUPS, spread_order
from .units import size_text

GIB = float(1 << 30)
# core's reserve for inference (comfy/model_management.py minimum_inference_memory(): 0.8 GiB
# + --reserve-vram): ComfyUI keeps it free whatever a model asks.
RESERVE_VRAM = int(0.8 * GIB)
# Block-level streaming keeps RING_GROUPS["block_level"] (2) largest streamed blocks in VRAM: the
# one computing and the one prefetched (memorykit/offload_plan.py, the event ring).
RING_BLOCKS = RING_GROUPS["block_level"]
# Measured (H200, Flux-shaped 5.05 B, 1024²): resident bf16 0.069 s, fp8 resident 0.088 s for
# 4.76 GiB of fp8 weights → the cast up costs 0.019 s per 4.76 GiB ≈ 270 GB/s of fp8 bytes.
FP8_CAST_BYTES_PER_S = 270e9
# diffusers-mm's published rule when no activation estimate exists: weights × 1.5 ≤ free VRAM
# → no offload, i.e. activations ≈ half the weights.
DIFFUSERS_MM_FACTOR = 1.5
# Defaults for plan_for = given figures (a machine we cannot measure):
DEFAULT_H2D = 25e9       # PCIe 4.0 x16 pinned copies (31.5 GB/s raw; ~25 GB/s achieved, NVIDIA bandwidthTest)
DEFAULT_DISK_READ = 3e9  # a PCIe 4.0 NVMe SSD's sequential read (3–7 GB/s published); SATA is 0.55 GB/s
DEFAULT_FLOPS = 110e12   # RTX 4090 165 TFLOP/s dense bf16 (NVIDIA Ada whitepaper) × 0.68, the share the H200
                         # anchor reached (2·5.05e9·4608 FLOPs in 0.069 s = 674 of 989 TFLOP/s)
TILE_CHOICES = (1024, 768, 512, 384, 256, 192, 128, 64)  # tile sides offered, px (core's default is 512)
PREFERS = ("speed", "memory")


@dataclass(frozen=True)
class Machine:
    """What the plan may use. ``vram_bytes``: free VRAM for this model (0 = no GPU: ComfyUI
    computes on the CPU); ``ram_bytes``: RAM the model may hold, its own loaded weights
    included; ``disk_bytes``: free space in the offload folder; bandwidths in bytes/s;
    ``flops_per_s``: sustained dense throughput; ``dynamic_vram``: ComfyUI's dynamic VRAM
    manages this model (core places weights); ``source``: ``measured`` / ``given``."""

    vram_bytes: int
    ram_bytes: int
    disk_bytes: int
    h2d_bytes_per_s: float = DEFAULT_H2D
    disk_read_bytes_per_s: float = DEFAULT_DISK_READ
    flops_per_s: float = DEFAULT_FLOPS
    reserve_vram_bytes: int = RESERVE_VRAM
    dynamic_vram: bool = False
    source: str = "given"

    @property
    def gpu(self) -> bool:
        return self.vram_bytes > 0

    @property
    def usable_vram(self) -> int:
        return max(0, self.vram_bytes - self.reserve_vram_bytes) if self.gpu else 0


@dataclass(frozen=True)
class ModelFigures:
    """One diffusion model. ``block_bytes``: each block's weights in execution order;
    ``other_bytes``: weights outside blocks; ``fp8_*``: the same after FP8 Layerwise Cast
    (None: fp8 not possible); ``activation_bytes``: working memory of one step for the latent
    (None: diffusers-mm's ×1.5 rule) with cond and uncond batched, ``activation_min_bytes`` with
    them run one after the other (core's ``minimum_memory_required``: it splits the batch when
    memory is short, comfy/samplers.py — then every streamed byte crosses twice per step);
    ``flops_per_step``; ``dtype`` for the sentences; ``fp8_copy_bytes``: see :attr:`fp8_added`;
    ``fp8_work_bytes``: scratch of quantising the largest layer (where no GPU does it)."""

    block_bytes: tuple[int, ...]
    other_bytes: int
    fp8_block_bytes: tuple[int, ...] | None = None
    fp8_other_bytes: int = 0
    activation_bytes: int | None = None
    flops_per_step: float = 0.0
    activation_min_bytes: int | None = None
    fp8_copy_bytes: int | None = None
    fp8_work_bytes: int = 0

    @property
    def fp8_added(self) -> int:
        """RAM the fp8 copies add next to the loaded weights (the cast layers' fp8 weights, scales
        and bias copies; kept layers are shared); default the whole fp8 size."""
        return self.fp8_copy_bytes if self.fp8_copy_bytes is not None else (self.fp8_bytes or 0)
    dtype: str = "bfloat16"
    label: str = "model"

    @property
    def weight_bytes(self) -> int:
        return sum(self.block_bytes) + self.other_bytes

    @property
    def fp8_bytes(self) -> int | None:
        return None if self.fp8_block_bytes is None else sum(self.fp8_block_bytes) + self.fp8_other_bytes

    @property
    def activations(self) -> int:
        if self.activation_bytes is not None:
            return int(self.activation_bytes)
        return int((DIFFUSERS_MM_FACTOR - 1) * self.weight_bytes)


@dataclass(frozen=True)
class PlanOptions:
    allow_fp8: bool = True
    prefer: str = "speed"

    def validate(self) -> None:
        if self.prefer not in PREFERS:
            raise ValueError(f"prefer must be one of {PREFERS}, got {self.prefer!r}")


@dataclass
class Candidate:
    """One way to run the model, predicted. ``offload_to``: None (no Group Offload), ``cpu``,
    ``disk``; ``residency``: who places weights (``resident``, ``memorykit`` streams,
    ``core dynamic VRAM``); ``vram_budget_bytes``: Group Offload's budget (weights + ring)."""

    name: str
    fp8: bool
    offload_to: str | None
    residency: str
    peak_vram_bytes: int = 0
    peak_ram_bytes: int = 0
    disk_bytes: int = 0
    resident_bytes: int = 0
    streamed_bytes: int = 0
    vram_budget_bytes: int = 0
    compute_s: float = 0.0
    floor_s: float = 0.0
    est_s: float = 0.0
    forwards: int = 1
    short: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.short

    def badge(self) -> str:
        """"fp8 + stream 6.10 GiB/step from RAM", "fp8 resident", "core dynamic VRAM", ..."""
        pre = "fp8 + " if self.fp8 else ""
        if self.offload_to is not None or (self.residency == "core dynamic VRAM" and self.streamed_bytes):
            from .badge import fmt_bytes
            src = "disk" if self.offload_to == "disk" else "RAM"
            return f"{pre}stream {fmt_bytes(self.streamed_bytes)}/step from {src}"
        if self.residency == "core dynamic VRAM":
            return f"{pre}core dynamic VRAM"
        return "fp8 resident" if self.fp8 else "as loaded"


@dataclass
class Plan:
    """The candidates (predicted), the pick, the tile size (None: decode untiled) and one sentence
    per decision."""

    machine: Machine
    model: ModelFigures
    options: PlanOptions
    candidates: list[Candidate]
    pick: Candidate
    reasons: list[str]
    tile_px: int | None = None

    def badge(self) -> list[str]:
        tiles = f"tiles {self.tile_px}" if self.tile_px else "no tiles"
        return [self.pick.badge(), tiles]

    def as_dict(self) -> dict:
        return {"machine": asdict(self.machine), "model": {"label": self.model.label, "dtype": self.model.dtype,
                "weight_bytes": self.model.weight_bytes, "fp8_bytes": self.model.fp8_bytes,
                "blocks": len(self.model.block_bytes), "activation_bytes": self.model.activations,
                "flops_per_step": self.model.flops_per_step},
                "options": asdict(self.options), "candidates": [asdict(c) | {"fits": c.fits} for c in self.candidates],
                "pick": self.pick.name, "reasons": list(self.reasons), "tile_px": self.tile_px}

    def table(self) -> str:
        """The candidates as a text table (GiB, seconds), the pick marked with *."""
        rows = [f"{'':2}{'candidate':<22}{'VRAM':>7}{'RAM':>7}{'disk':>7}{'stream/step':>12}"
                f"{'compute':>9}{'floor':>8}{'est s/step':>11}  fits"]
        for c in self.candidates:
            mark = "* " if c is self.pick else "  "
            rows.append(f"{mark}{c.name:<22}{c.peak_vram_bytes / GIB:>7.2f}{c.peak_ram_bytes / GIB:>7.2f}"
                        f"{c.disk_bytes / GIB:>7.2f}{c.streamed_bytes / GIB:>12.2f}{c.compute_s:>9.3f}"
                        f"{c.floor_s:>8.3f}{c.est_s:>11.3f}  {'yes' if c.fits else '; '.join(c.short)}")
        return "\n".join(rows)


def gib_text(n: float) -> str:
    """Bytes → "1.23 GiB", or MiB/KiB below 1 GiB (:func:`memorykit.units.size_text`)."""
    return size_text(n)


def fit_blocks(block_bytes: tuple[int, ...], other_bytes: int, budget: int | None) -> tuple[int, int, int]:
    """Group Offload's rule on sizes (:func:`memorykit.offload_plan.plan_offload`, block_level,
    event ring): the remainder stays, then blocks in :func:`spread_order` while they fit next to
    a ring of :data:`RING_BLOCKS` largest streamed blocks. Returns ``(resident, streamed, ring)``
    bytes; ``budget`` None streams every block."""
    blocks = [b for b in block_bytes if b > 0]
    ring = RING_BLOCKS * max(blocks, default=0)
    resident = set()
    if budget is not None:
        avail = budget - ring - other_bytes
        for i in spread_order(len(blocks)):
            if avail >= 0 and blocks[i] <= avail:
                resident.add(i)
                avail -= blocks[i]
    streamed = [b for i, b in enumerate(blocks) if i not in resident]
    ring = min(RING_BLOCKS * max(streamed, default=0), sum(streamed))
    return other_bytes + sum(blocks[i] for i in resident), sum(streamed), ring


def _times(c: Candidate, m: Machine, model: ModelFigures, fp8_bytes: int, bandwidth: float) -> None:
    c.compute_s = model.flops_per_step / m.flops_per_s if m.flops_per_s > 0 else 0.0
    cast = fp8_bytes / FP8_CAST_BYTES_PER_S if c.fp8 else 0.0
    c.floor_s = max(c.compute_s + cast, c.streamed_bytes / bandwidth if bandwidth > 0 else 0.0)
    c.est_s = c.floor_s * (STREAM_OVERHEAD if c.streamed_bytes else 1.0)


def _check(c: Candidate, m: Machine, vram_cap: int) -> Candidate:
    if m.gpu and c.peak_vram_bytes > vram_cap and m.vram_bytes <= m.reserve_vram_bytes:
        c.short.append(f"the VRAM given ({m.vram_bytes / GIB:.2f} GiB) is at or below core's {m.reserve_vram_bytes / GIB:.2f} "
                       "GiB reserve, which ComfyUI keeps free whatever a model asks: nothing fits in VRAM")
    elif m.gpu and c.peak_vram_bytes > vram_cap:
        c.short.append(f"VRAM short by {gib_text(c.peak_vram_bytes - vram_cap)}")
    if c.peak_ram_bytes > m.ram_bytes:
        c.short.append(f"RAM short by {gib_text(c.peak_ram_bytes - m.ram_bytes)}")
    if c.disk_bytes > m.disk_bytes:
        c.short.append(f"disk short by {gib_text(c.disk_bytes - m.disk_bytes)}")
    return c


def _streamed(name, fp8, offload_to, residency, blocks, other, m, model, act, opts, weights, bf16, forwards=1):
    """A streaming candidate: the largest budget (speed), or the smallest whose transfer still
    hides under compute (memory: streamed bytes ≤ compute time × bandwidth)."""
    cap = m.usable_vram
    bw = m.h2d_bytes_per_s if offload_to != "disk" else min(m.h2d_bytes_per_s, m.disk_read_bytes_per_s)
    budget = max(0, cap - act)
    if opts.prefer == "memory" and offload_to is not None:
        hide = model.flops_per_step / m.flops_per_s * bw if m.flops_per_s > 0 else 0
        lo, hi = 0, budget
        while hi - lo > (1 << 24):  # 16 MiB resolution
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fit_blocks(blocks, other, mid)[1] * forwards <= hide else (mid, hi)
        budget = hi
    resident, streamed, ring = fit_blocks(blocks, other, budget if m.gpu else None)
    if residency == "core dynamic VRAM":  # core keeps what fits, streams the rest (no ring of ours)
        resident, ring = min(weights, budget), 0
        streamed = weights - resident
    # disk: the streamed groups' files; RAM keeps the ring's staging copies (resident blocks and
    # the remainder live in VRAM). RAM otherwise: the loaded weights, plus their fp8 copies.
    disk = streamed if offload_to == "disk" else 0
    ram = ring if offload_to == "disk" else bf16 + (model.fp8_added if fp8 else 0)
    c = Candidate(name, fp8, offload_to, residency, peak_vram_bytes=resident + ring + act, peak_ram_bytes=ram,
                  disk_bytes=disk, resident_bytes=resident, streamed_bytes=streamed * forwards,
                  vram_budget_bytes=resident + ring if offload_to is not None else 0, forwards=forwards)
    _times(c, m, model, weights, bw)
    return c


def candidates(m: Machine, model: ModelFigures, opts: PlanOptions) -> list[Candidate]:
    """Every candidate, predicted (see the module docstring); fitting or not (``short``). A
    candidate whose batched activations do not fit VRAM is predicted with cond and uncond one
    after the other (``activation_min_bytes``, two forwards per step) when that fits."""
    full = _candidates(m, model, opts, model.activations, 1)
    if model.activation_min_bytes is None or not m.gpu:
        return full
    split = {c.name: c for c in _candidates(m, model, opts, int(model.activation_min_bytes), 2)}
    return [split[c.name] if not c.fits and c.name in split else c for c in full]


def _candidates(m: Machine, model: ModelFigures, opts: PlanOptions, act: int, forwards: int) -> list[Candidate]:
    w, w8 = model.weight_bytes, model.fp8_bytes
    fp8_ok = opts.allow_fp8 and w8 is not None and w8 < w
    cap = m.usable_vram
    out = []
    if m.dynamic_vram and m.gpu:
        out.append(_streamed("core dynamic VRAM", False, None, "core dynamic VRAM", model.block_bytes,
                             model.other_bytes, m, model, act, opts, w, w, forwards))
        if fp8_ok:
            out.append(_streamed("fp8 + core dynamic VRAM", True, None, "core dynamic VRAM", model.fp8_block_bytes,
                                 model.fp8_other_bytes, m, model, act, opts, w8, w, forwards))
    else:
        # RAM is what the plan holds while sampling: core moves resident weights to the GPU (the
        # file is read once through RAM while loading); fp8 keeps the loaded weights in RAM (the
        # input MODEL's), streaming keeps them there, disk keeps only the ring's staging copies.
        c = Candidate("as loaded", False, None, "resident", peak_vram_bytes=w + act if m.gpu else 0,
                      peak_ram_bytes=0 if m.gpu else w + act, resident_bytes=w if m.gpu else 0)
        _times(c, m, model, 0, 0)
        out.append(c)
        if fp8_ok:  # fp8 copies next to the loaded weights (the input MODEL keeps them)
            # without a GPU the quantising scratch (memorykit.fp8.quantize_weight: |w| of the largest
            # layer in its dtype + a 4096-row float32 chunk) is in RAM too, before the forward's activations
            c = Candidate("fp8 resident", True, None, "resident", peak_vram_bytes=w8 + act if m.gpu else 0,
                          peak_ram_bytes=w + model.fp8_added + (0 if m.gpu else max(act, model.fp8_work_bytes)),
                          resident_bytes=w8 if m.gpu else 0)
            _times(c, m, model, w8, 0)
            out.append(c)
        if m.gpu and len(model.block_bytes) >= 1:
            out.append(_streamed("stream from RAM", False, "cpu", "memorykit", model.block_bytes, model.other_bytes,
                                 m, model, act, opts, w, w, forwards))
            if fp8_ok:
                out.append(_streamed("fp8 + stream from RAM", True, "cpu", "memorykit", model.fp8_block_bytes,
                                     model.fp8_other_bytes, m, model, act, opts, w8, w, forwards))
    if model.block_bytes:  # disk: the model's own weights to files, RAM keeps the rest and the ring
        c = _streamed("stream from disk", False, "disk", "memorykit", model.block_bytes, model.other_bytes,
                      m, model, act, replace(opts, prefer="speed"), w, w, forwards)
        if not m.gpu:
            c.peak_vram_bytes, c.resident_bytes = 0, 0
            c.peak_ram_bytes += act
        out.append(c)
    # a streaming plan that streams nothing is its resident counterpart: left out
    out = [c for c in out if c.offload_to is None or c.streamed_bytes or not m.gpu]
    return [_check(c, m, cap) for c in out]


def choose_tile(vram_bytes: int, vae_weight_bytes: int, fixed_bytes: float, per_latent_pixel_bytes: float,
                latent_hw: tuple[int, int], spatial_factor: int,
                reserve_bytes: int = RESERVE_VRAM) -> tuple[int | None, str]:
    """Tile side (px) for decoding a ``latent_hw`` latent, or None when the whole image fits.

    The cost model is Tiled VAE's (:class:`memorykit.tiled_vae.TileCost`: ``fixed + per_pixel ×
    latent pixels``); the budget is ``vram_bytes`` − core's reserve − the VAE's weights (core
    unloads the diffusion model to make room for the VAE). Returns ``(tile_px, sentence)``.
    """
    from .tiled_vae import TileCost, fit_tile
    budget = vram_bytes - reserve_bytes - vae_weight_bytes
    cost = TileCost(fixed_bytes, per_latent_pixel_bytes, "modelled")
    whole = cost.bytes_for(latent_hw[0] * latent_hw[1])
    if whole <= budget:
        return None, (f"VAE: decoding the whole {latent_hw[1] * spatial_factor}×{latent_hw[0] * spatial_factor} image "
                      f"needs about {gib_text(whole)} next to {gib_text(vae_weight_bytes)} of VAE weights, within {gib_text(budget)}: "
                      "no tiles.")
    for px in TILE_CHOICES:
        t = px // spatial_factor
        if fit_tile(latent_hw, cost, budget, t, t) is not None:
            return px, (f"VAE: the whole image would need {gib_text(whole)} of {gib_text(budget)} free for decoding; tiles of "
                        f"{px} px need about {gib_text(cost.bytes_for(min(t, latent_hw[0]) * min(t, latent_hw[1])))}.")
    return TILE_CHOICES[-1], (f"VAE: even {TILE_CHOICES[-1]} px tiles exceed the {gib_text(budget)} left; smallest "
                              "tiles chosen; if decoding still runs out of memory, start ComfyUI with --cpu-vae "
                              "or make the image smaller.")


def make_plan(machine: Machine, model: ModelFigures, options: PlanOptions | None = None) -> Plan:
    """Predict every candidate and pick one (see :func:`candidates`,
    :func:`memorykit.memory_plan_choice.choose`).
    Raises ValueError for a bad option, :class:`PlanError` when nothing fits."""
    options = options or PlanOptions()
    options.validate()
    cands = candidates(machine, model, options)
    pick, reasons = choose(cands, machine, model, options)
    return Plan(machine, model, options, cands, pick, reasons)


def module_figures(module, block_lists, fp8_cast: set[str] | None, label: str, dtype: str,
                   activation_bytes: int | None, flops_per_step: float) -> ModelFigures:
    """:class:`ModelFigures` of a torch module (meta tensors work: only sizes are read).

    ``block_lists``: ``[(list_name, [(qualified_name, block), ...]), ...]`` as Group Offload
    streams them; ``fp8_cast``: qualified names of the layers FP8 Layerwise Cast casts (their
    weights become 1 byte per element plus a float32 scale; None = fp8 not possible).
    """
    from .offload_plan import module_tensors, tensor_bytes
    names = {id(t): n for n, t in list(module.named_parameters()) + list(module.named_buffers())}
    cast_w = {f"{n}.weight" for n in (fp8_cast or ())}

    def fp8_size(ts) -> int:
        return sum(t.numel() + 4 if names.get(id(t)) in cast_w else t.numel() * t.element_size() for t in ts)

    blocks = [b for _, bl in block_lists for _, b in bl]
    in_blocks = {id(t) for b in blocks for t in module_tensors(b)}
    rest = [t for t in module_tensors(module) if id(t) not in in_blocks]
    fp8_blocks = None if fp8_cast is None else tuple(fp8_size(module_tensors(b)) for b in blocks)
    mods = dict(module.named_modules())
    copies = None if fp8_cast is None else sum(
        mods[n].weight.numel() + 4 + (mods[n].bias.numel() * mods[n].bias.element_size()
                                      if getattr(mods[n], "bias", None) is not None else 0) for n in fp8_cast)
    work = max((mods[n].weight.numel() * mods[n].weight.element_size()
                + min(4096, mods[n].weight.shape[0]) * (mods[n].weight[0].numel() if mods[n].weight.ndim else 1) * 4
                for n in (fp8_cast or ())), default=0)
    return ModelFigures(tuple(tensor_bytes(module_tensors(b)) for b in blocks), tensor_bytes(rest),
                        fp8_block_bytes=fp8_blocks, fp8_other_bytes=fp8_size(rest) if fp8_cast is not None else 0,
                        activation_bytes=activation_bytes, flops_per_step=flops_per_step, dtype=dtype, label=label,
                        fp8_copy_bytes=copies, fp8_work_bytes=work)
