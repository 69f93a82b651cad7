"""Timing, peak memory and error measurement for one benchmark case."""
from __future__ import annotations

import gc
import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def pinned_host_bytes() -> int | None:
    """Bytes currently held by torch's pinned (page-locked) host allocator, None if unknown."""
    try:
        stats = torch.cuda.memory.host_memory_stats()
        return int(stats.get("allocated_bytes.current", stats.get("allocation.current", 0)))
    except Exception:
        return None


def h2d_bandwidth(device: torch.device, n_bytes: int = 1 << 30, iters: int = 5) -> float | None:
    """Pinned host→device copy bandwidth in bytes/second (None on CPU)."""
    if device.type != "cuda":
        return None
    buf = torch.empty(n_bytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(buf, device=device)
    for _ in range(2):
        dst.copy_(buf, non_blocking=True)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(buf, non_blocking=True)
    sync(device)
    bw = iters * n_bytes / (time.perf_counter() - t0)
    del buf, dst
    free(device)
    return bw


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def time_forward(fn, args, device: torch.device, iters: int) -> tuple[float, torch.Tensor, float | None]:
    """Run ``fn(*args)`` once to warm up (diffusers records the prefetch order then), then
    ``iters`` times. Returns (seconds per forward, last output, peak allocated bytes or None)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with torch.no_grad():
        out = fn(*args)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        sync(device)
        dt = (time.perf_counter() - t0) / iters
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return dt, out.detach(), peak


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error ‖out − ref‖ / ‖ref‖ in fp32."""
    o, r = out.float().cpu(), ref.float().cpu()
    return float((o - r).norm() / r.norm())


def write_json_atomic(path, data) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file and ``os.replace`` (a reader
    never sees half a file, a kill never leaves one)."""
    import json
    import os
    from pathlib import Path
    path = Path(path)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


class DevicePeak:
    """Peak device memory in use (``cudaMemGetInfo``: every allocator, comfy-aimdo's too) above
    ``base`` bytes in use (default: the level on entering), sampled every ``period_s`` by a
    thread while the ``with`` block runs. ``peak`` is None on a CPU."""

    def __init__(self, device: torch.device, period_s: float = 0.002, base: int | None = None):
        self.device, self.period_s, self.peak, self._stop, self._base = device, period_s, None, None, base

    def _used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def __enter__(self):
        if self.device.type != "cuda":
            return self
        import threading
        self.base = self._base if self._base is not None else self._used()
        self.peak = 0
        self._stop = threading.Event()

        def loop():
            while not self._stop.is_set():
                self.peak = max(self.peak, self._used() - self.base)
                self._stop.wait(self.period_s)
        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._stop is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self._used() - self.base)
        return False


def h2d_bytes(fn, device: torch.device) -> int | None:
    """Host→device bytes copied during one call of ``fn()`` (CUDA memcpy activity recorded by
    the profiler, whoever issued it: torch, ComfyUI or comfy-aimdo). None on a CPU or when the
    profiler gives no byte counts."""
    if device.type != "cuda":
        return None
    import json
    import os
    import tempfile
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)
    total, seen = 0, False
    for e in events:
        if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", ""):
            b = (e.get("args") or {}).get("bytes")
            if b is not None:
                total, seen = total + int(b), True
    return total if seen else None


def vram_filler(device: torch.device, leave_free_bytes: int):
    """Allocate a filler tensor so that only ``leave_free_bytes`` of device memory stay free
    (the runbook's capped VRAM, the same for every case). Returns ``(tensor or None, bytes)``;
    on a CPU nothing is allocated."""
    if device.type != "cuda":
        return None, 0
    free(device)
    free_now, _ = torch.cuda.mem_get_info(device)
    n = int(free_now - leave_free_bytes)
    if n <= 0:
        return None, 0
    return torch.empty(n, dtype=torch.uint8, device=device), n
