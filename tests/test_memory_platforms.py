"""Host memory readings on platforms without ``resource`` or ``/proc`` (issue 14 item 14).

Windows has no ``resource`` module: the pack used to import it at module level, so nothing
of the pack loaded there. The import test runs in a fresh interpreter where ``import
resource`` raises ImportError in the pack's own modules (as on Windows; third-party
packages keep their Linux backends, e.g. psutil's), imports the pack as ComfyUI does, then
every module under it, and reads host memory.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

IMPORT_ALL = textwrap.dedent("""
    import builtins, sys
    real_import = builtins.__import__

    def no_resource(name, globals=None, *args, **kwargs):
        if name == "resource" and (globals or {{}}).get("__name__", "").startswith("comfyui_memorykit"):
            raise ImportError("No module named 'resource' (as on Windows)")
        return real_import(name, globals, *args, **kwargs)

    builtins.__import__ = no_resource
    sys.path.insert(0, {tests!r})
    import importlib, pkgutil
    from harness import comfy_env
    pack = comfy_env.load_pack()
    names = [m.name for m in pkgutil.walk_packages(pack.__path__, "comfyui_memorykit.")
             if ".tests" not in m.name and ".benchmarks" not in m.name and ".scripts" not in m.name]
    for name in names:
        importlib.import_module(name)
    from comfyui_memorykit.memorykit import memory
    host = memory.host_memory()
    assert host.rss_bytes > 0 and host.rss_peak_bytes >= host.rss_bytes, host
    memory._proc_status = lambda pid="self": {{}}  # no /proc either: psutil's reading
    host = memory.host_memory()
    assert host.rss_bytes > 0 and host.rss_peak_bytes >= host.rss_bytes, host
    assert memory._rusage_peak_bytes() is None
    print("imported", len(names), "modules")
""")


def test_every_module_imports_without_resource(comfy):
    code = IMPORT_ALL.format(tests=str(TESTS))
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    n = int(r.stdout.split("imported ")[1].split()[0])
    assert n >= 20, r.stdout  # memorykit.*, comfy_integration.*, nodes.*


@pytest.mark.parametrize(("platform", "factor"), [("linux", 1024), ("darwin", 1)])
def test_ru_maxrss_unit_per_platform(comfy, monkeypatch, platform, factor):
    """``ru_maxrss`` is KiB on Linux and bytes on macOS."""
    import resource

    from comfyui_memorykit.memorykit import memory
    raw = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    monkeypatch.setattr(memory.sys, "platform", platform)
    peak = memory._rusage_peak_bytes()
    assert raw * factor <= peak <= (raw + 4096) * factor  # the peak may grow a little in between


def test_host_memory_without_proc_and_psutil(comfy, monkeypatch):
    """No ``/proc`` and no psutil (a bare macOS install): the peak from ``getrusage`` in
    bytes stands in for every field; never zero, never raising."""
    from comfyui_memorykit.memorykit import memory
    monkeypatch.setattr(memory, "_proc_status", lambda pid="self": {})
    monkeypatch.setitem(sys.modules, "psutil", None)
    host = memory.host_memory()
    assert host.rss_peak_bytes == host.rss_bytes == host.rss_anon_bytes > 0
    assert memory.host_memory(pid=2**22 + 7) == memory.HostMemory(0, 0, 0)  # no such process
