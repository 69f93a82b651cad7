"""Print the device maps the Balanced Device Map node plans for full-size models on budgets you give.

No GPU and no weights needed: the models are ComfyUI's own classes on the meta device
(``tests/harness/meta_models.py``), and accelerate plans for GPUs this machine does not have.
The README's two-GPU section is this script's output:

    .venv/bin/python scripts/device_map_plans.py --max-memory "cuda:0=24GiB, cuda:1=24GiB, cpu=64GiB"
"""
from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from harness import comfy_env, meta_models  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-memory", default="cuda:0=24GiB, cuda:1=24GiB, cpu=64GiB")
    ap.add_argument("--models", nargs="*", default=sorted(meta_models.BLOCK_CLASSES))
    ap.add_argument("--strategies", nargs="*", default=["balanced", "balanced_low_0", "sequential"])
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)  # accelerate warns once per absent GPU
    warnings.simplefilter("ignore")
    comfy_env.setup_comfy()
    comfy_env.load_pack()  # registers the pack as comfyui_memorykit
    from comfyui_memorykit.memorykit.comfy_integration import device_map_model
    for kind in args.models:
        patcher = meta_models.meta_patcher(kind)
        total = sum(t.numel() * t.element_size() for t in patcher.model.diffusion_model.state_dict().values())
        print(f"\n## {kind} ({total / 2**30:.1f} GiB bf16), max_memory {args.max_memory}")
        for strategy in args.strategies:
            _, rep, text = device_map_model(patcher, strategy, args.max_memory)
            body = text.split("\n\n")[0].splitlines()
            print(f"\n{strategy}: " + ", ".join(f"{d} {b / 2**30:.1f} GiB" for d, b in rep["bytes_per_device"].items()))
            for line in body[3:]:
                if not line.startswith("NOTE"):
                    print("    " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
