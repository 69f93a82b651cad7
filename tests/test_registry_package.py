"""The Comfy Registry package (`comfy node pack`, comfy-cli) holds only what a user runs.

`comfy node pack` zips the git-tracked files minus the `.comfyignore` patterns. The test packs a
copy of the working tree's tracked files (so nothing is written into the repository) and checks
the zip's file list: the pack's code, js/, example workflows each with its thumbnail, docs/,
README, LICENSE, pyproject.toml, requirements.txt; no tests, benchmarks, scripts or CI files.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from harness import paths

pytestmark = pytest.mark.core_independent  # runs on the ComfyUI 0.33 suite only

SHIPPED_TOP = {"__init__.py", "nodes", "memorykit", "js", "example_workflows", "docs", "README.md", "LICENSE",
               "pyproject.toml", "requirements.txt"}
NEVER = ("tests/", "benchmarks/", "scripts/", ".ci/", "Makefile", "requirements-dev.txt", ".gitignore")


def _comfy_cli() -> str:
    exe = Path(sys.executable).with_name("comfy")
    found = str(exe) if exe.exists() else shutil.which("comfy")
    assert found, "comfy-cli is not installed (requirements-dev.txt)"
    return found


def _tracked() -> list[str]:
    out = subprocess.run(["git", "-C", str(paths.REPO), "ls-files", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, text=True, check=True).stdout
    return [p for p in out.splitlines() if p and (paths.REPO / p).is_file()]


def test_registry_package_holds_only_what_a_user_runs(tmp_path):
    work = tmp_path / "pack"
    files = _tracked()
    for rel in files:
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(paths.REPO / rel, work / rel)
    git = ["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    proc = subprocess.run([_comfy_cli(), "--skip-prompt", "--no-enable-telemetry", "node", "pack"], cwd=work,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with zipfile.ZipFile(work / "node.zip") as z:
        names = set(z.namelist())
    top = {n.split("/", 1)[0] for n in names}
    assert top == SHIPPED_TOP, f"package top level {sorted(top)}, want {sorted(SHIPPED_TOP)}"
    leaked = sorted(n for n in names if n.startswith(NEVER) or n in NEVER)
    assert not leaked, f"development files in the package: {leaked}"
    for rel in files:  # everything a user runs is in it
        if rel.split("/", 1)[0] in SHIPPED_TOP:
            assert rel in names, f"{rel} is missing from the package"
    workflows = sorted(n for n in names if n.startswith("example_workflows/") and n.endswith(".json"))
    assert workflows, "no example workflow in the package"
    for w in workflows:
        assert w[:-5] + ".jpg" in names, f"{w} has no thumbnail in the package"
    _nodesafe_verdict_is_not_malicious(work / "node.zip", tmp_path / "unpacked")


def _nodesafe_verdict_is_not_malicious(zip_path: Path, folder: Path) -> None:
    """nodesafe (the scanner users run on packs) on the registry zip: no high or critical finding,
    verdict not "malicious" (its docstring-entropy and ``ord(`` heuristics stay medium)."""
    exe = Path(sys.executable).with_name("nodesafe")
    assert exe.exists(), "nodesafe is not installed (requirements-dev.txt)"
    with zipfile.ZipFile(zip_path) as z:
        z.extractall(folder)
    proc = subprocess.run([str(exe), "scan", str(folder), "--format", "json"], capture_output=True, text=True,
                          timeout=300)
    report = json.loads(proc.stdout)
    severe = [(f["severity"], f["title"], f.get("location")) for f in report["findings"]
              if f["severity"].lower() in ("high", "critical")]
    assert not severe, f"nodesafe's high/critical findings on the registry zip: {severe}"
    assert report["verdict"]["label"] != "malicious", report["verdict"]
