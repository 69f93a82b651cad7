"""Peak working memory of a call, on any device (plain torch, no ComfyUI).

CUDA has a peak counter (``torch.cuda.max_memory_allocated``); the CPU and other devices do
not, and RSS is too coarse (the allocator keeps freed pages, other threads allocate too). So
off CUDA this module counts the bytes of the tensors ATen ops return while a
:class:`LiveTensorBytes` dispatch mode is active, and subtracts them when their storage is
freed. PyTorch's own ``torch.distributed._tools.mem_tracker`` does the same with private
names; this is the small public-API version (``TorchDispatchMode`` + a weak reference to each
new storage; PyTorch keeps one Python object per storage, which ``tests/test_peak_memory.py``
checks).

What it sees: every tensor an operator returns (activations, outputs, copies). What it does
not: scratch memory a kernel allocates and frees inside one operator (convolution
workspaces), and tensors allocated before the mode began (weights; an op output that shares
an input's storage, i.e. a view, is not new memory either).
"""
from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """Count live bytes of the tensors created on ``device`` inside the mode.

    ``live``: bytes of storages created since the mode began and still alive; ``peak``: the
    largest ``live`` since the mode began or :meth:`reset_peak`. Units: bytes. Storages are
    counted once however many views share them.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        super().__init__()
        self.device = torch.device(device)
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def reset_peak(self) -> int:
        """Set ``peak`` to the current ``live`` and return it (the baseline of a new window)."""
        self.peak = self.live
        return self.live

    def _freed(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != self.device.type:
                continue
            key = _storage_key(t)
            if key is None or key in inputs or key in self._sizes:
                continue
            storage = t.untyped_storage()
            n = storage.nbytes()
            if n == 0:
                continue
            self._sizes[key] = n
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key)
        return out


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, meta-like)
        return None


def peak_bytes(fn: Callable[[], object], device: torch.device | str) -> int:
    """Peak working memory of ``fn()`` on ``device`` in bytes, above what was allocated before
    the call (the result counts while it is alive inside the call).

    CUDA: ``torch.cuda.max_memory_allocated`` (resets the device's peak counter; includes
    kernel workspaces). Other devices: :class:`LiveTensorBytes` (tensors returned by ATen ops).
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        y = fn()
        torch.cuda.synchronize(device)
        del y
        return max(0, torch.cuda.max_memory_allocated(device) - base)
    with LiveTensorBytes(device) as meter:
        y = fn()
        del y
    return meter.peak
