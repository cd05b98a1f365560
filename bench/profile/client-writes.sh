#!/usr/bin/env bash
# How pika and amqplib write to the broker: strace counts of the write
# system calls of 1 000 publishes of 1 KiB (confirm mode) and of 1 000
# deliveries acked one by one, as quoted in bench/src/framewise.rs.
#
#   bench/profile/client-writes.sh [HOST:PORT]   (default 127.0.0.1:5672, guest)
#
# Needs strace, python3 (venv, pip) and node with npm; installs pika and
# amqplib (versions below) from PyPI and npm into a temporary directory.
# The ack counts include the consumer's basic.consume and basic.cancel.
set -euo pipefail
PIKA_VERSION=1.4.4
AMQPLIB_VERSION=2.3.1
addr="${1:-127.0.0.1:5672}"
host="${addr%:*}" port="${addr##*:}"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
cd "$dir"
python3 -m venv venv
venv/bin/pip install --quiet --disable-pip-version-check "pika==$PIKA_VERSION"
npm init -y >/dev/null
npm install --silent --no-audit --no-fund "amqplib@$AMQPLIB_VERSION" >/dev/null

cat >pika_pub.py <<PY
import os, pika
c = pika.BlockingConnection(pika.ConnectionParameters("$host", $port))
ch = c.channel(); q = "client-writes-pika-%d" % os.getpid()
ch.queue_declare(q); ch.confirm_delivery()
os.write(2, b"START\n")
for _ in range(1000): ch.basic_publish("", q, b"x" * 1024)
os.write(2, b"END\n")
ch.basic_qos(prefetch_count=100); n = [0]
def got(ch_, m, p, b):
    ch_.basic_ack(m.delivery_tag); n[0] += 1
    if n[0] == 1000: ch_.stop_consuming()
os.write(2, b"START\n")
ch.basic_consume(q, got); ch.start_consuming()
os.write(2, b"END\n")
ch.queue_delete(q); c.close()
PY
cat >amqplib_pub.js <<JS
const amqp = require('amqplib');
(async () => {
  const c = await amqp.connect('amqp://guest:guest@$host:$port');
  const ch = await c.createConfirmChannel();
  const q = 'client-writes-amqplib-' + process.pid; await ch.assertQueue(q);
  const body = Buffer.alloc(1024, 0x61);
  process.stderr.write('START\n');
  for (let i = 0; i < 1000; i++) { ch.sendToQueue(q, body); if (i % 200 == 199) await ch.waitForConfirms(); }
  await ch.waitForConfirms();
  process.stderr.write('END\n');
  await ch.prefetch(100); let n = 0;
  process.stderr.write('START\n');
  await new Promise(done => ch.consume(q, m => { ch.ack(m); if (++n == 1000) done(); }));
  process.stderr.write('END\n');
  await ch.close(); await ch.deleteQueue(q).catch(() => {}); await c.close();
})().catch(e => { console.error(e); process.exit(1); });
JS

# Write system calls between the START/END markers, by call.
count() {
  awk '/write\(2, "START/{s++; next} /write\(2, "END/{s=0} s' "$1" |
    grep -oE '^[0-9]+ +(write|writev|sendto|sendmsg)\(' | awk '{print $2}' | tr -d '(' |
    sort | uniq -c | awk '{printf "%s%s %s", (NR > 1 ? ", " : " "), $1, $2}'
}
phase() { # the Nth START..END block of $1
  awk -v n="$2" '/write\(2, "START/{k++} k==n && /write\(2, "END/{exit} k==n' "$1"
}
trace=write,writev,sendto,sendmsg
# The clients' own stderr (the markers, and any error) goes to a file,
# shown when a client fails.
traced() {
  local name="$1"
  shift
  if ! strace -f -e trace=$trace -o "$name.st" "$@" 2>"$name.err"; then
    echo "client-writes: $name failed:" >&2
    grep -v -x -e START -e END "$name.err" >&2 || true
    exit 1
  fi
}
traced pika venv/bin/python pika_pub.py
traced amqplib node amqplib_pub.js
for client in "pika $PIKA_VERSION:pika.st" "amqplib $AMQPLIB_VERSION:amqplib.st"; do
  name="${client%%:*}" file="${client##*:}"
  phase "$file" 1 >pub.st; phase "$file" 2 >ack.st
  if [ ! -s pub.st ] || [ ! -s ack.st ]; then
    echo "client-writes: no START..END block in $file" >&2
    exit 1
  fi
  echo "$name: 1000 publishes:$(count pub.st); 1000 acks:$(count ack.st)"
done
