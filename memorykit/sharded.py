"""Sharded safetensors checkpoints: find an index, validate it completely, load the shards.

A sharded checkpoint is a folder of ``*.safetensors`` shards plus an index
``<name>.safetensors.index.json`` = ``{"metadata": {"total_size": N}, "weight_map": {tensor: file}}``
as written by huggingface_hub / transformers / diffusers (``model.safetensors.index.json``,
``diffusion_pytorch_model.safetensors.index.json``, ...).

Rules (each broken rule raises :class:`ShardedCheckpointError` naming the file and key):

- Everything is validated before any tensor is read (:func:`read_index`): the index parses,
  every shard named by it exists inside the folder and is a valid safetensors file, the index
  and the shard headers list exactly the same tensors, no tensor is stored twice, and
  ``metadata.total_size`` (when present) equals the bytes of the tensors. So a bad checkpoint
  loads nothing, never half a model.
- A shard name that leaves the folder (``../x``, an absolute path, a symlink pointing outside
  the folder's real path) is refused; the one exception is a Hugging Face cache snapshot
  (``models--org--name/snapshots/<rev>/``), whose files link into the same repository's
  ``blobs/`` folder.
- The index and the shards must be regular files (symlinks followed): a FIFO, a device such
  as ``/dev/zero`` or a dangling link is refused before any read (:mod:`safe_files`), and an
  index larger than ``MAX_INDEX_BYTES`` is refused before it is read. Shard names with control
  characters (NUL) or components over 255 bytes are refused with the index's name.
- Only ``.safetensors`` shards are read. Pickle files (``.bin``, ``.pt``, ``.pth``, ``.ckpt``,
  ``.pkl``) are never opened, let alone unpickled.
- Shards are read one at a time with ``safetensors.safe_open`` (memory-mapped): the returned
  tensors are views of the mapped files, the same as ``comfy.utils.load_torch_file`` returns
  for one file, so loading sharded costs no more anonymous memory than loading one file.

Knows nothing of ComfyUI; plain ``safetensors`` + ``torch``.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from . import safe_files
from .validation import NAME_MAX

INDEX_SUFFIX = ".safetensors.index.json"
SHARD_SUFFIX = ".safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# The file names transformers / diffusers give a model saved in one file (below max_shard_size): a
# folder holding one of them and no index (a Hugging Face repository's text_encoder/) is a
# checkpoint of one shard.
UNSHARDED_NAMES = ("model.safetensors", "diffusion_pytorch_model.safetensors")
MAX_INDEX_BYTES = 512 * 2**20  # an index of 10⁶ tensors is ~60 MB; refused above this before reading

Progress = Callable[[int, int], None]
"""``progress(done, total)``: called after each shard (``done`` shards of ``total`` finished)."""


class ShardedCheckpointError(ValueError):
    """A sharded checkpoint (folder, index or shard) is missing, malformed or unsafe."""


@dataclass(frozen=True)
class Shard:
    """One validated shard: ``path`` (resolved), ``name`` (as in the index), ``keys`` (tensor
    names, in file order), ``nbytes`` (bytes of tensor data), ``metadata`` (safetensors header
    metadata, ``{}`` when absent)."""

    path: Path
    name: str
    keys: tuple[str, ...]
    nbytes: int
    metadata: dict


@dataclass(frozen=True)
class ShardedIndex:
    """A validated sharded checkpoint (see :func:`read_index`).

    ``index_path``: the index file; ``folder``: its folder (real path); ``weight_map``: tensor
    name → shard name; ``shards``: in first-use order of the weight map; ``total_size``: the
    index's ``metadata.total_size`` or None when absent; ``nbytes``: bytes of all tensors.
    """

    index_path: Path
    folder: Path
    weight_map: dict
    shards: tuple[Shard, ...]
    total_size: int | None
    nbytes: int
    index_metadata: dict = field(default_factory=dict)

    @property
    def metadata(self) -> dict:
        """Header metadata entries every shard agrees on (``format`` excluded)."""
        common = dict(self.shards[0].metadata) if self.shards else {}
        for s in self.shards[1:]:
            common = {k: v for k, v in common.items() if s.metadata.get(k) == v}
        common.pop("format", None)
        return common


def _rel(path: Path, folder: Path) -> str:
    try:
        return str(path.relative_to(folder))
    except ValueError:
        return str(path)


def find_index(path: str | os.PathLike) -> Path:
    """The index file of a sharded checkpoint given as a folder or as the index file itself.

    A folder must hold exactly one ``*.safetensors.index.json``, or no index and one file named as
    transformers/diffusers name an unsharded save (:data:`UNSHARDED_NAMES`; returned itself). Raises
    :class:`ShardedCheckpointError` when ``path`` does not exist, is an empty folder, holds no
    index (with a specific message when it holds only pickle files such as
    ``pytorch_model.bin.index.json``), holds two or more indexes (choose one index file), or is
    a file that is not a ``.safetensors.index.json``. (Whether the index is a regular file is
    checked when it is read, :func:`read_index`.)
    """
    p = Path(path)
    if not os.path.lexists(p):
        raise ShardedCheckpointError(f"Sharded checkpoint not found: {p}")
    if not p.is_dir():
        if p.name.endswith(INDEX_SUFFIX):
            return p
        if p.name.lower().endswith(PICKLE_SUFFIXES) or p.name.lower().endswith(".bin.index.json"):
            raise ShardedCheckpointError(f"{p.name}: pickle checkpoints (.bin/.pt/.ckpt) are never unpickled by "
                                         "this loader; convert the model to .safetensors shards.")
        raise ShardedCheckpointError(f"{p}: not a sharded-checkpoint index (expected a file named "
                                     f"'*{INDEX_SUFFIX}' or the folder holding it).")
    entries = sorted(e.name for e in p.iterdir())
    if not entries:
        raise ShardedCheckpointError(f"Sharded checkpoint folder is empty: {p}")
    indexes = [e for e in entries if e.endswith(INDEX_SUFFIX)]
    if len(indexes) > 1:
        raise ShardedCheckpointError(f"Folder {p} holds {len(indexes)} indexes ({', '.join(indexes)}): it is ambiguous "
                                     "which shards to load; choose one index file instead of the folder.")
    if indexes:
        return p / indexes[0]
    single = [e for e in entries if e in UNSHARDED_NAMES]
    if len(single) == 1:
        return p / single[0]
    pickles = [e for e in entries if e.lower().endswith(PICKLE_SUFFIXES) or e.endswith(".bin.index.json")]
    if pickles:
        raise ShardedCheckpointError(f"Folder {p} holds only pickle checkpoint files ({', '.join(pickles[:3])}): they "
                                     "are never unpickled by this loader; convert the model to .safetensors shards.")
    raise ShardedCheckpointError(f"Folder {p} holds no '*{INDEX_SUFFIX}' index (files: {', '.join(entries[:5])}) "
                                 f"and no {' or '.join(UNSHARDED_NAMES)}. A single .safetensors file loads with "
                                 "ComfyUI's own loaders.")


def list_sharded(root: str | os.PathLike) -> list[str]:
    """Sharded checkpoints under ``root``, as paths relative to it with ``/`` separators.

    A folder holding exactly one index (or no index and one unsharded Hugging Face save,
    :data:`UNSHARDED_NAMES`) is listed as the folder; a folder holding several
    indexes (e.g. ``diffusion_pytorch_model.safetensors.index.json`` and its
    ``.fp16.safetensors.index.json`` variant) lists each index file. Symlinked folders are
    followed (as ComfyUI's own file lists do). Sorted; ``[]`` when ``root`` does not exist.
    """
    root = Path(root)
    out = []
    if not root.is_dir():
        return out
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:  # a symlink cycle, or a folder linked twice
            dirnames[:] = []
            continue
        seen.add(real)
        # Hidden folders skipped: Save Sharded's unfinished ".<name>.partial-*" folders among them.
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        indexes = sorted(f for f in filenames if f.endswith(INDEX_SUFFIX))
        rel = Path(dirpath).relative_to(root).as_posix()
        if len(indexes) == 1 and rel != ".":
            out.append(rel)
        elif not indexes and rel != "." and sum(f in UNSHARDED_NAMES for f in filenames) == 1:
            out.append(rel)  # an unsharded Hugging Face save: one shard, no index
        else:
            out.extend(f if rel == "." else f"{rel}/{f}" for f in indexes)
    return sorted(out)


def safe_join(folder: Path, name: str, what: str = "shard") -> Path:
    """``folder / name`` resolved, refusing names that leave ``folder``.

    ``folder`` must already be a real path. Refused (ShardedCheckpointError): non-strings, empty
    names, absolute paths (POSIX or Windows), ``..`` components, and names whose real path
    (symlinks followed) lies outside ``folder``, except, inside a Hugging Face cache snapshot,
    links into the same repository's ``blobs/`` (:func:`hf_cache_blobs`).
    """
    if not isinstance(name, str) or not name.strip():
        raise ShardedCheckpointError(f"{what} name {name!r} is not a file name")
    bad = next((i for i, c in enumerate(name) if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise ShardedCheckpointError(f"{what} name {name[:60]!r} holds a control character ({name[bad]!r} at "
                                     f"position {bad + 1}); no file has such a name: fix the index")
    long = next((c for c in name.replace("\\", "/").split("/") if len(c.encode("utf-8", "replace")) > NAME_MAX), None)
    if long is not None:
        raise ShardedCheckpointError(f"{what} name {long[:40]!r}... is {len(long.encode('utf-8', 'replace'))} bytes "
                                     f"long; file systems allow at most {NAME_MAX} bytes per name: fix the index")
    parts = name.replace("\\", "/").split("/")
    if name.startswith(("/", "\\")) or os.path.isabs(name) or (len(name) > 1 and name[1] == ":") or ".." in parts:
        raise ShardedCheckpointError(f"{what} name {name!r} points outside the folder {folder}: refused")
    target = Path(os.path.realpath(folder / name))
    if os.path.commonpath([target, folder]) == str(folder):
        return target
    blobs = hf_cache_blobs(folder)
    if blobs is not None and os.path.commonpath([target, blobs]) == str(blobs):
        return target  # a Hugging Face cache snapshot: its files link into the same repository's blobs/
    raise ShardedCheckpointError(f"{what} {name!r} is a symlink to {target}, outside the folder {folder}: "
                                 "refused (copy the file into the folder, or link the whole folder)")


def hf_cache_blobs(folder: Path) -> Path | None:
    """``<cache>/models--org--name/blobs`` when ``folder`` (a real path) lies inside that
    repository's ``snapshots/<revision>/`` of a Hugging Face cache, else None. Files of a cache
    snapshot are symlinks into ``../../blobs/``; links there are the only ones allowed to leave
    the folder."""
    parts = folder.parts
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith("models--") and len(parts) > i + 1:
            return Path(*parts[:i]) / "blobs"
    return None


def _json_type(value) -> str:
    return {dict: "JSON object", list: "JSON list", bool: "boolean", type(None): "null", int: "number",
            float: "number"}.get(type(value), type(value).__name__)


def _load_index_json(index_path: Path) -> dict:
    def no_duplicates(pairs):
        seen = {}
        for k, v in pairs:
            if k in seen:
                raise ShardedCheckpointError(f"{index_path}: tensor/key {k!r} is listed twice")
            seen[k] = v
        return seen
    raw = safe_files.read_regular(index_path, "sharded-checkpoint index", MAX_INDEX_BYTES, ShardedCheckpointError)
    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ShardedCheckpointError(f"{index_path}: not a valid JSON index ({e})") from e
    except RecursionError:
        raise ShardedCheckpointError(f"{index_path}: the JSON is nested too deeply to be an index (expected "
                                     '{"metadata": {"total_size": N}, "weight_map": {tensor: file}}); '
                                     "re-download or re-save the checkpoint") from None
    if not isinstance(data, dict) or not isinstance(data.get("weight_map"), dict):
        raise ShardedCheckpointError(f"{index_path}: no 'weight_map' object (expected "
                                     '{"metadata": {"total_size": N}, "weight_map": {tensor: file}})')
    if not data["weight_map"]:
        raise ShardedCheckpointError(f"{index_path}: 'weight_map' is empty")
    for key, name in data["weight_map"].items():
        if not isinstance(name, str):
            raise ShardedCheckpointError(f"{index_path}: weight_map[{key!r}] is a {_json_type(name)}; each value must "
                                         "be the file name of the shard holding that tensor (a string such as "
                                         "'model-00001-of-00002.safetensors'): fix the index")
    meta = data.get("metadata") or {}
    if not isinstance(meta, dict):
        raise ShardedCheckpointError(f"{index_path}: 'metadata' is not an object")
    return data


def _read_shard(path: Path, name: str, folder: Path) -> Shard:
    """Open one shard's header (safe_open validates it: length, JSON, offsets covering the file)."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            keys = tuple(f.keys())
            metadata = dict(f.metadata() or {})
    except SafetensorError as e:
        raise ShardedCheckpointError(f"shard {name!r} in {folder} is not a valid safetensors file (truncated "
                                     f"or corrupted header: {e}); re-download or re-save it") from e
    except OSError as e:
        raise ShardedCheckpointError(f"shard {name!r} in {folder} cannot be read: {e}") from e
    # Exact data bytes per tensor from the header's data_offsets (valid: safe_open accepted it).
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    nbytes = sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    return Shard(path, name, keys, nbytes, metadata)


def read_index(path: str | os.PathLike) -> ShardedIndex:
    """Find (see :func:`find_index`) and fully validate a sharded checkpoint; reads no tensor.

    Raises :class:`ShardedCheckpointError` for: an invalid index (not JSON, no/empty
    ``weight_map``, a tensor listed twice); a shard name that escapes the folder or is not a
    ``.safetensors`` file (pickles refused); a missing shard; a truncated or corrupted shard
    header; a tensor listed in the index but absent from its shard; the same tensor stored in
    two shards; a shard holding tensors the index does not list; ``metadata.total_size`` not
    equal to the shards' tensor bytes.
    """
    index_path = find_index(path)
    folder = Path(os.path.realpath(index_path.parent))
    if index_path.name in UNSHARDED_NAMES:  # one shard, no index: its own keys are the weight map
        safe_files.check_regular(index_path, f"{index_path.name} in {folder}", ShardedCheckpointError)
        shard = _read_shard(index_path, index_path.name, folder)
        if not shard.keys:
            raise ShardedCheckpointError(f"{index_path} holds no tensors")
        return ShardedIndex(index_path, folder, dict.fromkeys(shard.keys, shard.name), (shard,), None, shard.nbytes, {})
    data = _load_index_json(index_path)
    weight_map: dict = data["weight_map"]
    by_shard: dict[str, list[str]] = {}
    for key, name in weight_map.items():
        by_shard.setdefault(name, []).append(key)
    shards: list[Shard] = []
    for name in by_shard:
        if isinstance(name, str) and name.lower().endswith(PICKLE_SUFFIXES):
            raise ShardedCheckpointError(f"{index_path}: shard {name!r} is a pickle file: pickle files "
                                         "(.bin/.pt/.ckpt) are never unpickled by this loader; use .safetensors shards")
        target = safe_join(folder, name)
        if not name.lower().endswith(SHARD_SUFFIX):
            raise ShardedCheckpointError(f"{index_path}: shard {name!r} is not a .safetensors file; only "
                                         "safetensors shards are read")
        if not os.path.lexists(target):
            more = len(by_shard[name]) - 1
            raise ShardedCheckpointError(f"{index_path} lists shard {name!r}, which is missing from {folder} "
                                         f"(it should hold tensor {by_shard[name][0]!r}"
                                         + (f" and {more} more)" if more else ")"))
        safe_files.check_regular(target, f"shard {name!r} of {index_path}", ShardedCheckpointError)
        shards.append(_read_shard(target, name, folder))
    where: dict[str, str] = {}
    for s in shards:
        for k in s.keys:
            if k in where:
                raise ShardedCheckpointError(f"tensor {k!r} is stored in two shards of {folder}, {where[k]!r} and "
                                             f"{s.name!r}; the index maps it to {weight_map.get(k)!r}")
            where[k] = s.name
    for s in shards:
        absent = [k for k in by_shard[s.name] if where.get(k) != s.name]
        if absent:
            raise ShardedCheckpointError(f"{index_path} lists tensor {absent[0]!r} in shard {s.name!r}, but the "
                                         f"shard does not hold it ({len(absent)} such tensors)")
        extra = [k for k in s.keys if weight_map.get(k) != s.name]
        if extra:
            raise ShardedCheckpointError(f"shard {s.name!r} in {folder} holds tensor {extra[0]!r}, which "
                                         f"{index_path.name} does not list ({len(extra)} such tensors): index and "
                                         "shards do not match")
    nbytes = sum(s.nbytes for s in shards)
    meta = dict(data.get("metadata") or {})
    total_size = meta.get("total_size")
    if total_size is not None:
        shown = json.dumps(total_size)  # as written in the index: Infinity, NaN, "12", ...
        try:
            if isinstance(total_size, bool) or (isinstance(total_size, float) and not total_size.is_integer()):
                raise ValueError
            total_size = int(total_size)
        except (TypeError, ValueError, OverflowError):
            raise ShardedCheckpointError(f"{index_path}: metadata.total_size {shown} is not a whole number of bytes; "
                                         f"set it to {nbytes} (the bytes of the shards' tensors) or remove it") from None
        if total_size != nbytes:
            raise ShardedCheckpointError(f"{index_path}: metadata.total_size is {total_size} bytes but the shards "
                                         f"hold {nbytes} bytes of tensors: index and shards do not match")
    return ShardedIndex(index_path, folder, dict(weight_map), tuple(shards), total_size, nbytes, meta)


def load_state_dict(index: ShardedIndex | str | os.PathLike, progress: Progress | None = None,
                    device: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], dict]:
    """Load a sharded checkpoint's tensors, one shard at a time, memory-mapped.

    ``index``: a :class:`ShardedIndex` or a path for :func:`read_index` (validation first).
    Returns ``(state_dict, metadata)``: tensor name → tensor (views of the mapped shard files
    on CPU, or copies on ``device``), and the header metadata all shards agree on.
    ``progress(done, total)`` is called after each shard; an exception it raises (e.g. an
    interrupt) stops loading and nothing is returned.
    """
    if not isinstance(index, ShardedIndex):
        index = read_index(index)
    sd: dict[str, torch.Tensor] = {}
    total = len(index.shards)
    for i, shard in enumerate(index.shards):
        try:
            with safe_open(str(shard.path), framework="pt", device=str(device)) as f:
                for k in shard.keys:
                    sd[k] = f.get_tensor(k)
        except SafetensorError as e:  # the file changed since validation
            raise ShardedCheckpointError(f"shard {shard.name!r} could not be read: {e}") from e
        if progress is not None:
            progress(i + 1, total)
    return sd, index.metadata


def describe(index: ShardedIndex, seconds: float | None = None) -> dict:
    """JSON-serialisable summary: ``index`` (path), ``shards``, ``tensors``, ``total_bytes``,
    ``seconds`` (load time, when given)."""
    out = {"index": str(index.index_path), "shards": len(index.shards), "tensors": len(index.weight_map),
           "total_bytes": index.nbytes}
    if seconds is not None:
        out["seconds"] = round(seconds, 3)
    return out


def summary_text(info: dict) -> str:
    """One line for the node's text output, e.g. ``Loaded 3 shards, 780 tensors, 2.03 GiB in 4.1 s``."""
    verb = info.get("action", "Loaded")
    s = f"{verb} {info['shards']} shards, {info['tensors']} tensors, {info['total_bytes'] / 2**30:.2f} GiB"
    if "seconds" in info:
        s += f" in {info['seconds']:.1f} s"
    return s


class Timer:
    """``with Timer() as t: ...`` then ``t.seconds`` (wall time, perf_counter)."""

    def __enter__(self):
        self._t0 = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self._t0
