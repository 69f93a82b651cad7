#!/usr/bin/env bash
# GPU runbook: every GPU measurement of MemoryKit in one call, within one time budget (≤ 510 s).
# Prepare once on the development machine (fills the git-ignored gpu_bundle/, ≤ 60 MiB):
#   bash benchmarks/prepare_gpu_bundle.sh
# Run on the GPU machine from the repo root with the device tool:
#   run(command="bash benchmarks/gpu_runbook.sh", carry=["gpu_bundle"], timeout_s=570)
# Dry run on a CPU (tiny model, what CI runs; same budget):
#   DEVICE=cpu bash benchmarks/gpu_runbook.sh
# Environment: DEVICE (cuda|cpu), BUDGET_S (510), CASES (comma-separated names, see
# benchmarks/rb_plan.py), RESUME (a results.json of an earlier call: its finished cases are kept),
# OUT (output folder; default benchmarks/results/gpu-run, or benchmarks/results/cpu-dry-run),
# USE_BUNDLE=1 (the dry run takes ComfyUI 0.33 and the wheels from gpu_bundle/ as the GPU does).
# Writes into OUT (5 files): runbook.jsonl (a line per case, as it goes), results.json (rewritten
# atomically after every case), runbook.log (everything else, merged), table.md, plot.png.
set -uo pipefail
T0=$(date +%s.%N)
main() {  # the whole script is parsed before it runs
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DEVICE="${DEVICE:-cuda}"
BUDGET_S="${BUDGET_S:-510}"
if [ "$DEVICE" = cpu ]; then OUTDIR="${OUT:-$ROOT/benchmarks/results/cpu-dry-run}"; else OUTDIR="${OUT:-$ROOT/benchmarks/results/gpu-run}"; fi
mkdir -p "$OUTDIR"
exec > >(tee -a "$OUTDIR/runbook.log") 2>&1
echo "[runbook.sh] $(date -u +%FT%TZ) DEVICE=$DEVICE BUDGET_S=$BUDGET_S OUT=$OUTDIR"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ "$DEVICE" = cpu ] && [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi
B="$ROOT/gpu_bundle"
if [ "$DEVICE" != cpu ] && [ ! -d "$B" ] && [ -z "${COMFYUI_PATH:-}" ]; then
  echo "[runbook.sh] no gpu_bundle/ here: run benchmarks/prepare_gpu_bundle.sh and pass carry=[\"gpu_bundle\"]" >&2
  return 2
fi
if { [ "$DEVICE" != cpu ] || [ "${USE_BUNDLE:-0}" = 1 ]; } && [ -d "$B" ]; then
  # Wheels the machine lacks, unpacked (no pip, no network), and the ComfyUI 0.33 tree.
  SITE="${TMPDIR:-/tmp}/mk-site"; rm -rf "$SITE"; mkdir -p "$SITE"
  "$PY" - "$B/wheels" "$SITE" <<'PYEOF' || echo "[runbook.sh] WARNING: unpacking wheels failed"
import glob, os, sys, zipfile
for w in sorted(glob.glob(os.path.join(sys.argv[1], "*.whl"))):
    zipfile.ZipFile(w).extractall(sys.argv[2])
    print("[runbook.sh] unpacked", os.path.basename(w))
PYEOF
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  if [ -f "$B/comfyui.tar.gz" ] && [ -z "${COMFYUI_PATH:-}" ]; then
    CT="${TMPDIR:-/tmp}/mk-comfyui"; rm -rf "$CT"; mkdir -p "$CT"
    tar -xzf "$B/comfyui.tar.gz" -C "$CT" && export COMFYUI_PATH="$CT/$(ls "$CT" | head -n1)"
  fi
  [ "$DEVICE" = cpu ] || nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || true
fi
echo "[runbook.sh] python $("$PY" -c 'import sys; print(sys.version.split()[0])') COMFYUI_PATH=${COMFYUI_PATH:-default}"
"$PY" -m benchmarks.runbook --device "$DEVICE" --out "$OUTDIR" --budget "$BUDGET_S" --t0 "$T0" \
  ${CASES:+--cases "$CASES"} ${RESUME:+--resume "$RESUME"}
rc=$?
echo "[runbook.sh] done rc=$rc after $(( $(date +%s) - ${T0%.*} )) s; files in $OUTDIR: $(ls "$OUTDIR" | wc -l)"
return $rc
}
main "$@"
exit $?
