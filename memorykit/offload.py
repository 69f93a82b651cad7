"""Group offloading of a plain ``nn.Module``: MemoryKit's event ring or ``diffusers.hooks.apply_group_offloading``.

:func:`apply_group_offload` keeps the remainder and, under a budget, as many blocks as fit on
the onload device (see :mod:`memorykit.offload_plan`) and streams the other blocks: from CPU
RAM with :class:`memorykit.offload_stream.EventRing` (``scheduler="memorykit"``, the default;
why: see that module) or diffusers' hooks, from disk always with the event ring (an unnamed
file, :mod:`memorykit.offload_store`: the real weights stay readable whatever happens to the
folder, and the ring's rule for weights read outside their module's forward holds on disk too).
:func:`remove_group_offload` undoes it exactly.
:func:`offload_figures` returns the figures a benchmark needs. No ComfyUI knowledge here.

Where this code does what diffusers does not (each marked "why" below):
- a budget: diffusers streams every block; resident blocks are hidden from it while it applies;
- removal: diffusers removes its hooks but leaves weights where they last were (module
  buffers stay on the GPU on the stream path, diffusers #13238) and leaves its instance ``forward`` and registry attributes behind;
- pinning: diffusers pins by copying every streamed weight (twice the host RAM while it runs,
  then pinned blocks of torch's caching host allocator); here the weights are page-locked in
  place (``cudaHostRegister``) and unlocked on removal.
"""
from __future__ import annotations

import contextlib
import errno
import inspect
import logging
import os
import re
import shutil
import tempfile
import weakref

import torch
from torch import nn

from . import leftovers, stored_parts
from .units import size_text
from .offload_plan import (BlockLists, GroupOffloadOptions, OffloadPlan, default_block_lists, group_tensors,
                           module_tensors, plan_offload, stream_groups)
from .offload_stream import EventRing, cuda_ok

log = logging.getLogger(__name__)

# diffusers.hooks.group_offloading's hook names (_GROUP_OFFLOADING, _LAYER_EXECUTION_TRACKER,
# _LAZY_PREFETCH_GROUP_OFFLOADING).
HOOK_NAMES = ("group_offloading", "layer_execution_tracker", "lazy_prefetch_group_offloading")
_MARK = "_memorykit_group_offload"
DISK_MARGIN_BYTES = 256 << 20


class GroupOffloadHandle:
    """What :func:`apply_group_offload` did to one module; give it to :func:`remove_group_offload`.

    ``forwards`` counts forward calls of the module since apply; ``disk_dir`` is the folder of
    this application's offload files (None for the cpu target).
    """

    def __init__(self, module: nn.Module, plan: OffloadPlan, options: GroupOffloadOptions,
                 onload: torch.device, offload: torch.device):
        self.module, self.plan, self.options = module, plan, options
        self.onload_device, self.offload_device = onload, offload
        self.disk_dir: str | None = None
        self.forwards = 0
        self.never_ran: list[str] = []
        self.removed = False
        self._placements = [(t, t.device, _pinned(t)) for t in module_tensors(module)]
        mods = list(module.modules())
        self._had_registry = {id(m) for m in mods if "_diffusers_hook" in m.__dict__}
        self._had_forward = {id(m) for m in mods if "forward" in m.__dict__}
        self._locked: list[tuple[int, torch.Tensor]] = []  # (data_ptr, tensor keeping the storage alive)
        self._torch_hooks: list = []
        self._dir_finalizer = None
        self.ring: EventRing | None = None  # the event-ring scheduler, when it streams (see offload_stream)


