"""The headline figures a node's badge shows, from its report dict (``memorykit/report.py``).

One list of short strings per report, most telling first: the technique's own result (FP8:
weights before → after; Group Offload: resident / streamed per forward / peak; Tiled VAE: the
tile grid and peak; Memory Plan: the pick and the tiles; Sharded: shards, size, seconds; Device Map: bytes per device), then the
memory peak where it belongs to the node. The editor shows as many as fit in the node's width
(``js/memorykit_format.js``: "+N" for the rest); the full report stays in the node's text.

Units: bytes in binary units (B, KiB, MiB, GiB = 2**30 bytes), seconds as "s", counts bare.
"""
from __future__ import annotations

KIB, MIB, GIB = 1024, 1024**2, 1024**3


def fmt_bytes(n: float | int | None) -> str:
    """Bytes → "512 B", "12.0 KiB", "345.6 MiB", "1.23 GiB" (binary units); None → "?"."""
    if n is None:
        return "?"
    a = abs(n)
    if a >= GIB:
        return f"{n / GIB:.2f} GiB"
    if a >= MIB:
        return f"{n / MIB:.1f} MiB"
    if a >= KIB:
        return f"{n / KIB:.1f} KiB"
    return f"{int(n)} B"


def _unit_of(n: float) -> tuple[int, str]:
    a = abs(n)
    return (GIB, "GiB") if a >= GIB else (MIB, "MiB") if a >= MIB else (KIB, "KiB") if a >= KIB else (1, "B")


def fmt_bytes_pair(a: int, b: int) -> str:
    """Two sizes in the larger one's unit: "0.096 → 0.036 GiB" (3 decimals for GiB, 1 otherwise)."""
    scale, unit = _unit_of(max(a, b))
    places = 3 if unit == "GiB" else 1 if unit != "B" else 0
    return f"{a / scale:.{places}f} → {b / scale:.{places}f} {unit}"


def fmt_seconds(s: float) -> str:
    """Seconds → "0.34 s", "4.6 s", "75 s"."""
    return f"{s:.2f} s" if s < 1 else f"{s:.1f} s" if s < 60 else f"{s:.0f} s"


def _peak(rep: dict) -> str | None:
    """'VRAM peak X' (max over CUDA devices) on a GPU, else 'RAM peak X' (process), or None."""
    cuda = rep.get("cuda") or []
    if cuda:
        return f"VRAM peak {fmt_bytes(max(d['peak_allocated_bytes'] for d in cuda))}"
    host = rep.get("host") or {}
    if isinstance(host.get("rss_peak_bytes"), (int, float)):
        return f"RAM peak {fmt_bytes(host['rss_peak_bytes'])}"
    return None


def _fp8(info: dict) -> list[str]:
    # "(core)": the Linear layers hold core's QuantizedTensor (fp8_core); the text has the full path.
    before, after = info["weight_bytes_before"], info["weight_bytes_after"]
    if info.get("passed_through"):
        return ["already quantized: passed through", f"{fmt_bytes(before)} as stored"]
    pct = round(100 * (after - before) / before) if before else 0
    sign = "−" if pct < 0 else "+"
    return [f"{fmt_bytes_pair(before, after)} ({sign}{abs(pct)} %)",
            f"{info.get('cast_layers', 0)} layers fp8" + (" (core)" if info.get("core_layers") else ""),
            f"{len(info.get('kept_layers', []))} kept"]


def _group_offload(info: dict, rep: dict | None = None) -> list[str]:
    """Before a run: the plan (resident, streamed per forward, what it needs, "planned"). After a
    run (``info["run"]``): what happened (bytes streamed per step first, the VRAM peak, or the RAM
    peak without a GPU, resident, and the steps' time), the plan's figures no longer shown."""
    fig = info.get("figures") or {}
    plan = info.get("plan") or fig
    run = info.get("run") or {}
    src = " from disk" if (info.get("options") or {}).get("offload_to") == "disk" else ""
    out = []
    resident = [f"resident {fmt_bytes(plan['resident_bytes'])}"] if "resident_bytes" in plan else []
    if run.get("forwards"):  # what the offload did first: bytes streamed per step (never behind "+N")
        per, unit = (run["steps"], "step") if run.get("steps") else (run["forwards"], "forward")
        out.append(f"streams {fmt_bytes(run.get('bytes_moved', 0) / per)}/{unit}{src}")
        if run.get("peak_vram_bytes") is not None:
            out.append(f"peak {fmt_bytes(run['peak_vram_bytes'])}")
        elif isinstance(((rep or {}).get("host") or {}).get("rss_peak_bytes"), (int, float)):
            out.append(f"RAM peak {fmt_bytes(rep['host']['rss_peak_bytes'])}")
        out += resident
        if run.get("seconds") is not None:
            n, what = (run["steps"], "step") if run.get("steps") else (run["forwards"], "forward")
            out.append(f"{n} {what}{'' if n == 1 else 's'} in {fmt_seconds(run['seconds'])}")
    else:
        out += resident
        if plan.get("streamed_bytes") is not None:
            out.append(f"streams {fmt_bytes(plan['streamed_bytes'])}/forward{src}")
        if "footprint_bytes" in plan:
            out.append(f"needs {fmt_bytes(plan['footprint_bytes'])}")
        if str(info.get("status", "")).startswith("planned"):
            out.append("planned")
    if any(str(n).startswith("pinned memory disabled") for n in info.get("notes", [])):
        out.append("pageable copies")
    return out


