"""Import a real ComfyUI into this process (for in-process tests and model generation).

No mock: the ComfyUI tree from :func:`paths.comfyui_path` is put on ``sys.path`` and its
modules are imported as ComfyUI's own ``main.py`` would, with ``--cpu`` when no GPU exists.
The pack itself is imported under the package name ``comfyui_memorykit``.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from . import paths

_ready = False


def setup_comfy(base_directory: Path | None = None):
    """Put ComfyUI on sys.path and configure it for this machine; idempotent.

    ``base_directory``: where ComfyUI's ``folder_paths`` looks for models/output (default: the
    cache's ``models`` folder's parent). Returns the ComfyUI path.
    """
    global _ready
    root = paths.comfyui_path()
    if not _ready:
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        import comfy.options
        comfy.options.enable_args_parsing(False)
        import comfy.cli_args
        if not torch.cuda.is_available():
            comfy.cli_args.args.cpu = True
        comfy.cli_args.args.disable_auto_launch = True
        import folder_paths  # noqa: F401  (creates ComfyUI's folder registry)
        _ready = True
    if base_directory is not None:
        set_models_dir(Path(base_directory) / "models")
    return root


def flux_version_params() -> dict:
    """Flux constructor/config entries this ComfyUI version requires beyond Flux.1's classic set.

    The one place where the tests detect a ComfyUI API difference in model construction:
    ComfyUI 0.33 added the required ``FluxParams.txt_ids_dims`` (``[]`` for Flux.1, as its own
    model detection sets it); 0.3.75 has no such field.
    """
    import dataclasses

    setup_comfy()
    from comfy.ldm.flux.model import FluxParams
    names = {f.name for f in dataclasses.fields(FluxParams)}
    return {"txt_ids_dims": []} if "txt_ids_dims" in names else {}


def file_key(model_key: str, file_keys) -> str | None:
    """The name under which a model file stores the parameter a loaded ComfyUI model calls
    ``model_key`` (None when absent). The second place the tests meet a version difference:
    ComfyUI 0.33 renamed Flux's QK-norm parameter ``*_norm.scale`` to ``*_norm.weight`` and renames
    it on load, so a fixture written by 0.3.75 stores the old name (and one written by 0.33 the new)."""
    if model_key in file_keys:
        return model_key
    for new, old in (("_norm.weight", "_norm.scale"), ("_norm.scale", "_norm.weight")):
        if model_key.endswith(new) and model_key[:-len(new)] + old in file_keys:
            return model_key[:-len(new)] + old
    return None


def set_models_dir(models_dir: Path) -> None:
    """Point ComfyUI's model folders (diffusion_models, checkpoints, vae, ...) at ``models_dir``."""
    import folder_paths
    for name, (dirs, exts) in list(folder_paths.folder_names_and_paths.items()):
        if name in ("custom_nodes", "configs"):
            continue
        folder_paths.folder_names_and_paths[name] = ([str(models_dir / name)] + list(dirs), exts)
    folder_paths.filename_list_cache.clear()


def load_pack():
    """Import this repo as ComfyUI would import a custom-node folder; returns the module.

    Registered in ``sys.modules`` as ``comfyui_memorykit`` so tests can
    ``from comfyui_memorykit.memorykit import ...``.
    """
    setup_comfy()
    name = "comfyui_memorykit"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, paths.REPO / "__init__.py",
                                                  submodule_search_locations=[str(paths.REPO)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
