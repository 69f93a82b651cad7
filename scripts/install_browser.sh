#!/usr/bin/env bash
# Installs what the browser test (tests/test_frontend.py) drives: Debian's `chromium` and
# `chromium-driver` (chromedriver). Idempotent: does nothing when both are on PATH.
# Needs root (CI runs as root) or sudo. Selenium itself comes from requirements-dev.txt.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "[install_browser] chromium/chromedriver missing and not root: install the Debian packages" \
         "'chromium' and 'chromium-driver' yourself" >&2
    exit 1
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "[install_browser] no apt-get: install Chromium and a matching chromedriver, or set" \
       "CHROMIUM_BIN and CHROMEDRIVER" >&2
  exit 1
fi
echo "[install_browser] installing chromium + chromium-driver (apt)" >&2
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium chromium-driver
command -v chromium >/dev/null && command -v chromedriver >/dev/null
