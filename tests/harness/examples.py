"""Run the workflows in ``example_workflows/`` on the generated models (demo and tests).

The example workflows are ordinary user workflows. Two things cannot run on a CPU test
machine as written, and are substituted here (and only here):
- Wan's and Flux 2's text encoders (CLIPLoader type ``wan``: UMT5-XXL, 5.7 B parameters;
  ``flux2``: Mistral Small 3, 24 B; core builds both at full size whatever the file holds): each
  CLIPTextEncode they feed becomes ``MemoryKitTestWanTextEncode`` with the same text (context
  4096, which the Wan and Flux 2 stand-ins take); the CLIPLoader is dropped. Wired through Memory
  Plan, the plan loses its ``clip`` input and the text encoders fed by its CLIP output are
  substituted the same way.
- Output file prefixes get the workflow's name, so outputs can be told apart.
- Balanced Device Map's ``auto`` budgets keep a model on a CPU-only machine's one device: the
  tiny model gets :data:`TINY_DEVICE_MAP` (embeddings in RAM, blocks streamed from disk), so the
  split really happens.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from . import paths, workflow
from .server import ComfyServer, RunResult

EXAMPLES = paths.REPO / "example_workflows"
# Balanced Device Map settings for the tiny Wan model (4.2 MiB) in place of the template's "auto".
TINY_DEVICE_MAP = {"strategy": "sequential", "max_memory": "cpu=4MiB, disk"}
SAVE_NODES = {"SaveImage", "SaveAnimatedWEBP", "SaveAnimatedPNG", "MemoryKitTestSaveTensor"}


def example_names() -> list[str]:
    """File stems of every example workflow, sorted."""
    return sorted(p.stem for p in EXAMPLES.glob("*.json"))


def pack_node_types(name: str) -> set[str]:
    """The MemoryKit node types (``MemoryKit*``) in ``example_workflows/<name>.json``."""
    ui = json.loads((EXAMPLES / f"{name}.json").read_text())
    return {n["type"] for n in ui["nodes"] if n["type"].startswith("MemoryKit")}


def covering_examples() -> list[str]:
    """The fewest example workflows (greedy set cover, ties by name) that hold between them every
    MemoryKit node type found in any example that runs on the ComfyUI under test (:func:`unavailable`), sorted."""
    kinds = {name: pack_node_types(name) for name in example_names() if not unavailable(name)}
    left = set().union(*kinds.values())
    chosen = []
    while left:
        best = max(sorted(kinds), key=lambda n: len(kinds[n] & left))
        chosen.append(best)
        left -= kinds[best]
    return sorted(chosen)


# Real model files named by the example workflows → the generated fixtures that stand in for
# them (same architecture, tiny, random weights). Generated on first use where noted.
MODEL_FILES = {
    "v1-5-pruned-emaonly-fp16.safetensors": "mk_sd15_tiny.safetensors",
    "vae-ft-mse-840000-ema-pruned.safetensors": "mk_sd15_vae_tiny.safetensors",
    "wan2.1_t2v_1.3B_fp16.safetensors": "mk_wan21_tiny.safetensors",
    "wan2.1_t2v_14B_fp8_scaled.safetensors": "mk_wan21_tiny.safetensors",
    "sd15_unet_sharded": "mk_sd15_tiny_unet_sharded",
    "sd15_clip_l_sharded": "mk_sd15_clip_l_sharded",
    "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors": "mk_wan22_high_noise_tiny.safetensors",
    "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors": "mk_wan22_low_noise_tiny.safetensors",
    "wan_2.1_vae.safetensors": "mk_wan21_vae_tiny.safetensors",
}
_NEEDS_WAN22 = {"mk_wan22_high_noise_tiny.safetensors", "mk_wan22_low_noise_tiny.safetensors"}
MODEL_FILES.update({
    "flux2_dev_fp8mixed.safetensors": "mk_flux2_tiny.safetensors",
    "flux2-vae.safetensors": "mk_flux2_vae.safetensors",
})
_NEEDS_FLUX2 = {"mk_flux2_tiny.safetensors", "mk_flux2_vae.safetensors"}
# CLIPLoader types whose text encoder the harness substitutes (see the module docstring).
BIG_TEXT_ENCODERS = {"wan", "flux2"}


def unavailable(name: str) -> str | None:
    """Why ``example_workflows/<name>.json`` cannot run on the ComfyUI under test, or None.
    Flux 2: ComfyUI before 0.33 detects a Flux 2 model with 48 heads whatever its width, so
    its smallest stand-in would be 1.5 B parameters."""
    ui = json.loads((EXAMPLES / f"{name}.json").read_text())
    flux2 = any(v in ("flux2_dev_fp8mixed.safetensors",) for n in ui["nodes"] for v in n.get("widgets_values") or [])
    if flux2 and paths.comfyui_version_tuple() < (0, 33):
        return ("ComfyUI before 0.33 reads every Flux 2 model as 48 heads of width 128 (hidden size 6144), "
                "so no small Flux 2 stand-in loads there; runs on ComfyUI 0.33")
    return None


def load_example(name: str, object_info: dict) -> dict:
    """API-format prompt for ``example_workflows/<name>.json`` with the substitutions above
    (and real model file names mapped to the fixtures, :data:`MODEL_FILES`)."""
    ui = json.loads((EXAMPLES / f"{name}.json").read_text())
    api = workflow.ui_to_api(ui, object_info)
    for n in api.values():
        for k, v in n["inputs"].items():
            if isinstance(v, str) and v in MODEL_FILES:
                n["inputs"][k] = MODEL_FILES[v]
                if MODEL_FILES[v] in _NEEDS_WAN22:
                    from .wan22_models import ensure_wan22_experts
                    ensure_wan22_experts()
                if MODEL_FILES[v] in _NEEDS_FLUX2:
                    from .flux2_models import ensure_flux2
                    ensure_flux2()
    for n in api.values():
        if n["class_type"] == "MemoryKitBalancedDeviceMap" and n["inputs"].get("max_memory") == "auto":
            n["inputs"].update(TINY_DEVICE_MAP)
    wan_clips = {nid for nid, n in api.items()
                 if n["class_type"] == "CLIPLoader" and n["inputs"].get("type") in BIG_TEXT_ENCODERS}
    # A wan CLIP through Memory Plan: the plan gets no clip (the stand-in encodes apart), and the
    # text encoders fed by its CLIP output (slot 2) are substituted as if fed by the loader.
    planned = set()
    for nid, n in api.items():
        if n["class_type"] == "MemoryKitMemoryPlan" and isinstance(n["inputs"].get("clip"), list) \
                and n["inputs"]["clip"][0] in wan_clips:
            del n["inputs"]["clip"]
            planned.add(nid)

    def wan_clip(link) -> bool:
        return isinstance(link, list) and (link[0] in wan_clips or (link[0] in planned and link[1] == 2))
    for nid, n in list(api.items()):
        if n["class_type"] == "CLIPTextEncode" and wan_clip(n["inputs"].get("clip")):
            api[nid] = {"class_type": "MemoryKitTestWanTextEncode",
                        "inputs": {"text": n["inputs"].get("text", ""), "tokens": 16}}
        elif n["class_type"] in SAVE_NODES and "filename_prefix" in n["inputs"]:
            n["inputs"]["filename_prefix"] = f"{name}/{name}"
    for nid in wan_clips:
        del api[nid]
    return workflow.strip_meta(api)


def ensure_stand_ins(name: str) -> None:
    """Generate the stand-ins made on first use that ``example_workflows/<name>.json`` names
    (a server lists them under the real names, see ``harness.stand_ins``)."""
    ui = json.loads((EXAMPLES / f"{name}.json").read_text())
    wanted = {MODEL_FILES[v] for n in ui["nodes"] for v in n.get("widgets_values") or []
              if isinstance(v, str) and v in MODEL_FILES}
    if wanted & _NEEDS_WAN22:
        from .wan22_models import ensure_wan22_experts
        ensure_wan22_experts()
    if wanted & _NEEDS_FLUX2:
        from .flux2_models import ensure_flux2
        ensure_flux2()


def template_as_run(name: str) -> dict:
    """``example_workflows/<name>.json`` as a user opens it (UI format, every node, widget value and
    link as the file has them, real model file names), but for the one substitution a CPU needs:
    each CLIPTextEncode fed by a Wan or Flux 2 text encoder (directly or through Memory Plan's CLIP
    output) becomes ``MemoryKitTestWanTextEncode`` with the same text, and that CLIPLoader goes
    (with its links, Memory Plan's ``clip`` input among them). Stand-ins are generated first."""
    ensure_stand_ins(name)
    ui = json.loads((EXAMPLES / f"{name}.json").read_text())
    nodes = {n["id"]: n for n in ui["nodes"]}
    links = {lk[0]: lk for lk in ui.get("links", [])}
    big = {n["id"] for n in ui["nodes"] if n["type"] == "CLIPLoader"
           and len(n.get("widgets_values") or []) > 1 and n["widgets_values"][1] in BIG_TEXT_ENCODERS}
    drop: set[int] = set()
    planned = set()
    for n in ui["nodes"]:
        for inp in n.get("inputs", []):
            lk = links.get(inp.get("link"))
            if lk is None:
                continue
            if n["type"] == "MemoryKitMemoryPlan" and inp["name"] == "clip" and lk[1] in big:
                drop.add(lk[0])
                inp["link"] = None
                planned.add(n["id"])
    for n in ui["nodes"]:
        if n["type"] != "CLIPTextEncode":
            continue
        lk = next((links.get(i.get("link")) for i in n.get("inputs", []) if i["name"] == "clip"), None)
        if lk is not None and (lk[1] in big or (lk[1] in planned and lk[2] == 2)):
            drop.add(lk[0])
            n.update(type="MemoryKitTestWanTextEncode", inputs=[],
                     widgets_values=[(n.get("widgets_values") or [""])[0], 16])
    for nid in big:
        for out in nodes[nid].get("outputs", []):
            drop.update(out.get("links") or [])
    for n in ui["nodes"]:
        for out in n.get("outputs", []):
            if out.get("links"):
                out["links"] = [x for x in out["links"] if x not in drop]
    ui["links"] = [lk for lk in ui.get("links", []) if lk[0] not in drop]
    ui["nodes"] = [n for n in ui["nodes"] if n["id"] not in big]
    return ui


def memorykit_reports(result: RunResult) -> dict[str, dict]:
    """node id → the report dict every MemoryKit node puts under ``memorykit_report``."""
    out = {}
    for nid, ui in result.outputs.items():
        for rep in ui.get("memorykit_report", []) or []:
            out[nid] = rep
    return out


def output_files(server: ComfyServer, res: RunResult) -> list[Path]:
    """The files a finished prompt's save nodes wrote, from its UI outputs (``images``,
    ``animated``, ``tensors``; entries that are not file records, such as the ``animated``
    flags ``[True]``, are skipped)."""
    files = []
    for ui in res.outputs.values():
        for key in ("images", "animated", "tensors"):
            for f in ui.get(key, []) or []:
                if isinstance(f, dict) and "filename" in f:
                    files.append(server.base / "output" / f.get("subfolder", "") / f["filename"])
    return files


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
    files = output_files(server, res)
    if copy_outputs_to is not None:
        dest = Path(copy_outputs_to) / name
        dest.mkdir(parents=True, exist_ok=True)
        files = [Path(shutil.copy2(f, dest / f.name)) for f in files if f.exists()]
    return {"name": name, "status": res.status, "error": res.error, "seconds": seconds,
            "peak_rss_bytes": peak, "reports": reports, "files": files, "result": res}


# --- the plain baseline of a workflow (the demo runs each example beside it) ------------------
# MemoryKit nodes that pass one input through (bypassed, as mode 4 would), by the input they pass.
_PASSTHROUGH = {"MemoryKitFp8LayerwiseCast": "model", "MemoryKitGroupOffload": "model",
                "MemoryKitBalancedDeviceMap": "model", "MemoryKitFreeMemory": "value"}
# Nodes replaced by core's plain node of the same job.
_CORE_EQUIVALENT = {"MemoryKitTiledVAEDecode": ("VAEDecode", ("samples", "vae")),
                    "MemoryKitTiledVAEEncode": ("VAEEncode", ("pixels", "vae"))}
# A sharded model folder → the single file core loads it from (the generated shards are split
# from these files), and which output of that loader carries it.
_SHARDED_PLAIN = {
    "mk_sd15_tiny_unet_sharded": ({"class_type": "CheckpointLoaderSimple",
                                   "inputs": {"ckpt_name": "mk_sd15_tiny.safetensors"}}, 0),
    "mk_sd15_clip_l_sharded": ({"class_type": "CheckpointLoaderSimple",
                                "inputs": {"ckpt_name": "mk_sd15_tiny.safetensors"}}, 1),
    "mk_flux_tiny_sharded": ({"class_type": "UNETLoader",
                              "inputs": {"unet_name": "mk_flux_tiny.safetensors", "weight_dtype": "default"}}, 0),
}


def plain_prompt(api: dict) -> dict:
    """The same prompt without MemoryKit's techniques: pass-through nodes bypassed (their
    consumers take their input), Tiled VAE replaced by core's VAE Decode/Encode, a MemoryKit
    loader replaced by core's plain loader of the same model, Save Sharded dropped. Memory
    Report nodes stay: they are how the peak is read. Raises KeyError for a sharded model with
    no plain file known."""
    api = json.loads(json.dumps(api))
    redirect: dict[tuple[str, int], list] = {}
    for nid, n in list(api.items()):
        ct, inp = n["class_type"], n["inputs"]
        if ct in _PASSTHROUGH:
            redirect[(nid, 0)] = inp[_PASSTHROUGH[ct]]
            del api[nid]
        elif ct == "MemoryKitMemoryPlan":  # MODEL, VAE, CLIP, MODEL_2 passed through (outputs 0-3)
            redirect[(nid, 0)] = inp["model"]
            for slot, key in ((1, "vae"), (2, "clip"), (3, "model_2")):
                if key in inp:
                    redirect[(nid, slot)] = inp[key]
            del api[nid]
        elif ct in _CORE_EQUIVALENT:
            core, names = _CORE_EQUIVALENT[ct]
            api[nid] = {"class_type": core, "inputs": {k: inp[k] for k in names}}
        elif ct == "MemoryKitGroupOffloadLoader":
            api[nid] = {"class_type": "UNETLoader", "inputs": {"unet_name": inp["unet_name"],
                                                               "weight_dtype": inp.get("weight_dtype", "default")}}
        elif ct in ("MemoryKitShardedCheckpointLoader", "MemoryKitShardedTextEncoderLoader"):
            name = inp.get("model_name") or inp.get("text_encoder_name")
            loader, slot = _SHARDED_PLAIN[name]
            new_id = f"{nid}00"
            api[new_id] = json.loads(json.dumps(loader))
            redirect[(nid, 0)] = [new_id, slot]
            del api[nid]
        elif ct == "MemoryKitSaveSharded":
            del api[nid]

    def resolve(link):
        seen = 0
        while isinstance(link, list) and (link[0], link[1]) in redirect and seen < 100:
            link, seen = redirect[(link[0], link[1])], seen + 1
        return link

    for n in api.values():
        for k, v in list(n["inputs"].items()):
            if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str):
                n["inputs"][k] = resolve(v)
    # Loaders replaced by the same checkpoint loader twice: keep one.
    firsts: dict[str, str] = {}
    for nid in sorted(api, key=lambda i: (len(i), i)):
        key = json.dumps(api[nid], sort_keys=True)
        if api[nid]["class_type"].endswith("Loader") or api[nid]["class_type"] == "CheckpointLoaderSimple":
            if key in firsts:
                for n in api.values():
                    for k, v in n["inputs"].items():
                        if isinstance(v, list) and len(v) == 2 and v[0] == nid:
                            n["inputs"][k] = [firsts[key], v[1]]
                del api[nid]
            else:
                firsts[key] = nid
    return api


def run_prompt(server: ComfyServer, name: str, prompt: dict, timeout: float = 900) -> dict:
    """Run an API prompt like :func:`run_example` (same result dict, no output copies)."""
    memory = paths.memory_module()
    memory.reset_host_peak(server.pid)
    t0 = time.time()
    res = server.run(prompt, timeout=timeout)
    seconds = time.time() - t0
    reports = memorykit_reports(res)
    peak = max([memory.host_memory(server.pid).rss_peak_bytes]
               + [r["host"]["rss_peak_bytes"] for r in reports.values() if "host" in r])
    return {"name": name, "status": res.status, "error": res.error, "seconds": seconds,
            "peak_rss_bytes": peak, "reports": reports, "files": [], "result": res}
