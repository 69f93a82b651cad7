"""Process and device memory readings (no ComfyUI knowledge).

Units: every ``*_bytes`` value is in bytes; helpers ``gib`` convert to GiB (2**30 bytes).
"""
from __future__ import annotations

import os
import resource
from dataclasses import dataclass, asdict

import torch

GIB = float(1 << 30)


def gib(n_bytes: float) -> float:
    """Bytes → GiB (2**30 bytes), rounded to 3 decimals."""
    return round(n_bytes / GIB, 3)


def _proc_status(pid: int | str = "self") -> dict[str, int]:
    """Read the ``Vm*``/``Rss*`` lines of ``/proc/<pid>/status`` as bytes (Linux only)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB":
                    out[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return out


@dataclass
class HostMemory:
    """Resident memory of one process in bytes.

    rss_bytes: current resident set size; rss_peak_bytes: high-water mark (VmHWM) since the
    process started or since the last :func:`reset_host_peak`; rss_anon_bytes: anonymous
    resident memory (RssAnon: excludes memory-mapped file pages, e.g. mmapped safetensors).
    """

    rss_bytes: int
    rss_peak_bytes: int
    rss_anon_bytes: int


def host_memory(pid: int | str = "self") -> HostMemory:
    """Resident memory of ``pid`` (default: this process), from ``/proc/<pid>/status``.

    Falls back to ``resource.getrusage`` (peak only) where ``/proc`` is missing.
    """
    st = _proc_status(pid)
    if not st:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return HostMemory(peak, peak, peak)
    return HostMemory(st.get("VmRSS", 0), st.get("VmHWM", 0), st.get("RssAnon", 0))


def reset_host_peak(pid: int | str = "self") -> bool:
    """Reset the VmHWM high-water mark of ``pid`` to its current RSS.

    Writes ``5`` to ``/proc/<pid>/clear_refs`` (Linux ≥ 4.0, see ``man 5 proc``). Returns
    False where that is not permitted or not supported; never raises.
    """
    try:
        with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass
class DeviceMemory:
    """Memory of one CUDA device in bytes, as torch's caching allocator sees it."""

    device: str
    allocated_bytes: int
    peak_allocated_bytes: int
    reserved_bytes: int
    total_bytes: int


def cuda_memory() -> list[DeviceMemory]:
    """Allocator statistics of every visible CUDA device; ``[]`` without CUDA."""
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        out.append(DeviceMemory(
            device=f"cuda:{i}",
            allocated_bytes=torch.cuda.memory_allocated(i),
            peak_allocated_bytes=torch.cuda.max_memory_allocated(i),
            reserved_bytes=torch.cuda.memory_reserved(i),
            total_bytes=torch.cuda.get_device_properties(i).total_memory,
        ))
    return out


def reset_cuda_peak() -> None:
    """Reset ``torch.cuda.max_memory_allocated`` on every visible device (no-op without CUDA)."""
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(i)


def snapshot() -> dict:
    """Host and device memory of this process as a JSON-serialisable dict (bytes)."""
    return {
        "host": asdict(host_memory()),
        "cuda": [asdict(d) for d in cuda_memory()],
    }
