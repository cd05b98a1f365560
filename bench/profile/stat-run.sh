#!/bin/bash
# stat-run.sh NAME [BROKER]: one nackd-bench run (direct / nackd / haproxy,
# one 25 s round each, 1 KiB, confirms window 200, acks every 100) with
# perf stat on nackd during its round and on haproxy during its round.
# Writes NAME.bench, NAME.nackd.perfstat, NAME.haproxy.perfstat here.
# Run from anywhere after `cargo build --release --bins`.
here=$(cd "$(dirname "$0")" && pwd)
bin="$here/../../target/release/nackd-bench"
"$bin" passthrough --broker "${2:-127.0.0.1:5672}" --haproxy --only throughput \
  --rounds 1 --seconds 25 --warmup 2 > "$1.bench" 2>&1 &
bench=$!
until grep -q "^haproxy " "$1.bench" 2>/dev/null; do sleep 0.5; done
npid=$(sed -n 's/^nackd .*(pid \([0-9]*\)).*/\1/p' "$1.bench")
hpid=$(sed -n 's/^haproxy .*(pid \([0-9]*\)).*/\1/p' "$1.bench")
"$here/busy.sh" "$npid" "$here/perfstat.sh" "$npid" "$1.nackd.perfstat"
"$here/busy.sh" "$hpid" "$here/perfstat.sh" "$hpid" "$1.haproxy.perfstat"
wait $bench
