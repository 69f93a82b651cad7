"""One benchmark harness: every memory strategy on the same model, side by side, one process.

    python -m benchmarks.run            # GPU default: Flux-shaped 8+16 blocks (5.05 B), 1024² and 2048²
    python -m benchmarks.run --quick    # CPU: 1+1 blocks at 256², GPU-only cases listed as skipped
    python -m benchmarks.run --quick --tiny  # the same on the runbook dry run's narrow model (what the tests run)

Per case and resolution: seconds per forward, ratio to resident, the transfer floor
max(resident compute time, streamed bytes / measured pinned H2D bandwidth) and the ratio to
it, peak VRAM, pinned host bytes, process RSS, relative L2 error of the output vs resident.
Prints one JSON line per row as it goes and rewrites the JSON file (``--out``) atomically after
each; a case that fails is an ``error`` row and the run goes on. At the end: a table and a PNG
(peak VRAM or RSS vs s/forward). The GPU runbook (``benchmarks/gpu_runbook.sh``) is separate.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from harness import comfy_env  # noqa: E402

from . import measure  # noqa: E402
from .cases import Ctx, all_cases  # noqa: E402
from . import model as bm  # noqa: E402

# Output tolerance vs resident, per case-name prefix (relative L2). Exact techniques: 0.
TOLERANCE = {"resident": 0.0, "comfy_lowvram": 0.0, "diffusers_block": 0.0, "diffusers_leaf": 0.0,
             "comfy_fp8": 0.25, "mk_offload_fp8": 0.20, "mk_offload": 0.0, "mk_device_map": 0.0, "mk_fp8": 0.20}


def tolerance(name: str) -> float | None:
    for prefix, tol in TOLERANCE.items():
        if name.startswith(prefix):
            return tol
    return None


def measure_one(case, prep, res, args, dtype, device, bw, refs, resident_s) -> dict:
    """One case at one resolution: the row of figures (see the module doc)."""
    inp = bm.inputs(res, dtype, device, tiny=args.tiny)
    s, out, peak = measure.time_forward(prep.fn, inp, device, args.iters)
    if case.name == "resident":
        refs[res], resident_s[res] = out.cpu(), s
    floor = max(resident_s.get(res, s), prep.streamed_bytes / bw if bw else 0.0)
    err = measure.rel_l2(out, refs[res]) if res in refs else None
    tol = tolerance(case.name)
    return {
        "case": case.name, "group": case.group, "res": res, "s_per_forward": round(s, 4),
        "ratio_to_resident": round(s / resident_s[res], 3) if res in resident_s else None,
        "floor_s": round(floor, 4), "ratio_to_floor": round(s / floor, 3),
        "streamed_bytes": prep.streamed_bytes, "peak_vram_bytes": peak,
        "pinned_host_bytes": measure.pinned_host_bytes() if device.type == "cuda" else None,
        "rss_bytes": measure.rss_bytes(), "rel_err_vs_resident": err, "tolerance": tol,
        "within_tolerance": None if err is None or tol is None else err <= tol, **prep.extra}


def report(row: dict, out_path, meta: dict, results: list) -> None:
    """Print ``row`` as one JSON line (flushed) and rewrite the results file atomically."""
    print(json.dumps(row, default=str), flush=True)
    if out_path is not None:
        measure.write_json_atomic(out_path, {"meta": meta, "results": results})


def run(args, out_path=None) -> dict:
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    comfy_env.setup_comfy()
    import comfy
    from comfyui_version import __version__ as comfy_version  # noqa: F401
    bw = measure.h2d_bandwidth(device)
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})",
            "torch": torch.__version__, "comfyui": comfy_version, "python": platform.python_version(),
            "depth": args.depth, "single": args.single, "tiny": args.tiny, "dtype": args.dtype, "res": args.res, "iters": args.iters,
            "h2d_pinned_bytes_per_s": bw}
    results, refs, resident_s = [], {}, {}
    with tempfile.TemporaryDirectory(prefix="mk-bench-") as tmp:
        ctx = Ctx(args.depth, args.single, dtype, device, tmp, args.tiny)
        for case in all_cases():
            if args.cases and case.name != "resident" and not any(c in case.name for c in args.cases):
                continue
            if case.gpu_only and device.type != "cuda":
                results.append({"case": case.name, "group": case.group, "skipped": case.gpu_only})
                report(results[-1], out_path, meta, results)
                continue
            print(f"[bench] {case.name} ...", file=sys.stderr, flush=True)
            try:
                prep = case.prepare(ctx)
            except Exception as e:  # a case that cannot be set up is reported, not fatal
                results.append({"case": case.name, "group": case.group, "error": f"{type(e).__name__}: {e}"})
                report(results[-1], out_path, meta, results)
                continue
            try:
                for res in args.res:
                    try:
                        results.append(measure_one(case, prep, res, args, dtype, device, bw, refs, resident_s))
                    except Exception as e:  # one failing forward (OOM, a missing kernel) is a row, not the end
                        results.append({"case": case.name, "group": case.group, "res": res,
                                        "error": f"{type(e).__name__}: {e}"})
                    report(results[-1], out_path, meta, results)
            finally:
                prep.cleanup()
                del prep
                measure.free(device)
    return {"meta": meta, "results": results}


def print_table(data: dict) -> None:
    m = data["meta"]
    print(f"\n{m['device']} · torch {m['torch']} · ComfyUI {m['comfyui']} · Flux-shaped {m['depth']}+{m['single']} "
          f"blocks{' (tiny: hidden 128)' if m.get('tiny') else ''} {m['dtype']} · H2D {m['h2d_pinned_bytes_per_s'] / 1e9 if m['h2d_pinned_bytes_per_s'] else float('nan'):.1f} GB/s")
    hdr = f"{'case':<40} {'res':>5} {'s/fwd':>8} {'×res':>6} {'×floor':>7} {'peak GiB':>9} {'RSS GiB':>8} {'err':>8}"
    print(hdr)
    print("-" * len(hdr))
    g = lambda b: "-" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
    for r in data["results"]:
        if "skipped" in r or "error" in r:
            print(f"{r['case']:<40} {'':>5} {'skipped: ' + r['skipped'] if 'skipped' in r else 'ERROR: ' + r['error']}")
            continue
        err = "-" if r["rel_err_vs_resident"] is None else f"{r['rel_err_vs_resident']:.4f}"
        print(f"{r['case']:<40} {r['res']:>5} {r['s_per_forward']:>8.4f} {r['ratio_to_resident'] or 0:>6.2f} "
              f"{r['ratio_to_floor']:>7.2f} {g(r['peak_vram_bytes']):>9} {g(r['rss_bytes']):>8} {err:>8}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="MemoryKit benchmark harness")
    ap.add_argument("--quick", action="store_true", help="small CPU-friendly run (1+1 blocks, 256², fp32, 1 iter)")
    ap.add_argument("--tiny", action="store_true",
                    help="the narrow model of the runbook's dry run (hidden 128, 0.9 M params): checks the harness, "
                         "its figures mean little")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--single", type=int, default=16)
    ap.add_argument("--res", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 2048])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--cases", nargs="*", help="run only cases whose name contains one of these")
    ap.add_argument("--out", help="JSON output path (default benchmarks/results/latest_<cpu|gpu>.json)")
    ap.add_argument("--plot", help="PNG plot path (default next to the JSON)")
    args = ap.parse_args(argv)
    if args.quick:
        args.depth, args.single, args.res, args.iters = 1, 1, [256], 1
    if args.dtype is None:
        args.dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    kind = ("gpu" if args.device.startswith("cuda") else "cpu") + ("_tiny" if args.tiny else "")  # never over the real figures
    out = Path(args.out or REPO / "benchmarks" / "results" / f"latest_{kind}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    data = run(args, out)
    measure.write_json_atomic(out, data)
    print_table(data)
    from .plot import plot
    png = Path(args.plot) if args.plot else out.with_suffix(".png")
    plot(data, png)
    print(f"\nwrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
