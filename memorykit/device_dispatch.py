"""Dispatch a device map onto a module with accelerate, and undo it exactly.

Plain torch + accelerate; knows nothing of ComfyUI. :func:`dispatch_device_map` wraps
``accelerate.dispatch_model`` (``AlignDevicesHook`` on every submodule that holds tensors:
weights placed or offloaded, inputs moved to each submodule's execution device, outputs of the
root returned to the device its input came from). The returned :class:`DispatchedModel`
undoes it: ``remove_hook_from_module(recurse=True)``, then every parameter and buffer is put
back on the device it had before (accelerate's removal only restores offloaded tensors), the
``forward`` attributes accelerate's removal leaves on each hooked module are dropped (so a
module copied from it later runs its own class's forward), the ``hf_device_map`` attribute is
dropped and the offload folder is deleted.

Weights mapped to ``disk`` go to one unnamed file (:class:`memorykit.offload_store.DiskStore`,
space reserved before writing: a full disk is an OSError, never a SIGBUS) and reach accelerate
as views of its mapping (``dispatch_model(state_dict=...)``), not as accelerate's ``<name>.dat``
files: a file without a name cannot be removed or truncated while the map is loaded, so the
forward and the restore on removal always read the real weights (issue 23 item 8).

Quantized weights (core's ``QuantizedTensor``, GGUF) reach accelerate as their stored parts
(:func:`memorykit.weight_parts.decompose` with ``several=True``, the rule Group Offload uses
too): before dispatch each is replaced by plain Parameters (fp8 data, scales: ``<name>__mk_part<i>``;
GGUF: its raw bytes under its own name), so accelerate places, offloads and writes to disk the
stored bytes; the layer's forward gets the weight rebuilt over the parts where accelerate put
them, and removal puts the original weight object back over its restored parts.
"""
from __future__ import annotations

import tempfile

import torch
from accelerate import dispatch_model
from accelerate.hooks import remove_hook_from_module
from accelerate.utils import set_module_tensor_to_device
from accelerate.utils.offload import extract_submodules_state_dict

from . import leftovers, weight_parts
from .device_map import OFFLOAD_DEVICES, Device, device_name, main_device as default_main_device
from .offload import check_disk_folder
from .offload_plan import address_phase, copy_at_phase, packed_layout
from .offload_store import DiskStore

OFFLOAD_DIR_PREFIX = "memorykit-devicemap-"


def check_devices_present(device_map: dict) -> None:
    """Raise RuntimeError naming a device of ``device_map`` this machine does not have
    (a GPU index ≥ ``torch.cuda.device_count()``, or mps without MPS)."""
    n = torch.cuda.device_count()
    for d in dict.fromkeys(device_map.values()):
        if isinstance(d, int) and d >= n:
            have = f"{n} CUDA device(s)" if n else "no CUDA device"
            raise RuntimeError(f"the device map uses {device_name(d)} but this machine has {have}; "
                               "change max_memory / the custom device map")
        if d == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            raise RuntimeError("the device map uses mps but MPS is not available on this machine")


