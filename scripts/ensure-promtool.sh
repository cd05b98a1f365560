#!/usr/bin/env bash
# Makes sure `promtool` is there for the alert rule tests (tests/it/alerts.rs):
# installs Debian's prometheus package (which ships it) if it is missing,
# and exits non-zero (loudly) if it cannot. Sourced by scripts/test; never
# skips. The package's own server is not started by nackd's tests.
set -euo pipefail

ensure_promtool() {
  if command -v promtool >/dev/null; then return 0; fi
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  echo "nackd: promtool is not installed; installing Debian's prometheus (for the alert rule tests)" >&2
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends prometheus
  if ! command -v promtool >/dev/null; then
    echo "nackd: FATAL: no promtool after apt-get install; the alert rule tests need it and do not skip" >&2
    exit 1
  fi
}
