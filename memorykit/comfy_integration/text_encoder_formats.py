"""Text encoders in the formats users download, for :mod:`.text_encoder`: which weights the
event ring streams as stored (core's QuantizedTensor of an fp8_scaled file, city96/ComfyUI-GGUF's
GGMLTensor), the notes saying so, the GGUF patcher class below a CLIP's, and FP8 Layerwise
Cast's refusal of a GGUF text encoder."""
from __future__ import annotations

import torch

from .. import stored_parts
from .gguf_weights import gguf_counts, is_ggml, is_gguf_patcher


def streamable_weights(patcher, node: str, options) -> None:
    """Refuse weights the event ring cannot stream, naming the first one. Quantized weights
    (core's QuantizedTensor of an fp8_scaled file, GGUF's GGMLTensor) stream as stored with the
    memorykit scheduler; anything else must be a plain tensor."""
    for name, t in list(patcher.model.named_parameters()) + list(patcher.model.named_buffers()):
        if type(t.data) is torch.Tensor:
            continue
        if stored_parts.is_quantized(t) or is_ggml(t):
            if not options.event_ring:
                raise ValueError(f"{node}: scheduler 'diffusers' streams plain tensors only and 'clip' holds "
                                 f"quantized weights ({name}); choose scheduler 'memorykit'.")
            continue
        raise ValueError(f"{node}: 'clip' holds {type(t.data).__name__} weights ({name}), which MemoryKit cannot "
                         "stream. Load the text encoder from a safetensors (bf16/fp16/fp8_scaled) or GGUF file, or "
                         "use Text Encoder Device without Group Offload.")


def stored_notes(model, parts) -> list[str]:
    """What streams as stored: quantized weights (fp8_scaled, GGUF) stream their stored bytes."""
    n = sum(1 for t in model.parameters() if not stored_parts.is_plain(t) and stored_parts.is_quantized(t))
    kinds = dict(parts.kinds) if parts else {}
    if n:
        kinds["quantized (fp8_scaled)"] = n
    if not kinds:
        return []
    return [", ".join(f"{c} {k} weights" for k, c in kinds.items())
            + " streamed as stored (quantized bytes, dequantised by their layers when a prompt is encoded)"]


def gguf_class(p) -> type | None:
    """ComfyUI-GGUF's patcher class below ``p``'s (None for a CLIP from a core loader)."""
    if not is_gguf_patcher(p):
        return None
    return next(c for c in type(p).__mro__ if c.__name__ == "GGUFModelPatcher")


def gguf_clip_description(clip) -> str | None:
    """What GGUF weights ``clip`` holds (e.g. ``Q8_0 ×24, F32 ×12``) when it comes from a GGUF file, else None."""
    counts = gguf_counts(clip.cond_stage_model)
    if counts or is_gguf_patcher(clip.patcher):
        return ", ".join(f"{k} ×{v}" for k, v in sorted(counts.items())) or "GGUF weights"
    return None
