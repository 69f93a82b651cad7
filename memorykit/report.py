"""Build the Memory Report dict (JSON-serialisable) and its one-screen text summary."""
from __future__ import annotations

import time

from . import memory
from .validation import bounded_text

MAX_LABEL_CHARS = 1000


def build_report(label: str, models: list[dict]) -> dict:
    """Report of this process's memory now.

    ``models`` is a list as returned by ``comfy_integration.loaded_models()``. All sizes are in
    bytes; ``time`` is seconds since the epoch. Peak values are since the previous reset
    (see :func:`memory.reset_host_peak` / :func:`memory.reset_cuda_peak`).
    """
    label = bounded_text(label, "label", MAX_LABEL_CHARS, "a short name is enough")
    snap = memory.snapshot()
    return {
        "label": label,
        "time": time.time(),
        "host": snap["host"],
        "cuda": snap["cuda"],
        "models": models,
    }


def format_report(rep: dict) -> str:
    """Human-readable summary of :func:`build_report`'s dict, figures in GiB."""
    g = memory.gib
    lines = [f"[{rep['label']}]" if rep.get("label") else "[Memory Report]"]
    h = rep["host"]
    lines.append(f"RAM: {g(h['rss_bytes'])} GiB now, peak {g(h['rss_peak_bytes'])} GiB")
    if not rep["cuda"]:
        lines.append("VRAM: no CUDA device")
    for d in rep["cuda"]:
        lines.append(f"VRAM {d['device']}: {g(d['allocated_bytes'])} GiB now, "
                     f"peak {g(d['peak_allocated_bytes'])} GiB of {g(d['total_bytes'])} GiB")
    if not rep["models"]:
        lines.append("Models loaded: none")
    for m in rep["models"]:
        path = f", {m['memory_path']}" if m.get("memory_path") else ""
        lines.append(f"{m['name']}: {g(m['size_bytes'])} GiB, {g(m['on_gpu_bytes'])} GiB on GPU "
                     f"({m['current_device']}{path})")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Free Memory: what was freed
# --------------------------------------------------------------------------------------------

def freed_fields(before: dict, after: dict, unloaded: list[dict]) -> dict:
    """Fields Free Memory adds to its report (all sizes in bytes).

    ``before``: :func:`memory.snapshot` taken before freeing; ``after``: the report built after;
    ``unloaded``: model dicts (as ``comfy_integration.loaded_models()``) that were unloaded.
    Returns ``unloaded_models`` (names), ``unloaded_bytes`` (sum of their weights that ComfyUI
    had loaded on their load device), ``freed_vram_bytes`` (drop of torch-allocated VRAM, summed
    over CUDA devices, ≥ 0) and ``released_cache_bytes`` (drop of VRAM reserved by torch's
    caching allocator, i.e. handed back to the driver, ≥ 0). Both VRAM figures are 0 without CUDA.
    """
    def total(snap, key):
        return sum(d[key] for d in snap["cuda"])

    return {
        "unloaded_models": [m["name"] for m in unloaded],
        "unloaded_bytes": sum(m["loaded_bytes"] for m in unloaded),
        "freed_vram_bytes": max(0, total(before, "allocated_bytes") - total(after, "allocated_bytes")),
        "released_cache_bytes": max(0, total(before, "reserved_bytes") - total(after, "reserved_bytes")),
    }


def format_freed(rep: dict) -> str:
    """One-line summary of :func:`freed_fields` (GiB)."""
    g = memory.gib
    names = ", ".join(rep["unloaded_models"]) or "none"
    return (f"Unloaded: {names} ({g(rep['unloaded_bytes'])} GiB); VRAM freed {g(rep['freed_vram_bytes'])} GiB, "
            f"cache released {g(rep['released_cache_bytes'])} GiB")
