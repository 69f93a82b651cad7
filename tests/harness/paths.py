"""Where things live: the repo, the cache, the ComfyUI tree, the generated models."""
from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("MEMORYKIT_CACHE", REPO / ".cache")).resolve()
MODELS = CACHE / "models"
TEST_NODES = REPO / "tests" / "comfy_test_nodes"


def comfyui_path() -> Path:
    """The ComfyUI tree: ``$COMFYUI_PATH`` when set, else the 0.3.75 tree made by scripts/setup.sh.

    Raises FileNotFoundError (with the command that fixes it) when neither exists.
    """
    p = Path(os.environ.get("COMFYUI_PATH") or CACHE / "comfyui-0.3.75").resolve()
    if not (p / "main.py").is_file():
        raise FileNotFoundError(f"No ComfyUI tree at {p} (no main.py). Run `bash scripts/setup.sh` "
                                "or set COMFYUI_PATH to a ComfyUI checkout.")
    return p


def technique_package():
    """The pack's ``memorykit/`` technique package, imported by file as ``memorykit_tech``.

    Its modules import only torch/diffusers/accelerate/safetensors (``comfy_integration``
    excepted, which is not imported here), so the harness and the benchmarks can use them
    without importing the ComfyUI node API. The repo root is not put on sys.path: its ``nodes``
    package would shadow ComfyUI's ``nodes`` module.
    """
    import importlib
    import importlib.util
    import sys
    name = "memorykit_tech"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "memorykit" / "__init__.py",
                                                      submodule_search_locations=[str(REPO / "memorykit")])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def memory_module():
    """``memorykit/memory.py`` (process/device memory readings) via :func:`technique_package`."""
    import importlib
    technique_package()
    return importlib.import_module("memorykit_tech.memory")


def comfyui_version() -> str:
    """``__version__`` of the ComfyUI tree (:func:`comfyui_path`), read from its
    ``comfyui_version.py`` without importing it; ``""`` when it cannot be read."""
    import re
    try:
        text = (comfyui_path() / "comfyui_version.py").read_text(encoding="utf-8")
    except (OSError, FileNotFoundError):
        return ""
    m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", text)
    return m.group(1) if m else ""


def comfyui_version_tuple() -> tuple[int, ...]:
    """:func:`comfyui_version` as numbers (``(0, 33, 0)``); ``(0,)`` when it cannot be read."""
    import re
    return tuple(int(x) for x in re.findall(r"\d+", comfyui_version())[:3]) or (0,)


def one_version_only() -> bool:
    """True on the newest tested ComfyUI (0.33+) only: a check that cannot differ between the tested
    ComfyUI versions (technique code, plain files) runs once, on the 0.33 suite (CI time). The same
    rule as the ``core_independent`` marker (tests/conftest.py)."""
    return comfyui_version_tuple() >= (0, 33)
