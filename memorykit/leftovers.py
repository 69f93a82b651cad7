"""Folders the pack creates, listed so that a stopped server leaves none behind.

Group Offload's disk folders (``memorykit-offload-*``), Balanced Device Map's
(``memorykit-devicemap-*``) and Save Sharded's unfinished ``.<name>.partial-*`` are removed by
their owner when it is done. A process that is killed cannot do that, so each folder is made
through :func:`make_folder` / :func:`track`, which writes a marker file into it (``MARKER``:
the creating process's pid and boot id) and adds its path to a list (``folders.txt`` in the
state directory given to :func:`configure`; ComfyUI's user directory in the pack).

- :func:`remove_stale` (at start) deletes listed folders whose creator is gone: a different
  boot id, or no process with that pid. Folders of live processes are kept (two servers may
  share a folder and a list), as is anything whose marker is missing or does not match the
  list (never delete what is not provably ours).
- :func:`install_sigterm_cleanup` removes this process's folders on SIGTERM, then passes the
  signal on to the handler that was there before (or the default action: the process ends).

Plain paths and the standard library; knows nothing of ComfyUI. A damaged list is recovered
(its unreadable lines dropped), never an error. Thread- and process-safe
list updates (``fcntl`` lock where it exists).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

from . import safe_files

_log = logging.getLogger("MemoryKit")

MARKER = ".memorykit-owner.json"
LIST_NAME = "folders.txt"

_state_dir: Path | None = None
_mine: set[str] = set()
_lock = threading.Lock()


def configure(state_dir: str | os.PathLike | None) -> None:
    """Keep the list of folders in ``state_dir`` (created when needed); None: no list (folders
    still get their marker and are removed on SIGTERM, but not found after a kill -9)."""
    global _state_dir
    _state_dir = None if state_dir is None else Path(state_dir)


def boot_id() -> str:
    """This machine's boot id (Linux ``/proc/sys/kernel/random/boot_id``); elsewhere the boot
    time from psutil, or ``unknown``."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        try:
            import psutil
            return f"boot-{int(psutil.boot_time())}"
        except Exception:
            return "unknown"


def _owner() -> dict:
    return {"pid": os.getpid(), "boot_id": boot_id()}


def _alive(owner: dict) -> bool:
    """True when the process ``owner`` describes may still run (same boot, pid exists)."""
    if owner.get("boot_id") != boot_id():
        return False
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return False
    return True


@contextmanager
def _locked_list():
    """Yields the list file's path with an exclusive lock held (None when not configured)."""
    if _state_dir is None:
        yield None
        return
    _state_dir.mkdir(parents=True, exist_ok=True)
    path = _state_dir / LIST_NAME
    with _lock, open(_state_dir / ".lock", "a+") as lk:
        try:
            import fcntl
            fcntl.flock(lk, fcntl.LOCK_EX)
        except ImportError:  # Windows: the thread lock only
            pass
        yield path


