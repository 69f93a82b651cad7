"""Event-ring prefetch: MemoryKit's own scheduler for streaming weight groups from CPU RAM or disk.

Why not diffusers' stream path (``diffusers.hooks.group_offloading.ModuleGroup``, 0.42): before
every onload the host calls ``stream.synchronize()`` and, without ``record_stream``, after every
group ``current_stream().synchronize()`` as well, so the CPU stops queueing kernels once or
twice per group and the GPU idles while the next kernels are launched; each onload allocates
fresh device tensors through the caching allocator; it prefetches one group ahead and forces
one block per group. That costs the 1.13-1.25x over the PCIe floor measured in
``shared/design.md``. Here, as in DeepSpeed ZeRO-Infinity's and FSDP's prefetchers:

- each group's weights are packed into one host buffer (512-byte aligned tensors),
  page-locked in place with ``cudaHostRegister`` (pinned bytes = the streamed bytes plus
  alignment; torch's pinned allocator would round each buffer up to a power of two), so one
  group is one host-to-device copy;
- the onload device holds one preallocated ring buffer of ``ring_bytes``; groups take
  512-byte aligned regions of it in execution order (FIFO, wrapping at the end); their
  parameters become views of their region only while their forward runs (pre-hook to hook),
  and point at the host copies otherwise, so a reference taken outside the forward (model
  merging, LoRA key patches) never aliases a region that is later reused;
- a group whose forward did not run during the first forward (its parent read the weight
  without calling it: ``nn.MultiheadAttention.out_proj``, ``F.linear(x, self.proj.weight)``)
  is taken out of the ring and kept resident on the onload device from then on: its reads
  cannot be ordered after a copy;
- ordering uses events only, never the host: the copy stream waits for the ``done`` event
  (recorded on the compute stream after the forward of the group that last used a region)
  before overwriting it, and the compute stream waits for a group's ``ready`` event (recorded
  after its copy) before its forward. The host runs ahead as far as the ring allows;
- the execution order is traced on every forward (the first pre-hook of each group) and the
  prefetch follows the last complete trace, wrapping into the next forward (the next step's
  first groups load during this step's last ones). A group that was not prefetched (first
  forward, changed order) is copied on demand, evicting groups that already ran or were
  prefetched by mistake, never the one running.

From disk, the host copies are views of one unnamed, memory-mapped file
(:mod:`memorykit.offload_store`), whose pages are dropped after each copy: the same schedule,
the same rule for weights read outside their module's forward.

The same schedule runs on a CPU onload device (copies are memcpys into a CPU ring, no streams):
that is how CI checks the scheduling bit for bit against the plain model. No ComfyUI here.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from .offload_plan import ALIGN_BYTES, address_phase, copy_at_phase, packed_layout
from .offload_store import DiskStore, page_round

log = logging.getLogger(__name__)

HOST, PENDING, ACTIVE, RAN, RESIDENT = "host", "pending", "active", "ran", "resident"  # group states, see _Group


@dataclass(eq=False)
class _Group:
    """One streamed group. ``state``: HOST (only on the host), PENDING (copy issued, not run
    since), ACTIVE (its forward is running), RAN (in the ring, ran since its copy), RESIDENT
    (taken out of the ring for good: its forward never ran, see :meth:`EventRing._end`).
    ``dev``: the views of its ring region while it has one; its tensors point at them only
    while the group is ACTIVE."""

    index: int
    modules: list[nn.Module]
    tensors: list[torch.Tensor]
    offsets: list[int]
    nbytes: int
    host: list[torch.Tensor] = field(default_factory=list)
    buffer: torch.Tensor | None = None
    dev: list[torch.Tensor] = field(default_factory=list)
    locked_ptr: int | None = None
    store_offset: int = -1
    state: str = HOST
    start: int = -1
    ready: object = None
    done: object = None
    inference: list[bool] = field(default_factory=list)  # per tensor: an inference tensor before apply
    phases: list[int] = field(default_factory=list)  # per tensor: its address phase before apply


def _view(buf: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """``like``-shaped, ``like``-typed view of the uint8 buffer ``buf`` at byte ``offset``."""
    n = like.numel() * like.element_size()
    return buf[offset:offset + n].view(like.dtype).view(like.shape)


def cuda_ok(rc) -> bool:
    """True for cudaSuccess. On failure, clears CUDA's last-error state: torch's cudart
    bindings return the code without clearing it, and the next kernel launch check would
    raise it as an unrelated error."""
    try:
        ok = int(getattr(rc, "value", rc)) == 0
    except (TypeError, ValueError):
        ok = rc == 0
    if not ok:
        clear_cuda_error()
    return ok


def clear_cuda_error() -> None:
    """``cudaGetLastError()`` through the libcudart torch loaded (best effort, via ctypes:
    torch exposes no binding for it)."""
    import ctypes
    import os
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:
            ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_NOW).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


class EventRing:
    """Streams ``groups`` of modules through a ring buffer on ``onload_device`` (see module doc).

    ``groups``: ``(modules, tensors)`` pairs in expected execution order; ``tensors`` are the
    parameters/buffers of ``modules`` that stream with the group (each in one group only, see
    :func:`memorykit.offload_plan.group_tensors`). Each module gets a forward pre-hook
    (onload, prefetch) and a forward hook (done event); ``root`` gets hooks that trace the order. ``ring_bytes``: device bytes of the ring,
    at least the largest packed group. ``use_stream``: copy on a side CUDA stream ordered by
    events (else on the compute stream). ``pin``: pack the host copies into one buffer per
    group, page-locked on a GPU where ``lock`` (else copy each tensor from where it lies, pageable). ``disk_folder``: pack the host copies into
    one :class:`memorykit.offload_store.DiskStore` in that folder instead of RAM (``pin`` is
    then ignored); a group's pages are dropped after each copy. The tensors must be plain CPU
    tensors. Raises ValueError for a ring smaller than a group or a tensor that is not a plain
    tensor, OSError when the disk folder cannot take the weights. Undo with :meth:`remove`.
    """

    def __init__(self, root: nn.Module, groups: list[tuple[list[nn.Module], list[torch.Tensor]]],
                 onload_device: torch.device, ring_bytes: int, *, use_stream: bool, pin: bool,
                 disk_folder: str | None = None, lock: bool = True):
        self.root, self.device = root, torch.device(onload_device)
        self.store: DiskStore | None = None
        self.events = use_stream and self.device.type == "cuda"
        self.cuda = self.device.type == "cuda"
        self.groups: list[_Group] = []
        grown = largest_planned = 0
        for i, (mods, tensors) in enumerate(groups):
            for t in tensors:
                if type(t.data) is not torch.Tensor or t.device.type != "cpu":
                    raise ValueError(f"event-ring streaming needs plain CPU tensors; found a {type(t.data).__name__} "
                                     f"on {t.device}")
            phases = [address_phase(t) for t in tensors]
            # computed on the CPU: each copy at the address phase the weight had (offload_plan.address_phase)
            offsets, total = packed_layout(tensors, phases if self.device.type == "cpu" else None)
            plain_total = packed_layout(tensors)[1]
            largest_planned, grown = max(largest_planned, plain_total), grown + total - plain_total
            self.groups.append(_Group(i, list(mods), tensors, offsets, total,
                                      inference=[t.is_inference() for t in tensors], phases=phases))
        if ring_bytes < largest_planned:
            raise ValueError(f"ring of {ring_bytes} bytes is smaller than the largest group ({largest_planned} bytes)")
        ring_bytes += grown  # (CPU only) the phases' padding: the same groups fit as planned
        self.ring_bytes = ring_bytes
        self.pinned_bytes = 0
        self.copied_bytes = 0
        self.copied_last_forward = 0
        self.forwards = 0
        self.resident_groups = 0
        self.order = list(range(len(self.groups)))
        self._trace: list[int] = []
        self._cursor = 0
        self._last: _Group | None = None
        self._head = 0
        self._occupants: list[_Group] = []
        self._hooks: list = []
        self.ring: torch.Tensor | None = None
        self.copy_stream = None
        try:
            if disk_folder is not None:
                self._pack_to_disk(disk_folder)
            else:
                self._pack(pin, lock)
            self.ring = torch.empty(ring_bytes, dtype=torch.uint8, device=self.device)
            if self.events:
                self.copy_stream = torch.cuda.Stream(self.device)
                for g in self.groups:
                    g.ready, g.done = torch.cuda.Event(), torch.cuda.Event()
            self._install_hooks()
        except BaseException:
            self.remove()
            raise

    # set-up and removal ------------------------------------------------------------------
    def _pack(self, pin: bool, lock: bool = True) -> None:
        lock = lock and pin and self.cuda and torch.cuda.is_available()
        for g in self.groups:
            if not pin:
                g.host = [t.data for t in g.tensors]
                continue
            buf = torch.empty(g.nbytes, dtype=torch.uint8)
            views = [_view(buf, o, t).copy_(t.data) for t, o in zip(g.tensors, g.offsets)]
            for t, v in zip(g.tensors, views):
                t.data = v  # the original storage is freed here unless something else holds it
            g.buffer, g.host = buf, views
            if lock and buf.numel():
                ptr = buf.data_ptr()
                if cuda_ok(torch.cuda.cudart().cudaHostRegister(ptr, buf.numel(), 1)):  # 1 = portable
                    g.locked_ptr = ptr
                    self.pinned_bytes += buf.numel()
                else:
                    log.warning("cudaHostRegister failed for a %d-byte group: it streams from pageable memory",
                                buf.numel())

    def _pack_to_disk(self, folder: str) -> None:
        """Pack every group into one unnamed file (page-aligned regions), the tensors then view it."""
        starts, total = [], 0
        for g in self.groups:
            starts.append(total)
            total += page_round(g.nbytes)
        self.store = DiskStore(folder, total)
        for g, start in zip(self.groups, starts):
            buf = self.store.tensor[start:start + g.nbytes]
            views = [_view(buf, o, t).copy_(t.data) for t, o in zip(g.tensors, g.offsets)]
            for t, v in zip(g.tensors, views):
                t.data = v  # the original storage is freed here unless something else holds it
            g.buffer, g.host, g.store_offset = buf, views, start
            self.store.drop(start, g.nbytes)  # written back: the RAM it took is given back

    def remove(self) -> None:
        """Undo everything: hooks removed, each tensor back on a fresh, unpinned CPU tensor of
        its own (contiguous) with its values, host buffers unlocked and freed, ring freed. Safe
        after an interrupted forward; a second call does nothing."""
        if self.cuda and torch.cuda.is_initialized():
            torch.cuda.synchronize(self.device)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for g in self.groups:
            n = len(g.tensors)
            for t, host, inf, ph in zip(g.tensors, g.host, g.inference or [False] * n, g.phases or [0] * n):
                if g.buffer is None:
                    t.data = host
                    continue
                # an inference tensor (loaded inside ComfyUI's inference mode) gets one back: core's
                # quantized layers rebuild their Parameters from it in inference mode; at the
                # address phase it had, so the CPU computes with it as before
                with torch.inference_mode(inf):
                    own = copy_at_phase(host, ph)
                t.data = own
            if self.store is not None and g.buffer is not None:
                # the group's file pages were read for the copy: drop them now, so restoring a model
                # from disk holds its weights once (not the copies plus the mapping's pages)
                self.store.drop(g.store_offset, g.nbytes)
            g.host, g.dev, g.state = [], [], HOST
            if g.locked_ptr is not None:
                if not cuda_ok(torch.cuda.cudart().cudaHostUnregister(g.locked_ptr)):
                    log.warning("cudaHostUnregister failed for a group buffer at 0x%x", g.locked_ptr)
                g.locked_ptr = None
            g.buffer = None
        if self.store is not None:
            self.store.close()
            self.store = None
        self.pinned_bytes = 0
        self._occupants.clear()
        self.ring = None
        self.copy_stream = None

    def _install_hooks(self) -> None:
        for g in self.groups:
            for m in g.modules:
                self._hooks.append(m.register_forward_pre_hook(lambda mod, args, g=g: self._pre(g)))
                self._hooks.append(m.register_forward_hook(lambda mod, args, out, g=g: self._post(g)))
        self._hooks.append(self.root.register_forward_pre_hook(lambda mod, args: self._begin()))
        self._hooks.append(self.root.register_forward_hook(lambda mod, args, out: self._end()))

    # forward-time scheduling ---------------------------------------------------------------
    def _begin(self) -> None:
        for g in self.groups:  # left ACTIVE by an interrupted forward: its kernels were queued
            if g.state == ACTIVE:
                self._post(g)
        self.forwards += 1
        self._trace, self._cursor, self._last = [], 0, None
        self.copied_last_forward = 0

    def _end(self) -> None:
        if self._trace and self._trace != self.order:
            self.order = list(self._trace)
        if self.forwards == 1:
            self._keep_unrun_resident(set(self._trace))

    def _keep_unrun_resident(self, ran: set[int]) -> None:
        """Take every group whose forward did not run in the first forward out of the ring:
        its tensors get their own copy on the onload device (issue 14 item 10)."""
        for g in self.groups:
            if g.index in ran or g.state == RESIDENT:
                continue
            if g in self._occupants:
                self._occupants.remove(g)
            if self.events:
                torch.cuda.current_stream(self.device).wait_event(g.ready)
            for t, host in zip(g.tensors, g.host):
                t.data = copy_at_phase(host) if self.device.type == "cpu" else host.to(self.device, copy=True)
            g.dev, g.start, g.state = [], -1, RESIDENT
            self.resident_groups += 1

    def _pre(self, g: _Group) -> None:
        if g.state == HOST:
            self._load(g, demand=True)
        if g.state == RESIDENT:
            return
        if self.events:
            torch.cuda.current_stream(self.device).wait_event(g.ready)
        for t, d in zip(g.tensors, g.dev):
            t.data = d
        g.state = ACTIVE
        if self._last is g:
            return
        self._last = g
        self._trace.append(g.index)
        pos = self._position(g.index)
        if pos is not None:
            self._cursor = pos + 1
            self._prefetch(pos, g)

    def _post(self, g: _Group) -> None:
        if g.state == RESIDENT:
            return
        if self.events:
            g.done.record(torch.cuda.current_stream(self.device))
        for t, host in zip(g.tensors, g.host):
            t.data = host
        g.state = RAN

    def _position(self, index: int) -> int | None:
        order = self.order
        if self._cursor < len(order) and order[self._cursor] == index:
            return self._cursor
        for rng in (range(self._cursor, len(order)), range(0, min(self._cursor, len(order)))):
            for p in rng:
                if order[p] == index:
                    return p
        return None

    def _prefetch(self, pos: int, current: _Group) -> None:
        """Issue copies for the groups after ``pos`` in the traced order (wrapping into the next
        forward) while the ring has room without evicting a group that has not run yet."""
        n, ahead = len(self.order), 0
        for k in range(1, n):
            h = self.groups[self.order[(pos + k) % n]]
            ahead += h.nbytes
            if h is current or ahead > self.ring_bytes:  # beyond the ring nothing more can be held
                return
            if h.state == RESIDENT:
                continue
            if h.state == RAN:  # still in the ring from its last use: keep it
                h.state = PENDING
            elif h.state == HOST and not self._load(h, demand=False):
                return

    def _load(self, g: _Group, demand: bool) -> bool:
        """Give ``g`` a ring region and issue its copy. A prefetch may only evict groups that
        ran; a demand load also cancels prefetched ones. Returns False when a prefetch finds no room."""
        n = g.nbytes
        start = self._head if self._head + n <= self.ring_bytes else 0
        end = start + n
        victims = [o for o in self._occupants if o.start < end and start < o.start + max(o.nbytes, 1)]
        allowed = (RAN, PENDING) if demand else (RAN,)
        if any(v.state not in allowed for v in victims):
            if demand:
                raise RuntimeError("event ring: the running group's region was needed (ring too small)")
            return False
        for v in victims:
            if self.events:  # also for a PENDING victim: its last run's kernels may still read the region
                self.copy_stream.wait_event(v.done)  # (an event never recorded is a no-op wait)
            v.dev, v.state, v.start = [], HOST, -1
            self._occupants.remove(v)
        g.start, self._head = start, end
        dev = [_view(self.ring, start + o, t) for t, o in zip(g.tensors, g.offsets)]
        ctx = torch.cuda.stream(self.copy_stream) if self.events else _null()
        with ctx:
            if g.buffer is not None:
                self.ring[start:start + n].copy_(g.buffer, non_blocking=self.cuda)
            else:
                for d, host in zip(dev, g.host):
                    d.copy_(host, non_blocking=self.cuda)
            if self.events:
                g.ready.record(self.copy_stream)
        if self.store is not None:  # the copy has read the pages (pageable source): unmap them again
            self.store.drop(g.store_offset, n, evict=False)
        g.dev = dev
        g.state = PENDING
        self._occupants.append(g)
        self.copied_bytes += n
        self.copied_last_forward += n
        return True

    def figures(self) -> dict:
        """``groups``, ``ring_bytes``, ``streamed_bytes`` (packed), ``pinned_host_bytes``
        (page-locked now), ``copied_bytes`` (since apply), ``copied_bytes_last_forward``
        (copies issued during the last forward, prefetches for the next one included),
        ``disk_bytes`` (size of the disk store, 0 in RAM),
        ``resident_groups`` / ``resident_bytes`` (groups kept on the onload device because
        their forward never ran, outside the ring)."""
        return {"groups": len(self.groups), "ring_bytes": self.ring_bytes,
                "streamed_bytes": sum(g.nbytes for g in self.groups), "pinned_host_bytes": self.pinned_bytes,
                "copied_bytes": self.copied_bytes, "copied_bytes_last_forward": self.copied_last_forward,
                "resident_groups": self.resident_groups,
                "resident_bytes": sum(g.nbytes for g in self.groups if g.state == RESIDENT),
                "disk_bytes": self.store.nbytes if self.store is not None else 0,
                "align_bytes": ALIGN_BYTES}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
