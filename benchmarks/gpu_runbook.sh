#!/usr/bin/env bash
# GPU runbook: every GPU measurement of MemoryKit in one script (≤ 9 minutes on an H200).
# Prepare once on the development machine: bash benchmarks/prepare_gpu_bundle.sh
# Run on the GPU machine from the repo root (device tool: carry=["gpu_bundle"], timeout_s=580):
#   bash benchmarks/gpu_runbook.sh            # everything
#   CASES="lowvram diffusers_ mk_offload" bash benchmarks/gpu_runbook.sh   # only harness cases whose name
#                                              contains a word of CASES (resident always runs): the issue-3 set
# Writes into $OUT (or benchmarks/results/ when OUT is unset): bench_gpu.json/.png (our harness,
# every case side by side), anchor.jsonl (design.md's anchor script, same run, same machine),
# vae_gpu.json, ring_check_gpu.jsonl, env.txt. Commit them under benchmarks/results/ with the date.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUTDIR="${OUT:-$ROOT/benchmarks/results}"
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site gpu_bundle/wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site
export COMFYUI_PATH="$ROOT/gpu_bundle/ComfyUI"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__)"; } > "$OUTDIR/env.txt" 2>&1
cat "$OUTDIR/env.txt"
# 0. Event-ring correctness on the GPU: bit-exact vs resident, pinned ≤ 1.1 × streamed, nothing left after removal.
timeout 60 python3 -m benchmarks.ring_check --device cuda > "$OUTDIR/ring_check_gpu.jsonl" 2>"$OUTDIR/ring_check_gpu.log"
tail -n 8 "$OUTDIR/ring_check_gpu.jsonl"
# 1. Our harness: baselines + every MemoryKit case, 1024² and 2048².
# shellcheck disable=SC2086
timeout 330 python3 -m benchmarks.run --device cuda --depth 8 --single 16 --res 1024,2048 --iters 3 \
  ${CASES:+--cases $CASES} --out "$OUTDIR/bench_gpu.json" 2>&1 | tee "$OUTDIR/bench_gpu.log"
# 2. Tiled VAE: untiled vs core tiled vs ours, SD-KL VAE at 2048² with 512/64 tiles.
timeout 50 python3 -m benchmarks.vae_bench --res 2048 --tile 512 --overlap 64 --out "$OUTDIR/vae_gpu.json" 2>&1 | tee "$OUTDIR/vae_gpu.log"
# 3. The anchor script beside it (same machine, same run).
if [ -f gpu_bundle/anchor_flux.py ]; then
  DEV=cuda DEPTH=8 SINGLE=16 RES=1024 ITERS=3 timeout 110 python3 gpu_bundle/anchor_flux.py > "$OUTDIR/anchor.jsonl" 2>&1
  tail -n 20 "$OUTDIR/anchor.jsonl"
fi