def _named_tensors(module: torch.nn.Module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def is_dispatched(module: torch.nn.Module) -> bool:
    """True when ``module`` (or a submodule) carries accelerate hooks or an ``hf_device_map``."""
    return hasattr(module, "hf_device_map") or any(hasattr(m, "_hf_hook") for m in module.modules())


class DispatchedModel:
    """Handle of one dispatch of a device map onto ``module`` (see :func:`dispatch_device_map`).

    Attributes: ``module``, ``device_map`` (module order, accelerate devices), ``main_device``,
    ``offload_dir`` (the folder made for ``disk`` entries, or None), ``original_devices``
    (tensor name → ``torch.device`` before dispatch), ``own_forwards`` (names of the submodules
    that had a ``forward`` instance attribute before dispatch). :meth:`remove` undoes the
    dispatch; it is idempotent.
    """

    def __init__(self, module: torch.nn.Module, device_map: dict, main_device: Device,
                 offload_dir: str | None, original_devices: dict, own_forwards: frozenset = frozenset(),
                 store: DiskStore | None = None, parts: weight_parts.Decomposed | None = None):
        self.module = module
        self.store = store
        self.disk_bytes = 0  # bytes written to disk (the stored bytes of the disk entries, no padding)
        self.parts = parts if parts is not None else weight_parts.Decomposed()
        self.device_map = dict(device_map)
        self.main_device = main_device
        self.offload_dir = offload_dir
        self.original_devices = original_devices
        self.own_forwards = own_forwards
        self.ties: tuple = ()  # groups of names sharing one tensor (tied weights), tied again on removal
        self.page_hooks: list = []  # forward hooks letting go of the disk pages read (see _let_go_of_read_pages)
        self.active = True

    def remove(self) -> None:
        """Remove every hook, put each parameter/buffer back on its original device with its
        exact values (offloaded ones are read back from RAM or the offload files), drop the
        ``forward`` attributes the hooks left and ``hf_device_map``, and delete the offload
        folder. Safe to call twice; when it raised half-way, calling it again finishes it."""
        if not self.active:
            return
        # Raising half-way keeps the handle active with its store: calling again finishes the job.
        for h in self.page_hooks:
            h.remove()
        self.page_hooks = []
        _restore(self.module, self.original_devices, self.own_forwards, self.ties)
        _own_memory(self.module, self.store)
        self.parts.restore()
        self.active = False
        if self.store is not None:
            self.store.close()
            self.store = None
        if self.offload_dir:
            leftovers.remove_folder(self.offload_dir)

    def __repr__(self) -> str:
        return (f"DispatchedModel({type(self.module).__name__}, main_device={device_name(self.main_device)}, "
                f"{len(self.device_map)} entries, active={self.active})")


def _instance_forwards(module: torch.nn.Module) -> frozenset:
    return frozenset(n for n, m in module.named_modules() if "forward" in m.__dict__)


def _ties(module: torch.nn.Module) -> tuple:
    """Groups of names that share one tensor object (tied weights), each group of two or more."""
    by_id: dict = {}
    for n, t in _named_tensors(module):
        by_id.setdefault(id(t), []).append(n)
    return tuple(tuple(g) for g in by_id.values() if len(g) > 1)


def _slot(module: torch.nn.Module, name: str) -> tuple[dict, str]:
    """The ``_parameters`` or ``_buffers`` dict holding tensor ``name`` of ``module``, and its key."""
    owner, _, leaf = name.rpartition(".")
    m = module.get_submodule(owner)
    return (m._parameters if leaf in m._parameters else m._buffers), leaf


def _retie(module: torch.nn.Module, ties: tuple) -> None:
    """Each group of ``ties`` shares one tensor again (placing and restoring makes one per name):
    the first member not on ``meta``; the weights are held once, as before the dispatch."""
    for group in ties:
        slots = [_slot(module, n) for n in group]
        t = next((d[k] for d, k in slots if d[k] is not None and d[k].device.type != "meta"), None)
        if t is not None:
            for d, k in slots:
                d[k] = t


def _restore(module: torch.nn.Module, original_devices: dict, own_forwards: frozenset, ties: tuple = ()) -> None:
    remove_hook_from_module(module, recurse=True)
    if "hf_device_map" in module.__dict__:
        del module.__dict__["hf_device_map"]
    for name, m in module.named_modules():
        # accelerate's removal sets `m.forward = m._old_forward`: an instance attribute bound to m,
        # which anything copying m's __dict__ (a new layer built from it) would call instead of its own.
        if name not in own_forwards:
            m.__dict__.pop("forward", None)
    for name, t in list(_named_tensors(module)):
        want = original_devices.get(name)
        if want is not None and t.device != want and t.device.type != "meta":
            set_module_tensor_to_device(module, name, want, clear_cache=False)
    _retie(module, ties)
    for name, t in _named_tensors(module):
        if t.device.type == "meta":
            raise RuntimeError(f"{name} is still on the meta device after removing the device map")


def _own_memory(module: torch.nn.Module, store: DiskStore | None) -> None:
    """Tensors accelerate restored as views of the disk store get memory of their own."""
    if store is None or store.tensor is None or not store.nbytes:
        return
    lo = store.tensor.data_ptr()
    hi = lo + store.nbytes
    for _, t in _named_tensors(module):
        if t.device.type == "cpu" and lo <= t.untyped_storage().data_ptr() < hi:
            off, nb = t.data_ptr() - lo, t.numel() * t.element_size()
            t.data = copy_at_phase(t.data)  # the view keeps the phase the weight was loaded at (_pack_to_disk)
            store.drop(off, nb, evict=False)  # the pages read for the copy: the weights are held once


def _expand_root(module: torch.nn.Module, device_map: dict) -> dict:
    """``{"": d}`` → one entry per direct child / direct tensor of ``module`` on ``d``.

    Written here because accelerate 1.15's ``dispatch_model`` cannot offload the root entry
    ``""`` to disk (``extract_submodules_state_dict`` matches no key for ``""``, so no
    ``index.json`` is written and dispatch fails); per-child entries are equivalent.
    """
    if "" not in device_map:
        return dict(device_map)
    d = device_map[""]
    names = [n for n, _ in module.named_parameters(recurse=False)] + [n for n, _ in module.named_buffers(recurse=False)]
    names += [n for n, c in module.named_children() if len(c.state_dict()) > 0]
    return {n: d for n in names} or dict(device_map)


def _tensor_dict(module: torch.nn.Module) -> dict:
    """Parameters and persistent buffers by name: what accelerate's hooks look up (a layer's own
    ``state_dict`` may name its stored form otherwise, as core's quantized layers do). A tied
    weight is listed under each of its names: the hook of every module using it looks it up."""
    out = dict(module.named_parameters(remove_duplicate=False))
    for mn, m in module.named_modules():
        for bn, b in m._buffers.items():
            if b is not None and bn not in m._non_persistent_buffers_set:
                out[f"{mn}.{bn}" if mn else bn] = b
    return out


def disk_state_dict(module: torch.nn.Module, device_map: dict) -> dict:
    """The tensors of ``module`` a map puts on ``disk`` (state-dict names), as ``dispatch_model`` offloads them."""
    disk = [n for n, d in _expand_root(module, device_map).items() if d == "disk"]
    return extract_submodules_state_dict(_tensor_dict(module), disk) if disk else {}


def _same_layout(flat: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``flat`` (``t.numel()`` elements) viewed with ``t``'s shape and, where ``t`` is dense and
    non-overlapping (e.g. a transposed weight), its strides: the CPU's GEMM rounds a transposed
    operand otherwise than a contiguous one, so the copy must keep the layout to stay bit-exact."""
    if t.is_contiguous() or torch.empty_like(t, device="meta").stride() != t.stride():
        return flat.view(t.shape)  # contiguous, or overlapping (expanded): values only
    return flat.as_strided(t.shape, t.stride())


def _pack_to_disk(folder: str, state_dict: dict) -> tuple[DiskStore, dict]:
    """``state_dict`` copied into one unnamed file in ``folder`` (512-byte aligned tensors, see
    :class:`memorykit.offload_store.DiskStore`); returns the store and the views of it, same keys
    (names of one tensor, tied weights, share one view: written once).
    Raises OSError when the folder cannot take them (a full disk: ENOSPC)."""
    first = {}
    for n, t in state_dict.items():
        first.setdefault(id(t), n)
    names = list(dict.fromkeys(first.values()))
    tensors = [state_dict[n].detach() for n in names]
    # each at its address phase as loaded: the CPU computes with it bit for bit as before (address_phase)
    offsets, total = packed_layout(tensors, [address_phase(t) for t in tensors])
    store = DiskStore(folder, total)
    views = {}
    try:
        # Normal tensors even when ComfyUI loads inside inference mode: accelerate makes
        # Parameters of them on removal, which inference tensors refuse.
        with torch.inference_mode(False):
            for n, t, o in zip(names, tensors, offsets):
                nb = t.numel() * t.element_size()
                v = _same_layout(store.tensor[o:o + nb].view(t.dtype), t)
                v.copy_(t)
                views[n] = v
            views = {n: views[first[id(t)]] for n, t in state_dict.items()}
        store.drop()
    except BaseException:
        views.clear()
        store.close()
        raise
    return store, views


def _is_torch_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError)


def dispatch_device_map(module: torch.nn.Module, device_map: dict, offload_folder: str | None = None,
                        main_device: Device | None = None, skip_keys: list[str] | None = None,
                        preload_module_classes: list[str] | None = None, is_oom=None) -> DispatchedModel:
    """Place ``module`` according to ``device_map`` with ``accelerate.dispatch_model``.

    ``device_map``: a full map of ``module`` (see :func:`memorykit.device_map.validate_device_map`).
    ``offload_folder``: parent folder for ``disk`` entries; a new folder unique to this dispatch
    (``memorykit-devicemap-*``) is made inside it (default: the system temp folder) and removed
    by :meth:`DispatchedModel.remove`; it must exist, be writable and have room for the disk
    weights (+ 256 MiB). ``main_device``: where inputs go and offloaded entries are
    computed (default: the first GPU in map order, else cpu). ``skip_keys``: keyword arguments
    (and dict keys) the hooks pass through without moving tensors inside them.
    ``preload_module_classes``: class names (the blocks) whose offloaded weights are all loaded
    when the module's own forward starts, not per submodule: a block that reads a submodule's
    weight without calling that submodule (e.g. the q/k norms of NextDiT and Cosmos attention,
    read by core's fused RoPE kernels) then reads real values, not meta placeholders.
    ``is_oom(exception)``: what counts as running out of memory (default: ``torch.OutOfMemoryError``;
    a host application can widen it, e.g. to accelerator errors that mean the same).

    Hooks are attached even for a single-device map (``force_hooks``), so the root always
    moves its inputs to the main device and its outputs back to the input's device.

    Raises RuntimeError when a device is missing, when a device runs out of memory (the message
    names it; the module is left as it was), when the offload folder is missing, not writable,
    too small or fills up while writing, and ValueError when the module is already dispatched.
    On any error nothing is left behind (hooks, moved tensors, offload files).
    """
    if is_dispatched(module):
        raise ValueError(f"{type(module).__name__} already carries a device map (hf_device_map / accelerate "
                         "hooks); remove it first")
    check_devices_present(device_map)
    main = default_main_device(device_map) if main_device is None else main_device
    own_forwards = _instance_forwards(module)
    parts = weight_parts.decompose(module, several=True)
    try:
        return _dispatch(module, device_map, offload_folder, main, skip_keys, preload_module_classes, own_forwards,
                         parts, is_oom)
    except BaseException:
        parts.restore()
        raise


def _dispatch(module, device_map, offload_folder, main, skip_keys, preload_module_classes, own_forwards,
              parts, is_oom=None) -> DispatchedModel:
    original = {n: t.device for n, t in _named_tensors(module)}
    ties = _ties(module)
    offload_dir, store, weights, disk_bytes = None, None, None, 0
    expanded = _expand_root(module, device_map)
    if parts and main != "cpu" and "disk" not in device_map.values():
        cpu = [n for n, d in expanded.items() if d == "cpu"]
        if cpu:  # accelerate would build it from module.state_dict(), which names quantized layers otherwise
            weights = extract_submodules_state_dict(_tensor_dict(module), cpu)
    if "disk" in device_map.values():
        disk_weights = disk_state_dict(module, device_map)
        unique = {id(t): t for t in disk_weights.values()}.values()  # a tied weight is written once
        need = disk_bytes = sum(t.numel() * t.element_size() for t in unique)
        parent = check_disk_folder(offload_folder or tempfile.gettempdir(), need, what="offload_folder")
        try:
            offload_dir = leftovers.make_folder(OFFLOAD_DIR_PREFIX, parent)
        except OSError as e:
            raise RuntimeError(f"cannot create an offload folder in {parent!r}: {e}") from None
        try:
            store, weights = _pack_to_disk(offload_dir, disk_weights)
        except OSError as e:
            leftovers.remove_folder(offload_dir)
            raise RuntimeError(f"writing the disk weights to {offload_dir!r} failed ({e.strerror or e}): free space "
                               "in the offload folder or choose another one.") from None
        del disk_weights
        if main != "cpu":  # accelerate streams "cpu" entries from this state dict too when it is given
            cpu = [n for n, d in expanded.items() if d == "cpu"]
            if cpu:
                weights.update(extract_submodules_state_dict(_tensor_dict(module), cpu))
    try:
        dispatch_model(module, device_map=expanded, main_device=main, state_dict=weights,
                       offload_index={} if weights is not None else None, skip_keys=skip_keys,
                       preload_module_classes=preload_module_classes, force_hooks=True)
    except BaseException as e:
        try:
            _restore(module, original, own_forwards, ties)
            _own_memory(module, store)
        finally:
            if store is not None:
                store.close()
            if offload_dir:
                leftovers.remove_folder(offload_dir)
        if (is_oom or _is_torch_oom)(e):
            on = {device_name(d) for d in device_map.values() if d not in OFFLOAD_DEVICES}
            raise RuntimeError(f"out of memory while placing the device map on {', '.join(sorted(on))}: lower "
                               f"max_memory for those devices (or free memory) and run again. ({e})") from None
        raise
    handle = DispatchedModel(module, device_map, main, offload_dir, original, own_forwards, store, parts)
    handle.disk_bytes = disk_bytes
    handle.ties = ties
    if store is not None:
        handle.page_hooks = _let_go_of_read_pages(module, expanded, store, weights)
    return handle


def _let_go_of_read_pages(module: torch.nn.Module, expanded: dict, store: DiskStore, views: dict) -> list:
    """Forward hooks that let go of the store's pages a ``disk`` entry read, once its forward is
    done (and of all of them after the root's): accelerate hands each such weight to the forward
    as the view of the mapping itself (``.to("cpu")`` of a CPU tensor is the same tensor), so every
    page read stays mapped and counted in the RSS. Measured on 192 MiB of disk weights: after one
    step 192 MiB mapped before, one block (4 MiB) after (``tests/test_offload_disk.py``).
    Returns the hook handles (removed with the map)."""
    lo = store.tensor.data_ptr()
    ranges: dict[str, list] = {}
    for entry, d in expanded.items():
        if d != "disk":
            continue
        pre = f"{entry}." if entry else ""
        ranges[entry] = [(v.data_ptr() - lo, v.numel() * v.element_size()) for n, v in views.items()
                         if (n.startswith(pre) or n == entry) and v.device.type == "cpu"
                         and lo <= v.data_ptr() < lo + store.nbytes]

    def let_go(spans):
        def hook(_module, _args, _output):
            for off, nb in spans:
                store.drop(off, nb, evict=False)
        return hook

    handles = []
    subs = dict(module.named_modules())
    for entry, spans in ranges.items():
        if spans and entry in subs and subs[entry] is not module:
            handles.append(subs[entry].register_forward_hook(let_go(spans)))
    # weights read without their module's forward being called (a block reading a norm's weight)
    handles.append(module.register_forward_hook(let_go([(0, store.nbytes)])))
    return handles
