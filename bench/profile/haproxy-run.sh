#!/bin/bash
# haproxy-run.sh NAME: one nackd-bench run (direct / nackd / haproxy, 25 s
# rounds); during haproxy's round 6 s of `strace -c -f` on it (its syscall
# mix; strace slows it, so not per-message counts), then 8 s of perf record
# (kernel / user split). Writes NAME.bench, NAME.haproxy.strace,
# NAME.haproxy.perf.data here.
here=$(cd "$(dirname "$0")" && pwd)
"$here/../../target/release/nackd-bench" passthrough --haproxy --only throughput \
  --rounds 1 --seconds 25 --warmup 2 > "$1.bench" 2>&1 &
bench=$!
until grep -q "^haproxy " "$1.bench" 2>/dev/null; do sleep 0.5; done
hpid=$(sed -n 's/^haproxy .*(pid \([0-9]*\)).*/\1/p' "$1.bench")
"$here/busy.sh" "$hpid" timeout -s INT 6 strace -c -f -p "$hpid" -o "$1.haproxy.strace"
sleep 1
perf record -e cpu-clock -F 1999 -g -p "$hpid" -o "$1.haproxy.perf.data" -- sleep 8
wait $bench
