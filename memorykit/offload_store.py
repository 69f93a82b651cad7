"""Weights kept on disk in a file that has no name: the disk target of Group Offload and Balanced Device Map.

:class:`DiskStore` is one file created in the chosen folder by ``tempfile.TemporaryFile``
(Linux: ``O_TMPFILE``, elsewhere on POSIX created and unlinked at once; Windows: deleted on
close and locked while open), filled with the offloaded weights and mapped shared (``mmap``). The weights' tensors become views of the mapping, so:

- the values stay real whatever happens to the folder: nothing can delete, replace or truncate
  a file without a name (a ComfyUI start wiping its temp folder, a user emptying the folder),
  so the plain model, a save of the placed model and the restore on removal read the real
  weights (issue 23 items 4, 5, 8);
- the kernel frees the file when the mapping and the descriptor are closed, even after a
  ``kill -9``: no leftover file;
- RAM is what the page cache holds: pages are written back and dropped after filling
  (:meth:`DiskStore.drop`), and unmapped again after each group is copied to the onload device
  (left in the page cache, reclaimable, as reading a file leaves it).

The space is reserved before anything is written through the mapping (``posix_fallocate``;
where it is missing, by writing zeros), so a full disk is an ``OSError`` here, never a SIGBUS
while filling the mapping. Plain torch and the standard
library; no ComfyUI here.
"""
from __future__ import annotations

import logging
import mmap
import os
import tempfile

import torch

log = logging.getLogger(__name__)

PAGE = max(mmap.PAGESIZE, mmap.ALLOCATIONGRANULARITY)  # mapping offsets (flush, madvise) are multiples of it
_ZEROS = 1 << 20


def page_round(n: int) -> int:
    """``n`` bytes rounded up to a multiple of the page size."""
    return -(-n // PAGE) * PAGE


def _reserve(f, nbytes: int) -> None:
    """Allocate ``nbytes`` of disk for the open file ``f`` (OSError, e.g. ENOSPC, when it cannot)."""
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(f.fileno(), 0, nbytes)
        return
    zeros = bytes(min(_ZEROS, nbytes))
    left = nbytes
    while left:
        left -= f.write(zeros[:min(left, len(zeros))])
    f.flush()


class DiskStore:
    """``nbytes`` of disk space in ``folder``, mapped as the uint8 tensor :attr:`tensor`.

    Raises OSError when the folder cannot take the file (``ENOSPC`` for a full disk). Call
    :meth:`close` when no tensor uses the mapping any more.
    """

    def __init__(self, folder: str | os.PathLike, nbytes: int):
        self.folder, self.nbytes = os.fspath(folder), int(nbytes)
        self._file = tempfile.TemporaryFile(dir=self.folder, prefix=".memorykit-store-")
        self._map = None
        try:
            if self.nbytes:
                _reserve(self._file, self.nbytes)
                self._map = mmap.mmap(self._file.fileno(), self.nbytes, access=mmap.ACCESS_WRITE)
                self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
            else:
                self.tensor = torch.empty(0, dtype=torch.uint8)
        except BaseException:
            self.close()
            raise

    def drop(self, offset: int = 0, nbytes: int | None = None, evict: bool = True) -> None:
        """Write back bytes ``[offset, offset + nbytes)`` (default: all) and drop their pages
        from this process; ``evict`` also from the page cache (then they are read from disk when
        used next; without it they stay as reclaimable cache, as a file read leaves them). The
        range is widened to whole pages; data is never lost."""
        if self._map is None:
            return
        end = self.nbytes if nbytes is None else min(self.nbytes, offset + nbytes)
        start = offset - offset % PAGE
        if end <= start:
            return
        length = end - start
        try:
            self._map.flush(start, length)
            self._map.madvise(mmap.MADV_DONTNEED, start, length)
            if evict:
                os.posix_fadvise(self._file.fileno(), start, length, os.POSIX_FADV_DONTNEED)
        except (OSError, ValueError, AttributeError):  # a hint only
            log.debug("dropping offload pages failed", exc_info=True)

    def close(self) -> None:
        """Unmap and close the file (the kernel frees it). Tensors still viewing it keep the
        mapping alive until they are freed; a second call does nothing."""
        self.tensor = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still referenced: freed with the last one
                pass
            self._map = None
        if self._file is not None:
            self._file.close()
            self._file = None


def disk_read_speed(folder: str | os.PathLike, nbytes: int, timed) -> float:
    """Read speed of ``folder``'s disk in bytes/s: ``nbytes`` written to a file with no name
    (as :class:`DiskStore`'s: a kill at any moment leaves nothing behind), synced, dropped from
    the page cache (``posix_fadvise DONTNEED`` where it exists) and read back, timed by
    ``timed(fn) -> seconds``. Raises OSError when the folder cannot take the file."""
    with tempfile.TemporaryFile(dir=os.fspath(folder), prefix=".memorykit-plan-") as f:
        chunk = os.urandom(1 << 20)
        for _ in range(max(1, nbytes >> 20)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
        fd = f.fileno()
        size = max(1, nbytes >> 20) << 20

        def read():
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.lseek(fd, 0, os.SEEK_SET)
            while os.read(fd, 8 << 20):
                pass
        return size / timed(read)
