"""Device maps for one model: parse ``max_memory``, plan with accelerate, validate custom maps.

Plain torch + accelerate; knows nothing of ComfyUI and works on any ``torch.nn.Module`` (its
weights may be on the meta device: planning only reads sizes). Dispatching a map onto a model
and undoing it is in :mod:`memorykit.device_dispatch`.

Terms (accelerate's big-modeling vocabulary):

- *device map*: ``{module or tensor name: device}`` for the names inside the model, as
  ``infer_auto_device_map`` returns it and ``dispatch_model`` takes it. A device is a GPU index
  (``int``: 0 for ``cuda:0``), ``"cpu"`` or ``"disk"`` (``"mps"`` on Apple). ``cpu`` and
  ``disk`` entries are *offloaded*: their weights live in RAM / in files and are copied to the
  main execution device for each forward.
- *max_memory*: the budget per device in bytes that planning may fill.
- *block*: a module that must never be split across devices (accelerate's
  ``no_split_module_classes``); here the repeated layers of a diffusion model (transformer
  blocks, UNet layers), by the same rule Group Offload streams them
  (:func:`memorykit.offload_plan.block_lists`).
- *strategy*: ``balanced`` (same share per GPU), ``balanced_low_0`` (GPU 0 kept as light as
  possible), ``sequential`` (fill GPU 0, then GPU 1, ...), as diffusers' ``device_map``
  strings; the planning steps are those of diffusers' ``_determine_device_map`` (diffusers
  0.42, ``models/model_loading_utils.py``).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Iterable, Union

import torch
from accelerate.utils import (compute_module_sizes, convert_file_size_to_int, get_balanced_memory,
                              get_max_memory, infer_auto_device_map)

from .offload_plan import block_lists
from .units import size_text
from .validation import bounded_text

MAX_MEMORY_CHARS = 4096  # max_memory: a few entries, one per device
MAX_CUSTOM_MAP_CHARS = 2**20  # custom_device_map: one entry per module of the largest models fits

Device = Union[int, str]
STRATEGIES = ("balanced", "balanced_low_0", "sequential")
OFFLOAD_DEVICES = ("cpu", "disk")
GIB = float(1 << 30)
MAX_BUDGET_BYTES = 1 << 60  # 1 EiB: no device has more; larger sizes are typos

_GPU_PATTERN = r"^(?:cuda:)?(\d+)$"  # re's module-level functions cache the compiled pattern


def parse_device(value) -> Device:
    """A device as accelerate's maps write it: ``"cuda:1"``/``"1"``/``1`` → ``1``; ``"cpu"``,
    ``"disk"``, ``"mps"`` unchanged; ``"cuda"`` → ``0``.

    Raises ValueError naming the value when it is not one of these.
    """
    if isinstance(value, bool):
        raise ValueError(f"unknown device {value!r}: use cuda:N, cpu or disk")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"unknown device {value!r}: a GPU index must be 0 or more")
        return value
    if isinstance(value, torch.device):
        value = str(value)
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("cpu", "disk", "mps"):
            return v
        if v == "cuda":
            return 0
        m = re.match(_GPU_PATTERN, v)
        if m:
            return int(m.group(1))
    raise ValueError(f"unknown device {value!r}: use cuda:N (e.g. cuda:0), cpu or disk")


def format_bytes(n: float) -> str:
    """``23.8 GiB`` / ``512 MiB`` / ``12.0 KiB``: GiB from 1 GiB up (3 significant digits), else
    :func:`memorykit.units.size_text`'s MiB, KiB or bytes."""
    return f"{n / GIB:.3g} GiB" if n >= GIB else size_text(n)


def device_name(device: Device) -> str:
    """Display name of a map device: ``0`` → ``"cuda:0"``; strings unchanged."""
    return f"cuda:{device}" if isinstance(device, int) else str(device)


@dataclass(frozen=True)
class MaxMemory:
    """Parsed ``max_memory`` text.

    ``budgets``: bytes per device in accelerate's order (GPUs by index, then mps, cpu), or None
    for ``auto`` (accelerate measures free memory on every device). ``allow_disk``: whether
    planning may put modules on ``disk`` (``auto``, or a ``disk`` entry in the text).
    """

    budgets: dict | None
    allow_disk: bool

    def describe(self) -> str:
        if self.budgets is None:
            return "auto"
        parts = [f"{device_name(d)}={format_bytes(b).replace(' ', '')}" for d, b in self.budgets.items()]
        return ", ".join(parts + (["disk"] if self.allow_disk else []))


