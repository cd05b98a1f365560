#!/bin/bash
# perfstat.sh PID OUT: 10 s of perf stat on PID (all its threads): CPU,
# context switches, syscalls by kind, and the wake-ups PID causes.
# Per message = each count / (the round's msg/s x the elapsed seconds).
perf stat -e cpu-clock,task-clock,context-switches,cpu-migrations,raw_syscalls:sys_enter,syscalls:sys_enter_writev,syscalls:sys_enter_write,syscalls:sys_enter_sendto,syscalls:sys_enter_recvfrom,syscalls:sys_enter_read,syscalls:sys_enter_splice,syscalls:sys_enter_epoll_wait,syscalls:sys_enter_futex,sched:sched_wakeup \
  -p "$1" -o "$2" -- sleep 10
