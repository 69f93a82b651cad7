"""requirements.txt (what ComfyUI-Manager installs) = pyproject.toml's dependencies minus the
frontend package (which the user's ComfyUI pins: a Manager install must never change it)."""
from __future__ import annotations

import re
import tomllib

import pytest

from harness import paths

pytestmark = pytest.mark.core_independent  # runs on the ComfyUI 0.33 suite only

FRONTEND = "comfyui-frontend-package"


def _name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _requirements() -> list[str]:
    lines = (paths.REPO / "requirements.txt").read_text().splitlines()
    return [ln.split("#", 1)[0].strip() for ln in lines if ln.split("#", 1)[0].strip()]


def test_requirements_txt_matches_pyproject_without_frontend():
    deps = tomllib.loads((paths.REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    reqs = _requirements()
    assert FRONTEND not in {_name(r) for r in reqs}, "requirements.txt must not list the frontend package"
    want = sorted(d.replace(" ", "") for d in deps if _name(d) != FRONTEND)
    assert sorted(r.replace(" ", "") for r in reqs) == want, f"requirements.txt {reqs} vs pyproject {deps}"


def test_diffusers_floor_has_the_group_offloading_stream_fixes():
    """The ``diffusers`` scheduler of Group Offload runs diffusers' hooks with ``use_stream`` /
    ``record_stream``: the floor is the first release whose disk offload synchronises the compute
    stream before freeing weights (0.41.0; 0.39.0 and 0.40.0 lack it), and the installed diffusers
    meets it (its ``_offload_to_disk`` waits for the compute stream)."""
    import inspect

    from packaging.version import Version
    floor = next(r for r in _requirements() if _name(r) == "diffusers").split(">=", 1)[1]
    assert Version(floor) >= Version("0.41.0"), floor
    import diffusers
    from diffusers.hooks import group_offloading
    assert Version(diffusers.__version__) >= Version(floor), diffusers.__version__
    src = inspect.getsource(group_offloading.ModuleGroup._offload_to_disk)
    assert "synchronize()" in src