def parse_max_memory(text: str) -> MaxMemory:
    """Parse ``"cuda:0=20GiB, cuda:1=22GiB, cpu=64GiB, disk"`` or ``"auto"``.

    Entries are separated by commas, semicolons or new lines; each is ``device=size`` with the
    size as accelerate's ``convert_file_size_to_int`` reads it (``GiB``/``MiB``/``KiB`` are
    powers of 2, ``GB``/``MB``/``KB`` powers of 10, a lower-case ``b`` means bits, a bare
    number is bytes). ``disk`` takes no size (a value, if given, is ignored: disk is unbounded
    in accelerate). Raises ValueError naming the bad entry: unknown device, malformed or
    infinite size, a size over 1 EiB, a device given twice, or no entry.
    """
    text = bounded_text(text, "max_memory", MAX_MEMORY_CHARS, "give one entry per device, e.g. cuda:0=20GiB, cpu=64GiB").strip()
    if text.lower() in ("", "auto"):
        return MaxMemory(None, True)
    budgets: dict = {}
    allow_disk = False
    for raw in re.split(r"[,;\n]", text):
        entry = raw.strip()
        if not entry:
            continue
        name, sep, size = entry.partition("=")
        device = parse_device(name)
        if device == "disk":
            if allow_disk:
                raise ValueError(f"max_memory names disk twice ({entry!r})")
            allow_disk = True
            continue
        if not sep or not size.strip():
            raise ValueError(f"max_memory entry {entry!r} has no size: write {name.strip()}=20GiB")
        size = size.strip().replace(" ", "")
        try:
            n = convert_file_size_to_int(int(size) if size.isdigit() else size)
        except (ValueError, OverflowError):  # OverflowError: a float size that is infinite (1e400GiB)
            n = -1
        if n <= 0:
            raise ValueError(f"max_memory entry {entry!r}: size {size!r} is not valid; use e.g. 20GiB, 512MiB, "
                             "24GB or a number of bytes")
        if n > MAX_BUDGET_BYTES:
            raise ValueError(f"max_memory entry {entry!r}: size {size!r} is too large (over 1 EiB); use the "
                             "memory the device has, e.g. 64GiB")
        if device in budgets:
            raise ValueError(f"max_memory names {device_name(device)} twice ({entry!r})")
        budgets[device] = n
    if not budgets and not allow_disk:
        raise ValueError(f"max_memory {text!r} has no entry: write e.g. cuda:0=20GiB, cpu=64GiB or auto")
    gpus = sorted(d for d in budgets if isinstance(d, int))
    ordered = {d: budgets[d] for d in gpus + [k for k in ("mps", "cpu") if k in budgets]}
    return MaxMemory(ordered, allow_disk)


def model_blocks(module: torch.nn.Module, containers: tuple = ()) -> list[str]:
    """Qualified names of the blocks of ``module`` by the pack's one block rule
    (:func:`memorykit.offload_plan.block_lists`, which Group Offload streams), in module order."""
    return [qn for _, items in block_lists(module, containers) for qn, _ in items]


def block_classes(module: torch.nn.Module, blocks: Iterable[str] | None = None) -> list[str]:
    """accelerate's ``no_split_module_classes`` for ``module``: the class names of its blocks
    (``blocks``: qualified names, default :func:`model_blocks`) that have submodules, in order of
    first appearance (a block without submodules, e.g. a Linear element of a ``Sequential``, is
    never split anyway)."""
    mods = dict(module.named_modules())
    out: list[str] = []
    for name in (model_blocks(module) if blocks is None else blocks):
        m = mods[name]
        if next(m.children(), None) is not None and type(m).__name__ not in out:
            out.append(type(m).__name__)
    return out


def split_blocks(device_map: dict, blocks: Iterable[str]) -> list[str]:
    """Blocks that ``device_map`` splits (an entry lies strictly inside the block); [] when none."""
    return sorted({b for b in blocks for k in device_map if k.startswith(b + ".")})