def _tiled_vae(rep: dict, info: dict) -> list[str]:
    axes = list((info.get("plan") or {}).get("tiles_per_axis") or [])
    while len(axes) > 2 and axes[0] == 1:  # a video tiled in space only: "3×3"
        axes.pop(0)
    out = [f"{'×'.join(str(a) for a in axes)} tiles" if axes else f"{info.get('tiles_per_item', '?')} tiles"]
    peak = _peak(rep)
    if peak:
        out.append(peak)
    tile = info.get("tile_px")
    if tile:
        out.append(f"{'×'.join(str(t) for t in tile)} px")
    if info.get("seconds") is not None:
        out.append(fmt_seconds(info["seconds"]))
    return out


def _sharded(info: dict) -> list[str]:
    out = []
    if "shards" in info:
        out.append(f"{info['shards']} shard{'s' if info['shards'] != 1 else ''}")
    if "total_bytes" in info:
        out.append(fmt_bytes(info["total_bytes"]))
    if info.get("seconds") is not None:
        out.append(fmt_seconds(info["seconds"]))
    if "tensors" in info:
        out.append(f"{info['tensors']} tensors")
    return out


def _device_map(bytes_per_device: dict) -> list[str]:
    vals = [v for v in bytes_per_device.values() if isinstance(v, (int, float))]
    if not vals:
        return []
    scale, unit = _unit_of(min(vals))
    if all(_unit_of(v)[1] == unit for v in vals):  # one unit: "cuda:0 10.8 · cuda:1 11.3 GiB"
        places = 1 if unit != "B" else 0
        parts = [f"{d} {v / scale:.{places}f}" for d, v in bytes_per_device.items()]
        parts[-1] += f" {unit}"
        return parts
    return [f"{d} {fmt_bytes(v)}" for d, v in bytes_per_device.items()]


def _free_memory(rep: dict) -> list[str]:
    out = [f"unloaded {fmt_bytes(rep.get('unloaded_bytes', 0))}"]
    if rep.get("cuda"):
        out.append(f"VRAM freed {fmt_bytes(rep.get('freed_vram_bytes', 0))}")
        out.append(f"cache released {fmt_bytes(rep.get('released_cache_bytes', 0))}")
    peak = _peak(rep)
    if peak:
        out.append(peak)
    return out


def _memory_report(rep: dict) -> list[str]:
    out = []
    cuda = rep.get("cuda") or []
    if cuda:
        label = "VRAM peak" if len(cuda) == 1 else f"VRAM peak (max of {len(cuda)})"
        out.append(f"{label} {fmt_bytes(max(d['peak_allocated_bytes'] for d in cuda))}")
    host = rep.get("host") or {}
    if "rss_peak_bytes" in host:
        out.append(f"RAM peak {fmt_bytes(host['rss_peak_bytes'])}")
    models = rep.get("models")
    if isinstance(models, list):
        out.append(f"{len(models)} model{'s' if len(models) != 1 else ''} loaded")
    return out


def _memory_plan(info: dict) -> list[str]:
    return [str(f) for f in info.get("badge") or []]


def badge_figures(rep: dict) -> list[str]:
    """Headline figures for ``rep`` (a report dict as the nodes put in ``memorykit_report``),
    most important first. Never empty for a report built by ``report.build_report``."""
    if isinstance(rep.get("memory_plan"), dict):
        return _memory_plan(rep["memory_plan"]) or _memory_report(rep)
    if isinstance(rep.get("fp8"), dict) and "weight_bytes_before" in rep["fp8"]:
        return _fp8(rep["fp8"])
    if isinstance(rep.get("group_offload"), dict):
        return _group_offload(rep["group_offload"], rep) or _memory_report(rep)
    if isinstance(rep.get("tiled_vae"), dict):
        return _tiled_vae(rep, rep["tiled_vae"])
    if isinstance(rep.get("sharded"), dict):
        return _sharded(rep["sharded"]) or _memory_report(rep)
    if isinstance(rep.get("bytes_per_device"), dict):
        return _device_map(rep["bytes_per_device"]) or _memory_report(rep)
    if "unloaded_bytes" in rep:
        return _free_memory(rep)
    return _memory_report(rep)


def with_badge(rep: dict) -> dict:
    """``rep`` with ``badge`` (the list of :func:`badge_figures`) set; returns ``rep``."""
    rep["badge"] = badge_figures(rep)
    return rep
