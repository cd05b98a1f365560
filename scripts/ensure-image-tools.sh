#!/usr/bin/env bash
# Makes sure the tools of the container image test (tests/alone/image.rs,
# through scripts/image) are there: buildah (builds deploy/Dockerfile),
# podman and runc (run the image), umoci (OCI image layouts) and debootstrap
# (the local base images are debootstrap roots: no image registry is
# reachable from the test machines). Installs Debian's packages when one is
# missing and exits non-zero (loudly) if it cannot. Sourced by scripts/test;
# run by scripts/image too; never skips.
set -euo pipefail

ensure_image_tools() {
  local tool missing=()
  for tool in buildah podman runc umoci debootstrap; do
    command -v "$tool" >/dev/null || missing+=("$tool")
  done
  [ ${#missing[@]} -gt 0 ] || return 0
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  echo "nackd: ${missing[*]} not installed; installing Debian's buildah podman runc umoci debootstrap (for the container image test)" >&2
  $sudo apt-get update -q >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q \
    buildah podman runc umoci debootstrap >&2
  for tool in buildah podman runc umoci debootstrap; do
    if ! command -v "$tool" >/dev/null; then
      echo "nackd: FATAL: no $tool after apt-get install; the container image test needs it and does not skip" >&2
      exit 1
    fi
  done
}

# Run directly (scripts/image does): install them now.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  ensure_image_tools
fi
