"""Write a state dict as safetensors shards + index, the way huggingface_hub does, atomically.

Shard plan and file names come from ``huggingface_hub.split_torch_state_dict_into_shards``
(greedy in key order, ``max_shard_size`` in decimal units: "5GB" = 5·10⁹ bytes; a tensor
bigger than the limit gets a shard of its own). Each shard is written with
``safetensors.torch.save_file`` and the index as ``{"metadata": {"total_size": N, ...},
"weight_map": {tensor: file}}`` -- the recipe huggingface_hub documents for
``split_torch_state_dict_into_shards``. ``save_torch_state_dict`` itself is not called
because it has no per-shard hook (the progress bar counts shards; an interrupt between shards
must stop the write) and because it drops all but one name of tensors sharing memory, which
ComfyUI's loaders do not re-tie: here such tensors are copied so every name is saved.

The shards are written into a hidden temporary folder next to the destination, which is
renamed into place at the end; on any error or interrupt the temporary folder is removed, so
a destination is either complete or untouched. An existing destination is refused unless
``overwrite=True``. Knows nothing of ComfyUI.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch

from .sharded import Progress

# Same units as huggingface_hub.serialization._base.SIZE_UNITS (decimal, as HF writes them).
SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}
DEFAULT_PATTERN = "model{suffix}.safetensors"


def parse_size(size: str | int) -> int:
    """``"5GB"`` → 5 000 000 000 bytes, parsed as ``huggingface_hub``'s ``parse_size_to_int``
    does (units TB/GB/MB/KB, case-insensitive, powers of 10, decimals allowed: ``"1.5GB"``).
    Ints pass through. Raises ValueError (naming the text) for other units, unparsable numbers
    or a size ≤ 0."""
    if isinstance(size, int):
        value = size
    else:
        text = str(size).strip()
        unit = text[-2:].upper()
        if unit not in SIZE_UNITS:
            raise ValueError(f"max_shard_size {size!r}: unit must be one of TB, GB, MB, KB (e.g. '5GB')")
        try:
            value = int(float(text[:-2].strip()) * SIZE_UNITS[unit])
        except ValueError as e:
            raise ValueError(f"max_shard_size {size!r}: cannot read the number before the unit") from e
    if value <= 0:
        raise ValueError(f"max_shard_size {size!r} must be larger than 0 bytes")
    return value


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
    FileExistsError when ``folder`` exists and ``overwrite`` is False.
    """
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    folder = Path(folder)
    limit = parse_size(max_shard_size)
    if "{suffix}" not in filename_pattern or not filename_pattern.endswith(".safetensors"):
        raise ValueError(f"filename_pattern {filename_pattern!r} must contain '{{suffix}}' and end in '.safetensors'")
    if not state_dict:
        raise ValueError("nothing to save: the state dict is empty")
    if folder.exists() and not overwrite:
        raise FileExistsError(f"{folder} already exists; choose another name or enable overwrite to replace it")
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"{folder} exists and is not a folder; refusing to replace it")
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

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        for i, fname in enumerate(files):
            shard = {k: sd[k].to("cpu").contiguous() for k in file_to_tensors[fname]}
            save_file(shard, str(tmp / fname), metadata={"format": "pt", **metadata})
            del shard
            if progress is not None:
                progress(i + 1, len(files))
        index = {"metadata": {**split.metadata, **metadata}, "weight_map": tensor_to_filename}
        (tmp / index_name).write_text(json.dumps(index, indent=2))
        _replace_folder(tmp, folder, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    total = int(split.metadata.get("total_size", sum(t.nbytes for t in sd.values())))
    return {"folder": str(folder), "index": str(folder / index_name), "files": files, "shards": len(files),
            "tensors": len(tensor_to_filename), "total_bytes": total}


def _replace_folder(tmp: Path, folder: Path, overwrite: bool) -> None:
    """Move the finished ``tmp`` to ``folder``; an existing ``folder`` (overwrite) is moved
    aside first and deleted only after the new one is in place."""
    if not folder.exists():
        try:
            os.rename(tmp, folder)
        except OSError as e:  # appeared meanwhile
            raise FileExistsError(f"{folder} could not be created: {e}") from e
        return
    if not overwrite:
        raise FileExistsError(f"{folder} already exists; enable overwrite to replace it")
    old = folder.parent / f".{folder.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(folder, old)
    try:
        os.rename(tmp, folder)
    except BaseException:
        os.rename(old, folder)
        raise
    shutil.rmtree(old, ignore_errors=True)

