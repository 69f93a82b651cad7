"""A small tmpfs for tests of a full disk. Mounting needs root (CI runs as root); elsewhere the
test is skipped and the reason printed."""
from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "30m"):
    """Mount a tmpfs of ``size`` (mount's syntax: ``30m``, ``1m``) on the new folder ``path``;
    yields ``path`` and unmounts it. Skips the calling test when it cannot be mounted."""
    path.mkdir(parents=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        reason = f"cannot mount a tmpfs here (needs root): {(r.stderr or r.stdout).strip() or r.returncode}"
        print(reason)
        pytest.skip(reason)
    try:
        yield path
    finally:
        # a file the test still maps (a loaded safetensors tensor) keeps it busy: detach it then
        # (lazy unmount, freed with the last mapping), so no mount outlives the test
        if subprocess.run(["umount", str(path)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)
