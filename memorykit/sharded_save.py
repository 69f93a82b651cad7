"""Write a state dict as safetensors shards + index, the way huggingface_hub does, atomically.

Shard plan and file names come from ``huggingface_hub.split_torch_state_dict_into_shards``
(greedy in key order, ``max_shard_size`` in decimal units: "5GB" = 5·10⁹ bytes; a tensor
bigger than the limit gets a shard of its own). Each shard is a standard safetensors file
written by :func:`aligned_safetensors.save_file` (every tensor's data 16/64-byte aligned, so a
weight loaded from the memory-mapped shard computes the same bits as in memory) and the index as ``{"metadata": {"total_size": N, ...},
"weight_map": {tensor: file}}`` -- the recipe huggingface_hub documents for
``split_torch_state_dict_into_shards``. ``save_torch_state_dict`` itself is not called
because it has no per-shard hook (the progress bar counts shards; an interrupt between shards
must stop the write) and because it drops all but one name of tensors sharing memory, which
ComfyUI's loaders do not re-tie: here such tensors are copied so every name is saved.

The shards are written into a hidden temporary folder next to the destination, which is
renamed into place at the end; on any error or interrupt the temporary folder is removed, so
a destination is either complete or untouched. An existing destination is refused unless
``overwrite=True``; then only what an earlier save wrote there (its index and the shards that
index names) is replaced, anything else in the folder is left as it is, and a folder holding
no such checkpoint is refused (:func:`previous_save`). An earlier save is recognised by the
marker file it writes (``safe_files.SAVE_MARKER``), never by file names. Free space, path
length and write permission are checked before the first byte is written. Knows nothing of ComfyUI.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from pathlib import Path

import torch

from . import leftovers, safe_files
from .sharded import Progress
from .units import size_text
from .validation import NAME_MAX

# Same units as huggingface_hub.serialization._base.SIZE_UNITS (decimal, as HF writes them).
SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}
DEFAULT_PATTERN = "model{suffix}.safetensors"
MAX_SIZE = 10**18  # 1 EB: far beyond any disk, still exact in int and float


def parse_size(size: str | int) -> int:
    """``"5GB"`` → 5 000 000 000 bytes, parsed as ``huggingface_hub``'s ``parse_size_to_int``
    does (units TB/GB/MB/KB, case-insensitive, powers of 10, decimals allowed: ``"1.5GB"``).
    Ints pass through. Raises ValueError (naming the text) for other units, unparsable numbers
    or a size ≤ 0."""
    if isinstance(size, int):
        value = size
    else:
        text = str(size).strip()
        if len(text) > 64:
            raise ValueError(f"max_shard_size is {len(text):,} characters long; at most 64 are read: give a size "
                             "such as '5GB'")
        unit = text[-2:].upper()
        if unit not in SIZE_UNITS:
            raise ValueError(f"max_shard_size {size!r}: unit must be one of TB, GB, MB, KB (e.g. '5GB')")
        try:
            number = float(text[:-2].strip())
        except ValueError as e:
            raise ValueError(f"max_shard_size {size!r}: cannot read the number before the unit") from e
        if not math.isfinite(number) or number * SIZE_UNITS[unit] > MAX_SIZE:
            raise ValueError(f"max_shard_size {size!r} is not a usable size: give a finite size up to "
                             f"{MAX_SIZE // 10**12} TB, e.g. '5GB'")
        value = int(number * SIZE_UNITS[unit])
    if value <= 0:
        raise ValueError(f"max_shard_size {size!r} must be larger than 0 bytes")
    return value


def previous_save(folder: str | os.PathLike, filename_pattern: str = DEFAULT_PATTERN) -> list[str]:
    """The files an earlier :func:`save_sharded` wrote into ``folder``: what ``overwrite`` may
    replace, in the order to move them aside (indexes first, the marker last).

    An earlier save is recognised by the marker file it wrote (``safe_files.SAVE_MARKER``,
    listing its files), never by file names: a huggingface_hub / transformers checkpoint
    (``model-00001-of-00002.safetensors`` + ``model.safetensors.index.json``) looks exactly
    like a save. Raises FileExistsError, naming what the folder holds and what to do, when
    ``folder`` is not a folder or holds no valid marker -- also a folder saved by a version of
    the pack before the marker existed (delete or move it by hand, then save again).
    ``filename_pattern`` is accepted for compatibility; the marker decides.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileExistsError(f"{folder} exists and is not a folder; refusing to replace it: choose another name")
    entries = sorted(e.name + ("/" if e.is_dir() else "") for e in folder.iterdir())
    shown = ", ".join(entries[:8]) + (f" and {len(entries) - 8} more" if len(entries) > 8 else "")
    files = safe_files.read_marker(folder)
    if files is None:
        raise FileExistsError(
            f"{folder} is not a sharded checkpoint written by Save Sharded (no valid {safe_files.SAVE_MARKER} marker; "
            f"it holds: {shown or 'nothing'}); overwrite replaces only a checkpoint Save Sharded wrote and never "
            "deletes other files: choose another name, or move those files away. (A folder saved by an earlier "
            "MemoryKit version, before the marker existed, has none either: delete or move it yourself, then save "
            "again.)")
    changed = safe_files.changed_since_marker(folder, files)
    if changed:
        listed = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
        raise FileExistsError(
            f"{folder}: {listed} {'is' if len(changed) == 1 else 'are'} not the file{'s'[:len(changed) > 1]} Save "
            f"Sharded wrote there (size or modification time differs from its {safe_files.SAVE_MARKER} marker: "
            "replaced, rewritten or copied since); overwrite never replaces a file the pack did not write: choose "
            "another name, or move those files away.")
    present = [n for n in files if (folder / n).is_file() and not (folder / n).is_symlink()]
    present.sort(key=lambda n: not n.endswith(".index.json"))  # indexes first: never an index naming missing shards
    return present + [safe_files.SAVE_MARKER]




