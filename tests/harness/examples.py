"""Run the workflows in ``example_workflows/`` on the generated models (demo and tests).

The example workflows are ordinary user workflows. Two things cannot run on a CPU test
machine as written, and are substituted here (and only here):
- Wan's text encoder (CLIPLoader type ``wan`` → CLIPTextEncode): each such CLIPTextEncode
  becomes ``MemoryKitTestWanTextEncode`` with the same text; the CLIPLoader is dropped.
- Output file prefixes get the workflow's name, so outputs can be told apart.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from . import paths, workflow
from .server import ComfyServer, RunResult

EXAMPLES = paths.REPO / "example_workflows"
SAVE_NODES = {"SaveImage", "SaveAnimatedWEBP", "SaveAnimatedPNG", "MemoryKitTestSaveTensor"}


def example_names() -> list[str]:
    """File stems of every example workflow, sorted."""
    return sorted(p.stem for p in EXAMPLES.glob("*.json"))


def load_example(name: str, object_info: dict) -> dict:
    """API-format prompt for ``example_workflows/<name>.json`` with the substitutions above."""
    ui = json.loads((EXAMPLES / f"{name}.json").read_text())
    api = workflow.ui_to_api(ui, object_info)
    wan_clips = {nid for nid, n in api.items()
                 if n["class_type"] == "CLIPLoader" and n["inputs"].get("type") == "wan"}
    for nid, n in list(api.items()):
        if n["class_type"] == "CLIPTextEncode" and isinstance(n["inputs"].get("clip"), list) \
                and n["inputs"]["clip"][0] in wan_clips:
            api[nid] = {"class_type": "MemoryKitTestWanTextEncode",
                        "inputs": {"text": n["inputs"].get("text", ""), "tokens": 16}}
        elif n["class_type"] in SAVE_NODES and "filename_prefix" in n["inputs"]:
            n["inputs"]["filename_prefix"] = f"{name}/{name}"
    for nid in wan_clips:
        del api[nid]
    return workflow.strip_meta(api)


def memorykit_reports(result: RunResult) -> dict[str, dict]:
    """node id → the report dict every MemoryKit node puts under ``memorykit_report``."""
    out = {}
    for nid, ui in result.outputs.items():
        for rep in ui.get("memorykit_report", []) or []:
            out[nid] = rep
    return out


def run_example(server: ComfyServer, name: str, object_info: dict, copy_outputs_to: Path | None = None,
                timeout: float = 900) -> dict:
    """Run one example workflow; returns a dict with ``name``, ``status``, ``error``,
    ``seconds`` (wall), ``peak_rss_bytes`` (server VmHWM during the run), ``reports`` and
    ``files`` (output files, copied to ``copy_outputs_to/<name>/`` when given)."""
    memory = paths.memory_module()
    host_memory, reset_host_peak = memory.host_memory, memory.reset_host_peak
    prompt = load_example(name, object_info)
    reset_host_peak(server.pid)
    t0 = time.time()
    res = server.run(prompt, timeout=timeout)
    seconds = time.time() - t0
    # Memory Report nodes may reset the high-water mark mid-run: take the max of all readings.
    reports = memorykit_reports(res)
    peak = max([host_memory(server.pid).rss_peak_bytes]
               + [r["host"]["rss_peak_bytes"] for r in reports.values() if "host" in r])
    files = []
    for ui in res.outputs.values():
        for key in ("images", "animated", "tensors"):
            for f in ui.get(key, []) or []:
                if isinstance(f, dict) and "filename" in f:
                    src = server.base / "output" / f.get("subfolder", "") / f["filename"]
                    files.append(src)
    if copy_outputs_to is not None:
        dest = Path(copy_outputs_to) / name
        dest.mkdir(parents=True, exist_ok=True)
        files = [Path(shutil.copy2(f, dest / f.name)) for f in files if f.exists()]
    return {"name": name, "status": res.status, "error": res.error, "seconds": seconds,
            "peak_rss_bytes": peak, "reports": reports, "files": files, "result": res}
