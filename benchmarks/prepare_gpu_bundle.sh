#!/usr/bin/env bash
# Run HERE (the development machine, with network for pip) before a GPU session. Fills the
# git-ignored gpu_bundle/ (≤ 60 MiB: the device tool carries ≤ 64 MiB with the repo) with what
# the GPU machine lacks (it has Python 3.12 + torch 2.11 cu130, transformers, accelerate,
# safetensors, huggingface_hub, scipy, einops, aiohttp, torchaudio; no diffusers, torchsde,
# comfy-aimdo, comfy-kitchen, av, no network):
#   gpu_bundle/wheels/          cp312 manylinux x86_64 wheels: comfy-aimdo, comfy-kitchen (its
#                               ROCm/hip backend removed: unused on NVIDIA, 10.6 MB), diffusers,
#                               torchsde, trampoline (no importlib_metadata: py3.12 has it built in)
#   gpu_bundle/comfyui.tar.gz   the ComfyUI 0.33.0 tree, pruned (tests, API nodes, blueprints and
#                               tokenizer data files out). Only 0.33 is carried: the legacy
#                               baseline is 0.33 with dynamic VRAM off (--disable-dynamic-vram).
#   gpu_bundle/anchor_flux.py   design.md's anchor script (../shared does not travel)
# The 0.33 tree comes from $COMFYUI_033 (a tree or a .tar.gz), ../shared/comfyui/comfyui-0.33.0.tar.gz,
# or .cache/comfy-new. Then, with the device tool, from the repo root:
#   run(command="bash benchmarks/gpu_runbook.sh", carry=["gpu_bundle"], timeout_s=570)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
B="$ROOT/gpu_bundle"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
LIMIT_MIB="${BUNDLE_LIMIT_MIB:-60}"
SRC="${COMFYUI_033:-}"
if [ -z "$SRC" ]; then
  for c in "$ROOT/../shared/comfyui/comfyui-0.33.0.tar.gz" /work/shared/comfyui/comfyui-0.33.0.tar.gz "$ROOT/.cache/comfy-new"; do
    if [ -e "$c" ]; then SRC="$c"; break; fi
  done
fi
[ -n "$SRC" ] || { echo "no ComfyUI 0.33 tree: set COMFYUI_033 to a tree or its .tar.gz" >&2; exit 1; }
REQ_DIR="$(mktemp -d)"; trap 'rm -rf "$REQ_DIR"' EXIT
if [ -d "$SRC" ]; then cp -r "$SRC" "$REQ_DIR/tree"; else mkdir "$REQ_DIR/t" && tar -xzf "$SRC" -C "$REQ_DIR/t" && mv "$REQ_DIR/t/"* "$REQ_DIR/tree"; fi
T="$REQ_DIR/tree"
[ -f "$T/comfyui_version.py" ] || { echo "$SRC is not a ComfyUI tree (no comfyui_version.py)" >&2; exit 1; }
pin() { grep -i -E "^$1==" "$T/requirements.txt" | head -n1; }
AIMDO="$(pin comfy-aimdo)"; KITCHEN="$(pin comfy-kitchen)"
rm -rf "$B" && mkdir -p "$B/wheels"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d "$B/wheels" "${AIMDO:-comfy-aimdo}" "${KITCHEN:-comfy-kitchen}" "diffusers==0.42.1" "torchsde==0.2.6" "trampoline==0.1.2"
# Drop the ROCm parts (NVIDIA machine) from the wheels, RECORD lines included.
"$PY" - "$B/wheels" <<'PYEOF'
import glob, os, sys, zipfile
DROP = ("comfy_kitchen/backends/hip/", "comfy_aimdo/aimdo_rocm.so")
for w in glob.glob(os.path.join(sys.argv[1], "*.whl")):
    with zipfile.ZipFile(w) as z:
        names = z.namelist()
        if not any(n.startswith(DROP) for n in names):
            continue
        tmp = w + ".tmp"
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as o:
            for n in names:
                if n.startswith(DROP):
                    continue
                data = z.read(n)
                if n.endswith(".dist-info/RECORD"):
                    data = b"\n".join(l for l in data.split(b"\n") if not l.decode().startswith(DROP))
                o.writestr(z.getinfo(n), data)
    os.replace(tmp, w)
    print("stripped ROCm parts from", os.path.basename(w))
PYEOF
# The 0.33 tree, pruned, as one archive (unpacked on the GPU machine by gpu_runbook.sh).
rm -rf "$T/tests" "$T/tests-unit" "$T/comfy_api_nodes" "$T/blueprints" "$T/.git" "$T/.github"
find "$T/comfy/text_encoders" "$T/comfy/sd1_tokenizer" -type f ! -name '*.py' -delete 2>/dev/null || true
mv "$T" "$REQ_DIR/comfyui-0.33"
tar -czf "$B/comfyui.tar.gz" -C "$REQ_DIR" comfyui-0.33
for f in "$ROOT/../shared/bench/anchor_flux.py" /work/shared/bench/anchor_flux.py; do
  if [ -f "$f" ]; then cp "$f" "$B/anchor_flux.py"; chmod u+w "$B/anchor_flux.py"; break; fi
done
# The anchor was written for 0.3.75: ComfyUI 0.33's FluxParams requires txt_ids_dims ([] for Flux.1).
if [ -f "$B/anchor_flux.py" ]; then
  "$PY" - "$B/anchor_flux.py" <<'PYEOF'
import sys
p = sys.argv[1]
s = open(p).read()
old = '"guidance_embed": True}\n    return c\n'
new = ('"guidance_embed": True}\n    import dataclasses, comfy.ldm.flux.model as _fm  # 0.33: txt_ids_dims required\n'
       '    if "txt_ids_dims" in {f.name for f in dataclasses.fields(_fm.FluxParams)}:\n'
       '        c["txt_ids_dims"] = []\n    return c\n')
if old in s:
    open(p, "w").write(s.replace(old, new, 1))
    print("anchor_flux.py: txt_ids_dims patch applied")
else:
    print("anchor_flux.py: unet_cfg not as expected, left unpatched")
PYEOF
fi
ls -la "$B" "$B/wheels"
size=$(du -sb "$B" | cut -f1)
echo "gpu_bundle: $(( size / 1048576 )) MiB (limit $LIMIT_MIB MiB)"
if [ "$size" -gt $(( LIMIT_MIB * 1048576 )) ]; then
  echo "gpu_bundle is over $LIMIT_MIB MiB: the device tool carries at most 64 MiB with the repo" >&2
  exit 1
fi
