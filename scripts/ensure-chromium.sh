#!/usr/bin/env bash
# Makes sure a `chromium` binary is there for the status page test
# (tests/status_page.rs): installs Debian's chromium if it is missing, and
# exits non-zero (loudly) if it cannot. Sourced by scripts/test; never skips.
set -euo pipefail

ensure_chromium() {
  if command -v chromium >/dev/null; then return 0; fi
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  echo "nackd: chromium is not installed; installing Debian's chromium (for the status page test)" >&2
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q chromium
  if ! command -v chromium >/dev/null; then
    echo "nackd: FATAL: no chromium after apt-get install; the status page test needs it and does not skip" >&2
    exit 1
  fi
}
