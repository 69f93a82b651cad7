"""What the demo runs beyond the example workflows as written: a stand-in model big enough that
each technique's effect is larger than ComfyUI's own memory (about 1.2–2 GiB on a CPU), a real
photograph for the Tiled VAE row, and per-workflow settings the demo sets on the prompt (the
templates are left as a user gets them).

- ``diffusion_models/mk_wan21_demo.safetensors`` (and ``..._demo_b``, other weights, the Wan 2.2
  rows' second expert): Wan 2.1 t2v shaped like the real 1.3B (dim 1536,
  ffn 8960, 12 heads) with 11 layers: 0.54 B parameters, 2.0 GiB in fp32 (the dtype ComfyUI
  computes in on a CPU, so the file's bytes are the bytes in RAM). Random weights.
- the Tiled VAE row (ComfyUI with TAEF2, 0.33 and later): a photograph (scikit-image's astronaut,
  upscaled) encoded once by the trained TAEF2 into a ``.latent`` file that core's Load Latent
  reads; the row decodes it untiled (plain) and with Tiled VAE Decode (MemoryKit).
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from harness import comfy_env, models, paths  # noqa: E402

DEMO_WAN = "mk_wan21_demo.safetensors"
DEMO_WAN_B = "mk_wan21_demo_b.safetensors"  # the second expert of the Wan 2.2 rows (other weights)
WAN_DEMO_SHAPE = dict(dim=1536, ffn_dim=8960, num_heads=12, num_layers=11)
DEMO_VERSION = "1"


def make_wan21_demo(path: Path, seed: int) -> None:
    """Write the demo's Wan 2.1 stand-in (see the module docstring), fp32, block by block."""
    comfy_env.setup_comfy()
    from comfy.ldm.wan.model import WanModel
    with torch.device("meta"):
        m = WanModel(model_type="t2v", in_dim=16, out_dim=16, text_dim=4096, operations=models._ops(),
                     **WAN_DEMO_SHAPE)
    m = m.to_empty(device="cpu")
    models.randomize_(m, seed)
    models._save(m.state_dict(), path)


def ensure_demo_models(names: list[str]) -> dict[str, Path]:
    """Generate the demo's own files that the workflows ``names`` use, if missing (a stamp per
    version); returns their paths."""
    out = {}
    if TILED_ROW in names and not taef2_missing():
        out[PHOTO_LATENT] = ensure_photo_latent()
    if not BIG_MODEL_ROWS & set(names):
        return out
    for i, name in enumerate((DEMO_WAN, DEMO_WAN_B)):
        path = out[name] = paths.MODELS / "diffusion_models" / name
        stamp = path.with_name(name + f".v{DEMO_VERSION}.ok")
        if not (stamp.exists() and path.exists()):
            make_wan21_demo(path, models.SEED + 60 + i)
            stamp.touch()
    return out




# Workflows whose diffusion model is the demo's stand-in (the model-size techniques), and the
# latent the demo gives them: 64×64 px, 5 frames (2 latent frames, 32 tokens) keeps a step of a
# 0.54 B model at about a second on 2 CPU cores, so the memory figures, not the compute, are shown.
BIG_MODEL_ROWS = {"group_offload_wan21_t2v", "balanced_device_map_wan21_t2v", "wan22_two_experts_on_32gb_ram",
                  "memory_plan_wan22_16gb_vram_32gb_ram"}
BIG_LATENT = {"width": 64, "height": 64, "length": 5}
# Two sampling steps (one per expert where two sample): every streamed block crosses each step.
BIG_STEPS = 2
# Balanced Device Map on a CPU-only machine: 'auto' keeps the model on its one device; the demo
# gives it 256 MiB of RAM and the rest on disk, so the split is what is measured.
DEVICE_MAP = {"strategy": "sequential", "max_memory": "cpu=256MiB, disk"}
# Memory Plan for a machine the stand-in is too big for, in the template's proportions: the
# template plans two 14 GB experts for 16 GB VRAM and 32 GB RAM; two 2.0 GiB stand-ins get
# 2 GB VRAM and 4 GB RAM.
PLAN_FIGURES = {"plan_for": "given figures", "vram_gb": 2.0, "ram_gb": 4.0}


