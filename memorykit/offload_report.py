"""One-screen text for the group offloading report (figures in GiB, see :func:`memorykit.offload.offload_figures`)."""
from __future__ import annotations

from .memory import gib


def offload_summary(info: dict) -> list[str]:
    """Lines describing a Group Offload report dict (its ``group_offload`` entry)."""
    status = info.get("status", "?")
    if status == "passthrough":
        return [f"Group Offload: passed through unchanged ({info.get('reason', '')})"]
    opts = info.get("options", {})
    head = (f"Group Offload: {opts.get('offload_type')} → {opts.get('offload_to')}"
            + (f" ({info['disk_folder']})" if opts.get("offload_to") == "disk" else "")
            + f", {status}")
    lines = [head]
    fig = info.get("figures") or info.get("plan")
    if fig:
        budget = fig.get("budget_bytes")
        lines.append(f"resident {gib(fig['resident_bytes'])} GiB ({fig['resident_blocks']} blocks + rest), "
                     f"streamed {gib(fig['streamed_bytes'])} GiB ({fig['streamed_blocks']} blocks), "
                     f"buffers {gib(fig['buffer_bytes'])} GiB, budget "
                     + ("none (stream all)" if budget is None else f"{gib(budget)} GiB"))
        if fig.get("below_minimum"):
            lines.append("budget below the minimum footprint: everything streams")
    if info.get("figures"):
        f = info["figures"]
        lines.append(f"per forward: {gib(f['h2d_bytes_per_forward'])} GiB to {f['onload_device']}, "
                     f"{gib(f['d2h_bytes_per_forward'])} GiB back, {gib(f['disk_read_bytes_per_forward'])} GiB "
                     f"from disk; pinned {gib(f['pinned_host_bytes'])} GiB")
        if f.get("never_ran_blocks"):
            n = f["never_ran_blocks"]
            lines.append(f"never ran (unused by this model's forward, left alone): {', '.join(n[:4])}"
                         + (f" and {len(n) - 4} more" if len(n) > 4 else ""))
        if f.get("scheduler") == "memorykit":
            lines.append(f"event ring: {f['groups']} groups through a {gib(f['ring_bytes'])} GiB ring, "
                         f"{gib(f['copied_bytes_last_forward'])} GiB copied in the last forward")
    run = info.get("run")
    if run:
        peak = "-" if run.get("peak_vram_bytes") is None else f"{gib(run['peak_vram_bytes'])} GiB"
        lines.append(f"last run: {run['forwards']} forwards in {run['seconds']:.2f} s, "
                     f"{gib(run['bytes_moved'])} GiB moved, peak VRAM {peak}")
    for note in info.get("notes", []):
        lines.append(f"note: {note}")
    return lines
