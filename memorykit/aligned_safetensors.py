"""Write a safetensors file whose tensors start at 64-byte-aligned file offsets.

``safetensors.torch.save_file`` lays tensors out by dtype, then by name, after a header padded
to 8 bytes: a tensor's data often starts only 4- or 8-byte aligned (a 4-byte float32 scale
before it is enough). Loaders (``safe_open``, ComfyUI's) hand out views of the memory-mapped
file, so a weight keeps that alignment in the loaded model, and CPU kernels do not compute
the same float32 bits on a weight that is not 16-byte aligned (a batch-1 Linear's matrix-vector
product sums in another order: about 1e-8 relative), while a model in memory has 64-byte-aligned
weights. Here the header is padded so the data starts at a multiple of 64 and the tensors are
written in order of how far their sizes keep the next offset aligned (multiples of 64 bytes
first, in the given order, then 32, 16, ...): every tensor whose size is a multiple of 16 bytes
starts 16-byte aligned, every multiple of 64 at 64. The file is standard safetensors (any
reader validates it; tensor order in the data is free). Knows nothing of ComfyUI.
"""
from __future__ import annotations

import json
import struct
import sys

import torch

ALIGN = 64
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
           torch.complex64: "C64"}


def _alignment(nbytes: int) -> int:
    """The largest power of two up to :data:`ALIGN` that divides ``nbytes``."""
    a = ALIGN
    while nbytes % a:
        a //= 2
    return a


def save_file(tensors: dict[str, torch.Tensor], filename: str, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (contiguous CPU tensors, none sharing memory) and ``metadata`` (str → str)
    to ``filename`` as safetensors, aligned as the module doc says. Raises ValueError for a dtype
    safetensors has no name for; OSError from writing."""
    if sys.byteorder != "little":
        raise ValueError("safetensors files are little-endian; this machine is not")
    order = sorted(tensors, key=lambda k: -_alignment(tensors[k].nbytes))  # stable: given order within a class
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for k in order:
        t = tensors[k]
        if t.dtype not in _DTYPES:
            raise ValueError(f"tensor {k!r}: dtype {t.dtype} cannot be saved in a safetensors file")
        header[k] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)  # the data starts at a multiple of ALIGN
    with open(filename, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for k in order:
            t = tensors[k]
            if t.numel():
                f.write(t.detach().reshape(-1).view(torch.uint8).numpy().data)
