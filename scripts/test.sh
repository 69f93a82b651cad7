#!/usr/bin/env bash
# `make test`: the suite on ComfyUI 0.3.75 (or $COMFYUI_PATH), then on ComfyUI 0.33.0 when a
# 0.33 tree is provided ($COMFYUI_033_PATH, $COMFYUI_033_TARBALL, or ../shared/comfyui/ beside
# the repo; see scripts/setup.sh). Prints which versions ran, their times and results.
#   REQUIRE_COMFYUI_033=1  fail when no 0.33 tree is found (CI)
#   REQUIRE_BROWSER=1      the browser tests fail instead of skipping without Chromium (CI)
#   extra arguments go to pytest (e.g. `bash scripts/test.sh -k sharded`)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CACHE="${MEMORYKIT_CACHE:-$ROOT/.cache}"
REPORTS="$(mktemp -d)"
trap 'rm -rf "$REPORTS"' EXIT

# Chromium + chromedriver for the browser tests, where this user may install them (root or sudo).
if [ "$(id -u)" = "0" ] || sudo -n true 2>/dev/null; then
  bash scripts/install_browser.sh || echo "[test] could not install Chromium: the browser tests will skip (or fail with REQUIRE_BROWSER=1)" >&2
else
  echo "[test] not root and no sudo: Chromium is not installed; the browser tests skip unless it is already there" >&2
fi

summary=()
status=0
run_suite() {  # name venv comfy_dir
  local name="$1" venv="$2" comfy="$3" start end rc
  echo "[test] ===== ComfyUI $name: $comfy ====="
  start=$(date +%s)
  COMFYUI_PATH="$comfy" "$venv/bin/python" -m pytest -c tests/pytest.ini tests \
    --junitxml="$REPORTS/$name.xml" "${@:4}"
  rc=$?
  end=$(date +%s)
  summary+=("ComfyUI $name: exit $rc in $((end - start)) s")
  [ "$rc" = 0 ] || status=1
}

bash scripts/setup.sh 0.3.75 || exit 1
run_suite "0.3.75" "${MEMORYKIT_VENV:-$ROOT/.venv}" "${COMFYUI_PATH:-$CACHE/comfyui-0.3.75}" "$@"

bash scripts/setup.sh 0.33
rc=$?
if [ "$rc" = 0 ]; then
  run_suite "0.33.0" "${MEMORYKIT_VENV_033:-$ROOT/.venv-0.33}" "${COMFYUI_033_PATH:-$CACHE/comfyui-0.33.0}" "$@"
elif [ "$rc" = 3 ] && [ "${REQUIRE_COMFYUI_033:-0}" != 1 ]; then
  summary+=("ComfyUI 0.33.0: not run (no 0.33 tree; set COMFYUI_033_PATH or COMFYUI_033_TARBALL)")
else
  summary+=("ComfyUI 0.33.0: set-up failed (exit $rc)")
  status=1
fi

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
