#!/usr/bin/env bash
# Run HERE (the development machine) before a GPU session: fills the git-ignored gpu_bundle/
# with what the GPU machine lacks (it has Python 3.12 + torch 2.11 + CUDA, accelerate,
# transformers, safetensors, huggingface_hub; no diffusers, no torchsde, no network):
#   gpu_bundle/wheels/   diffusers, torchsde, trampoline, importlib_metadata (py3.12 wheels)
#   gpu_bundle/ComfyUI/  the ComfyUI 0.3.75 tree (from .cache, made by scripts/setup.sh)
#   gpu_bundle/anchor_flux.py  the anchor script from ../shared/bench (shared/ does not travel)
# Then, with the device tool: run(command="bash benchmarks/gpu_runbook.sh", carry=["gpu_bundle"]).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
B="$ROOT/gpu_bundle"
bash "$ROOT/scripts/setup.sh"
rm -rf "$B" && mkdir -p "$B/wheels"
"$ROOT/.venv/bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$B/wheels" "diffusers==0.42.1" "torchsde==0.2.6" "trampoline==0.1.2" "importlib_metadata>=7"
cp -r "$ROOT/.cache/comfyui-0.3.75" "$B/ComfyUI"
rm -rf "$B/ComfyUI/tests" "$B/ComfyUI/tests-unit" "$B/ComfyUI/comfy_api_nodes"
for f in "$ROOT/../shared/bench/anchor_flux.py" /work/shared/bench/anchor_flux.py; do
  [ -f "$f" ] && cp "$f" "$B/anchor_flux.py" && break
done
du -sh "$B"