def partial_folder(folder: Path) -> Path:
    """A new hidden sibling ``.<name>.partial-<8 hex>`` of ``folder`` for an unfinished save
    (``<name>`` shortened when needed so that the name and its ``-old`` twin fit NAME_MAX)."""
    tag = f".partial-{uuid.uuid4().hex[:8]}"
    room = NAME_MAX - len(("." + tag + "-old").encode())
    name = folder.name.encode()[:room].decode("utf-8", "ignore")
    return folder.parent / f".{name}{tag}"


def _own_storage(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor contiguous and alone in its storage, so the shard plan's sizes (storage
    sizes) equal the bytes written and no tensor shares memory with another (safetensors
    refuses shared tensors). Copies only the tensors that need it."""
    out, seen = {}, set()
    for k, t in sd.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"state dict entry {k!r} is a {type(t).__name__}, not a tensor; pass it as metadata")
        t = t.detach()
        st = t.untyped_storage()
        sid = (t.device, st.data_ptr())
        shared = t.numel() > 0 and sid in seen
        if shared or not t.is_contiguous() or st.nbytes() != t.nbytes or t.storage_offset() != 0:
            t = t.clone(memory_format=torch.contiguous_format)
        if t.numel() > 0:
            seen.add((t.device, t.untyped_storage().data_ptr()))
        out[k] = t
    return out


def save_sharded(state_dict: dict[str, torch.Tensor], folder: str | os.PathLike, *,
                 max_shard_size: str | int = "5GB", filename_pattern: str = DEFAULT_PATTERN,
                 metadata: dict[str, str] | None = None, overwrite: bool = False,
                 progress: Progress | None = None) -> dict:
    """Write ``state_dict`` into ``folder`` as shards + index; returns a summary dict.

    Files: ``filename_pattern`` with ``{suffix}`` = ``-00001-of-0000N`` (huggingface_hub's
    names, e.g. ``model-00001-of-00003.safetensors``) and the index
    ``model.safetensors.index.json``. An index is written even when everything fits in one
    shard, so the folder is always a sharded checkpoint. ``metadata`` (str → str) goes into
    every shard's header and the index's ``metadata``. Tensors may live on any device; each is
    copied to CPU only while its shard is written (peak extra host memory ≈ one shard).
    ``progress(done, total)`` is called after each shard.

    Returns ``{"folder", "index", "files", "shards", "tensors", "total_bytes"}``. Raises
    ValueError for a bad ``max_shard_size``, a non-tensor entry, an empty state dict, a
    ``filename_pattern`` without ``{suffix}`` or not ending in ``.safetensors``, and
    FileExistsError when ``folder`` exists and ``overwrite`` is False, or with ``overwrite``
    when it holds no earlier save (see :func:`previous_save`) or a file the new save would write;
    before any write (:func:`safe_files.check_destination`) ValueError for a path that is too
    long or runs through a file, PermissionError for a read-only folder, OSError(ENOSPC) when
    the disk has not enough free space for the whole save. The finished folder holds the
    marker ``safe_files.SAVE_MARKER`` listing its files (what a later overwrite may replace).
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    from .aligned_safetensors import save_file

    folder = shown = Path(folder)
    limit = parse_size(max_shard_size)
    if "{suffix}" not in filename_pattern or not filename_pattern.endswith(".safetensors"):
        raise ValueError(f"filename_pattern {filename_pattern!r} must contain '{{suffix}}' and end in '.safetensors'")
    if not state_dict:
        raise ValueError("nothing to save: the state dict is empty")
    safe_files.check_destination(folder, 0, "name")  # path length, a file in the way, permission
    if folder.is_symlink() and folder.is_dir():
        # a link to a folder elsewhere (often another disk): save beside the folder it points to, so
        # every rename stays on one file system; the link itself is left as it is
        folder = Path(os.path.realpath(folder))
    if folder.exists() and not overwrite:
        raise FileExistsError(f"{folder} already exists; choose another name or enable overwrite to replace it")
    old_files = previous_save(folder, filename_pattern) if folder.exists() else None
    metadata = {str(k): str(v) for k, v in (metadata or {}).items()}
    sd = _own_storage(state_dict)
    split = split_torch_state_dict_into_shards(sd, filename_pattern=filename_pattern, max_shard_size=limit)
    if split.is_sharded:
        file_to_tensors = {f: list(v) for f, v in split.filename_to_tensors.items()}
        tensor_to_filename = dict(split.tensor_to_filename)
    else:  # one shard: still name it like a shard so that the index makes sense
        only = filename_pattern.format(suffix="-00001-of-00001")
        file_to_tensors = {only: [k for v in split.filename_to_tensors.values() for k in v]}
        tensor_to_filename = {k: only for k in file_to_tensors[only]}
    files = list(file_to_tensors)
    index_name = filename_pattern.format(suffix="") + ".index.json"
    if old_files is not None:
        clash = [f for f in files if (folder / f).exists() and f not in old_files]
        if clash:
            raise FileExistsError(f"{folder} holds {clash[0]!r}, which the new save would write but its index does "
                                  "not name; move it away or choose another name")

    total = int(split.metadata.get("total_size", sum(t.nbytes for t in sd.values())))
    safe_files.check_destination(folder, total, "name")  # free space for the whole save
    tmp = partial_folder(folder)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise type(e)(e.errno, f"name: cannot create {folder.name!r} in {folder.parent}: {e.strerror} (is the folder "
                      "read-only, or on a read-only disk?): choose another place or make it writable") from None
    try:
        leftovers.track(tmp)  # removed at the next start if this process is killed
        for i, fname in enumerate(files):
            shard = {k: sd[k].to("cpu").contiguous() for k in file_to_tensors[fname]}
            _write(folder, fname, save_file, shard, str(tmp / fname), metadata={"format": "pt", **metadata})
            del shard
            if progress is not None:
                progress(i + 1, len(files))
        index = {"metadata": {**split.metadata, **metadata}, "weight_map": tensor_to_filename}
        _write(folder, index_name, (tmp / index_name).write_text, json.dumps(index, indent=2))
        _write(folder, safe_files.SAVE_MARKER, safe_files.write_marker, tmp, files + [index_name])
        if old_files is None:
            _new_folder(tmp, folder)
        else:
            _replace_files(tmp, folder, old_files, files + [index_name, safe_files.SAVE_MARKER])
    except BaseException:
        leftovers.remove_folder(tmp)
        raise
    return {"folder": str(shown), "index": str(shown / index_name), "files": files, "shards": len(files),
            "tensors": len(tensor_to_filename), "total_bytes": total}


