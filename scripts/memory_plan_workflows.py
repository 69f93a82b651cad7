"""Write Memory Plan's whole-workflow decisions for Flux 2 [dev] and Wan 2.2 14B (two experts + UMT5)
on 8/12/16/24 GiB VRAM × 16/32/64 GiB RAM (given figures) to ``benchmarks/results/memory_plan_workflows.md``.

No GPU and no weights needed: every component is built from ComfyUI's own classes on the meta
device (``tests/harness/workflow_plans.py``). ``docs/memory-plan.md`` quotes the file;
``tests/test_memory_plan_workflow.py`` checks it is current and checks the decisions:

    .venv/bin/python scripts/memory_plan_workflows.py
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from harness import comfy_env, workflow_plans

RESULTS = REPO / "benchmarks" / "results" / "memory_plan_workflows.md"


def main() -> int:
    comfy_env.setup_comfy()
    comfy_env.load_pack()  # registers the pack as comfyui_memorykit
    comps = {w: workflow_plans.components(w) for w in workflow_plans.WORKFLOWS}
    text = workflow_plans.markdown(comps, workflow_plans.grid(comps))
    RESULTS.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
