"""Process and device memory readings (no ComfyUI knowledge).

Units: every ``*_bytes`` value is in bytes; helpers ``gib`` convert to GiB (2**30 bytes).

Host memory per platform: Linux reads ``/proc/<pid>/status`` (current RSS, the VmHWM peak,
RssAnon). Elsewhere psutil gives the current RSS (and Windows' peak working set), and
``resource.getrusage`` the peak of this process where that module exists (POSIX, not
Windows); ``ru_maxrss`` is bytes on macOS and KiB on Linux and the BSDs. ``resource`` is
imported only when needed: a module-level import made the whole pack fail to import on
Windows (issue 14 item 14).
"""
from __future__ import annotations

import sys
from dataclasses import asdict, dataclass

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


def _rusage_peak_bytes() -> int | None:
    """Peak RSS of this process from ``resource.getrusage`` in bytes; None where the module
    does not exist (Windows). ``ru_maxrss`` is bytes on macOS, KiB on Linux and the BSDs."""
    try:
        import resource
    except ImportError:
        return None
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024


def _psutil_memory(pid: int | str) -> tuple[int, int] | None:
    """(current RSS, peak RSS or 0 where unknown) of ``pid`` from psutil, in bytes; None
    without psutil or for a process it cannot read. Windows reports a peak (``peak_wset``)."""
    try:
        import psutil
        info = psutil.Process(None if pid == "self" else int(pid)).memory_info()
    except Exception:  # noqa: BLE001 - no psutil, no such process, access denied: no reading
        return None
    return int(info.rss), int(getattr(info, "peak_wset", 0))


def host_memory(pid: int | str = "self") -> HostMemory:
    """Resident memory of ``pid`` (default: this process), in bytes.

    Linux: ``/proc/<pid>/status`` (VmRSS, VmHWM, RssAnon). Elsewhere: psutil's current RSS,
    the peak from Windows' peak working set or, for this process, ``resource.getrusage``
    (never below the current RSS), and ``rss_anon_bytes`` = the RSS (no split of mapped
    files). Zeros where nothing can be read. Never raises.
    """
    st = _proc_status(pid)
    if st:
        return HostMemory(st.get("VmRSS", 0), st.get("VmHWM", 0), st.get("RssAnon", 0))
    current = _psutil_memory(pid)
    rss, peak = current if current is not None else (0, 0)
    if pid == "self" and not peak:
        peak = _rusage_peak_bytes() or 0
    rss = rss or peak
    return HostMemory(rss, max(peak, rss), rss)


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