def _write(folder: Path, fname: str, write, *args, **kwargs) -> None:
    """``write(*args, **kwargs)`` (writing ``fname`` for ``folder``); an OSError or
    SafetensorError (a full disk, an I/O error) becomes an OSError naming the file and the
    destination."""
    from safetensors import SafetensorError
    try:
        write(*args, **kwargs)
    except (OSError, SafetensorError) as e:
        free = shutil.disk_usage(folder.parent).free if folder.parent.exists() else 0
        msg = (f"could not write {fname} for {folder}: {e} ({size_text(free)} free on that disk; nothing was "
               "kept): free some space or save elsewhere")
        errno_ = getattr(e, "errno", None)
        raise (OSError(errno_, msg) if errno_ else OSError(msg)) from e


def _new_folder(tmp: Path, folder: Path) -> None:
    leftovers.forget(tmp, drop_marker=True)  # the finished folder is the user's, not a leftover
    try:
        os.rename(tmp, folder)
    except OSError as e:  # appeared meanwhile
        leftovers.track(tmp)
        raise FileExistsError(f"{folder} could not be created: {e}") from e


def _replace_files(tmp: Path, folder: Path, old_files: list[str], new_files: list[str]) -> None:
    """Swap an earlier save's files in ``folder`` for the finished ones in ``tmp``: the old
    index and shards are moved aside (into ``tmp``'s sibling), the new shards moved in, the
    new index last; on failure the old files are put back. Other entries are never touched.
    The aside folder is deliberately not tracked by :mod:`leftovers`: after a kill in the
    middle of the swap it holds the only copy of the old model."""
    aside = tmp.parent / f"{tmp.name}-old"
    aside.mkdir()
    moved: list[str] = []
    placed: list[str] = []
    try:
        for name in old_files:  # the index first: the folder never shows an index naming missing shards
            os.rename(folder / name, aside / name)
            moved.append(name)
        for name in new_files:  # index last
            os.rename(tmp / name, folder / name)
            placed.append(name)
    except BaseException:
        for name in placed:
            os.rename(folder / name, tmp / name)
        for name in reversed(moved):
            os.rename(aside / name, folder / name)
        shutil.rmtree(aside, ignore_errors=True)
        raise
    shutil.rmtree(aside, ignore_errors=True)
    leftovers.remove_folder(tmp)