def plan_device_map(module: torch.nn.Module, max_memory: dict | None, strategy: str = "balanced",
                    no_split_module_classes: Iterable[str] = (), allow_disk: bool = True,
                    blocks: Iterable[str] | None = None) -> tuple[dict, dict]:
    """Plan a device map for ``module`` with accelerate, as diffusers does for ``device_map=strategy``.

    ``max_memory``: bytes (or accelerate size strings) per device, GPU indices as ints; None
    measures the free memory of every device (accelerate's ``get_max_memory``; balanced
    strategies then keep 10 % of a single GPU free). GPUs this machine does not have are
    planned for all the same (accelerate only warns). Sizes are those of the tensors as
    stored (``dtype=None``). Returns ``(device_map, budgets)``: the map (in module order) and the
    per-device budgets the map was fitted into (after balancing).

    ``blocks``: the blocks' qualified names (default :func:`model_blocks`); what lies outside every
    block stays on the main device
    (:func:`resident_remainder`): accelerate's map is recomputed with those bytes reserved there.
    The result is checked against ``max_memory`` (:func:`check_budgets`).

    Raises ValueError for an unknown strategy, when ``allow_disk`` is False but the budgets
    cannot hold the model (the message names what did not fit and the largest block), and when
    a device of ``max_memory`` would hold more than its budget (naming the device and the shortfall).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    no_split = list(no_split_module_classes)
    blocks = model_blocks(module) if blocks is None else list(blocks)
    budgets = None if max_memory is None else dict(max_memory)
    if strategy == "sequential":
        budgets = get_max_memory(budgets)
    else:
        budgets = get_balanced_memory(module, max_memory=budgets, no_split_module_classes=no_split,
                                      low_zero=strategy == "balanced_low_0")
    planned, reserve = dict(budgets), 0
    for _ in range(4):  # each round reserves on the main device what the previous one offloaded
        device_map = in_module_order(module, infer_auto_device_map(module, max_memory=dict(planned),
                                                                   no_split_module_classes=no_split))
        device_map, moved = resident_remainder(module, device_map, blocks)
        main = main_device(device_map)
        if not moved or main not in budgets:
            break
        reserve += moved
        planned[main] = max(0, budgets[main] - reserve)
    if not allow_disk and "disk" in device_map.values():
        raise ValueError(_too_small_message(module, device_map, max_memory or budgets, blocks))
    if max_memory is not None:
        check_budgets(module, device_map, max_memory, blocks)
    return device_map, budgets


def _holds_block(name: str, blocks: list[str]) -> bool:
    return name == "" or any(b.startswith(name + ".") for b in blocks)


def _in_block(name: str, blocks: list[str]) -> bool:
    return any(name == b or name.startswith(b + ".") for b in blocks)


def resident_remainder(module: torch.nn.Module, device_map: dict, blocks: Iterable[str]) -> tuple[dict, int]:
    """``device_map`` with everything outside every block kept on the main device; returns
    ``(map, bytes moved)``.

    The one rule for tensors outside the blocks (root-level tokens such as NextDiT's
    ``x_pad_token``, embeddings used by indexing, modules a forward moves with ``.to()``):
    they may be read outside their own module's forward, where accelerate's offload hooks never
    run, so they must never be offloaded (``disk``, or ``cpu`` under a GPU main device: both
    leave a meta placeholder). Inside a block, weights read outside a submodule's forward are
    covered by preloading the whole block (``dispatch_model``'s ``preload_module_classes``, see
    :func:`memorykit.device_dispatch.dispatch_device_map`). Group Offload keeps its remainder
    resident by the same rule (:mod:`memorykit.offload_plan`). An offloaded entry that holds
    blocks and other tensors is split into its children and direct tensors.
    """
    blocks = list(blocks)
    main = main_device(device_map)
    offloaded = {"disk"} | ({"cpu"} if main not in OFFLOAD_DEVICES else set())
    modules = dict(module.named_modules())
    sizes = compute_module_sizes(module)
    out: dict = {}
    moved = 0

    def place(name: str, device) -> None:
        nonlocal moved
        if device not in offloaded or _in_block(name, blocks):
            out[name] = device
        elif not _holds_block(name, blocks) or name not in modules:
            out[name] = main
            moved += int(sizes.get(name, 0))
        else:
            prefix = f"{name}." if name else ""
            m = modules[name]
            for n, _ in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False)):
                place(prefix + n, device)
            for n, c in m.named_children():
                if len(c.state_dict()) > 0:
                    place(prefix + n, device)

    for k, d in device_map.items():
        place(k, d)
    return in_module_order(module, out), moved


def check_budgets(module: torch.nn.Module, device_map: dict, max_memory: dict, blocks: Iterable[str] = ()) -> None:
    """Raise ValueError when ``device_map`` puts more bytes on a device than ``max_memory``
    allows (the message names the device, what the map needs there and the shortfall)."""
    per = bytes_per_device(module, device_map)
    blocks = list(blocks)
    for d, cap in max_memory.items():
        cap = convert_file_size_to_int(cap) if isinstance(cap, str) else int(cap)
        used = per.get(device_name(d), 0)
        if used > cap:
            sizes = compute_module_sizes(module)
            rest = sum(int(sizes.get(k, 0)) for k, v in device_map.items()
                       if v == d and not _in_block(k, blocks))
            why = (f" ({format_bytes(rest)} of it outside every block, which stays on the main device)"
                   if rest else "")
            raise ValueError(f"max_memory {device_name(d)}={format_bytes(cap).replace(' ', '')} is too small: the "
                             f"plan needs {format_bytes(used)} on {device_name(d)}{why}, "
                             f"{format_bytes(used - cap)} more. Raise {device_name(d)} to at least "
                             f"{format_bytes(used).replace(' ', '')}.")


def _too_small_message(module, device_map: dict, budgets: dict, blocks: list[str]) -> str:
    sizes = compute_module_sizes(module)
    spilled = [k for k, d in device_map.items() if d == "disk"]
    spilled_bytes = sum(sizes[k] for k in spilled)
    largest = max(blocks, key=lambda b: sizes[b], default=None)
    listed = ", ".join(f"{device_name(d)}={format_bytes(b).replace(' ', '')}" for d, b in budgets.items())
    msg = (f"max_memory ({listed}) is too small: {len(spilled)} module(s) ({format_bytes(spilled_bytes)}, "
           f"starting with {spilled[0]!r}) fit on no listed device.")
    if largest is not None:
        biggest_budget = max(budgets.values(), default=0)
        msg += f" The largest block, {largest!r}, needs {format_bytes(sizes[largest])}"
        msg += (" and no budget holds it." if sizes[largest] > biggest_budget else
                " (accelerate also keeps that much free on the first GPU and on cpu, for onloading).")
    return msg + " Raise a budget, add cpu=<size>, or add disk (weights then stream from files)."


def parse_custom_device_map(text: str) -> dict:
    """JSON text ``{"module name": "cuda:0" | 0 | "cpu" | "disk", ...}`` → dict with parsed devices
    (see :func:`parse_device`). Raises ValueError for invalid or too deeply nested JSON, a
    non-object, or a bad device."""
    bounded_text(text, "custom_device_map", MAX_CUSTOM_MAP_CHARS,
                 "map whole blocks (e.g. {\"double_blocks\": \"cuda:0\"}) instead of single layers")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"custom device map is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError("custom_device_map is nested too deeply to read: write one flat JSON object, module name "
                         '→ device, e.g. {"blocks.0": "cuda:0", "blocks.1": "cpu"}') from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError('custom device map must be a JSON object like {"double_blocks": "cuda:0", '
                         '"single_blocks": "cuda:1", ...}')
    out = {}
    for name, dev in raw.items():
        try:
            out[str(name)] = parse_device(dev)
        except ValueError as e:
            raise ValueError(f"custom device map entry {name!r}: {e}") from None
    return out


def validate_device_map(module: torch.nn.Module, device_map: dict) -> dict:
    """Check that ``device_map`` names only modules/tensors of ``module``, covers every tensor,
    and has no overlapping entries; return it in module order with parsed devices.

    Raises ValueError naming an unknown module (with close names), an uncovered module, or two
    overlapping entries.
    """
    dm = {k: parse_device(v) for k, v in device_map.items()}
    modules = dict(module.named_modules())
    tensors = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    for key in dm:
        if key != "" and key not in modules and key not in tensors:
            parent = key.rsplit(".", 1)[0] if "." in key else ""
            near = [n for n, _ in (modules[parent].named_children() if parent in modules else module.named_children())]
            where = f"in {parent!r} " if parent else ""
            hint = f"; {where}there are: {', '.join(near[:12])}" if near else ""
            raise ValueError(f"custom device map names {key!r}, which is not a module of the model{hint}")
    keys = sorted(dm, key=len)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            if a == "" or b.startswith(a + "."):
                raise ValueError(f"custom device map entries {a!r} and {b!r} overlap: keep one of them")
    uncovered = [t for t in tensors if not any(k == "" or t == k or t.startswith(k + ".") for k in dm)]
    if uncovered:
        tops = []
        for t in uncovered:
            parts = t.split(".")
            top = next((".".join(parts[:i]) for i in range(1, len(parts) + 1)
                        if not any(k.startswith(".".join(parts[:i]) + ".") for k in dm)), t)
            if top not in tops:
                tops.append(top)
        raise ValueError(f"custom device map leaves out {', '.join(repr(t) for t in tops[:8])}"
                         f"{' ...' if len(tops) > 8 else ''}: give every module a device")
    return in_module_order(module, dm)


def in_module_order(module: torch.nn.Module, device_map: dict) -> dict:
    """``device_map`` with its entries sorted as ``module.named_modules()`` (then tensors) lists them
    (accelerate lists merged entries last)."""
    names = [n for n, _ in module.named_modules()]
    names += [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    order: dict[str, int] = {}
    for i, n in enumerate(names):
        order.setdefault(n, i)
    return {k: device_map[k] for k in sorted(device_map, key=lambda k: order.get(k, -1))}


def main_device(device_map: dict) -> Device:
    """The main execution device of a map: the first GPU (or mps) in map order, else ``"cpu"``.

    The model's inputs are moved there, and ``cpu``/``disk`` entries are computed there.
    (accelerate's ``dispatch_model`` picks the first of a set, which is not ordered.)
    """
    return next((d for d in device_map.values() if d not in OFFLOAD_DEVICES), "cpu")


def bytes_per_device(module: torch.nn.Module, device_map: dict) -> dict[str, int]:
    """Bytes of weights (parameters + buffers, as stored) each device of ``device_map`` holds,
    keyed by display name (``cuda:0``, ``cpu``, ``disk``)."""
    sizes = compute_module_sizes(module)
    out: dict[str, int] = {}
    for k, d in device_map.items():
        out[device_name(d)] = out.get(device_name(d), 0) + int(sizes.get(k, 0))
    return out


def summarize_device_map(device_map: dict, module: torch.nn.Module | None = None) -> list[str]:
    """One line per run of consecutive entries on one device, numbered runs compressed:
    ``cuda:0: img_in, time_in, double_blocks.0-9 (10.2 GiB)`` (size only with ``module``)."""
    sizes = compute_module_sizes(module) if module is not None else None
    runs: list[tuple[Device, list[str]]] = []
    for k, d in device_map.items():
        if runs and runs[-1][0] == d:
            runs[-1][1].append(k)
        else:
            runs.append((d, [k]))
    lines = []
    for d, names in runs:
        text = ", ".join(_compress(names))
        if sizes is not None:
            text += f" ({format_bytes(sum(sizes.get(n, 0) for n in names))})"
        lines.append(f"{device_name(d)}: {text}")
    return lines


def _compress(names: list[str]) -> list[str]:
    """``a.0, a.1, a.2, b`` → ``a.0-2, b``; ``""`` → ``(whole model)``."""
    out: list[str] = []
    prev: tuple[str, int, int] | None = None
    for n in names:
        m = re.match(r"^(.*)\.(\d+)$", n)
        if m and prev and prev[0] == m.group(1) and prev[2] + 1 == int(m.group(2)):
            prev = (prev[0], prev[1], int(m.group(2)))
            out[-1] = f"{prev[0]}.{prev[1]}" + (f"-{prev[2]}" if prev[2] != prev[1] else "")
            continue
        prev = (m.group(1), int(m.group(2)), int(m.group(2))) if m else None
        out.append(n if n else "(whole model)")
    return out
