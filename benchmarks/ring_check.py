"""Event-ring checks on a real device: the GPU half of the group-offloading tests.

    python -m benchmarks.ring_check                 # cuda when available, else cpu
    python -m benchmarks.ring_check --device cpu --depth 1 --single 1

On the benchmark's Flux-shaped model (ComfyUI's classes), for each scheduler setting
(block_level groups of 1 and 2, leaf_level; use_stream on/off; packed+pinned or pageable;
MemoryKit's ring and diffusers' hooks): the output of two forwards equals the resident
model's bit for bit, the page-locked host bytes are ≤ 1.1 × the streamed weights, and after
removal no page-locked bytes, no onload-device bytes and no hooks are left. Prints one JSON
line per setting and exits 1 when a check fails.

On CUDA the compute stream is stalled (``torch.cuda._sleep``) before and after every block,
i.e. between the copies into the ring and the reads of them: a missing event wait (a slot
overwritten while still read, or read before its copy landed) then changes the output, which
the bit-exact comparison catches. Leftover device memory is measured after the outputs are
freed (they are not the offload's).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness import comfy_env, paths  # noqa: E402

from . import model as bm  # noqa: E402

SETTINGS = [  # (offload_type, num_blocks_per_group, use_stream, low_cpu_mem_usage, scheduler)
    ("block_level", 1, True, False, "memorykit"), ("block_level", 2, True, False, "memorykit"),
    ("leaf_level", 1, True, False, "memorykit"), ("block_level", 1, False, False, "memorykit"),
    ("block_level", 1, True, True, "memorykit"), ("block_level", 1, True, False, "diffusers"),
    ("block_level", 1, True, True, "diffusers"),
]
# The runbook's case names for SETTINGS (benchmarks.rb_plan.RING_SETTINGS), same order.
SETTING_NAMES = ["block1_stream", "block2_stream", "leaf_stream", "block1_nostream", "block1_stream_lowmem",
                 "block1_stream_diffusers", "block1_stream_lowmem_diffusers"]
STALL_CYCLES = 2_000_000  # about 1 ms on an H200 per stall


def _add_stalls(dm, device) -> list:
    """Forward pre/post hooks that stall the current (compute) stream around every block."""
    if device.type != "cuda":
        return []
    from memorykit_tech.comfy_integration.offload_patcher import comfy_block_lists

    def stall(*_args):
        torch.cuda._sleep(STALL_CYCLES)
    handles = []
    for _name, blocks in comfy_block_lists(dm):
        for _bn, block in blocks:
            handles += [block.register_forward_pre_hook(stall), block.register_forward_hook(stall)]
    return handles


def check(dm, ref, inp, device, setting) -> dict:
    from memorykit_tech import offload, offload_plan
    from memorykit_tech.comfy_integration.offload_patcher import comfy_block_lists
    offload_type, n, use_stream, low_mem, scheduler = setting
    gpu = device.type == "cuda"
    opts = offload_plan.GroupOffloadOptions(offload_type=offload_type, num_blocks_per_group=n,
                                            use_stream=use_stream and gpu, low_cpu_mem_usage=low_mem,
                                            scheduler=scheduler)
    base = torch.cuda.memory_allocated(device) if gpu else 0
    h = offload.apply_group_offload(dm, device, "cpu", options=opts, block_lists=comfy_block_lists(dm))
    stalls = _add_stalls(dm, device)
    try:
        with torch.no_grad():
            outs = [dm(*inp).cpu() for _ in range(2)]
        fig = offload.offload_figures(h)
    finally:
        for s_ in stalls:
            s_.remove()
        offload.remove_group_offload(h)
    exact = all(torch.equal(o, ref) for o in outs)
    del outs
    if gpu:
        torch.cuda.synchronize(device)
        import gc
        gc.collect()
    left_hooks = sum(bool(m._forward_pre_hooks or m._forward_hooks or "_diffusers_hook" in m.__dict__)
                     for m in dm.modules())
    ts = list(dm.parameters()) + list(dm.buffers())
    pinned_after = sum(t.numel() * t.element_size() for t in ts if gpu and t.device.type == "cpu" and t.is_pinned())
    on_device_after = (torch.cuda.memory_allocated(device) - base) if gpu else 0
    streamed = fig["streamed_bytes"]
    r = {"setting": dict(zip(("offload_type", "num_blocks_per_group", "use_stream", "low_cpu_mem_usage",
                              "scheduler"), setting)),
         "exact": exact, "stalled": bool(stalls), "groups": fig["groups"],
         "streamed_bytes": streamed, "pinned_host_bytes": fig["pinned_host_bytes"],
         "pinned_to_streamed": round(fig["pinned_host_bytes"] / streamed, 4) if streamed else None,
         "footprint_bytes": fig["footprint_bytes"], "hooks_left": left_hooks, "pinned_left_bytes": pinned_after,
         "device_bytes_left": on_device_after, "all_on_cpu_after": all(t.device.type == "cpu" for t in ts)}
    pinned_ok = (low_mem or not gpu or scheduler != "memorykit"
                 or streamed <= fig["pinned_host_bytes"] <= 1.1 * streamed)
    r["ok"] = bool(r["exact"] and pinned_ok and not left_hooks and not pinned_after and on_device_after <= 0
                   and r["all_on_cpu_after"])
    return r


def prepare(device: torch.device, depth: int, single: int, res: int, tiny: bool = False):
    """The model (on the CPU), its resident output (CPU) and the inputs (on ``device``)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dm = bm.build(depth, single, dtype, device, tiny=tiny).diffusion_model
    inp = bm.inputs(res, dtype, device, tiny=tiny)
    dm.to(device)
    with torch.no_grad():
        ref = dm(*inp).cpu()
    dm.to("cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dm, ref, inp


def run_setting(dm, ref, inp, device, name: str) -> dict:
    """One setting by its runbook name; ``{"not_on_cpu": True}`` for a pinning-only setting on a CPU."""
    setting = SETTINGS[SETTING_NAMES.index(name)]
    if setting[3] and device.type != "cuda":
        return {"setting": name, "not_on_cpu": True}
    return check(dm, ref, inp, device, setting)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--single", type=int, default=4)
    ap.add_argument("--res", type=int, default=512)
    args = ap.parse_args(argv)
    comfy_env.setup_comfy()
    paths.technique_package()
    device = torch.device(args.device)
    dm, ref, inp = prepare(device, args.depth, args.single, args.res)
    ok = True
    for setting in SETTINGS:
        if setting[3] and device.type != "cuda":
            continue  # low_cpu_mem_usage only changes pinning
        try:
            r = check(dm, ref, inp, device, setting)
        except Exception as e:  # report and go on: every setting gets its line
            r = {"setting": setting, "ok": False, "error": f"{type(e).__name__}: {e}"}
        ok &= r["ok"]
        print(json.dumps(r), flush=True)
    print(json.dumps({"ring_check": "passed" if ok else "FAILED", "device": str(device)}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
