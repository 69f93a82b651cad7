#!/usr/bin/env bash
# `make test`: the suite on ComfyUI 0.3.75 (or $COMFYUI_PATH), then on ComfyUI 0.33.0 when a
# 0.33 tree is provided ($COMFYUI_033_PATH, $COMFYUI_033_TARBALL, or ../shared/comfyui/ beside
# the repo; see scripts/setup.sh). Prints which versions ran, their times and results.
#   REQUIRE_COMFYUI_033=1  fail when no 0.33 tree is found (CI)
#   REQUIRE_BROWSER=1      the browser tests fail instead of skipping without Chromium (CI)
#   extra arguments go to pytest (e.g. `bash scripts/test.sh -k sharded`)
# The 0.33.0 suite also runs the browser tests on the newest frontend, comfyui-frontend-package
# $FRONTEND_NEW (fetched once from PyPI into $CACHE), in Nodes 2.0 and on the classic canvas.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CACHE="${MEMORYKIT_CACHE:-$ROOT/.cache}"
REPORTS="$(mktemp -d)"

# Chromium + chromedriver for the browser tests, where this user may install them (root or sudo).
if [ "$(id -u)" = "0" ] || sudo -n true 2>/dev/null; then
  bash scripts/install_browser.sh || echo "[test] could not install Chromium: the browser tests will skip (or fail with REQUIRE_BROWSER=1)" >&2
else
  echo "[test] not root and no sudo: Chromium is not installed; the browser tests skip unless it is already there" >&2
fi

# Both cores busy: the suite runs in two lanes at once, each its own processes and ComfyUI tree,
# sharing only the generated fixtures (made once, before the lanes start):
#   lane 1: ComfyUI 0.3.75, then the browser tests on frontend $FRONTEND_NEW (ComfyUI 0.33.0)
#   lane 2: ComfyUI 0.33.0
# Each lane's output goes to a log printed whole when the lane ends (no interleaved lines).
# MEMORYKIT_SERIAL=1 runs the same steps one after another in the foreground.
# Kept to CI's time budget without losing a check: on the frontend each ComfyUI tree ships, the
# badge check runs on the fewest example workflows that hold every MemoryKit node type
# (MEMORYKIT_FRONTEND_EXAMPLES=cover; every example still runs end to end in test_memory_report.py, and in the browser on the newest
# frontend below); the benchmark/GPU-runbook tools (not the pack) and the checks marked
# core_independent (no ComfyUI code runs in them) are checked on 0.33.0 only.
LANES="$(mktemp -d)"
trap 'rm -rf "$REPORTS" "$LANES"' EXIT
status=0

run_suite() {  # name venv comfy_dir [pytest args]
  local name="$1" venv="$2" comfy="$3" start end rc
  echo "[test] ===== ComfyUI $name: $comfy ====="
  start=$(date +%s)
  COMFYUI_PATH="$comfy" MEMORYKIT_FRONTEND_EXAMPLES=cover "$venv/bin/python" -m pytest -c tests/pytest.ini tests \
    --junitxml="$REPORTS/$name.xml" "${@:4}"
  rc=$?
  end=$(date +%s)
  echo "ComfyUI $name: exit $rc in $((end - start)) s" >> "$LANES/summary"
  [ "$rc" = 0 ] || echo 1 > "$LANES/failed"
}

