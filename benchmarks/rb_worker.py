"""One worker process of the GPU runbook: sets ComfyUI up (legacy or dynamic VRAM), runs the
cases it is given in order, and prints for each ``@@START <case>`` then ``@@ROW <json>``.

    python -m benchmarks.rb_worker --group legacy --device cuda --cases a,b --deadline EPOCH \\
        --scratch DIR --results FILE [--tiny]

A case that raises becomes an error row; one that cannot run on this device raises
:class:`rb_ctx.NeedsCuda` after running what it can and becomes a ``skipped: needs cuda``
row; one whose estimate does not fit before ``--deadline`` becomes ``skipped: budget``.
``MK_RUNBOOK_FAIL=case,...`` makes those cases raise (to test the error path);
``MK_RUNBOOK_CRASH=case`` kills the process at that case (to test the driver's restart).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def emit(tag: str, payload) -> None:
    text = payload if isinstance(payload, str) else json.dumps(payload, default=str)
    sys.stdout.write(f"@@{tag} {text}\n")
    sys.stdout.flush()


def setup_dynamic_vram() -> dict:
    """Repeat what ComfyUI 0.33's ``main.py`` does to switch dynamic VRAM on (comfy-aimdo
    ``control.init`` before CUDA starts, ``init_devices`` after ``comfy.model_management``,
    then ``ModelPatcherDynamic`` as the core patcher). Returns what happened; never raises."""
    info = {"dynamic_vram": False}
    try:
        import comfy.options
        comfy.options.enable_args_parsing(False)
        from comfy.cli_args import args
        import comfy_aimdo.control as ctl
    except ImportError as e:
        info["reason"] = f"no comfy-aimdo / dynamic-VRAM ComfyUI: {e}"
        return info
    try:
        try:
            ctl.init(simple_vram_headroom=None, nvml_pressure=not getattr(args, "disable_nvml_pressure", False))
        except TypeError:
            ctl.init()
        import torch
        if not torch.cuda.is_available():
            info["reason"] = "no CUDA device"
            return info
        import comfy.memory_management
        import comfy.model_management as mm
        import comfy.model_patcher as mp
        devices = list(mm.get_all_torch_devices())
        try:
            ok = ctl.init_devices((d.index, int(getattr(args, "vram_headroom", 0) * 1024 ** 3)) for d in devices)
        except TypeError:
            ok = ctl.init_devices(d.index for d in devices)
        if not ok:
            info["reason"] = "comfy_aimdo.control.init_devices returned False"
            return info
        mp.CoreModelPatcher = mp.ModelPatcherDynamic
        comfy.memory_management.aimdo_enabled = True
        info["dynamic_vram"] = True
    except Exception as e:  # reported in the rows; the cases then say they need it
        info["reason"] = f"{type(e).__name__}: {e}"
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--group", required=True, choices=["legacy", "dynamic"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cases", required=True)
    ap.add_argument("--deadline", type=float, required=True)
    ap.add_argument("--scratch", required=True)
    ap.add_argument("--results", required=True)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "tests"))
    from harness import paths
    sys.path.insert(0, str(paths.comfyui_path()))
    dyn = {"dynamic_vram": False}
    if args.group == "dynamic":
        dyn = setup_dynamic_vram()
    from harness import comfy_env, paths
    comfy_env.setup_comfy()
    import comfy.cli_args
    if args.group == "legacy":
        comfy.cli_args.args.disable_dynamic_vram = True  # 0.33+: core's legacy ModelPatcher (no-op on 0.3.75)
    paths.technique_package()
    from . import rb_cases, rb_ctx
    from .rb_plan import by_name
    ctx = rb_ctx.Ctx.make(args.device, args.tiny, Path(args.scratch), Path(args.results), dyn)
    plan = by_name()
    fail = set(filter(None, os.environ.get("MK_RUNBOOK_FAIL", "").split(",")))
    crash = os.environ.get("MK_RUNBOOK_CRASH", "")
    for name in args.cases.split(","):
        est = plan[name].est_s if ctx.device.type == "cuda" else plan[name].cpu_est_s
        row = {"case": name, "group": args.group}
        if time.time() + est > args.deadline:
            emit("ROW", {**row, "skipped": f"budget: {est:.0f} s needed, {args.deadline - time.time():.0f} s left"})
            continue
        emit("START", name)
        t0 = time.perf_counter()
        try:
            if name == crash:
                os._exit(3)
            if name in fail:
                raise RuntimeError("injected failure (MK_RUNBOOK_FAIL)")
            row.update(rb_cases.run_case(ctx, name))
            if ctx.device.type != "cuda" and plan[name].gpu_only:
                row["skipped"] = f"needs cuda: {plan[name].gpu_only} (its code path ran on the cpu)"
        except rb_ctx.NeedsCuda as e:
            row.update(e.partial)
            row["skipped"] = f"needs cuda: {e}"
        except Exception as e:  # every case gets its row; the run goes on
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc(limit=6)[-2000:]
        finally:
            rb_ctx.cleanup(ctx)
        row["wall_s"] = round(time.perf_counter() - t0, 2)
        ctx.rows[name] = row
        emit("ROW", row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
