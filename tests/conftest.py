"""Fixtures: a real ComfyUI, in-process (``comfy``) and as a headless server (``server``).

``tests/`` (not a package) is on sys.path through pytest's rootdir handling, so the harness
is imported as ``harness``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import comfy_env, models, offload_models, paths  # noqa: E402
from harness.server import ComfyServer  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "core_independent: the check cannot differ between ComfyUI versions (no ComfyUI code "
        "runs in it); it runs on the newest tested core only, so CI's time goes to what can differ")


def pytest_collection_modifyitems(config, items):
    if paths.one_version_only():
        return
    skip = pytest.mark.skip(reason="core-independent check: runs once, on the ComfyUI 0.33 suite")
    for item in items:
        if item.get_closest_marker("core_independent"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def fixture_models() -> dict:
    """Paths of the generated models (generated on first use, then cached)."""
    return models.ensure_models()


@pytest.fixture(scope="session")
def comfy(tmp_path_factory):
    """ComfyUI imported into this process, models folders pointing at the generated models;
    returns the pack module (imported as ``comfyui_memorykit``)."""
    comfy_env.setup_comfy()
    comfy_env.set_models_dir(paths.MODELS)
    return comfy_env.load_pack()


@pytest.fixture(scope="session")
def server(fixture_models):
    """A headless ComfyUI server with the pack and the test-only nodes, shared by the session."""
    srv = ComfyServer()
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def object_info(server) -> dict:
    return server.object_info()


@pytest.fixture(scope="module")
def fp8(comfy):
    """The pack's ``memorykit.fp8`` technique module (imported through the pack)."""
    from comfyui_memorykit.memorykit import fp8 as mod
    return mod


@pytest.fixture(scope="module")
def ci(comfy):
    """The pack's ``memorykit.comfy_integration`` package (imported through the pack)."""
    from comfyui_memorykit.memorykit import comfy_integration as mod
    return mod


@pytest.fixture(scope="module")
def loaded(comfy, fixture_models):
    """``loaded(key)``: the ``sd15``/``wan``/``flux`` diffusion model of the fixtures as a
    :class:`harness.offload_models.Loaded` (one in memory at a time)."""
    cache: dict[str, offload_models.Loaded] = {}

    def get(key: str) -> offload_models.Loaded:
        if key not in cache:
            for other in list(cache):  # one model in memory at a time (the Flux one is 2.2 GB)
                del cache[other]
            cache[key] = offload_models.Loaded(key, fixture_models[key])
        return cache[key]

    yield get
    cache.clear()
