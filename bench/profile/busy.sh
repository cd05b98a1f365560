#!/bin/bash
# busy.sh PID CMD...: waits until PID uses more than 0.15 core (the bench
# round through it is under way), waits 3 s more, runs CMD, and prints how
# long CMD ran. Used by stat-run.sh and haproxy-run.sh (issue 24 profile).
pid=$1; shift
ticks() { awk '{print $14+$15}' "/proc/$pid/stat"; }
while :; do a=$(ticks); sleep 1; b=$(ticks); [ $((b-a)) -gt 15 ] && break; done
sleep 3
t0=$(date +%s.%N); "$@"; t1=$(date +%s.%N)
echo "busy.sh: pid $pid, window $(echo "$t1-$t0" | bc) s"
