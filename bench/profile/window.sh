#!/bin/bash
# window.sh METRICS_ADDR CMD...: for a nackd started by hand (nackd.toml
# here) and driven by `nackd-bench passthrough --proxy ADDR`: waits until
# nackd moves more than MIN_FRAMES (default 5000) frames/s to the broker,
# waits 3 s more, runs CMD, and prints the frames nackd moved meanwhile from
# its /metrics. Messages ~ to_upstream / 3.01: publish method + header +
# body per message, plus a consumer ack per 100.
m=$1; shift
frames() { curl -s "$m/metrics" | awk -v d="$1" '$1=="nackd_frames_total{direction=\""d"\"}"{print $2}'; }
while :; do a=$(frames to_upstream); sleep 1; b=$(frames to_upstream); [ $((b-a)) -gt "${MIN_FRAMES:-5000}" ] && break; done
sleep 3
u0=$(frames to_upstream); c0=$(frames to_client); t0=$(date +%s.%N)
"$@"
u1=$(frames to_upstream); c1=$(frames to_client); t1=$(date +%s.%N)
echo "window: $(echo "$t1-$t0" | bc) s; frames to_upstream $((u1-u0)), to_client $((c1-c0)); messages ~ $(echo "($u1-$u0)/3.01" | bc)"
