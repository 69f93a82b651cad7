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
