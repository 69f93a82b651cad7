"""Wan 2.2 two-experts fixtures for the "Wan 2.2 two experts on 32 GB RAM" example workflow.

Wan 2.2 (14B) samples with two experts of Wan 2.1's architecture: a high-noise model for the
first steps and a low-noise model for the rest. The fixtures are two tiny Wan 2.1-shaped
models (dim 128, 2 layers, as ``models.make_wan21``) with different random weights:
``diffusion_models/mk_wan22_high_noise_tiny.safetensors`` and ``..._low_noise_tiny...``.
"""
from __future__ import annotations

from pathlib import Path

from . import comfy_env, models, paths

EXPERTS = {"high": "mk_wan22_high_noise_tiny.safetensors", "low": "mk_wan22_low_noise_tiny.safetensors"}


def _make(path: Path, seed: int) -> None:
    comfy_env.setup_comfy()
    from comfy.ldm.wan.model import WanModel
    m = WanModel(model_type="t2v", dim=128, ffn_dim=256, num_heads=1, num_layers=2, in_dim=16,
                 out_dim=16, text_dim=4096, operations=models._ops())
    models.randomize_(m, seed)
    models._save(m.state_dict(), path)


def ensure_wan22_experts() -> dict[str, Path]:
    """Generate the two expert files if missing; returns {"high": path, "low": path}."""
    out = {}
    for i, (key, name) in enumerate(EXPERTS.items()):
        path = paths.MODELS / "diffusion_models" / name
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            _make(path, models.SEED + 40 + i)
        out[key] = path
    return out
