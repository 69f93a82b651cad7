"""The one rule for files the pack reads and folders it writes.

Reading (:func:`read_regular`, :func:`check_regular`): only regular files (symlinks followed)
are read. A FIFO would block the prompt worker for ever (no interrupt reaches a blocked
``read``), a link to ``/dev/zero`` never ends, a dangling symlink gives a raw
FileNotFoundError: all are refused with a message before any read. The file is opened with
``O_NONBLOCK`` (opening a FIFO does not wait for a writer) and checked with ``fstat`` on the
open descriptor, so nothing can be swapped in between the check and the read. JSON indexes
are read only up to a size limit checked before the read.

Writing (:func:`check_destination`, :func:`write_marker`, :func:`read_marker`): before a save
starts, the destination path is checked (length within PATH_MAX, every existing component a
folder, the nearest existing folder writable, enough free space); a finished save gets a
marker file of the pack's own (``SAVE_MARKER``) listing the files it wrote, and an overwrite
replaces only the files a marker lists -- never a folder the pack did not write.

Plain standard library; knows nothing of ComfyUI.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import stat
from pathlib import Path

from .units import size_text

SAVE_MARKER = ".memorykit-save.json"
MARKER_WRITER = "ComfyUI-MemoryKit Save Sharded"
PATH_MAX = 4096  # Linux; os.pathconf gives the folder's own limit where it exists
FREE_MARGIN = 64 * 2**20  # bytes left free besides a save (file-system metadata, the index)

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))


class UnsafeFileError(ValueError):
    """A file the pack was asked to read is not a regular file, is too large, or is missing."""


def _kind(mode: int) -> str:
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def _open_regular(path: Path, what: str, error: type[Exception]) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        if os.path.islink(path):
            raise error(f"{what} {path} is a symlink to {os.readlink(path)}, which does not exist: "
                        "fix or remove the link") from None
        raise error(f"{what} {path} does not exist") from None
    except OSError as e:
        raise error(f"{what} {path} cannot be opened: {e.strerror or e}") from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(f"{what} {path} is {_kind(mode)}, not a regular file: only regular files are read; "
                    "replace it with the real file")
    return fd


def check_regular(path: str | os.PathLike, what: str = "file", error: type[Exception] = UnsafeFileError) -> int:
    """Size in bytes of ``path`` after checking it is a regular file (symlinks followed),
    without blocking on a FIFO. Raises ``error`` (a ValueError subclass by default) naming
    ``what`` and the path for a missing file, a dangling symlink, a FIFO, a device, a socket or
    a folder."""
    fd = _open_regular(Path(path), what, error)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def read_regular(path: str | os.PathLike, what: str = "file", max_bytes: int = 256 * 2**20,
                 error: type[Exception] = UnsafeFileError) -> bytes:
    """The bytes of a regular file (see :func:`check_regular`), refusing one larger than
    ``max_bytes`` before reading (and never reading more than ``max_bytes + 1`` bytes should
    it grow meanwhile)."""
    path = Path(path)
    fd = _open_regular(path, what, error)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise error(f"{what} {path} is {size / 2**20:.1f} MiB; at most {max_bytes / 2**20:.0f} MiB is read "
                        "for a file of this kind: is it the right file?")
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise error(f"{what} {path} grew beyond {max_bytes / 2**20:.0f} MiB while being read")
    return data


def _path_max(folder: Path) -> int:
    try:
        return int(os.pathconf(folder, "PC_PATH_MAX"))
    except (AttributeError, OSError, ValueError):
        return PATH_MAX


def check_destination(dest: str | os.PathLike, needed_bytes: int, field: str = "name") -> None:
    """Refuse, before any work, a save into ``dest`` (a folder to create or replace) that cannot
    succeed. Raises ValueError naming ``field`` when the path is longer than the file system's
    PATH_MAX or runs through an existing file (``a/b`` where ``a`` is a file); PermissionError
    when the nearest existing folder is not writable; OSError(ENOSPC) when its file system has
    less free space than ``needed_bytes`` + FREE_MARGIN (0 skips that check)."""
    dest = Path(dest)
    existing = dest
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is" if existing == dest else "in the name is"
        raise ValueError(f"{field}: {existing.name!r} {what} an existing file in {existing.parent}, not a folder: "
                         "choose another name")
    n = len(os.fsencode(str(dest)))
    limit = _path_max(existing)
    if n >= limit:
        raise ValueError(f"{field}: the folder path {str(dest)[:60]}... is {n} bytes long; this file system allows "
                         f"paths up to {limit - 1} bytes: give a shorter name")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, f"{field}: the folder {existing} is read-only for this ComfyUI process "
                              "(no write permission): make it writable or choose another place")
    free = shutil.disk_usage(existing).free
    if needed_bytes and needed_bytes + FREE_MARGIN > free:
        raise OSError(errno.ENOSPC, f"not enough free space in {existing}: the save needs "
                      f"{size_text(needed_bytes)} (plus {FREE_MARGIN // 2**20} MiB margin), "
                      f"{size_text(free)} are free: free some space or save elsewhere")


def write_marker(folder: str | os.PathLike, files: list[str]) -> None:
    """Write the pack's marker into ``folder``: it lists ``files``, the entries of ``folder``
    the pack wrote (the only ones a later overwrite may replace), each with its size and
    modification time in nanoseconds as written (a rename keeps both), so that a later
    overwrite can tell them from other files put there under the same names."""
    stats = {}
    for f in files:
        st = os.stat(Path(folder, f), follow_symlinks=False)
        stats[f] = [st.st_size, st.st_mtime_ns]
    Path(folder, SAVE_MARKER).write_text(json.dumps({"writer": MARKER_WRITER, "files": sorted(files),
                                                     "stat": stats}), encoding="utf-8")


def read_marker(folder: str | os.PathLike) -> dict[str, tuple[int, int] | None] | None:
    """The files the pack's marker in ``folder`` lists, each with the (size, mtime in ns) it had
    when written (None for a marker of a pack version that recorded names only); None when
    ``folder`` has no valid marker (a folder the pack did not write, or saved by a version
    before the marker existed)."""
    try:
        data = json.loads(read_regular(Path(folder, SAVE_MARKER), "save marker", 2**20).decode("utf-8"))
    except (ValueError, OSError):
        return None
    files = data.get("files") if isinstance(data, dict) and data.get("writer") == MARKER_WRITER else None
    if not isinstance(files, list) or not all(isinstance(f, str) and f and "/" not in f and "\\" not in f
                                              and f not in (".", "..") for f in files):
        return None
    stats = data.get("stat") if isinstance(data.get("stat"), dict) else {}
    out: dict[str, tuple[int, int] | None] = {}
    for f in files:
        s = stats.get(f)
        ok = isinstance(s, list) and len(s) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in s)
        out[f] = (s[0], s[1]) if ok else None
    return out


def changed_since_marker(folder: str | os.PathLike, recorded: dict[str, tuple[int, int] | None]) -> list[str]:
    """The files of ``recorded`` (from :func:`read_marker`) present in ``folder`` that are not
    the ones the pack wrote: a symlink or not a regular file, no recorded size and time, or a
    size or modification time other than recorded (replaced, rewritten or copied there)."""
    out = []
    for name, rec in recorded.items():
        try:
            st = os.stat(Path(folder, name), follow_symlinks=False)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode) or rec is None or (st.st_size, st.st_mtime_ns) != tuple(rec):
            out.append(name)
    return out
