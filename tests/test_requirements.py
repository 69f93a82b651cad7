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
