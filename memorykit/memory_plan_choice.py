"""Memory Plan's pick among the predicted candidates (:mod:`memorykit.memory_plan`) and the
sentences that explain it, each naming the figures that decided it, with the constants those
sentences quote and :class:`PlanError` (``memorykit.memory_plan`` imports them from here, so
imports run one way). Plain Python."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .units import size_text as gib_text

if TYPE_CHECKING:  # annotations only: memory_plan imports this module
    from .memory_plan import Candidate, Machine, ModelFigures, PlanOptions

# Measured: block_level + stream ran 0.214 s against its floor max(0.069, 9.4 GiB / 55.4 GB/s =
# 0.182 s), 1.18×; compute-bound (2048²) every offload path ran 1.11–1.14× resident. 1.15 ×
# the floor is the estimate for a plan that streams.
STREAM_OVERHEAD = 1.15
# diffusers-mm streams only models with ≥ 8 repeated blocks (fewer: whole-model offload).
MIN_STREAM_BLOCKS = 8
# prefer=memory: the least VRAM among plans at most this much slower than the fastest (a choice
# of this pack: a plan twice as slow is not what "memory" asks for).
MEMORY_SLOWDOWN = 1.5


class PlanError(ValueError):
    """No candidate fits: the message names what is short (VRAM, RAM, disk) and by how much."""


def choose(cands: list[Candidate], m: Machine, model: ModelFigures, opts: PlanOptions) -> tuple[Candidate, list[str]]:
    """The pick and the sentences that explain it. Raises :class:`PlanError` when nothing fits."""
    fits = [c for c in cands if c.fits]
    if not fits:
        best = min(cands, key=lambda c: (len(c.short), c.peak_vram_bytes + c.peak_ram_bytes))
        raise PlanError(f"Memory Plan: no way to run {model.label} ({gib_text(model.weight_bytes)} of weights) fits this "
                        f"machine ({gib_text(m.vram_bytes)} VRAM, {gib_text(m.ram_bytes)} RAM, {gib_text(m.disk_bytes)} disk). The "
                        f"closest, {best.name}, needs {gib_text(best.peak_vram_bytes)} VRAM, {gib_text(best.peak_ram_bytes)} RAM, "
                        f"{gib_text(best.disk_bytes)} disk: {'; '.join(best.short)}. Free memory, lower the latent size, "
                        "or add RAM/disk.")
    fastest = min(fits, key=lambda c: (c.est_s, c.peak_vram_bytes))
    why = []
    w, act = model.weight_bytes, model.activations
    if opts.prefer == "speed":
        pick = fastest
    else:
        near = [c for c in fits if c.est_s <= MEMORY_SLOWDOWN * fastest.est_s]
        pick = min(near, key=lambda c: (c.peak_vram_bytes if m.gpu else c.peak_ram_bytes, c.est_s))
    if m.dynamic_vram and m.gpu:
        why.append("ComfyUI's dynamic VRAM manages this model: core decides which weights stay in VRAM and streams "
                   "the rest; the plan chooses only fp8 storage, disk versus RAM and tiles.")
    if m.gpu:
        need = w + act
        why.append(f"Weights {gib_text(w)} + activations {gib_text(act)} = {gib_text(need)} against {gib_text(m.usable_vram)} usable VRAM "
                   f"({gib_text(m.vram_bytes)} free − {gib_text(m.reserve_vram_bytes)} core reserve): "
                   + ("everything fits resident." if need <= m.usable_vram else
                      f"{gib_text(need - m.usable_vram)} short, so part of the weights must stream or shrink."))
    else:
        why.append("No GPU: ComfyUI computes on the CPU from RAM, so streaming to a GPU does not apply; "
                   f"the weights ({gib_text(w)}) and activations ({gib_text(act)}) live in RAM ({gib_text(m.ram_bytes)}).")
    if pick.forwards == 2:
        why.append(f"Activations with cond and uncond batched ({gib_text(act)}) do not fit next to the weights; run one "
                   f"after the other they need {gib_text(model.activation_min_bytes)} (core splits the batch by itself), so "
                   "streamed weights cross twice per step.")
    if pick.fp8:
        why.append(f"fp8 storage: {gib_text(w)} → {gib_text(model.fp8_bytes)} of weights"
                   + (f", streamed bytes per step {gib_text(pick.streamed_bytes)} instead of "
                      f"{gib_text(next((c.streamed_bytes for c in cands if c.offload_to == pick.offload_to and not c.fp8 and c.residency == pick.residency), w))}"
                      if pick.streamed_bytes else "") + f"; it needs {gib_text(pick.peak_ram_bytes)} RAM of {gib_text(m.ram_bytes)}.")
    elif opts.allow_fp8 and model.fp8_bytes is not None:
        fp8s = [c for c in cands if c.fp8]
        alt = min(fp8s, key=lambda c: (not c.fits, c.est_s)) if fp8s else None  # the best fp8 plan
        if alt is not None:
            why.append(f"No fp8: {alt.name} ({alt.est_s:.3f} s/step estimated, {gib_text(alt.peak_vram_bytes)} VRAM"
                       + (f", {'; '.join(alt.short)}" if alt.short else "") + f") does not beat {pick.name} "
                       f"({pick.est_s:.3f} s/step) for prefer={opts.prefer}; full precision kept.")
    elif not opts.allow_fp8:
        why.append("fp8 not allowed (allow_fp8 off): weights keep their dtype.")
    if pick.streamed_bytes:
        src = "disk" if pick.offload_to == "disk" else "RAM"
        bw = m.h2d_bytes_per_s if src == "RAM" else min(m.h2d_bytes_per_s, m.disk_read_bytes_per_s)
        why.append(f"Streams {gib_text(pick.streamed_bytes)} per step from {src} at {bw / 1e9:.1f} GB/s = "
                   f"{pick.streamed_bytes / bw:.3f} s against {pick.compute_s:.3f} s compute: floor "
                   f"{pick.floor_s:.3f} s, estimate {pick.est_s:.3f} s (×{STREAM_OVERHEAD} measured overhead); "
                   f"{gib_text(pick.resident_bytes)} stays resident.")
        if len(model.block_bytes) < MIN_STREAM_BLOCKS:
            why.append(f"Only {len(model.block_bytes)} blocks (diffusers-mm streams from {MIN_STREAM_BLOCKS}): "
                       "each transfer is large, so less of it hides under compute.")
    if pick.offload_to == "disk":
        ram_alt = next((c for c in cands if c.offload_to == "cpu" or c.name == "as loaded"), None)
        why.append(f"Disk, not RAM: {('RAM plans need ' + gib_text(ram_alt.peak_ram_bytes)) if ram_alt else 'RAM is short'} "
                   f"of {gib_text(m.ram_bytes)} RAM; disk holds {gib_text(pick.disk_bytes)} of {gib_text(m.disk_bytes)} free and is read "
                   f"at {m.disk_read_bytes_per_s / 1e9:.1f} GB/s." if not (ram_alt and ram_alt.fits) else
                   f"Disk: prefer={opts.prefer} and it needs least RAM ({gib_text(pick.peak_ram_bytes)}).")
    why.append(f"Pick: {pick.name} (prefer={opts.prefer}: "
               + ("fastest estimate" if opts.prefer == "speed" else
                  f"least {'VRAM' if m.gpu else 'RAM'} within {MEMORY_SLOWDOWN}× of the fastest, {fastest.name} "
                  f"{fastest.est_s:.3f} s") + f"; {len(fits)} of {len(cands)} candidates fit).")
    return pick, why
