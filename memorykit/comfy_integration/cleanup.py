"""Leftover folders after a stopped server (see ``memorykit.leftovers``), wired to ComfyUI.

The list of folders the pack creates lives in ComfyUI's user directory, in the system-user
folder ``__memorykit`` (the ``__`` prefix keeps it out of the user-data HTTP API).
"""
from __future__ import annotations

import logging

from .. import leftovers
from .compat import system_user_directory

log = logging.getLogger("memorykit")


def state_directory() -> str:
    """``<ComfyUI user directory>/__memorykit``: where the list of created folders is kept."""
    return system_user_directory("memorykit")


def default_disk_folder() -> str:
    """``<state directory>/offload``: where Group Offload and Balanced Device Map put their disk
    folders when the node's folder field is empty. Only the path: :func:`usable_disk_folder`
    creates and checks it, where a disk is used.

    Not ComfyUI's temp folder: every ComfyUI start on the same install empties that one (a
    second server started beside a running one would delete the first one's folders). The
    folders made inside are tracked by :mod:`memorykit.leftovers` and removed when done."""
    import os
    return os.path.join(state_directory(), "offload")


def usable_disk_folder(folder: str, need_bytes: int = 0, what: str = "disk_folder") -> str:
    """The one check of an offload folder, made where weights go to disk: ``folder`` (a node's
    field; empty: :func:`default_disk_folder`, created when missing) must be a writable folder
    with room (:func:`memorykit.offload.check_disk_folder`). Returns its absolute path. Raises
    RuntimeError naming the folder and ``what`` (the field) when the default cannot be created
    (a file or a dangling symlink in its place) or the folder is unusable."""
    import os
    from ..offload import check_disk_folder
    folder = (folder or "").strip()
    if not folder:
        folder = default_disk_folder()
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            if os.path.islink(folder) and not os.path.exists(folder):
                why = f"is a symlink to {os.readlink(folder)!r}, which does not exist"
            elif os.path.lexists(folder) and not os.path.isdir(folder):
                why = "is a file, not a folder"
            else:
                why = f"cannot be created ({e.strerror or e})"
            raise RuntimeError(f"{what} is empty, so the default offload folder is used, and {folder!r} {why}: "
                               f"remove or fix it, or give a folder in {what}.") from None
    return check_disk_folder(folder, need_bytes, what=what)


def start_leftover_cleanup() -> list[str]:
    """At pack start in a ComfyUI server: keep the folder list in :func:`state_directory`,
    delete the listed folders whose creating process is gone (a killed server's offload and
    partial-save folders; a live server's are kept), and remove this process's folders on
    SIGTERM before passing the signal on. Returns the deleted paths. Never raises: a failure
    is logged and the pack loads anyway."""
    try:
        leftovers.configure(state_directory())
        removed = leftovers.remove_stale()
        for path in removed:
            log.info("MemoryKit: removed %s, left behind by a stopped process", path)
        leftovers.install_sigterm_cleanup()
        return removed
    except Exception as e:  # never block the pack from loading
        log.warning("MemoryKit: cleaning up leftover folders failed: %s", e)
        return []