def _pinned(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and torch.cuda.is_available() and t.is_pinned()


def _move_(t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        t.data = t.data.to(device)


def _path_text(folder, what: str) -> str:
    """``folder`` as text, refusing what no path can hold: NUL and unpaired surrogates (JSON
    ``\\u0000`` / ``\\ud800``), which ``os.path.exists`` answers with False ("does not exist")."""
    text = str(folder)
    bad = next((i for i, ch in enumerate(text) if ch == "\x00" or "\ud800" <= ch <= "\udfff"), None)
    if bad is not None:
        shown = repr(text[:60]) + ("..." if len(text) > 60 else "")
        raise RuntimeError(f"{what} {shown}: character {bad + 1} ({text[bad]!r}) cannot be part of a path: "
                           "remove it (paste the folder's path again).")
    return text


def check_disk_folder(folder: str | os.PathLike, need_bytes: int = 0, what: str = "Disk offload folder") -> str:
    """Check that ``folder`` can take ``need_bytes`` of offload files; return its absolute path.

    Writability is tested by creating a file (so it also holds for root). Raises RuntimeError
    saying what to fix when the folder is missing, not a folder, not writable, or has less than
    ``need_bytes`` + 256 MiB free. ``what`` names the folder in messages (a node's field name).
    """
    path = os.path.abspath(os.path.expanduser(_path_text(folder, what)))
    try:
        os.stat(path)
    except OSError as e:  # os.path.exists says False for every error: say which it is
        if e.errno == errno.ENOENT and os.path.islink(path):
            raise RuntimeError(f"{what} {path!r} is a symlink to {os.readlink(path)!r}, which does not exist: "
                               "fix the link or choose another folder.") from None
        shown = repr(path) if len(path) <= 200 else repr(path[:100]) + f"... ({len(path)} characters)"
        why = {errno.ENAMETOOLONG: "is longer than the file system allows (255 bytes per name, 4096 in all): "
                                   "choose a shorter path.",
               errno.ENOTDIR: "has a file, not a folder, on its way: fix the path or choose another folder.",
               errno.EACCES: f"cannot be reached ({e.strerror}): choose a folder this process may open.",
               errno.ELOOP: "goes through a loop of symlinks: fix the links or choose another folder."}
        raise RuntimeError(f"{what} {shown} " + why.get(e.errno, "does not exist: create it or choose another "
                                                        "folder.")) from None
    if not os.path.isdir(path):
        raise RuntimeError(f"{what} {path!r} is not a folder: choose a folder.")
    try:
        tempfile.TemporaryFile(prefix=".memorykit-probe-", dir=path).close()  # no name (Linux) or unlinked at once
    except OSError as e:
        raise RuntimeError(f"{what} {path!r} is not writable ({e.strerror}): "
                           "choose a writable folder.") from None
    free = shutil.disk_usage(path).free
    if need_bytes and free < need_bytes + DISK_MARGIN_BYTES:
        raise RuntimeError(f"{what} {path!r} has {size_text(free)} free; the offloaded weights "
                           f"need {size_text(need_bytes)} (+256 MiB margin): free space or choose another folder.")
    return path


def _page_lock(h: GroupOffloadHandle, tensors) -> None:
    """Page-lock CPU tensors in place with ``cudaHostRegister`` (why: see module docstring).

    diffusers then finds them pinned (``Tensor.pin_memory`` returns a pinned tensor itself) and
    copies nothing. A tensor whose registration fails is left alone: diffusers pins a copy.
    """
    cudart = torch.cuda.cudart()
    seen = set()
    for t in tensors:
        if t.device.type != "cpu" or t.numel() == 0 or t.is_pinned():
            continue
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        if cuda_ok(cudart.cudaHostRegister(ptr, st.nbytes(), 1)):  # 1 = cudaHostRegisterPortable
            h._locked.append((ptr, t.data))


@contextlib.contextmanager
def _only_streamed_blocks(module: nn.Module, lists: BlockLists, streamed: set[str], anchor: bool):
    """While diffusers applies, make ``module``'s children the streamed blocks only.

    Why: diffusers streams every direct ModuleList/Sequential child and the rest as one group;
    it has no notion of a resident block or of blocks nested deeper. Hiding the resident parts
    (and the remainder, kept resident) for the duration of ``apply_group_offloading`` and
    restoring the exact same child/parameter/buffer dicts afterwards leaves its hooks on the
    streamed blocks only. ``anchor`` adds an empty child, so diffusers creates the top-level
    group whose lazy-prefetch hook chains the streamed groups when ``use_stream`` is on.
    """
    saved = (dict(module._modules), dict(module._parameters), dict(module._buffers))
    try:
        module._modules.clear()
        module._parameters.clear()
        module._buffers.clear()
        for j, (_, bl) in enumerate(lists):
            mods = [b for n, b in bl if n in streamed]
            if mods:
                module._modules[f"memorykit_streamed_{j}"] = nn.ModuleList(mods)
        if anchor:
            module._modules["memorykit_prefetch_anchor"] = nn.Module()
        yield
    finally:
        for d, s in zip((module._modules, module._parameters, module._buffers), saved):
            d.clear()
            d.update(s)


def apply_group_offload(module: nn.Module, onload_device: str | torch.device,
                        offload_device: str | torch.device = "cpu", *, options: GroupOffloadOptions,
                        budget_bytes: int | None = None, block_lists: BlockLists | None = None,
                        disk_folder: str | os.PathLike | None = None, disk_tag: str = "model") -> GroupOffloadHandle:
    """Apply group offloading to ``module``; return the handle that undoes it.

    ``onload_device`` computes (``cuda:0``; ``cpu`` for disk offload on a CPU machine),
    ``offload_device`` stores (``cpu``). ``budget_bytes``: onload-device bytes the weights may
    use, streaming buffers included (None: stream all blocks); ``block_lists``: see
    :func:`memorykit.offload_plan.plan_offload`. With ``options.offload_to == "disk"`` the
    weights go to an unnamed file (:mod:`memorykit.offload_store`) in a new folder
    ``memorykit-offload-<disk_tag>-*`` inside ``disk_folder`` (tracked by
    :mod:`memorykit.leftovers`), both freed with the handle. Block_level checks on the first forward that every streamed block ran
    through its ``forward`` (a block called another way would run with offloaded weights) and
    raises RuntimeError otherwise. Raises ValueError for invalid options or a module already
    offloaded, RuntimeError for an unusable disk folder; on any error the module is restored.
    """
    from diffusers.hooks import apply_group_offloading  # imported here: importing diffusers costs seconds

    onload, offload = torch.device(onload_device), torch.device(offload_device)
    options.validate(onload)
    if options.offload_to == "disk" and not disk_folder:
        raise ValueError("offload_to='disk' needs a disk_folder")
    marker = module.__dict__.get(_MARK)
    if (marker is not None and marker() is not None) or _collect_groups(module):
        raise ValueError(f"{type(module).__name__} already has group offloading applied; remove it first")
    if not options.event_ring and any(not stored_parts.is_plain(t) for t in module.parameters()):
        raise ValueError("scheduler='diffusers' streams plain tensors only and this model holds quantized weights "
                         "(fp8_scaled / GGUF): choose scheduler 'memorykit', which streams their stored bytes")
    lists = default_block_lists(module) if block_lists is None else block_lists
    plan = plan_offload(module, options, budget_bytes, lists)
    h = GroupOffloadHandle(module, plan, options, onload, offload)
    if options.event_ring and (plan.streamed_blocks or not plan.remainder_resident):
        try:
            if options.offload_to == "disk":
                parent = check_disk_folder(disk_folder, plan.streamed_bytes)
                tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", disk_tag)[:64]
                h.disk_dir = leftovers.make_folder(f"memorykit-offload-{tag}-", parent)
                h._dir_finalizer = weakref.finalize(h, leftovers.remove_folder, h.disk_dir)
            _apply_event_ring(h, lists)
        except BaseException:
            remove_group_offload(h)
            raise
        return h
    try:
        by_name = {n: b for _, bl in lists for n, b in bl}
        streamed_blocks = [by_name[n] for n in plan.streamed_blocks]
        if plan.remainder_resident:
            streamed = module_tensors(nn.ModuleList(streamed_blocks))
        else:
            streamed = module_tensors(module)
        streamed_ids = {id(t) for t in streamed}
        for t in module_tensors(module):
            _move_(t, offload if id(t) in streamed_ids else onload)
        module.__dict__[_MARK] = weakref.ref(h)
        if not streamed:  # everything fits the budget: no hooks, only the forward counter
            _install_counters(h, [])
            return h
        if options.use_stream and not options.low_cpu_mem_usage and options.page_lock and onload.type == "cuda":
            _page_lock(h, streamed)
        block_level = options.offload_type == "block_level"
        kwargs = dict(onload_device=onload, offload_device=offload, offload_type=options.offload_type,
                      num_blocks_per_group=options.group_size if block_level else None,
                      use_stream=options.use_stream, record_stream=options.record_stream,
                      low_cpu_mem_usage=options.low_cpu_mem_usage)
        if options.exclude_kwargs and "exclude_kwargs" in inspect.signature(apply_group_offloading).parameters:
            kwargs["exclude_kwargs"] = list(options.exclude_kwargs)  # newer diffusers only; older ones copy them
        if plan.remainder_resident:
            with _only_streamed_blocks(module, lists, set(plan.streamed_blocks),
                                       block_level and options.use_stream):
                apply_group_offloading(module, **kwargs)
        else:
            apply_group_offloading(module, **kwargs)
        _install_counters(h, list(zip(plan.streamed_blocks, streamed_blocks)) if block_level else [])
    except BaseException:
        remove_group_offload(h)
        raise
    return h


def _apply_event_ring(h: GroupOffloadHandle, lists: BlockLists) -> None:
    """Stream the plan's groups with :class:`memorykit.offload_stream.EventRing` (cpu target).

    The ring's weights are packed into host buffers (page-locked on a GPU unless
    ``low_cpu_mem_usage``); every other tensor goes to the onload device."""
    module, plan, options = h.module, h.plan, h.options
    mods = stream_groups(module, plan, lists, options)
    pairs = [(m, ts) for m, ts in zip(mods, group_tensors(mods, module)) if ts]
    streamed = {id(t) for _, ts in pairs for t in ts}
    for t in module_tensors(module):
        _move_(t, h.offload_device if id(t) in streamed else h.onload_device)
    module.__dict__[_MARK] = weakref.ref(h)
    try:
        h.ring = EventRing(module, pairs, h.onload_device, plan.buffer_bytes, use_stream=options.use_stream,
                           pin=not options.low_cpu_mem_usage, disk_folder=h.disk_dir, lock=options.page_lock)
    except OSError as e:
        raise RuntimeError(f"Writing the offloaded weights to {h.disk_dir!r} failed ({e.strerror or e}): free "
                           "space or choose another disk_folder.") from None
    block_level = options.offload_type == "block_level"
    by_name = {n: b for _, bl in lists for n, b in bl}
    _install_counters(h, [(n, by_name[n]) for n in plan.streamed_blocks] if block_level else [])


def _install_counters(h: GroupOffloadHandle, check: list[tuple[str, nn.Module]]) -> None:
    """Count forwards of the module; in block_level, check on the first forward that every
    streamed block ran through its own forward (diffusers' hooks only fire there).

    A block of which nothing ran (neither its forward nor any submodule's, e.g. ACE-Step's
    ``projectors``, unused at inference) never ran rather than ran the wrong way: it is listed
    in ``h.never_ran`` and left alone. A block whose submodules ran without its own forward
    is an error."""
    ref = weakref.ref(h)
    seen: set[int] = set()

    def top_pre(mod, args):
        hh = ref()
        if hh is not None:
            hh.forwards += 1
        seen.clear()

    h._torch_hooks.append(h.module.register_forward_pre_hook(top_pre))
    if not check:
        return
    block_hooks = [b.register_forward_pre_hook(lambda m, a, i=id(b): seen.add(i)) for _, b in check]
    inner: set[int] = set()  # blocks some submodule of which ran
    inner_hooks = [m.register_forward_pre_hook(lambda mod, a, i=id(b): inner.add(i))
                   for _, b in check for m in b.modules() if m is not b]

    def top_post(mod, args, out):
        missing = [n for n, b in check if id(b) not in seen and id(b) in inner]
        if missing:
            raise RuntimeError(
                f"Group offloading (block_level): blocks {missing[:4]} did not run through their own forward() "
                f"in {type(mod).__name__}, so their weights could not be streamed. Use offload_type=leaf_level "
                "for this model.")
        hh = ref()
        if hh is not None:
            hh.never_ran = [n for n, b in check if id(b) not in seen]
        for bh in block_hooks + inner_hooks + [post_handle]:
            bh.remove()

    post_handle = h.module.register_forward_hook(top_post)
    h._torch_hooks += block_hooks + inner_hooks + [post_handle]


def _collect_groups(module: nn.Module) -> list:
    """diffusers ModuleGroups whose hooks sit on ``module`` or its submodules."""
    groups, seen = [], set()
    for m in module.modules():
        reg = m.__dict__.get("_diffusers_hook")
        hook = reg.get_hook(HOOK_NAMES[0]) if reg is not None else None
        if hook is not None and id(hook.group) not in seen:
            seen.add(id(hook.group))
            groups.append(hook.group)
    return groups


def _restore_group_values(group) -> None:
    """Put each tensor of a diffusers ModuleGroup back on real values held in CPU memory.

    Stream groups: the CPU copies in ``cpu_param_dict`` (which also cover module buffers,
    diffusers #13238). Non-stream groups already hold their values (on CPU, or on the GPU
    mid-forward). (Disk groups are never diffusers': the event ring streams from disk.)
    """
    for t, cpu in (getattr(group, "cpu_param_dict", None) or {}).items():
        t.data = cpu


def remove_group_offload(h: GroupOffloadHandle) -> None:
    """Undo :func:`apply_group_offload`: every parameter and buffer back on its original device
    with its original values, not pinned unless it was, the hooks and the attributes diffusers
    added gone, page-locked memory unlocked, disk files deleted. Safe after an interrupted
    forward or a failed apply; a second call does nothing."""
    if h.removed:
        return
    module = h.module
    if h.onload_device.type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.synchronize(h.onload_device)
    if h.ring is not None:
        h.ring.remove()  # tensors back on plain CPU memory, host buffers unlocked
    for g in _collect_groups(module):
        _restore_group_values(g)
    for m in module.modules():
        reg = m.__dict__.get("_diffusers_hook")
        if reg is None:
            continue
        for name in HOOK_NAMES:
            reg.remove_hook(name, recurse=False)
        if not reg.hooks and id(m) not in h._had_registry:
            del m.__dict__["_diffusers_hook"]
            if "forward" in m.__dict__ and id(m) not in h._had_forward:
                del m.__dict__["forward"]
    locked_ptrs = {ptr for ptr, _ in h._locked}
    for t, device, was_pinned in h._placements:
        _move_(t, device)
        if device.type == "cpu" and not was_pinned and _pinned(t) \
                and t.untyped_storage().data_ptr() not in locked_ptrs:
            t.data = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype).copy_(t.data)
    if h._locked:
        torch.cuda.synchronize()
        cudart = torch.cuda.cudart()
        for ptr, _ in h._locked:
            if not cuda_ok(cudart.cudaHostUnregister(ptr)):
                log.warning("cudaHostUnregister failed for a weight at 0x%x", ptr)
        h._locked.clear()
    for th in h._torch_hooks:
        th.remove()
    h._torch_hooks.clear()
    if h._dir_finalizer is not None:
        h._dir_finalizer()  # deletes h.disk_dir
    module.__dict__.pop(_MARK, None)
    if torch.cuda.is_available() and torch.cuda.is_initialized() and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()  # give diffusers' pinned copies (if any) back to the OS
    h.removed = True


def page_locked_bytes(h: GroupOffloadHandle) -> int:
    """Host bytes this application page-locked itself (``cudaHostRegister``; 0 once removed)."""
    if h.removed:
        return 0
    if h.ring is not None:
        return h.ring.pinned_bytes
    return sum(t.untyped_storage().nbytes() for _, t in h._locked)


def offload_figures(h: GroupOffloadHandle) -> dict:
    """Figures of one application, in bytes (see :class:`memorykit.offload_plan.OffloadPlan`).

    ``h2d_bytes_per_forward``: weights copied to the onload device per forward (each streamed
    group once); ``d2h_bytes_per_forward``: copied back (diffusers' non-stream cpu path moves
    each group back with ``Module.to``; the stream path swaps pointers to its CPU copies);
    ``disk_read_bytes_per_forward``; ``pinned_host_bytes``: page-locked host memory holding
    weights now (measured); ``disk_bytes``: size of the disk store (its file has no name).
    """
    p = h.plan
    o = h.options
    same = h.onload_device == h.offload_device
    common = {
        **p.as_dict(), "onload_device": str(h.onload_device), "offload_device": str(h.offload_device),
        "offload_to": o.offload_to, "use_stream": o.use_stream, "record_stream": o.record_stream,
        "low_cpu_mem_usage": o.low_cpu_mem_usage, "num_blocks_per_group": o.group_size, "forwards": h.forwards,
        "h2d_bytes_per_forward": 0 if same else p.streamed_bytes, "removed": h.removed,
        "never_ran_blocks": list(h.never_ran),
    }
    if h.ring is not None:
        ring = h.ring.figures()
        return {**common, "scheduler": "memorykit", "groups": ring["groups"], "d2h_bytes_per_forward": 0,
                "pinned_host_bytes": 0 if h.removed else ring["pinned_host_bytes"],
                "copied_bytes": ring["copied_bytes"], "copied_bytes_last_forward": ring["copied_bytes_last_forward"],
                "ring_bytes": ring["ring_bytes"], "disk_bytes": ring["disk_bytes"], "disk_dir": h.disk_dir,
                "disk_read_bytes_per_forward": p.streamed_bytes if o.offload_to == "disk" else 0}
    groups = [] if h.removed else _collect_groups(h.module)
    pinned, seen = 0, set()
    for g in groups:
        for cpu in (getattr(g, "cpu_param_dict", None) or {}).values():
            ptr = cpu.untyped_storage().data_ptr()
            if ptr not in seen and _pinned(cpu):
                seen.add(ptr)
                pinned += cpu.untyped_storage().nbytes()
    return {
        **common, "scheduler": "diffusers", "groups": len(groups),
        "d2h_bytes_per_forward": p.streamed_bytes if (not o.use_stream and not same) else 0,
        "disk_read_bytes_per_forward": 0, "pinned_host_bytes": pinned, "disk_bytes": 0, "disk_dir": None,
    }
