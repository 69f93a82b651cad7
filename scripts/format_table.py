"""Architecture × format × node table (a benchmark, not a test): every node of the pack on the
zoo's quantized models, in-process on a real ComfyUI 0.33, on the CPU.

    COMFYUI_PATH=/path/to/comfyui-0.33.0 python scripts/format_table.py

Formats: fp8_scaled ``legacy`` (``scaled_fp8`` + ``scale_weight``) and ``mixed`` (per-layer
``comfy_quant``: e4m3, e5m2 and layers left in bf16) loaded as core's ``QuantizedTensor`` layers
(``harness.quant_models``), and GGUF Q8_0 loaded by city96/ComfyUI-GGUF's loader, ops and patcher
(``harness.gguf_models``). Each cell compares the node's output (one ``apply_model`` forward) with
the plain loaded model's: ``exact``, ``max err`` (relative L2 too), ``refused: <message>`` (the node
raised a ValueError naming the problem) or ``ERROR`` (anything else: a defect). Then the bytes the
Group Offload event ring copies per forward (its own counter, measured) for each quantized model
and for its bf16 original at the same budget. Writes benchmarks/results/formats.md and .json.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("MEMORYKIT_REALWEIGHTS", str(REPO.parent / "shared" / "realweights"))

import torch  # noqa: E402

from harness import comfy_env, gguf_models, gguf_pack, paths, quant_models, zoo  # noqa: E402

ARCHS = ["wan21", "flux", "qwen_image"]
FORMATS = ["fp8_scaled legacy", "fp8_scaled mixed", "GGUF Q8_0"]
NODES = ["Group Offload (RAM ring)", "Group Offload (disk)", "Balanced Device Map", "FP8 Layerwise Cast",
         "Memory Plan", "Save Sharded"]
RING_BUDGET = 16 << 10  # bytes resident: every block streamed
OUT = REPO / "benchmarks" / "results"


def _forward(patcher, name, args, load=True):
    import comfy.model_management as mm
    with torch.inference_mode():
        try:
            if load:
                mm.load_models_gpu([patcher])
            return zoo.forward(patcher, name, args)
        finally:
            if load:
                mm.unload_all_models()


def _compare(out, ref) -> dict:
    if torch.equal(out, ref):
        return {"result": "exact"}
    d = (out.float() - ref.float())
    return {"result": "error", "max_abs": float(d.abs().max()), "rel_l2": float(d.norm() / ref.float().norm())}


def _ring(patcher, name, args) -> tuple[torch.Tensor, dict]:
    """The event ring (RAM → onload device; here the CPU) at RING_BUDGET, technique level."""
    from comfyui_memorykit.memorykit import offload, weight_parts
    from comfyui_memorykit.memorykit.comfy_integration import comfy_block_lists
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    dm = patcher.model.diffusion_model
    # GGUF weights stream as their raw parts, as Group Offload's patcher decomposes them
    parts = weight_parts.decompose(dm) if any(type(p).__name__ == "GGMLTensor" for p in dm.parameters()) else None
    opts = GroupOffloadOptions(offload_to="cpu", exclude_kwargs=("transformer_options",))
    try:
        with torch.inference_mode():
            h = offload.apply_group_offload(dm, "cpu", "cpu", options=opts, budget_bytes=RING_BUDGET,
                                            block_lists=comfy_block_lists(dm))
            try:
                out = zoo.forward(patcher, name, args)
                fig = offload.offload_figures(h)
            finally:
                offload.remove_group_offload(h)
    finally:
        if parts is not None:
            parts.restore()
    # the stored bytes (no alignment) of what the plan streams: its blocks, and the rest when not resident
    streamed = set(h.plan.streamed_blocks)
    raw = sum(_stored_bytes(b) for _, items in comfy_block_lists(dm) for qn, b in items if qn in streamed)
    if not h.plan.remainder_resident:
        raw = _stored_bytes(dm)
    fig["stored_bytes_streamed"] = raw
    return out, fig


def _stored_bytes(dm) -> int:
    from comfyui_memorykit.memorykit import stored_parts
    return sum(stored_parts.stored_nbytes(t) for t in list(dm.parameters()) + list(dm.buffers()))


def run_cell(node, arch, fmt, patcher, args, ref, folder) -> dict:
    from comfyui_memorykit.memorykit import comfy_integration as ci
    from comfyui_memorykit.memorykit.comfy_integration import memory_plan_io as mpio
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    dm = patcher.model.diffusion_model
    if node == "Group Offload (RAM ring)":
        out, fig = _ring(patcher, arch, args)
        return _compare(out, ref) | {"copied_bytes": fig["copied_bytes_last_forward"],
                                     "streamed_bytes": fig["stored_bytes_streamed"]}
    if node == "Group Offload (disk)":
        s = ci.GroupOffloadSettings(GroupOffloadOptions(offload_type="block_level", offload_to="disk"),
                                    disk_folder=str(folder))
        return _compare(_forward(ci.prepare_group_offload(patcher, s)[0], arch, args), ref)
    if node == "Balanced Device Map":
        total = _stored_bytes(dm)
        in_blocks = sum(_stored_bytes(b) for _, items in ci.comfy_block_lists(dm) for _, b in items)
        clone = ci.device_map_model(patcher, "balanced", f"cpu={total - in_blocks // 2}, disk", str(folder))[0]
        return _compare(_forward(clone, arch, args), ref)
    if node == "FP8 Layerwise Cast":
        with torch.inference_mode():
            clone, info = ci.fp8_layerwise_cast(patcher)
        return _compare(_forward(clone, arch, args), ref) | (
            {"note": "passed through: already quantized"} if info.get("passed_through") else {})
    if node == "Memory Plan":
        out, _vae, info = mpio.memory_plan(patcher, latent={"samples": args[0]}, plan_for="given figures", vram_gb=2,
                                           ram_gb=0.04, disk_gb=10, disk_folder=str(folder))
        counted = info["model"]["weight_bytes"] == _stored_bytes(dm)
        return _compare(_forward(out, arch, args), ref) | {
            "note": ("stored bytes" if counted else "NOT the stored bytes") + (
                "; fp8 applied" if "fp8" in info["applied"] else "; no fp8 offered")}
    if node == "Save Sharded":
        from comfyui_memorykit.memorykit import sharded
        with torch.inference_mode():  # as the server runs it (core loads the model to save it)
            rep = ci.save_model_sharded(patcher, f"mk_format_table_{arch}_{fmt.replace(' ', '_')}", overwrite=True)
        try:
            sd, _ = sharded.load_state_dict(sharded.read_index(rep["folder"]), lambda done, n: None)
            prefix = "model.diffusion_model."
            reloaded = quant_models.load_zoo_quantized(arch, {k[len(prefix):]: v for k, v in sd.items()})
            return _compare(_forward(reloaded, arch, args), ref) | {
                "note": f"{rep['total_bytes']} bytes written, {_stored_bytes(dm)} stored"}
        finally:
            shutil.rmtree(rep["folder"], ignore_errors=True)
    raise KeyError(node)


def bf16_original(name: str):
    """The zoo model as the bf16 file the quantized ones were made from: bf16 weights, computed in
    float32 on the CPU (core's manual cast), the same values quant_models quantised."""
    import comfy.model_patcher
    import comfy.supported_models as sm
    src = dict(zoo.build(name).model.diffusion_model.state_dict())
    spec = zoo.SPECS[name]
    mc = getattr(sm, spec.supported_model)(zoo._config(name))
    mc.set_inference_dtype(torch.bfloat16, torch.float32)
    model = mc.get_model(spec.state_dict() if spec.state_dict else {})
    if spec.post_build is not None:
        spec.post_build(model.diffusion_model, mc.custom_operations or zoo._operations(model))
    model.diffusion_model.load_state_dict({k: v.to(torch.bfloat16) if v.is_floating_point() else v
                                           for k, v in src.items()})
    model.eval()
    return comfy.model_patcher.ModelPatcher(model, torch.device("cpu"), torch.device("cpu"))


def load(arch: str, fmt: str, folder: Path):
    if fmt.startswith("fp8_scaled"):
        return quant_models.build_zoo_quantized(arch, fmt.split()[1])
    why = gguf_pack.available()
    if why:
        raise LookupError(why)
    return gguf_models.zoo_gguf(arch, folder)


def main() -> int:
    comfy_env.setup_comfy()
    comfy_env.set_models_dir(paths.MODELS)
    comfy_env.load_pack()
    import comfy.quant_ops as qo
    if "float8_e5m2" not in getattr(qo, "QUANT_ALGOS", {}):
        raise SystemExit("run this on ComfyUI 0.33 (COMFYUI_PATH): 0.3.75 has no QuantizedTensor layers")
    import comfy.model_management as mm
    table, streamed = {}, []
    t0 = time.time()
    for arch in ARCHS:
        bf16 = bf16_original(arch)
        bf16_args = zoo.inputs(arch, bf16.model)
        _, fig = _ring(bf16, arch, bf16_args)
        bf16_bytes, bf16_streamed = fig["copied_bytes_last_forward"], fig["stored_bytes_streamed"]
        for fmt in FORMATS:
            folder = Path(tempfile.mkdtemp(prefix="mk_formats_"))
            try:
                patcher = load(arch, fmt, folder)
                args = zoo.inputs(arch, patcher.model)
                ref = _forward(patcher, arch, args)
                for node in NODES:
                    work = folder / node.replace(" ", "_").replace("(", "").replace(")", "")
                    work.mkdir()
                    try:
                        with torch.inference_mode():  # as the server runs nodes
                            cell = run_cell(node, arch, fmt, patcher, args, ref, work)
                    except ValueError as e:
                        cell = {"result": "refused", "message": str(e)}
                    except Exception as e:  # a defect: reported in the table, not hidden
                        cell = {"result": "ERROR", "message": f"{type(e).__name__}: {e}"}
                    finally:
                        with torch.inference_mode():
                            mm.unload_all_models()
                    if os.listdir(work):
                        cell["left_files"] = os.listdir(work)
                    table[f"{arch}|{fmt}|{node}"] = cell
                    print(arch, fmt, node, cell.get("result"), cell.get("message", "")[:100], flush=True)
                ring = table[f"{arch}|{fmt}|Group Offload (RAM ring)"]
                if fmt.startswith("fp8_scaled"):  # non-quantized layers in bf16 as on a GPU (the CPU loads them float32)
                    patcher = quant_models.build_zoo_quantized(arch, fmt.split()[1], torch.bfloat16)
                    ref = _forward(patcher, arch, args)
                    out, fig = _ring(patcher, arch, args)
                    ring = {"copied_bytes": fig["copied_bytes_last_forward"], "streamed_bytes": fig["stored_bytes_streamed"],
                            "exact": torch.equal(out, ref)}
                q, qs = ring.get("copied_bytes"), ring.get("streamed_bytes")
                streamed.append({"arch": arch, "format": fmt, "stored_bytes": _stored_bytes(patcher.model.diffusion_model),
                                 "streamed_bytes": qs, "bf16_streamed_bytes": bf16_streamed,
                                 "copied_bytes": q, "bf16_copied_bytes": bf16_bytes,
                                 "streamed_ratio": (qs / bf16_streamed) if qs else None,
                                 "copied_ratio": (q / bf16_bytes) if q else None})
            except LookupError as e:
                for node in NODES:
                    table[f"{arch}|{fmt}|{node}"] = {"result": "not run", "message": str(e)}
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    import comfy  # noqa: F401
    result = {"comfyui": comfy_env.comfy_version() if hasattr(comfy_env, "comfy_version") else "0.33",
              "archs": ARCHS, "formats": FORMATS, "nodes": NODES, "cells": table, "streamed": streamed,
              "ring_budget_bytes": RING_BUDGET, "seconds": round(time.time() - t0, 1)}
    (OUT / "formats.json").write_text(json.dumps(result, indent=1) + "\n")
    (OUT / "formats.md").write_text(render(result))
    print((OUT / "formats.md").read_text())
    return 0


def cell_text(c: dict) -> str:
    r = c["result"]
    if r == "exact":
        return "exact" + (" (passed through: already quantized)" if c.get("note", "").startswith("passed through") else "")
    if r == "error":
        return f"max err {c['max_abs']:.2g} (rel {c['rel_l2']:.2g})"
    msg = c.get("message", "").replace("|", "/").replace("\n", " ")
    return f"{r}: {msg[:140]}{'…' if len(msg) > 140 else ''}"


def render(res: dict) -> str:
    lines = ["# Quantized models through every node", "",
             "Written by `scripts/format_table.py` (ComfyUI 0.33, CPU, the zoo's tiny models; one forward per cell "
             "against the plain loaded model). `exact`: bit for bit; `max err`: largest absolute difference "
             "(relative L2); `refused`: the node stopped with the message shown; `ERROR`: a defect.", "",
             "| architecture | format | " + " | ".join(res["nodes"]) + " |",
             "|---|---|" + "---|" * len(res["nodes"])]
    for arch in res["archs"]:
        for fmt in res["formats"]:
            cells = [cell_text(res["cells"][f"{arch}|{fmt}|{n}"]) for n in res["nodes"]]
            lines.append(f"| {arch} | {fmt} | " + " | ".join(cells) + " |")
    lines += ["", "Bytes per step under Group Offload's event ring at the same budget (every block streamed, "
              f"{res['ring_budget_bytes'] // 1024} KiB resident), the quantized model against its bf16 original "
              "(fp8_scaled: the layers that are not quantized held in bf16, as on a GPU; GGUF: its F32 norms and "
              "biases, as the file stores them). *Streamed*: the stored bytes of the streamed blocks; *copied*: "
              "what the ring copied in one forward (its own counter, measured), which packs every tensor 512-byte "
              "aligned (on the CPU, as here, plus the offset within 64 bytes the weight was loaded at, so the CPU "
              "computes with it exactly as before) — on these tiny models (32-wide layers) a bias or a 4-byte scale takes a 512-byte slot; on "
              "real layers (MiB each) the alignment is negligible and copied equals streamed.", "",
              "| architecture | format | stored bytes (whole model) | streamed per step | bf16 original streamed "
              "| ratio | copied per step | bf16 original copied | ratio |",
              "|---|---|---|---|---|---|---|---|---|"]

    def r(x):
        return f"{x:.2f}" if x else "–"
    for s in res["streamed"]:
        lines.append(f"| {s['arch']} | {s['format']} | {s['stored_bytes']} | {s['streamed_bytes'] or '–'} | "
                     f"{s['bf16_streamed_bytes']} | {r(s['streamed_ratio'])} | {s['copied_bytes'] or '–'} | "
                     f"{s['bf16_copied_bytes']} | {r(s['copied_ratio'])} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
