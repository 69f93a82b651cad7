"""The MemoryKit demo: each workflow in ``example_workflows/`` run beside its plain baseline.

For every example workflow a real ComfyUI, headless, runs (1) the plain baseline — the same
workflow with the MemoryKit nodes bypassed, Tiled VAE replaced by core's VAE Decode, a
MemoryKit loader replaced by core's plain loader of the same model — and (2) the workflow as
written, each in a fresh server, so neither peak includes what an earlier run left behind.
It prints, per workflow: wall time, peak memory (VRAM from the Memory Report nodes on a GPU;
on a CPU the server's RSS, from the first sampling step on or over the whole run, see
``demo_table.CPU_NOTES``) plain vs MemoryKit, their ratio and difference, how far the
MemoryKit output is from the plain one, and the MemoryKit nodes' own figures (their badges).
Outputs are saved to ``demo_output/<workflow>/``.

The models are generated with random weights (no download), so the images and videos are
noise, except the Tiled VAE row's photograph (TAEF2, trained weights; see ``demo_setup``).
The demo sets sizes where a template's would show nothing on a CPU (``demo_setup``): a 2.0 GiB
stand-in diffusion model for the model-size techniques, a photograph large enough that the
untiled decode holds gigabytes.

Run with ``make demo`` (which runs scripts/setup.sh first). ComfyUI: ``$COMFYUI_PATH`` if set
(0.3.75 and 0.33.0 are tested), else the 0.3.75 tree set-up made. ``--only NAME ...`` runs a
few workflows; ``--markdown docs/demo.md`` writes the table that docs/demo.md holds (and
``python scripts/docs_figures.py`` quotes it in README.md). Time and disk: docs/demo.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import torch  # noqa: E402

from harness import examples, models, paths  # noqa: E402
from harness.server import ComfyServer, PromptRejected  # noqa: E402
from harness.ws import WsListener  # noqa: E402

import demo_setup  # noqa: E402
import demo_table  # noqa: E402


SAMPLERS = {"KSampler", "KSamplerAdvanced", "SamplerCustom", "SamplerCustomAdvanced"}
LOADER_TECHNIQUES = {"MemoryKitShardedCheckpointLoader", "MemoryKitShardedTextEncoderLoader",
                     "MemoryKitGroupOffloadLoader"}


def peak_of(r: dict, on_gpu: bool) -> float | None:
    """VRAM peak (max over the reports' CUDA devices) on a GPU, else the RSS high-water mark."""
    if not on_gpu:
        return r.get("peak_rss_bytes")
    peaks = [max(d["peak_allocated_bytes"] for d in rep["cuda"]) for rep in r["reports"].values() if rep.get("cuda")]
    return max(peaks) if peaks else None


def peak_kind(prompt: dict) -> str:
    """'S' (from the first sampling step on) for a workflow that samples, unless its technique is
    a loader; 'W' (the whole run) otherwise. See demo_table.CPU_NOTES."""
    kinds = {n["class_type"] for n in prompt.values()}
    return "S" if kinds & SAMPLERS and not kinds & LOADER_TECHNIQUES else "W"


def node_figures(r: dict, prompt: dict) -> list[str]:
    """'Label: figure · figure' for each MemoryKit technique node of a run (Memory Report excluded)."""
    out = []
    for nid, rep in sorted(r["reports"].items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0):
        if prompt.get(nid, {}).get("class_type") == "MemoryKitMemoryReport":
            continue
        out.append(f"{rep.get('label') or nid}: {' · '.join(rep.get('badge') or [])}")
    return out


def run_watched(srv: ComfyServer, name: str, prompt: dict, timeout: float = 900) -> dict:
    """Run one prompt like ``examples.run_prompt``, and also read the RSS peak from the first
    sampling step on: the high-water mark is reset when the first sampler reports progress, and
    the peak is the largest reading after that (``peak_sampling_bytes``; None without a sampler)."""
    memory = paths.memory_module()
    samplers = {nid for nid, n in prompt.items() if n["class_type"] in SAMPLERS}
    state: dict = {}
    with WsListener(srv) as ws:
        def watch():
            try:
                ws.wait_for(lambda m: m.get("type") == "progress" and m.get("data", {}).get("node") in samplers,
                            timeout=timeout)
            except TimeoutError:
                return
            memory.reset_host_peak(srv.pid)
            with ws._cond:
                state["after"] = len(ws.messages)
        if samplers:
            threading.Thread(target=watch, daemon=True).start()
        memory.reset_host_peak(srv.pid)
        t0 = time.time()
        res = srv.run(prompt, timeout=timeout)
        seconds = time.time() - t0
        final = memory.host_memory(srv.pid).rss_peak_bytes
        with ws._cond:
            later = ws.messages[state["after"]:] if "after" in state else []
    reports = examples.memorykit_reports(res)
    peak = max([final] + [r["host"]["rss_peak_bytes"] for r in reports.values() if "host" in r])
    # the nodes that ran from the first step on (a node's UI can reach the client again later, with
    # figures taken when it ran: its "executed" message alone does not place it in the window)
    after = {m["data"]["node"] for m in later if m.get("type") == "executing"}
    sampling = (max([final] + [reports[n]["host"]["rss_peak_bytes"] for n in after if "host" in reports.get(n, {})])
                if "after" in state else None)
    # what the badges show after the run: a node that reports again once the sampler is done (Group
    # Offload's "last run") replaces the report it made when it ran
    with ws._cond:
        for m in ws.messages:
            rep = (m.get("data", {}).get("output") or {}).get("memorykit_report") if m.get("type") == "executed" else None
            if rep and m["data"].get("node") in prompt:
                reports[m["data"]["node"]] = rep[-1]
    return {"name": name, "status": res.status, "error": res.error, "seconds": seconds, "peak_rss_bytes": peak,
            "peak_sampling_bytes": sampling, "reports": reports, "result": res}


def run_fresh(name: str, prompt: dict, out_dir: Path | None) -> dict:
    """Run one API prompt in a fresh server; copy its outputs to ``out_dir``."""
    srv = ComfyServer()
    demo_setup.prepare_server(name, srv.base)
    with srv:
        try:
            r = run_watched(srv, name, prompt)
        except PromptRejected as e:
            return {"name": name, "status": "rejected", "error": e.body, "seconds": 0.0, "peak_rss_bytes": None,
                    "peak_sampling_bytes": None, "reports": {}}
        if out_dir is not None:
            shutil.rmtree(out_dir, ignore_errors=True)
            out_dir.mkdir(parents=True, exist_ok=True)
            for src in examples.output_files(srv, r["result"]):
                if src.is_file():
                    shutil.copy2(src, out_dir / src.name)
    r.pop("result", None)
    return r


def disk_used(prompts: list[dict]) -> dict[str, int]:
    """Path → bytes of the generated model files the demo's prompts read (folders counted whole)."""
    seen, total = set(), {}
    for prompt in prompts:
        for n in prompt.values():
            for v in n["inputs"].values():
                if not isinstance(v, str) or not v.strip() or "/" in v:
                    continue
                for p in list(paths.MODELS.glob(f"*/{v}")) + list(paths.MODELS.glob(f"demo/{v}")):
                    if p in seen:
                        continue
                    seen.add(p)
                    total[str(p)] = (sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir()
                                     else p.stat().st_size)
    return total


def report(rows: list[dict], minutes: float, disk: dict[str, int], on_gpu: bool, markdown: str | None) -> bool:
    """Print the table (and write it as Markdown); True when every run succeeded."""
    kind = "VRAM from the Memory Report nodes" if on_gpu else "server RSS"
    header = [f"{len(rows)} example workflows on ComfyUI {paths.comfyui_version() or '?'}, each run plain (MemoryKit nodes "
              "bypassed, Tiled VAE → core's VAE Decode, MemoryKit loaders → core's loaders) and as written (MK: "
              "MemoryKit), each in a fresh ComfyUI server. "
              f"Peaks in GiB ({kind}); saved GiB: plain peak − MK peak (negative: the MK run's peak was higher); "
              "error vs plain: relative L2 difference of the saved images and frames. "
              "The models are generated with random weights (no download): their images are noise, except "
              "the Tiled VAE row's when it decodes a photograph with trained weights. Rows with the templates' "
              "small generated models (tens to hundreds of MiB) stay near 1.00×, since ComfyUI's own 1–2 GiB is "
              "most of the peak, Memory Plan finds nothing to do for them (as loaded), a decode that fits one tile "
              "runs whole, and Memory Report and Free Memory measure and free between stages: these rows show "
              "that the output matches the plain workflow's."]
    footer = ([] if on_gpu else demo_table.CPU_NOTES) + [
        f"Measured: {minutes:.0f} minutes for the {2 * len(rows)} runs on a {os.cpu_count()}-core machine "
        f"{'with a GPU' if on_gpu else 'without a GPU'}; the generated model files the workflows read take {sum(disk.values()) / 1e9:.1f} GB."]
    print()
    for line in header + demo_table.text_table(rows) + [""] + footer:
        print(line)
    ok = all(r["plain"]["status"] == "success" and r["memorykit"]["status"] == "success" for r in rows)
    for row in rows:
        for label, r in (("plain", row["plain"]), ("MemoryKit", row["memorykit"])):
            if r["status"] != "success":
                print(f"{row['name']}: {label} run {r['status']}: {json.dumps(r['error'])[:600]}")
    if markdown:
        Path(markdown).write_text(demo_table.markdown(rows, header, footer))
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="run only these example workflows (file stems)")
    ap.add_argument("--out", default=str(REPO / "demo_output"), help="where outputs are copied")
    ap.add_argument("--json", help="also write the results as JSON to this file")
    ap.add_argument("--markdown", help="also write the table as Markdown to this file (docs/demo.md)")
    ap.add_argument("--from-json", nargs="*", help="run nothing: the table of these --json files (parts of one "
                    "demo run, rows in workflow order)")
    args = ap.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    if args.from_json:
        parts = [json.loads(Path(f).read_text()) for f in args.from_json]
        rows = sorted((r for p in parts for r in p["rows"]), key=lambda r: r["name"])
        disk = {k: v for p in parts for k, v in p["disk"].items()}
        return 0 if report(rows, sum(p["minutes"] for p in parts), disk, parts[0].get("on_gpu", False),
                           args.markdown) else 1

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
    models.ensure_models(("sd15", "wan"))
    demo_setup.ensure_demo_models(names)
    print(f"ComfyUI: {paths.comfyui_path()}  ({'GPU: peak = VRAM' if on_gpu else 'CPU: peak = server RSS'})", flush=True)
    with ComfyServer() as srv:
        oi = srv.object_info()
    rows, prompts = [], []
    t_runs = time.time()
    for name in names:
        mk = examples.load_example(name, oi)
        notes = demo_setup.adjust_prompt(name, mk)
        plain = examples.plain_prompt(mk)
        prompts.append(mk)
        print(f"  {name}: plain ...", end="", flush=True)
        rp = run_fresh(name, plain, Path(args.out) / name / "plain")
        print(f" {rp['status']}, MemoryKit ...", end="", flush=True)
        rm = run_fresh(name, mk, Path(args.out) / name / "memorykit")
        print(f" {rm['status']}", flush=True)
        if on_gpu:
            rp["peak_rss_bytes"], rm["peak_rss_bytes"] = peak_of(rp, True), peak_of(rm, True)
        rows.append({"name": name, "plain": rp, "memorykit": rm, "figures": node_figures(rm, mk), "notes": notes,
                     "peak_kind": "W" if on_gpu else peak_kind(mk),
                     "error": demo_table.output_error(Path(args.out) / name / "plain", Path(args.out) / name / "memorykit")})
    minutes = (time.time() - t_runs) / 60
    disk = disk_used(prompts)
    ok = report(rows, minutes, disk, on_gpu, args.markdown)
    print(f"\nOutputs in {args.out}/<workflow>/plain and /memorykit.")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "minutes": minutes, "disk": disk, "on_gpu": on_gpu},
                                              indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