FRONTEND_NEW=1.58.1
fetch_frontend() {  # version venv → prints the static/ folder of that comfyui-frontend-package
  local v="$1" dir="$CACHE/comfyui-frontend-package-$1"
  if [ ! -f "$dir/comfyui_frontend_package/static/index.html" ]; then
    rm -rf "$dir.tmp" && mkdir -p "$dir.tmp" &&
      "$2/bin/python" -m pip download -q --no-deps "comfyui-frontend-package==$v" -d "$dir.tmp" >&2 &&
      "$2/bin/python" -c "import glob, sys, zipfile; zipfile.ZipFile(glob.glob(sys.argv[1] + '/*.whl')[0]).extractall(sys.argv[1])" "$dir.tmp" &&
      rm -f "$dir.tmp"/*.whl && rm -rf "$dir" && mv "$dir.tmp" "$dir" || { rm -rf "$dir.tmp"; return 1; }
  fi
  echo "$dir/comfyui_frontend_package/static"
}

run_new_frontend() {  # venv comfy_dir [pytest args]: tests/test_frontend.py on $FRONTEND_NEW
  local venv="$1" comfy="$2" root start rc
  if ! root=$(fetch_frontend "$FRONTEND_NEW" "$venv"); then
    echo "frontend $FRONTEND_NEW: could not fetch comfyui-frontend-package==$FRONTEND_NEW from PyPI" >> "$LANES/summary"
    [ "${REQUIRE_BROWSER:-0}" = 1 ] && echo 1 > "$LANES/failed"
    return
  fi
  echo "[test] ===== ComfyUI 0.33.0 + frontend $FRONTEND_NEW ====="
  start=$(date +%s)
  # MEMORYKIT_VUE_NODES=1: every badge check runs in Nodes 2.0, then on the classic canvas of the
  # same page (the renderer switched through the frontend's setting; one run of each workflow)
  COMFYUI_PATH="$comfy" MEMORYKIT_FRONT_END_ROOT="$root" MEMORYKIT_VUE_NODES=1 \
    "$venv/bin/python" -m pytest -c tests/pytest.ini tests/test_frontend.py \
    --junitxml="$REPORTS/frontend-$FRONTEND_NEW.xml" "${@:3}"
  rc=$?
  [ "$rc" = 5 ] && rc=0  # the extra arguments selected none of them
  echo "ComfyUI 0.33.0 + frontend $FRONTEND_NEW (Nodes 2.0 and classic): exit $rc in $(( $(date +%s) - start )) s" >> "$LANES/summary"
  [ "$rc" = 0 ] || echo 1 > "$LANES/failed"
}

V375="${MEMORYKIT_VENV:-$ROOT/.venv}"; C375="${COMFYUI_PATH:-$CACHE/comfyui-0.3.75}"
V033="${MEMORYKIT_VENV_033:-$ROOT/.venv-0.33}"; C033="${COMFYUI_033_PATH:-$CACHE/comfyui-0.33.0}"
bash scripts/setup.sh 0.3.75 || exit 1
bash scripts/setup.sh 0.33
rc033=$?
have033=0
if [ "$rc033" = 0 ]; then
  have033=1
elif [ "$rc033" = 3 ] && [ "${REQUIRE_COMFYUI_033:-0}" != 1 ]; then
  echo "ComfyUI 0.33.0: not run (no 0.33 tree; set COMFYUI_033_PATH or COMFYUI_033_TARBALL)" >> "$LANES/summary"
else
  echo "ComfyUI 0.33.0: set-up failed (exit $rc033)" >> "$LANES/summary"
  echo 1 > "$LANES/failed"
fi

# The generated fixtures, once, before the lanes (written by ComfyUI 0.3.75's classes, as before).
echo "[test] generating the test fixtures (once; cached in $CACHE/models)"
COMFYUI_PATH="$C375" "$V375/bin/python" tests/harness/prepare.py \
  || { echo "[test] fixture generation failed" >&2; exit 1; }

lane1() {
  run_suite "0.3.75" "$V375" "$C375" \
    --deselect test_benchmark_quick.py::test_quick_benchmark_json --deselect test_gpu_runbook_dryrun.py "$@"  # node ids (rootdir tests/)
  [ "$have033" = 1 ] && run_new_frontend "$V033" "$C033" "$@"
}
lane2() {
  [ "$have033" = 1 ] && run_suite "0.33.0" "$V033" "$C033" "$@"
}
if [ "${MEMORYKIT_SERIAL:-0}" = 1 ]; then
  lane1 "$@"; lane2 "$@"
else
  lane1 "$@" > "$LANES/lane1.log" 2>&1 &
  pid1=$!
  lane2 "$@" > "$LANES/lane2.log" 2>&1 &
  pid2=$!
  # a heartbeat, so a long CI run shows it is alive; each lane's log follows when it ends
  ( while sleep 300; do echo "[test] lanes running: $(date -u +%H:%M:%S)"; done ) &
  beat=$!
  wait "$pid2"; cat "$LANES/lane2.log"
  wait "$pid1"; cat "$LANES/lane1.log"
  kill "$beat" 2>/dev/null; wait "$beat" 2>/dev/null
fi
[ -f "$LANES/failed" ] && status=1
mapfile -t summary < <(sort "$LANES/summary" 2>/dev/null)

echo "[test] ===== versions ====="
printf '[test] %s\n' "${summary[@]}"
# One closing line over every version that ran (pytest's own lines above give the details).
"${MEMORYKIT_VENV:-$ROOT/.venv}/bin/python" - "$REPORTS" <<'PYEOF'
import glob, sys
import xml.etree.ElementTree as ET
p = f = s = 0
for path in glob.glob(sys.argv[1] + "/*.xml"):
    for suite in ET.parse(path).getroot().iter("testsuite"):
        tests, fail, err, skip = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        p += tests - fail - err - skip
        f += fail + err
        s += skip
print(f"{p} passed, {f} failed, {s} skipped")
PYEOF
exit $status
