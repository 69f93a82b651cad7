"""What FP8 Layerwise Cast tells the user: the one-screen text of its info, and the info of a cast
that cast nothing because the weights were already stored quantized (the input passes through)."""
from __future__ import annotations


def passed_through_info(patcher, family: str, why: str, kept: list[dict]) -> dict:
    """The info of an FP8 Layerwise Cast that cast nothing because the weights are already stored
    quantized: the model (or text encoder) passes through unchanged; ``why`` says so."""
    try:
        size = int(patcher.model_size())
    except Exception:  # noqa: BLE001 - another pack's patcher: the figure is only informative
        size = 0
    return {"family": family, "storage_dtype": "as stored", "compute_dtype": "as loaded", "scaling": "as stored",
            "weight_bytes_before": size, "weight_bytes_after": size, "cast_layers": 0, "cast_params": 0,
            "kept_layers": kept, "core_layers": 0, "passed_through": why,
            "path": "nothing cast: the weights are already stored quantized, so the input passes through unchanged"}


def format_fp8_info(info: dict, max_kept: int = 12) -> str:
    """One-screen summary of :func:`fp8_layerwise_cast`'s info (sizes in GiB)."""
    from ..memory import gib
    before, after = info["weight_bytes_before"], info["weight_bytes_after"]
    if info.get("passed_through"):
        lines = [f"FP8 Layerwise Cast ({info['family']}): nothing cast, passed through unchanged "
                 f"({gib(before)} GiB as stored)", info["passed_through"] + "."]
        lines += [f"  {k['name']}: {k['reason']}" for k in info["kept_layers"][:max_kept]]
        if len(info["kept_layers"]) > max_kept:
            lines.append(f"  ... and {len(info['kept_layers']) - max_kept} more")
        return "\n".join(lines)
    matmul = " (float8 matmul)" if info.get("fp8_matmul") else ""
    lines = [(f"FP8 Layerwise Cast ({info['family']}): {info['storage_dtype']} storage, "
              f"{info['compute_dtype']} compute{matmul}, scaling {info['scaling']}"),
             (f"weights {gib(before)} GiB -> {gib(after)} GiB ({after / max(1, before):.2f}x); "
              f"{info['cast_layers']} layers cast, {len(info['kept_layers'])} kept:")]
    if "path" in info:
        lines.insert(1, f"{info['path']}; LoRA {info['lora_mode']}")
    for k in info["kept_layers"][:max_kept]:
        lines.append(f"  {k['name']}: {k['reason']}")
    if len(info["kept_layers"]) > max_kept:
        lines.append(f"  ... and {len(info['kept_layers']) - max_kept} more")
    return "\n".join(lines)
