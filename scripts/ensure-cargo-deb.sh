#!/usr/bin/env bash
# Makes sure `cargo deb` (cargo-deb $NACKD_CARGO_DEB_VERSION) is there for the
# package test (tests/alone/deb.rs): installs it from crates.io with
# `cargo install --locked` when it is missing or another version, into
# cargo's bin directory, where it stays for later runs (a cold install
# compiles it: about 2 minutes on 2 cores). Exits non-zero (loudly) if it
# cannot. Sourced by scripts/test; run by tests/alone/deb.rs too; never skips.
set -euo pipefail

NACKD_CARGO_DEB_VERSION=3.8.0

ensure_cargo_deb() {
  local have
  have="$(cargo deb --version 2>/dev/null || true)"
  case "$have" in
    *" $NACKD_CARGO_DEB_VERSION") return 0 ;;
  esac
  echo "nackd: cargo-deb $NACKD_CARGO_DEB_VERSION is not installed (found: '${have:-none}'); installing it (for the package test)" >&2
  cargo install cargo-deb --locked --version "=$NACKD_CARGO_DEB_VERSION" >&2
  have="$(cargo deb --version 2>/dev/null || true)"
  case "$have" in
    *" $NACKD_CARGO_DEB_VERSION") ;;
    *)
      echo "nackd: FATAL: no cargo-deb $NACKD_CARGO_DEB_VERSION after cargo install (found: '${have:-none}'); the package test needs it and does not skip" >&2
      exit 1
      ;;
  esac
}

# Run directly (tests/alone/deb.rs does): install it now.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  ensure_cargo_deb
fi
