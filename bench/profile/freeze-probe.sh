#!/usr/bin/env bash
# What a local 3-node cluster (scripts/cluster) still does while one node
# is frozen (SIGSTOP): the facts behind issue 36's "interception that does
# not wait for net_ticktime". Declares three streams, each led by one node
# (x-queue-leader-locator client-local), freezes node 2, then times, each
# on a new connection and within 12 s: publishes with confirms to the
# streams led by nodes 1 and 2 through nodes 1 and 3, a new stream and a
# new classic queue declared through node 1. Thaws node 2, deletes it all.
#
#   bench/profile/freeze-probe.sh [3.10|4.3]     (default 3.10)
#
# Needs python3 (venv, pip: pika is installed into a temporary directory),
# and root for the 4.3 cluster (scripts/cluster). Queues it declared are
# deleted at the end; a run cut short leaves its freeze-probe-* streams.
# Run it on a fresh cluster: on 3.10 a node frozen past net_ticktime
# (60 s) is partitioned after it thaws (`scripts/cluster stop` and
# `start` mend it).
set -euo pipefail
version="${1:-3.10}"
case "$version" in
  3.10) base=568 ;;
  4.3) base=569 ;;
  *) echo "freeze-probe: 3.10 or 4.3" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/../.."
dir="$(mktemp -d)"
trap 'NACKD_CLUSTER_BROKER=$version scripts/cluster thaw-node 2 >/dev/null 2>&1 || true; rm -rf "$dir"' EXIT
python3 -m venv "$dir/venv"
"$dir/venv/bin/pip" install --quiet --disable-pip-version-check pika==1.4.4
cat >"$dir/op.py" <<'PY'
import sys, time, pika
port, op, name = int(sys.argv[1]), sys.argv[2], sys.argv[3]
t0 = time.time()
c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port, heartbeat=0))
ch = c.channel()
if op == "stream":
    ch.queue_declare(name, durable=True, arguments={"x-queue-type": "stream",
        "x-queue-leader-locator": "client-local", "x-initial-cluster-size": 3})
elif op == "classic":
    ch.queue_declare(name, durable=True)
elif op == "publish":
    ch.confirm_delivery()
    ch.basic_publish("", name, b"x", mandatory=True)
elif op == "delete":
    ch.queue_delete(name)
print(f"{time.time() - t0:.2f} s", flush=True)
c.close()
PY
# op NODE WHAT QUEUE: prints what took how long, or that it hung.
op() {
  local out
  local out rc=0
  out="$(timeout 12 "$dir/venv/bin/python" "$dir/op.py" "${base}$1" "$2" "$3" 2>&1)" || rc=$?
  case "$rc" in
    0) printf '%-8s %-22s through node %s: %s\n' "$2" "$3" "$1" "$(tail -1 <<<"$out")" ;;
    124) printf '%-8s %-22s through node %s: no answer within 12 s\n' "$2" "$3" "$1" ;;
    *) printf '%-8s %-22s through node %s: failed: %s\n' "$2" "$3" "$1" "$(tail -1 <<<"$out" | cut -c1-100)" ;;
  esac
}
q="freeze-probe-$$"
NACKD_CLUSTER_BROKER=$version scripts/cluster start >/dev/null
for n in 1 2 3; do op "$n" stream "$q-led-by-$n"; done
NACKD_CLUSTER_BROKER=$version scripts/cluster freeze-node 2 >/dev/null
echo "node 2 frozen at $(date -u +%T)"
op 1 publish "$q-led-by-1"
op 3 publish "$q-led-by-1"
op 3 publish "$q-led-by-3"
op 1 publish "$q-led-by-2"
op 1 stream "$q-new"
op 1 classic "$q-classic"
op 3 publish "$q-led-by-2"
echo "asked at $(date -u +%T)"
NACKD_CLUSTER_BROKER=$version scripts/cluster thaw-node 2 >/dev/null
sleep 3
for name in led-by-1 led-by-2 led-by-3 new classic; do
  op 1 delete "$q-$name" | grep -v ': [0-9.]* s$' || true
done
