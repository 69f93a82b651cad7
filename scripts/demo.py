"""The MemoryKit demo: each workflow in ``example_workflows/`` run beside its plain baseline.

For every example workflow a real ComfyUI, headless, runs (1) the plain baseline — the same
workflow with the MemoryKit nodes bypassed, Tiled VAE replaced by core's VAE Decode, a
MemoryKit loader replaced by core's plain loader of the same model — and (2) the workflow as
written, each in a fresh server, so neither peak includes what an earlier run left behind.
It prints, per workflow: wall time, peak memory (VRAM from the Memory Report nodes on a GPU,
the server's RSS high-water mark on a CPU) plain vs MemoryKit, their ratio, and the MemoryKit
nodes' own figures (their badges). Outputs are saved to ``demo_output/<workflow>/``.

The models are generated with random weights (no download), so the images and videos are
noise: the demo shows memory and time, not pictures.

Run with ``make demo`` (which runs scripts/setup.sh first). ComfyUI: ``$COMFYUI_PATH`` if set
(0.3.75 and 0.33.0 are tested), else the 0.3.75 tree set-up made. About 15 minutes on 2 CPU
cores (20 server starts and runs); ``--only NAME ...`` runs a few workflows.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import torch  # noqa: E402

from harness import examples, models, paths  # noqa: E402
from harness.server import ComfyServer, PromptRejected  # noqa: E402


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def peak_of(r: dict, on_gpu: bool) -> float | None:
    """VRAM peak (max over the reports' CUDA devices) on a GPU, else the RSS high-water mark."""
    if not on_gpu:
        return r.get("peak_rss_bytes")
    peaks = [max(d["peak_allocated_bytes"] for d in rep["cuda"]) for rep in r["reports"].values() if rep.get("cuda")]
    return max(peaks) if peaks else None


def node_figures(r: dict, prompt: dict) -> list[str]:
    """'Label: figure · figure' for each MemoryKit technique node of a run (Memory Report excluded)."""
    out = []
    for nid, rep in sorted(r["reports"].items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0):
        if prompt.get(nid, {}).get("class_type") == "MemoryKitMemoryReport":
            continue
        out.append(f"{rep.get('label') or nid}: {' · '.join(rep.get('badge') or [])}")
    return out


def run_fresh(name: str, prompt: dict, out_dir: Path | None) -> dict:
    """Run one API prompt in a fresh server; copy its outputs to ``out_dir``."""
    with ComfyServer() as srv:
        try:
            r = examples.run_prompt(srv, name, prompt)
        except PromptRejected as e:
            return {"name": name, "status": "rejected", "error": e.body, "seconds": 0.0, "peak_rss_bytes": None,
                    "reports": {}}
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            for src in examples.output_files(srv, r["result"]):
                if src.is_file():
                    shutil.copy2(src, out_dir / src.name)
    r.pop("result", None)
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="run only these example workflows (file stems)")
    ap.add_argument("--out", default=str(REPO / "demo_output"), help="where outputs are copied")
    ap.add_argument("--json", help="also write the results as JSON to this file")
    args = ap.parse_args(argv)

    names = args.only or examples.example_names()
    skipped = {n: examples.unavailable(n) for n in names}
    for n, why in skipped.items():
        if why:
            print(f"  {n}: skipped on this ComfyUI ({why})", flush=True)
    names = [n for n in names if not skipped[n]]
    if not names:
        print("Nothing to run on this ComfyUI.")
        return 0
    print("Generating the models (first run only) ...", flush=True)
    models.ensure_models()
    on_gpu = torch.cuda.is_available()
    print(f"ComfyUI: {paths.comfyui_path()}  ({'GPU: peak = VRAM' if on_gpu else 'CPU: peak = server RSS'})", flush=True)
    with ComfyServer() as srv:
        oi = srv.object_info()
    rows = []
    for name in names:
        mk = examples.load_example(name, oi)
        plain = examples.plain_prompt(mk)
        print(f"  {name}: plain ...", end="", flush=True)
        rp = run_fresh(name, plain, Path(args.out) / name / "plain")
        print(f" {rp['status']}, MemoryKit ...", end="", flush=True)
        rm = run_fresh(name, mk, Path(args.out) / name / "memorykit")
        print(f" {rm['status']}", flush=True)
        rows.append({"name": name, "plain": rp, "memorykit": rm, "figures": node_figures(rm, mk)})

    kind = "VRAM" if on_gpu else "RSS"
    print()
    print("The models have random weights: the images and videos are noise. Peaks in GiB "
          f"({'VRAM from the Memory Report nodes' if on_gpu else 'server RSS high-water mark'}), each run in a fresh server.")
    print(f"{'workflow':<32} {'plain s':>8} {'MK s':>8} {'plain ' + kind:>10} {'MK ' + kind:>8} {'MK/plain':>9}")
    print("-" * 80)
    ok = True
    for row in rows:
        p, m = row["plain"], row["memorykit"]
        ok &= p["status"] == "success" and m["status"] == "success"
        pp, pm = peak_of(p, on_gpu), peak_of(m, on_gpu)
        ratio = f"{pm / pp:.2f}×" if pp and pm else "-"
        print(f"{row['name']:<32} {p['seconds']:>8.1f} {m['seconds']:>8.1f} {_gib(pp):>10} {_gib(pm):>8} {ratio:>9}")
        for f in row["figures"]:
            print(f"    {f}")
        for label, r in (("plain", p), ("MemoryKit", m)):
            if r["status"] != "success":
                print(f"    {label} run {r['status']}: {json.dumps(r['error'])[:600]}")
    print(f"\nOutputs in {args.out}/<workflow>/plain and /memorykit.")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
