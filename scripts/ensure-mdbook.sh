#!/usr/bin/env bash
# Makes sure mdBook $NACKD_MDBOOK_VERSION is there for the book test
# (tests/alone/book.rs builds docs/ with it): installs it from crates.io
# with `cargo install --locked` into its own root, $NACKD_MDBOOK_ROOT
# (default /var/cache/nackd-mdbook), where it stays for later runs (a cold
# install compiles it: a few minutes on 2 cores). Only the `search`
# feature: the book is built, never served. Prints nothing on success but
# the binary's path when run directly; exits non-zero (loudly) if it
# cannot. Sourced by scripts/test; run by tests/alone/book.rs too; never
# skips.
set -euo pipefail

NACKD_MDBOOK_VERSION=0.5.4
NACKD_MDBOOK_ROOT="${NACKD_MDBOOK_ROOT:-/var/cache/nackd-mdbook}"

mdbook_bin() {
  echo "$NACKD_MDBOOK_ROOT/bin/mdbook"
}

ensure_mdbook() {
  local bin have
  bin="$(mdbook_bin)"
  have="$("$bin" --version 2>/dev/null || true)"
  case "$have" in
    *" v$NACKD_MDBOOK_VERSION") return 0 ;;
  esac
  echo "nackd: mdBook $NACKD_MDBOOK_VERSION is not in $NACKD_MDBOOK_ROOT (found: '${have:-none}'); installing it (for the book test)" >&2
  mkdir -p "$NACKD_MDBOOK_ROOT"
  # A lock: two tests or runs installing at once would share the root.
  (
    flock 9
    cargo install mdbook --locked --version "=$NACKD_MDBOOK_VERSION" \
      --no-default-features --features search --root "$NACKD_MDBOOK_ROOT" >&2
  ) 9>"$NACKD_MDBOOK_ROOT/.install.lock" || true
  have="$("$bin" --version 2>/dev/null || true)"
  case "$have" in
    *" v$NACKD_MDBOOK_VERSION") ;;
    *)
      echo "nackd: FATAL: no mdBook $NACKD_MDBOOK_VERSION at $bin after cargo install (found: '${have:-none}'); the book test needs it and does not skip" >&2
      exit 1
      ;;
  esac
}

# Run directly (tests/alone/book.rs does): install it now, print its path.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  ensure_mdbook
  mdbook_bin
fi
