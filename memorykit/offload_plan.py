"""Planning for group offloading: which blocks stay resident under a budget, which stream.

Plain torch, no diffusers and no ComfyUI: everything here only reads a module's structure
and tensor sizes. :mod:`memorykit.offload` applies a plan.

Terms: a *block* is one element of a block list (by default, as in diffusers'
``block_level`` rule, an element of a direct ``ModuleList``/``Sequential`` child); the
*remainder* is every parameter/buffer that lies in no block (embeddings, final layers).
The *onload* device computes, the *offload* device (CPU RAM, or disk behind it) stores.
All sizes are bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from . import stored_parts

OFFLOAD_TYPES = ("block_level", "leaf_level")
OFFLOAD_TARGETS = ("cpu", "disk")
SCHEDULERS = ("memorykit", "diffusers")
ALIGN_BYTES = 512  # tensor alignment inside packed host buffers and the device ring (cudaMalloc gives 512)
PHASE_BYTES = 64  # CPU allocations are aligned to this; kernels choose their path by the address modulo it
RING_GROUPS = {"block_level": 2, "leaf_level": 4}  # event ring size, in largest groups (see ring_bytes)

# Layers diffusers streams one by one in leaf_level (diffusers.hooks._common._GO_LC_SUPPORTED_PYTORCH_LAYERS).
LEAF_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
              nn.Linear, nn.Embedding)

BlockLists = list[tuple[str, list[tuple[str, nn.Module]]]]


@dataclass(frozen=True)
class GroupOffloadOptions:
    """Options of group offloading, named as in ``diffusers.hooks.apply_group_offloading``.

    ``num_blocks_per_group``: blocks streamed together in block_level (a value ≥ the length of
    a block list puts the whole list in one group; diffusers forces 1 with ``use_stream``).
    ``offload_to``: ``"cpu"`` (weights wait in RAM) or ``"disk"`` (an unnamed file, see
    :mod:`memorykit.offload_store`; always streamed by the event ring).
    ``exclude_kwargs``: keyword arguments the hooks must not copy to the onload device.
    ``scheduler``: who streams from CPU RAM: ``"memorykit"`` (:mod:`memorykit.offload_stream`,
    event-ordered prefetch into a preallocated ring, any group size; ``record_stream`` has no
    effect there) or ``"diffusers"`` (its hooks as they are). Disk offload always uses the event ring.
    ``ring_groups``: event ring size in largest groups (0 = :data:`RING_GROUPS`; 1 = no
    overlap of copy and compute, each group replaces the previous one).
    ``page_lock``: page-lock the host copies on a GPU (False: the event ring copies from pageable
    packed buffers; diffusers' stream path, which pins copies of its own, is refused).
    ``keep_remainder``: leaf_level keeps the remainder resident as block_level does (text
    encoders read their input embedding's device before calling it).
    """

    offload_type: str = "block_level"
    num_blocks_per_group: int = 1
    use_stream: bool = False
    record_stream: bool = False
    low_cpu_mem_usage: bool = False
    offload_to: str = "cpu"
    exclude_kwargs: tuple[str, ...] = ()
    scheduler: str = "memorykit"
    ring_groups: int = 0
    page_lock: bool = True
    keep_remainder: bool = False

    def validate(self, onload_device: torch.device | None = None) -> None:
        """Raise ValueError naming the option to change when the combination is invalid."""
        if self.offload_type not in OFFLOAD_TYPES:
            raise ValueError(f"offload_type must be one of {OFFLOAD_TYPES}, got {self.offload_type!r}")
        if self.offload_to not in OFFLOAD_TARGETS:
            raise ValueError(f"offload_to must be one of {OFFLOAD_TARGETS}, got {self.offload_to!r}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}")
        if self.ring_groups < 0:
            raise ValueError(f"ring_groups must be ≥ 0 (0 = default), got {self.ring_groups}")
        if self.num_blocks_per_group < 1:
            raise ValueError(f"num_blocks_per_group must be ≥ 1, got {self.num_blocks_per_group}")
        if not self.page_lock and self.use_stream and not self.event_ring:
            raise ValueError("pinned memory is disabled, and the diffusers scheduler's use_stream pins host copies "
                             "of the weights: choose scheduler memorykit (it then copies from pageable memory) "
                             "or turn use_stream off")
        if self.record_stream and not self.use_stream:
            raise ValueError("record_stream needs use_stream: turn use_stream on or record_stream off")
        if self.use_stream and onload_device is not None and torch.device(onload_device).type == "cpu":
            raise ValueError("use_stream needs a GPU as onload device (CUDA streams); turn use_stream off "
                             "when computing on the CPU")

    @property
    def event_ring(self) -> bool:
        """True when MemoryKit's event-ring scheduler streams: the memorykit scheduler, and
        always for the disk target (one scheduler for RAM and disk, issue 24)."""
        return self.scheduler == "memorykit" or self.offload_to == "disk"

    @property
    def group_size(self) -> int:
        """Blocks per group as they will stream (diffusers forces 1 with streams; the ring does not)."""
        return 1 if self.use_stream and not self.event_ring else self.num_blocks_per_group


def tensor_bytes(tensors) -> int:
    """Total stored bytes of distinct tensors (each counted once, by identity; a quantized
    weight counts its stored parts, see :mod:`memorykit.stored_parts`)."""
    return sum(t.numel() * t.element_size() for t in stored_parts.expand(tensors))


def packed_layout(tensors, phases=None) -> tuple[list[int], int]:
    """Byte offsets of ``tensors`` packed one after another, each at a multiple of
    :data:`ALIGN_BYTES` (plus ``phases[i]`` bytes when given, see :func:`address_phase`), and the
    packed size in bytes (a multiple of :data:`ALIGN_BYTES` too)."""
    offsets, total = [], 0
    for i, t in enumerate(tensors):
        total = -(-total // ALIGN_BYTES) * ALIGN_BYTES + (phases[i] if phases else 0)
        offsets.append(total)
        total += t.numel() * t.element_size()
    return offsets, -(-total // ALIGN_BYTES) * ALIGN_BYTES


def address_phase(t: torch.Tensor) -> int:
    """``t``'s address modulo :data:`PHASE_BYTES`.

    CPU matrix kernels (oneDNN / MKL GEMM) choose their code path by the operands' addresses, and
    the paths round differently in the last bit: the same float32 weight at an address 8 bytes off
    gives a result one ulp apart. A weight ComfyUI loaded as a view of the checkpoint's memory sits
    wherever the file put it (not on a 64-byte boundary); a copy of it computed on the CPU must sit
    at the same phase for the output to stay bit-exact (GPU allocations are all aligned alike)."""
    return t.data_ptr() % PHASE_BYTES


def copy_at_phase(t: torch.Tensor, phase: int | None = None) -> torch.Tensor:
    """A copy of ``t`` in memory of its own whose address has ``phase`` (default: ``t``'s own,
    see :func:`address_phase`); a plain ``clone()`` for a non-contiguous tensor."""
    if not t.is_contiguous():
        return t.clone()
    phase = address_phase(t) if phase is None else phase
    nbytes = t.numel() * t.element_size()
    buf = torch.empty(nbytes + PHASE_BYTES, dtype=torch.uint8, device=t.device)
    o = (phase - buf.data_ptr()) % PHASE_BYTES
    out = buf[o:o + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def module_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of ``module`` (recursively), shared ones once, as the plain
    tensors that store them: a quantized weight is its parts (fp8 data, scales; see
    :mod:`memorykit.stored_parts`), so what is placed, streamed and counted is the stored bytes.
    Raises :class:`memorykit.stored_parts.UnsupportedWeight` for a weight of an unknown kind."""
    return stored_parts.expand(list(module.parameters()) + list(module.buffers()))


def block_parents(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``module`` and its *wrappers*, ``[(qualified_name, module), ...]`` (root ``""`` first):
    the modules whose list children hold the blocks.

    A wrapper is a child that is not a list, has an ``nn.ModuleList`` child, and either holds at
    least half of its parent's tensor bytes or its parent has no ``nn.ModuleList`` child of its
    own (Stable Audio's ``transformer``, whose ``layers`` are 99 % of the full-size weights);
    wrappers are looked for again inside each wrapper. Without them the block rule, which looks
    at direct children only, finds no block in such a model."""
    out = [("", module)]
    i = 0
    while i < len(out):
        name, parent = out[i]
        total = tensor_bytes(module_tensors(parent))
        flat = not any(isinstance(c, nn.ModuleList) for c in parent.children())
        for cn, child in parent.named_children():
            if (not isinstance(child, (nn.ModuleList, nn.Sequential))
                    and any(isinstance(c, nn.ModuleList) for c in child.children())
                    and (flat or 2 * tensor_bytes(module_tensors(child)) >= total)):
                out.append((f"{name}.{cn}" if name else cn, child))
        i += 1
    return out


def default_block_lists(module: nn.Module) -> BlockLists:
    """diffusers' block_level rule: the elements of every direct ``ModuleList``/``Sequential``
    child, as ``[(child_name, [(qualified_name, block), ...]), ...]`` in module order; the same
    inside each wrapper of :func:`block_parents` (``transformer.layers``). The elements of a
    nested ``ModuleList`` are blocks themselves (:func:`_list_blocks`)."""
    out = []
    for prefix, parent in block_parents(module):
        for name, child in parent.named_children():
            if isinstance(child, (nn.ModuleList, nn.Sequential)) and len(child) > 0:
                qn = f"{prefix}.{name}" if prefix else name
                out.append((qn, _list_blocks(qn, child)))
    return out


def block_lists(module: nn.Module, containers: tuple = ()) -> BlockLists:
    """The blocks of ``module`` — the one rule of the pack: Group Offload streams these blocks and
    Balanced Device Map never splits them (:func:`memorykit.device_map.block_classes`).
    :func:`default_block_lists`, with each element that is an instance of one of ``containers``
    (a container whose forward the model never calls as a whole, e.g. ComfyUI's
    ``TimestepEmbedSequential``) replaced by its elements."""
    out = []
    for name, items in default_block_lists(module):
        flat = []
        for qn, b in items:
            if containers and isinstance(b, containers):
                flat += [(f"{qn}.{j}", layer) for j, layer in enumerate(b)]
            else:
                flat.append((qn, b))
        out.append((name, flat))
    return out


def _list_blocks(qn: str, lst: nn.Module) -> list[tuple[str, nn.Module]]:
    """The elements of a list; an element that is itself an ``nn.ModuleList`` (Stable Cascade's
    ``down_blocks``, a list of lists) is replaced by its elements: a ModuleList has no forward,
    so only its elements ever run."""
    out = []
    for i, b in enumerate(lst):
        out += _list_blocks(f"{qn}.{i}", b) if isinstance(b, nn.ModuleList) else [(f"{qn}.{i}", b)]
    return out


def spread_order(n: int) -> list[int]:
    """``0..n-1`` in bit-reversal (van der Corput) order: 0, n/2, n/4, 3n/4, ...

    Taking the first k indices of this order gives k positions spread evenly over the
    sequence, starting at 0. Used to place resident blocks between streamed ones, so the
    copy of a streamed block overlaps the compute of resident ones (with ``use_stream``).
    """
    if n <= 1:
        return list(range(n))
    bits = (n - 1).bit_length()
    return sorted(range(n), key=lambda i: int(format(i, f"0{bits}b")[::-1], 2))


@dataclass
class OffloadPlan:
    """What stays on the onload device and what streams, with the resulting footprint.

    ``footprint_bytes`` = ``resident_bytes`` + ``buffer_bytes``: the onload-device memory the
    weights need during a forward. ``buffer_bytes`` estimates the streaming buffers:
    (1 + use_stream + record_stream) × the largest streamed group (the group computing, the
    one being prefetched, and with record_stream one whose memory the allocator cannot reuse
    yet). ``below_minimum`` is True when a budget was given that even full streaming exceeds.
    """

    offload_type: str
    resident_blocks: list[str] = field(default_factory=list)
    streamed_blocks: list[str] = field(default_factory=list)
    remainder_resident: bool = True
    remainder_bytes: int = 0
    resident_bytes: int = 0
    streamed_bytes: int = 0
    buffer_bytes: int = 0
    budget_bytes: int | None = None
    below_minimum: bool = False

    @property
    def footprint_bytes(self) -> int:
        return self.resident_bytes + self.buffer_bytes

    def as_dict(self) -> dict:
        return {"offload_type": self.offload_type, "resident_blocks": len(self.resident_blocks),
                "streamed_blocks": len(self.streamed_blocks), "remainder_resident": self.remainder_resident,
                "remainder_bytes": self.remainder_bytes, "resident_bytes": self.resident_bytes,
                "streamed_bytes": self.streamed_bytes, "buffer_bytes": self.buffer_bytes,
                "footprint_bytes": self.footprint_bytes, "budget_bytes": self.budget_bytes,
                "below_minimum": self.below_minimum}


def _largest_leaf_group(modules) -> int:
    """Bytes of the largest leaf_level group: one supported layer, or one module's direct tensors."""
    best = 0
    for root in modules:
        for m in root.modules():
            if isinstance(m, LEAF_TYPES):
                best = max(best, tensor_bytes(list(m.parameters()) + list(m.buffers())))
            else:
                best = max(best, tensor_bytes(list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))))
    return best


def plan_offload(module: nn.Module, options: GroupOffloadOptions, budget_bytes: int | None = None,
                 block_lists: BlockLists | None = None) -> OffloadPlan:
    """Decide which blocks stay resident on the onload device and which stream.

    ``budget_bytes`` None: stream every block. In leaf_level the remainder streams too (as in
    diffusers); in block_level it stays resident (diffusers would onload it for the whole
    forward anyway, see ``_apply_group_offloading_block_level``'s unmatched group).
    ``budget_bytes`` given: the onload-device bytes the weights may use, streaming buffers
    included. The remainder is kept first, then blocks in :func:`spread_order` while they fit;
    if not even the remainder and the buffers fit, everything streams (``below_minimum``).
    ``block_lists``: the blocks, ``[(list_name, [(name, module), ...]), ...]`` in execution
    order; default :func:`default_block_lists`. Blocks without tensors are left out.
    """
    options.validate()
    lists = default_block_lists(module) if block_lists is None else block_lists
    blocks = [(n, b) for _, bl in lists for n, b in bl]
    block_ids = {id(t) for _, b in blocks for t in module_tensors(b)}
    remainder_bytes = tensor_bytes(t for t in module_tensors(module) if id(t) not in block_ids)
    sizes = {n: tensor_bytes(module_tensors(b)) for n, b in blocks}
    plan = OffloadPlan(options.offload_type, remainder_bytes=remainder_bytes, budget_bytes=budget_bytes)
    ring = options.event_ring
    if ring:  # the event ring: ring_groups largest groups
        factor = options.ring_groups or RING_GROUPS[options.offload_type]
    else:  # diffusers: the group computing, the one prefetched, one held by record_stream
        factor = 1 + int(options.use_stream) + int(options.record_stream)
    gsizes = {n: packed_layout(module_tensors(b))[1] for n, b in blocks} if ring else sizes
    if options.offload_type == "block_level":  # any group ≤ the group_size largest blocks of its list
        buffer = factor * max((sum(sorted((gsizes[n] for n, _ in bl), reverse=True)[:options.group_size])
                               for _, bl in lists), default=0)
        if ring:
            buffer = min(buffer, sum(gsizes.values()))
    elif ring:
        leaves = [packed_layout(module_tensors(m))[1] for m in module.modules() if isinstance(m, LEAF_TYPES)]
        buffer = min(factor * max(leaves, default=0), sum(leaves))
    else:
        buffer = factor * _largest_leaf_group([module])

    streamable = [(n, b) for n, b in blocks if sizes[n] > 0]
    resident: set[str] = set()
    keep_remainder = options.offload_type == "block_level" or options.keep_remainder
    if budget_bytes is None:
        plan.remainder_resident = keep_remainder
    else:
        avail = budget_bytes - buffer - remainder_bytes
        if avail < 0:
            plan.below_minimum = True
            plan.remainder_resident = keep_remainder
        else:
            for i in spread_order(len(streamable)):
                n = streamable[i][0]
                if sizes[n] <= avail:
                    resident.add(n)
                    avail -= sizes[n]
    plan.resident_blocks = [n for n, _ in streamable if n in resident]
    plan.streamed_blocks = [n for n, _ in streamable if n not in resident]
    plan.streamed_bytes = sum(sizes[n] for n in plan.streamed_blocks)
    plan.resident_bytes = sum(sizes[n] for n in resident)
    if plan.remainder_resident:
        plan.resident_bytes += remainder_bytes
    else:
        plan.streamed_bytes += remainder_bytes
    if plan.streamed_blocks or not plan.remainder_resident:
        if options.offload_type == "block_level":
            plan.buffer_bytes = factor * _largest_window(lists, set(plan.streamed_blocks), gsizes,
                                                         options.group_size)
            if ring:  # a ring larger than every streamed group together would hold nothing more
                plan.buffer_bytes = min(plan.buffer_bytes, sum(gsizes[n] for n in plan.streamed_blocks))
        elif ring:  # leaves stream, other tensors (norm scales, modulation vectors) stay resident
            groups = group_tensors(stream_groups(module, plan, lists, options), module)
            plan.streamed_bytes = tensor_bytes(t for ts in groups for t in ts)
            plan.resident_bytes = tensor_bytes(module_tensors(module)) - plan.streamed_bytes
            sizes_g = [packed_layout(ts)[1] for ts in groups]
            plan.buffer_bytes = min(factor * max(sizes_g, default=0), sum(sizes_g))
        else:
            plan.buffer_bytes = buffer
    return plan


def stream_groups(module: nn.Module, plan: OffloadPlan, block_lists: BlockLists,
                  options: GroupOffloadOptions) -> list[list[nn.Module]]:
    """The module groups the event ring streams, in module order.

    block_level: ``group_size`` consecutive streamed blocks of one list per group.
    leaf_level: one group per :data:`LEAF_TYPES` layer with tensors inside a streamed block
    (and, when the remainder streams, outside every block); tensors of other modules stay
    resident.
    """
    streamed = set(plan.streamed_blocks)
    if options.offload_type == "block_level":
        out = []
        for _, bl in block_lists:
            s = [b for n, b in bl if n in streamed]
            out += [s[i:i + options.group_size] for i in range(0, len(s), options.group_size)]
        return out
    inside: dict[int, bool] = {}  # id(submodule) → is it in a streamed block
    for _, bl in block_lists:
        for n, b in bl:
            for m in b.modules():
                inside[id(m)] = n in streamed
    return [[m] for m in module.modules()
            if isinstance(m, LEAF_TYPES) and inside.get(id(m), not plan.remainder_resident)
            and next(iter(list(m.parameters()) + list(m.buffers())), None) is not None]


def group_tensors(groups: list[list[nn.Module]], root: nn.Module | None = None) -> list[list[torch.Tensor]]:
    """Each group's parameters and buffers, leaving out tensors that belong to more than one
    group or (given ``root``) also to a module of ``root`` outside every group: tied weights
    must stay resident, a group's copy would not be the other user's."""
    per = [module_tensors(nn.ModuleList(mods)) for mods in groups]
    count: dict[int, int] = {}
    for ts in per:
        for t in ts:
            count[id(t)] = count.get(id(t), 0) + 1
    if root is not None:
        inside = {id(m) for mods in groups for top in mods for m in top.modules()}
        for m in root.modules():
            if id(m) not in inside:
                for t in stored_parts.expand(list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))):
                    count[id(t)] = count.get(id(t), 0) + 2
    return [[t for t in ts if count[id(t)] == 1] for ts in per]


def _largest_window(lists: BlockLists, streamed: set[str], sizes: dict[str, int], n: int) -> int:
    """Largest group diffusers forms: ``n`` consecutive streamed blocks of one list."""
    best = 0
    for _, bl in lists:
        s = [sizes[name] for name, _ in bl if name in streamed]
        for i in range(0, len(s), n):
            best = max(best, sum(s[i:i + n]))
    return best