def adjust_prompt(name: str, api: dict) -> list[str]:
    """Set the demo's sizes on the API prompt of example ``name`` in place; returns one line
    per change, for the table's notes."""
    notes = _general_notes(api)
    if name == TILED_ROW:
        why = taef2_missing()
        return [f"not the photograph: {why}"] if why else photo_row(api)
    if name not in BIG_MODEL_ROWS:
        return notes
    notes = []
    experts = sum(n["class_type"] == "UNETLoader" for n in api.values())
    notes.append(f"diffusion model{'s' if experts > 1 else ''}: {experts} × a 2.0 GiB Wan 2.1 stand-in, "
                 f"{BIG_LATENT['width']}×{BIG_LATENT['height']} px × {BIG_LATENT['length']} frames, {BIG_STEPS} steps")
    if experts > 1:
        notes.append("the second expert is loaded after the first sampling step, inside the measured window: "
                     "ComfyUI's loader holds the file's pages and its copy of the weights at once (about twice the "
                     "model) in both runs")
    for n in api.values():
        ct, inp = n["class_type"], n["inputs"]
        if ct == "UNETLoader":
            inp["unet_name"] = DEMO_WAN_B if "low_noise" in inp["unet_name"] else DEMO_WAN
        elif ct == "EmptyHunyuanLatentVideo":
            inp.update(BIG_LATENT)
        elif ct == "KSampler":
            inp["steps"] = BIG_STEPS
        elif ct == "KSamplerAdvanced":  # the first expert samples step 0, the second step 1
            inp["steps"] = BIG_STEPS
            if inp.get("start_at_step", 0) == 0:
                inp["end_at_step"] = 1
            else:
                inp["start_at_step"] = 1
        elif ct == "MemoryKitGroupOffload" and inp.get("offload_to") != "disk":
            inp["offload_to"] = "disk"  # to RAM, a CPU-only machine has nowhere to move the blocks: unchanged
            notes.append("Group Offload: offload_to disk (the template's cpu, offload to RAM, passes the model "
                         "through unchanged on a machine without a GPU)")
        elif ct == "MemoryKitBalancedDeviceMap":
            inp.update(DEVICE_MAP)
            notes.append(f"Balanced Device Map: {DEVICE_MAP['strategy']}, max_memory {DEVICE_MAP['max_memory']}")
        elif ct == "MemoryKitMemoryPlan":
            inp.update(PLAN_FIGURES)
            notes.append(f"Memory Plan for given figures: {PLAN_FIGURES['vram_gb']:g} GB VRAM, "
                         f"{PLAN_FIGURES['ram_gb']:g} GB RAM (the template's 16 GB / 32 GB for two 14 GB experts, "
                         "scaled to the stand-ins)")
    return notes


def _general_notes(api: dict) -> list[str]:
    """What a reader needs about a template the demo runs as written: what the plain run loads in
    place of the sharded loaders, and a Group Offload to RAM on a machine without a GPU."""
    kinds = {n["class_type"]: n["inputs"] for n in api.values()}
    notes = []
    if {"MemoryKitShardedCheckpointLoader", "MemoryKitShardedTextEncoderLoader"} & set(kinds):
        notes.append("the plain run loads the single checkpoint the shards were cut from with core's Load "
                     "Checkpoint (its UNet, CLIP and VAE); the sharded loaders read only the part each gives")
    go = kinds.get("MemoryKitGroupOffload")
    if go is not None and go.get("offload_to", "cpu") == "cpu" and not torch.cuda.is_available():
        notes.append("Group Offload to RAM passes the model through on a machine without a GPU (nothing to "
                     "move it from): its badge is a memory report here")
    return notes


# --- the Tiled VAE row: a real photograph through the trained TAEF2 ---------------------------
TILED_ROW = "tiled_vae_sd15"
PHOTO_PX = 1024  # TAEF2's untiled decode of a 1024² image holds about 1 GiB of activations
PHOTO_TILES = {"tile_size": 512, "overlap": 64}  # what a user sets for a real image
PHOTO_LATENT = f"mk_demo_astronaut_{PHOTO_PX}_taef2.latent"


