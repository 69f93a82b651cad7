"""Generate every shared test fixture once, before test processes run side by side
(``scripts/test.sh`` calls it before its two lanes). Each generator skips what is already there,
so this is cheap on a warm cache; a fixture a test makes on first use still works without it.

``python tests/harness/prepare.py`` (with ``COMFYUI_PATH`` as for the tests)."""
from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import gguf_models, gguf_pack, lora, loras, models, wan22_models  # noqa: E402


def ensure_all() -> None:
    models.ensure_models()
    wan22_models.ensure_wan22_experts()
    lora.ensure_sd15_lora()
    loras.ensure_sd15_lora()
    loras.ensure_big_lora()
    loras.ensure_sized_lora()
    if gguf_pack.available() is None:  # ComfyUI-GGUF unpacked once, the GGUF models written
        gguf_pack.unpacked()
        gguf_models.ensure_gguf_models()


if __name__ == "__main__":
    ensure_all()
    print("[prepare] test fixtures ready in", models.paths.MODELS)