def _read(path: Path) -> list[dict]:
    """The list's valid entries. A corrupted list (bytes that are not UTF-8, lines that are not
    JSON, not a regular file, larger than 16 MiB) loses only its bad lines: the next write
    rewrites the file with the good ones, so one damaged line never blocks the pack's disk writes."""
    out = []
    try:
        raw = safe_files.read_regular(path, "leftovers list", 16 * 2**20)
    except (OSError, ValueError):
        return out
    for line in raw.splitlines():
        try:
            entry = json.loads(line.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError and JSONDecodeError both
            continue
        if isinstance(entry, dict) and isinstance(entry.get("path"), str):
            out.append(entry)
    return out


def _write(path: Path, entries: list[dict]) -> None:
    tmp = path.with_name(f"{LIST_NAME}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps(e) + "\n" for e in entries), encoding="utf-8")
    os.replace(tmp, path)


def track(folder: str | os.PathLike) -> str:
    """Mark an existing, just-created ``folder`` as this process's and list it. Returns its
    absolute path. Call :func:`forget` (or :func:`remove_folder`) when the folder goes."""
    path = os.path.abspath(folder)
    owner = _owner()
    with _locked_list() as lst:
        if lst is not None:
            entries = [e for e in _read(lst) if e["path"] != path]
            _write(lst, entries + [dict(owner, path=path)])
        Path(path, MARKER).write_text(json.dumps(owner), encoding="utf-8")
        _mine.add(path)
    return path


def make_folder(prefix: str, parent: str | os.PathLike) -> str:
    """``tempfile.mkdtemp(prefix=prefix, dir=parent)``, tracked (see :func:`track`)."""
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        return track(path)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise


def forget(folder: str | os.PathLike, drop_marker: bool = False) -> None:
    """Take ``folder`` off the list (its owner removed it, or keeps it for good: then
    ``drop_marker=True`` deletes the marker file too)."""
    path = os.path.abspath(folder)
    with _locked_list() as lst:
        if drop_marker:
            try:
                os.unlink(os.path.join(path, MARKER))
            except OSError:
                pass
        if lst is not None:
            entries = _read(lst)
            kept = [e for e in entries if e["path"] != path]
            if len(kept) != len(entries):
                _write(lst, kept)
        _mine.discard(path)


def remove_folder(folder: str | os.PathLike) -> bool:
    """Delete ``folder`` (missing is fine), which the caller created, and take it off the list.
    Once tracked, only while it carries this process's marker: a folder put at its path by
    someone else (the pack's was deleted) is never deleted, unless empty. (A folder whose
    tracking failed half-way, e.g. its marker could not be written, is deleted.) A folder that
    cannot be deleted (made read-only meanwhile) stays listed: SIGTERM's clean-up and the next
    start (:func:`remove_stale`) delete it. Returns False only then."""
    path = os.path.abspath(folder)
    if path not in _mine or _marker(path) == _owner():
        shutil.rmtree(path, ignore_errors=True)
        if os.path.lexists(path):
            _log.warning("MemoryKit: cannot delete the folder %s (read-only?); it is deleted at the next start", path)
            return False
    else:
        try:
            os.rmdir(path)  # empty (its marker removed with the rest): nobody's files
        except OSError:
            pass
    forget(path)
    return True


def _marker(path: str) -> dict | None:
    try:
        data = json.loads(Path(path, MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def remove_stale() -> list[str]:
    """Delete the listed folders whose creating process is gone; returns their paths.

    A folder is deleted only when its marker names the same pid and boot id as its list entry
    and that process no longer runs. Entries whose folder is gone, or whose marker is missing
    or different (the folder is not provably ours), leave the list; folders of live processes
    stay listed and untouched. A temporary copy of the list left by a process killed while
    rewriting it (``folders.txt.<pid>.tmp``, that pid gone) is deleted too.
    """
    removed = []
    with _locked_list() as lst:
        if lst is None:
            return removed
        keep = []
        for e in _read(lst):
            owner = {"pid": e.get("pid"), "boot_id": e.get("boot_id")}
            if _alive(owner):
                keep.append(e)
                continue
            if os.path.isdir(e["path"]) and _marker(e["path"]) == owner:
                shutil.rmtree(e["path"], ignore_errors=True)
                if not os.path.exists(e["path"]):
                    removed.append(e["path"])
                else:
                    keep.append(e)
        _write(lst, keep)
        for tmp in lst.parent.glob(f"{LIST_NAME}.*.tmp"):  # a list half rewritten by a killed process
            pid = tmp.name[len(LIST_NAME) + 1:-len(".tmp")]
            if pid.isdigit() and not _alive({"pid": int(pid), "boot_id": boot_id()}):
                tmp.unlink(missing_ok=True)
    return removed


def remove_mine() -> list[str]:
    """Delete every folder this process tracked and still holds; returns their paths."""
    paths = sorted(_mine)
    for p in paths:
        remove_folder(p)
    return paths


_previous_handler = None
_installed = False


def _on_sigterm(signum, frame):
    try:
        remove_mine()
    finally:
        prev = _previous_handler
        if callable(prev):
            prev(signum, frame)
        elif prev != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def install_sigterm_cleanup() -> bool:
    """On SIGTERM, delete this process's folders and then hand the signal to the handler that
    was installed before (calling it, or re-raising the signal with the default action, which
    ends the process; an ignored SIGTERM stays ignored). Only from the main thread; returns
    False (nothing installed) elsewhere or where SIGTERM does not exist. Idempotent."""
    global _previous_handler, _installed
    if _installed:
        return True
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGTERM"):
        return False
    try:
        _previous_handler = signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):
        return False
    _installed = True
    return True
