"""The MemoryKit demo: a real ComfyUI, headless, runs every workflow in ``example_workflows/``
through the pack's nodes on generated models, saves outputs to ``demo_output/`` and prints a
table of wall time, peak memory and what each MemoryKit node reported.

Run with ``make demo`` (which runs scripts/setup.sh first). Peak memory is the CUDA peak
reported inside the server by Memory Report when a GPU exists, else the server process's RSS
high-water mark (VmHWM) over the run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import torch  # noqa: E402

from harness import examples, models, paths  # noqa: E402
from harness.server import ComfyServer, PromptRejected  # noqa: E402


def _fmt_gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def summarize_reports(reports: dict) -> str:
    parts = []
    for nid, rep in sorted(reports.items(), key=lambda kv: int(kv[0])):
        label = rep.get("label") or f"node {nid}"
        if rep.get("cuda"):
            peak = max(d["peak_allocated_bytes"] for d in rep["cuda"])
            parts.append(f"{label}: VRAM peak {_fmt_gib(peak)} GiB")
        else:
            parts.append(f"{label}: RAM peak {_fmt_gib(rep['host']['rss_peak_bytes'])} GiB")
    return "; ".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="run only these example workflows (file stems)")
    ap.add_argument("--out", default=str(REPO / "demo_output"), help="where outputs are copied")
    ap.add_argument("--json", help="also write the table as JSON to this file")
    args = ap.parse_args(argv)

    print("Generating test models (first run only) ...", flush=True)
    models.ensure_models()
    names = args.only or examples.example_names()
    device = "GPU" if torch.cuda.is_available() else "CPU"
    rows = []
    print(f"Starting ComfyUI ({paths.comfyui_path()}) headless ...", flush=True)
    with ComfyServer() as srv:
        oi = srv.object_info()
        for name in names:
            print(f"  running {name} ...", flush=True)
            try:
                r = examples.run_example(srv, name, oi, copy_outputs_to=Path(args.out))
            except PromptRejected as e:
                r = {"name": name, "status": "rejected", "error": e.body, "seconds": 0.0,
                     "peak_rss_bytes": None, "reports": {}, "files": []}
            rows.append(r)
    ok = all(r["status"] == "success" for r in rows)
    print()
    print(f"{'workflow':<34} {'status':<9} {'seconds (' + device + ')':>14} {'peak GiB':>9}  MemoryKit nodes reported")
    print("-" * 110)
    for r in rows:
        peak = r["peak_rss_bytes"]
        cuda_peaks = [max(d["peak_allocated_bytes"] for d in rep["cuda"]) for rep in r["reports"].values() if rep.get("cuda")]
        if cuda_peaks:
            peak = max(cuda_peaks)
        kind = "VRAM" if cuda_peaks else "RSS"
        print(f"{r['name']:<34} {r['status']:<9} {r['seconds']:>14.2f} {_fmt_gib(peak):>5} {kind:<4} {summarize_reports(r['reports'])}")
        if r["status"] != "success":
            print(f"    error: {json.dumps(r['error'])[:600]}")
    print(f"\nOutputs in {args.out}/. Peak = {'CUDA peak (Memory Report)' if device == 'GPU' else 'server RSS high-water mark'}.")
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k not in ("result", "files")} for r in rows],
                                              indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
