#!/usr/bin/env bash
# Makes sure a RabbitMQ answers on 127.0.0.1:5672: starts it if it is
# installed but down, installs Debian's rabbitmq-server if it is missing,
# and exits non-zero (loudly) if none can be had. Sourced by scripts/run and
# scripts/test; never skips.
set -euo pipefail

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

broker_up() { (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; }

broker_ready() {
  broker_up || return 1
  # The port opens late in boot, but make sure the app is fully started.
  if command -v rabbitmqctl >/dev/null; then
    $SUDO rabbitmqctl -q await_startup --timeout 60 >/dev/null 2>&1 || true
  fi
  return 0
}

ensure_broker() {
  if broker_ready; then return 0; fi
  if ! command -v rabbitmq-server >/dev/null; then
    echo "nackd: RabbitMQ is not installed; installing Debian's rabbitmq-server" >&2
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q rabbitmq-server
  fi
  if ! broker_up; then
    echo "nackd: starting RabbitMQ (rabbitmq-server -detached)" >&2
    $SUDO rabbitmq-server -detached || true
  fi
  for _ in $(seq 1 90); do
    if broker_ready; then return 0; fi
    sleep 1
  done
  echo "nackd: FATAL: no RabbitMQ on 127.0.0.1:5672 after 90 s; the tests need one and do not skip" >&2
  exit 1
}
