"""The leftovers registry (``memorykit/leftovers.py``), technique level, with real processes:
a folder of a live process is kept, a killed one's is removed at the next start, a folder that
is not provably ours is never deleted, and SIGTERM cleans up before passing the signal on."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness import paths

pytestmark = pytest.mark.core_independent  # runs on the ComfyUI 0.33 suite only

paths.technique_package()
from memorykit_tech import leftovers  # noqa: E402

CHILD = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {tests!r})
    from harness import paths
    paths.technique_package()
    from memorykit_tech import leftovers
    leftovers.configure(sys.argv[1])
    mode = sys.argv[3]
    if mode == "handler":
        signal.signal(signal.SIGTERM, lambda s, f: (open(sys.argv[2] + ".prev", "w").close(), os._exit(7)))
    if mode != "none":
        assert leftovers.install_sigterm_cleanup()
    path = leftovers.make_folder("memorykit-offload-T-", sys.argv[2])
    open(os.path.join(path, "w.safetensors"), "wb").write(b"x" * 1000)
    print(path, flush=True)
    time.sleep(120)
""")


def _child(state: Path, parent: Path, mode: str = "default") -> tuple[subprocess.Popen, str]:
    code = CHILD.format(tests=str(Path(__file__).resolve().parent))
    proc = subprocess.Popen([sys.executable, "-c", code, str(state), str(parent), mode], stdout=subprocess.PIPE, text=True)
    path = proc.stdout.readline().strip()
    assert path and os.path.isdir(path), proc.poll()
    return proc, path


@pytest.fixture
def dirs(tmp_path):
    state, parent = tmp_path / "state", tmp_path / "offload"
    parent.mkdir()
    leftovers.configure(state)
    yield state, parent
    leftovers.configure(None)


def test_live_process_folder_kept_dead_one_removed(dirs):
    state, parent = dirs
    proc, path = _child(state, parent)
    try:
        assert leftovers.remove_stale() == [] and os.path.isdir(path)  # another live server's folder
        marker = json.loads(Path(path, leftovers.MARKER).read_text())
        assert marker == {"pid": proc.pid, "boot_id": leftovers.boot_id()}
    finally:
        proc.kill()
        proc.wait()
    assert os.path.isdir(path)  # kill -9: nothing ran
    assert leftovers.remove_stale() == [path] and os.listdir(parent) == []
    assert (state / leftovers.LIST_NAME).read_text() == ""


def test_folder_without_matching_marker_is_never_deleted(dirs):
    state, parent = dirs
    proc, path = _child(state, parent)
    proc.kill()
    proc.wait()
    Path(path, leftovers.MARKER).write_text(json.dumps({"pid": 1, "boot_id": "someone else"}))
    assert leftovers.remove_stale() == [] and os.path.isdir(path)
    assert (state / leftovers.LIST_NAME).read_text() == ""  # off the list, left alone


@pytest.mark.parametrize("mode", ["default", "handler"])
def test_sigterm_removes_folders_then_passes_the_signal_on(dirs, mode):
    state, parent = dirs
    proc, path = _child(state, parent, mode)
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=30)
    assert not os.path.exists(path)
    assert (state / leftovers.LIST_NAME).read_text() == ""
    if mode == "default":
        assert rc == -signal.SIGTERM  # the default action still ends the process by the signal
    else:
        assert rc == 7 and Path(str(parent) + ".prev").exists()  # the previous handler ran


def test_without_the_handler_sigterm_leaves_the_folder(dirs):
    """What the handler fixes: a plain process killed by SIGTERM leaves its folder."""
    state, parent = dirs
    proc, path = _child(state, parent, "none")
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert os.path.isdir(path)
    assert leftovers.remove_stale() == [path]


def test_own_folders_removed_by_their_owner_leave_the_list(dirs):
    state, parent = dirs
    path = leftovers.make_folder("memorykit-devicemap-", parent)
    assert leftovers.remove_stale() == [] and os.path.isdir(path)  # this process is alive
    leftovers.remove_folder(path)
    assert not os.path.exists(path) and (state / leftovers.LIST_NAME).read_text() == ""


PROBE_CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from harness import paths
    paths.technique_package()
    from memorykit_tech import offload_store

    def timed(fn):
        t0 = time.perf_counter()
        fn()
        return max(time.perf_counter() - t0, 1e-9)
    print("ready", flush=True)
    while True:
        offload_store.disk_read_speed(sys.argv[1], 8 << 20, timed)
""")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_round3_item5_disk_speed_probe_leaves_no_file_when_killed(tmp_path, sig):
    """Memory Plan's disk-speed probe wrote a named temporary file (``memorykit-plan-*``, up to
    64 MiB) that SIGKILL/SIGTERM left for ever. It is a file with no name now: a process killed
    while it measures, again and again, leaves the folder empty."""
    code = PROBE_CHILD.format(tests=str(Path(__file__).resolve().parent))
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.poll()
        time.sleep(0.6)  # several probes (8 MiB written, synced, read) run meanwhile
        assert proc.poll() is None
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert os.listdir(tmp_path) == []


def test_round3_item5_a_half_written_list_of_a_killed_process_is_removed(dirs):
    """The list is rewritten through ``folders.txt.<pid>.tmp``; a kill between the write and the
    rename left that file for ever. The sweep at start deletes it when that process is gone."""
    state, parent = dirs
    leftovers.remove_folder(leftovers.make_folder("memorykit-offload-T-", parent))  # the list exists
    dead, live = state / f"{leftovers.LIST_NAME}.999999999.tmp", state / f"{leftovers.LIST_NAME}.{os.getppid()}.tmp"
    dead.write_text("{}\n")
    live.write_text("{}\n")
    leftovers.remove_stale()
    assert not dead.exists() and live.exists()  # another live process (pytest's parent) is writing it

