"""city96/ComfyUI-GGUF for the tests: unpacked once from its tarball, linked into the test
server's ``custom_nodes/`` and importable in-process.

Where the tarball comes from: ``$MEMORYKIT_GGUF_TARBALL`` when set, else
``ComfyUI-GGUF-*.tar.gz`` in ``shared/gguf/`` beside the repository (CI's ``../shared/gguf/``; a
git worktree one level deeper looks one folder further up). It is unpacked into
``.cache/ComfyUI-GGUF-<tag>/ComfyUI-GGUF`` (through a ``.partial`` folder, renamed when
complete). GGUF's own nodes also need the ``gguf`` package (requirements-dev.txt).
"""
from __future__ import annotations

import os
import shutil
import sys
import tarfile
from pathlib import Path

from . import paths

DIR_NAME = "ComfyUI-GGUF"
MODULE_NAME = "ComfyUI-GGUF"  # the name ComfyUI imports a custom-node folder under


def tarball() -> Path | None:
    """The ComfyUI-GGUF tarball, or None when none is found (see module docstring)."""
    env = os.environ.get("MEMORYKIT_GGUF_TARBALL")
    if env:
        return Path(env) if Path(env).is_file() else None
    for parent in (paths.REPO.parent, paths.REPO.parent.parent):
        found = sorted((parent / "shared" / "gguf").glob("ComfyUI-GGUF-*.tar.gz"))
        if found:
            return found[-1]
    return None


def unpacked() -> Path | None:
    """The unpacked ``ComfyUI-GGUF`` folder (unpacking it on first use), or None without a tarball."""
    tb = tarball()
    if tb is None:
        return None
    tag = tb.name[:-len(".tar.gz")]
    dest = paths.CACHE / tag
    target = dest / DIR_NAME
    if (target / "__init__.py").is_file():
        return target
    stage = dest.with_name(dest.name + f".{os.getpid()}.partial")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    with tarfile.open(tb) as t:
        t.extractall(stage, filter="data")
    if not (stage / DIR_NAME / "__init__.py").is_file():
        shutil.rmtree(stage, ignore_errors=True)
        raise RuntimeError(f"{tb} does not hold a {DIR_NAME}/ folder")
    try:
        os.replace(stage, dest)
    except OSError:  # another process finished first
        shutil.rmtree(stage, ignore_errors=True)
    return target


def available() -> str | None:
    """None when GGUF models can be tested; else why not (no tarball, no ``gguf`` package)."""
    if tarball() is None:
        return "no ComfyUI-GGUF tarball (shared/gguf/ beside the repository, or MEMORYKIT_GGUF_TARBALL)"
    try:
        import gguf  # noqa: F401
    except ImportError:
        return "the gguf package is not installed (requirements-dev.txt)"
    return None


def load_in_process():
    """Import the unpacked ComfyUI-GGUF as ComfyUI imports a custom-node folder (after
    ``comfy_env.set_models_dir``: it registers its ``unet_gguf`` folder from ``diffusion_models``
    at import); returns its ``nodes`` module."""
    import importlib.util
    if MODULE_NAME not in sys.modules:
        folder = unpacked()
        if folder is None:
            raise RuntimeError(available())
        spec = importlib.util.spec_from_file_location(MODULE_NAME, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[MODULE_NAME] = mod
        spec.loader.exec_module(mod)
    return sys.modules[MODULE_NAME + ".nodes"]