def taef2_missing() -> str | None:
    """Why the Tiled VAE row cannot decode the photograph here (None when it can): TAEF2's two
    files in the real-weights folder, scikit-image (the photograph) and a ComfyUI with TAEF2."""
    from harness import real_content
    why = real_content.missing(latents=False)
    if why:
        return why
    comfy_env.setup_comfy()
    return real_content.has_taef2()


def ensure_photo_latent() -> Path:
    """The astronaut photograph (scikit-image), upscaled to PHOTO_PX², encoded once by TAEF2 with
    Tiled VAE Encode (512 px tiles) into a ``.latent`` file as core's Save Latent writes it."""
    path = paths.MODELS / "demo" / PHOTO_LATENT
    if path.is_file():
        return path
    import skimage.data
    from safetensors.torch import save_file
    from harness import real_content
    comfy_env.setup_comfy()
    comfy_env.load_pack()
    from comfyui_memorykit.memorykit import comfy_integration as ci
    vae = real_content.load_taef2()
    x = torch.from_numpy(skimage.data.astronaut()).float().div(255.0)[None].movedim(-1, 1)
    img = torch.nn.functional.interpolate(x, size=(PHOTO_PX, PHOTO_PX), mode="bicubic").clamp(0, 1).movedim(1, -1)
    with torch.inference_mode():
        z, _ = ci.tiled_vae_encode(vae, img, ci.TiledVAEOptions(tile_px=512, overlap_px=64))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    save_file({"latent_tensor": z.contiguous(), "latent_format_version_0": torch.tensor([])}, str(tmp))
    tmp.replace(path)
    return path


def photo_row(api: dict) -> list[str]:
    """Rewire the Tiled VAE row: its Tiled VAE Decode takes the photograph's latent (core's Load
    Latent) and TAEF2 (core's VAE Loader); the sampler and its report are left out."""
    dec = next(nid for nid, n in api.items() if n["class_type"] == "MemoryKitTiledVAEDecode")
    api["demo_latent"] = {"class_type": "LoadLatent", "inputs": {"latent": PHOTO_LATENT}}
    api["demo_vae"] = {"class_type": "VAELoader", "inputs": {"vae_name": "taef2"}}
    api[dec]["inputs"].update(samples=["demo_latent", 0], vae=["demo_vae", 0], **PHOTO_TILES)
    keep, todo = set(), [nid for nid, n in api.items()
                         if n["class_type"] in ("SaveImage", "MemoryKitMemoryReport") and _feeds_from(api, nid, dec)]
    while todo:
        nid = todo.pop()
        if nid in keep:
            continue
        keep.add(nid)
        todo += [v[0] for v in api[nid]["inputs"].values() if isinstance(v, list) and len(v) == 2 and v[0] in api]
    for nid in set(api) - keep:
        del api[nid]
    return [f"a photograph (astronaut, {PHOTO_PX}² px) decoded by the trained TAEF2, "
            f"Tiled VAE Decode with {PHOTO_TILES['tile_size']} px tiles, {PHOTO_TILES['overlap']} px overlap"]


def _feeds_from(api: dict, nid: str, src: str) -> bool:
    """Whether node ``nid`` depends on node ``src``."""
    seen, todo = set(), [nid]
    while todo:
        cur = todo.pop()
        if cur == src:
            return True
        if cur in seen or cur not in api:
            continue
        seen.add(cur)
        todo += [v[0] for v in api[cur]["inputs"].values() if isinstance(v, list) and len(v) == 2]
    return False


def prepare_server(name: str, base: Path) -> None:
    """Lay out what the row needs in a server's base directory before it starts: TAEF2 in
    ``models/vae_approx`` and the photograph's latent in ``input/``."""
    if name != TILED_ROW or taef2_missing():
        return
    from harness import real_content
    link = base / "models" / "vae_approx"
    if not link.exists():
        link.symlink_to(real_content.REAL, target_is_directory=True)
    dst = base / "input" / PHOTO_LATENT
    if not dst.exists():  # a copy: Load Latent refuses a link that leads out of the input folder
        shutil.copyfile(ensure_photo_latent(), dst)


if __name__ == "__main__":
    print(ensure_demo_models(sys.argv[1:] or sorted(BIG_MODEL_ROWS | {TILED_ROW})))
