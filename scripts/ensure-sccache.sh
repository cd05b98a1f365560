#!/usr/bin/env bash
# Makes sure sccache $NACKD_SCCACHE_VERSION is there: scripts/test builds
# with it as cargo's compiler wrapper, so a fresh clone compiles the
# dependencies (the same crates, versions and flags every run, Cargo.lock
# pins them) once per machine rather than once per clone. It keeps them on
# the local disk only (~/.cache/sccache, at most 4 GiB): the build's
# features are `--no-default-features`, no remote storage. The workspace's
# own crates are not cached (cargo builds them incrementally, which
# sccache leaves alone), so clippy still checks every one of them.
# Installs it from crates.io with `cargo install --locked` when it is
# missing or another version (a cold install compiles it: about 3 minutes
# on 2 cores). Exits non-zero (loudly) if it cannot. Sourced by
# scripts/test; never skips.
set -euo pipefail

NACKD_SCCACHE_VERSION=0.19.0

ensure_sccache() {
  local have
  have="$(sccache --version 2>/dev/null || true)"
  case "$have" in
    "sccache $NACKD_SCCACHE_VERSION") return 0 ;;
  esac
  echo "nackd: sccache $NACKD_SCCACHE_VERSION is not installed (found: '${have:-none}'); installing it (the build's cache of dependencies)" >&2
  cargo install sccache --locked --no-default-features --version "=$NACKD_SCCACHE_VERSION" >&2
  have="$(sccache --version 2>/dev/null || true)"
  if [ "$have" != "sccache $NACKD_SCCACHE_VERSION" ]; then
    echo "nackd: FATAL: no sccache $NACKD_SCCACHE_VERSION after cargo install (found: '${have:-none}'); scripts/test builds with it" >&2
    exit 1
  fi
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  ensure_sccache
fi
