#!/usr/bin/env bash
# Makes sure cargo-nextest ($NACKD_NEXTEST_VERSION or newer 0.9) is there:
# scripts/test runs the suite with it (one process per test, so every
# test's time is known and the slow ones are named). Installs it from
# crates.io with `cargo install --locked` when it is missing (a cold install
# compiles it: a few minutes on 2 cores). Exits non-zero (loudly) if it
# cannot. Sourced by scripts/test; never skips.
set -euo pipefail

NACKD_NEXTEST_VERSION=0.9.143

ensure_nextest() {
  if cargo nextest --version >/dev/null 2>&1; then
    return 0
  fi
  echo "nackd: cargo-nextest is not installed; installing $NACKD_NEXTEST_VERSION (the suite runs with it)" >&2
  cargo install cargo-nextest --locked --version "=$NACKD_NEXTEST_VERSION" >&2
  if ! cargo nextest --version >/dev/null 2>&1; then
    echo "nackd: FATAL: no cargo-nextest after cargo install; scripts/test needs it" >&2
    exit 1
  fi
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  ensure_nextest
fi
