"""Build the Memory Report dict (JSON-serialisable) and its one-screen text summary."""
from __future__ import annotations

import time

from . import memory


def build_report(label: str, models: list[dict]) -> dict:
    """Report of this process's memory now.

    ``models`` is a list as returned by ``comfy_integration.loaded_models()``. All sizes are in
    bytes; ``time`` is seconds since the epoch. Peak values are since the previous reset
    (see :func:`memory.reset_host_peak` / :func:`memory.reset_cuda_peak`).
    """
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
        lines.append(f"{m['name']}: {g(m['size_bytes'])} GiB, {g(m['on_gpu_bytes'])} GiB on GPU "
                     f"({m['current_device']})")
    return "\n".join(lines)
