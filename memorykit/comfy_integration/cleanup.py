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
    folders when the node's folder field is empty (created when needed).

    Not ComfyUI's temp folder: every ComfyUI start on the same install empties that one (a
    second server started beside a running one would delete the first one's folders). The
    folders made inside are tracked by :mod:`memorykit.leftovers` and removed when done."""
    import os
    path = os.path.join(state_directory(), "offload")
    os.makedirs(path, exist_ok=True)
    return path


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
