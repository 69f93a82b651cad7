"""Stand-in model files under the real names the example workflows use, for a server that runs a
template exactly as a user opens it (the browser tests press Run on the unmodified file).

Each ComfyServer's base directory gets ``stand_ins/<folder>/<real name>`` → the generated fixture
(:data:`harness.examples.MODEL_FILES`), listed by ComfyUI through ``stand_ins.yaml``
(``--extra-model-paths-config``), beside the generated models' own folders. Fixtures generated on
first use (the Wan 2.2 experts, the Flux 2 files) are linked before they exist; the links resolve
once :func:`harness.examples.ensure_stand_ins` has made them. Nothing is written in the shared
models folder.
"""
from __future__ import annotations

from pathlib import Path

from . import paths

FOLDERS = ("checkpoints", "diffusion_models", "vae", "loras", "text_encoders", "clip")
# Fixtures made on first use, by folder (they may not exist yet when a server starts).
_LAZY = {"mk_wan22_high_noise_tiny.safetensors": "diffusion_models",
         "mk_wan22_low_noise_tiny.safetensors": "diffusion_models",
         "mk_flux2_tiny.safetensors": "diffusion_models", "mk_flux2_vae.safetensors": "vae"}


def lay_out(base: Path) -> Path:
    """Make ``base/stand_ins/`` and ``base/stand_ins.yaml``; returns the yaml's path."""
    from .examples import MODEL_FILES
    where = dict(_LAZY)
    for sub in FOLDERS:
        folder = paths.MODELS / sub
        if folder.is_dir():
            for entry in folder.iterdir():
                where.setdefault(entry.name, sub)
    root = base / "stand_ins"
    for real, fixture in MODEL_FILES.items():
        sub = where.get(fixture)
        if sub is None:
            continue
        link = root / sub / real
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(paths.MODELS / sub / fixture)
    for sub in FOLDERS:
        (root / sub).mkdir(parents=True, exist_ok=True)
    yaml = base / "stand_ins.yaml"
    yaml.write_text("memorykit_stand_ins:\n" + f"    base_path: {root}\n"
                    + "".join(f"    {sub}: {sub}\n" for sub in FOLDERS))
    return yaml
