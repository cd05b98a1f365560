#!/usr/bin/env python3
"""Shares of nackd's CPU samples by what each sample was doing (issue 24).

Usage:
  perf record -e cpu-clock -F 1999 --call-graph fp -p PID -o perf.data -- sleep 15
  perf script -i perf.data -F comm,tid,ip,sym,dso > perf.script
  classify.py perf.script

A kernel sample is put under the syscall it serves, found from the kernel's
own symbols first (so a libc wrapper built without frame pointers does not
lose it), else from the libc wrapper. A user sample is put under the first
group of the list below that any frame of its stack belongs to: the order
matters (a sample in malloc called from the method decoder counts as
decoding). Needs nackd built with frame pointers, see bench/RESULTS.md.
"""
import collections
import sys

SYSCALLS = [
    ("writev (send; on loopback includes delivery into the peer socket)",
     ("do_writev", "__x64_sys_writev"), "__GI___writev"),
    ("recvfrom (read)", ("__x64_sys_recvfrom", "tcp_recvmsg", "__sys_recvfrom"), "__libc_recv"),
    ("epoll_wait (park: sleep and wake-up)", ("__x64_sys_epoll_wait", "do_epoll_wait"), "epoll_wait"),
    ("futex", ("__x64_sys_futex",), "__futex"),
]
USER = [
    ("method decode (amq-protocol/nom, drop of the decoded method)",
     ("nackd::protocol::method::decode", "drop_in_place<amq_protocol")),
    ("channel lookups (HashMap<u16,Channel> + SipHash)",
     ("Channels::get", "hash_one", "sip::Hasher")),
    ("delivery tracking (outstanding tags, ack ranges)",
     ("Channel::on_broker_method", "on_settle", "take_covered",
      "drop_in_place<nackd::session::channel::Delivery")),
    ("frame cutting (FrameDecoder, split_to)",
     ("FrameDecoder::decode", "BytesMut::split_to", "advance_unchecked")),
    ("content-state checks", ("ContentState::advance",)),
    ("copies into write buffers / buffer growth (memmove)", ("memmove", "memcpy", "reserve_inner")),
    ("malloc/free", ("malloc", "free", "_int_")),
    ("tracing span enter/exit", ("tracing_subscriber", "tracing_core", "tracing::span")),
    ("clock reads (Instant::now)", ("clock_gettime", "Instant")),
    ("rest of on_bytes (handlers, metrics)", ("Session>::on_bytes",)),
    ("tokio scheduler / IO registration / pump loop",
     ("tokio::", "spawn_session", "mio::", "poll_fn", "PollFn")),
]


def read_samples(path):
    """Each sample: its frames, leaf first, as (symbol, is_kernel)."""
    samples, frames = [], None
    for line in open(path, errors="replace"):
        if not line.strip():
            if frames:
                samples.append(frames)
            frames = None
            continue
        if frames is None:  # the "comm tid" line
            frames = []
            continue
        parts = line.strip().split(None, 1)
        text = parts[1] if len(parts) > 1 else ""
        symbol, _, dso = text.rpartition(" (")
        frames.append((symbol, "kernel.kallsyms" in dso))
    if frames:
        samples.append(frames)
    return samples


def has(frames, keys):
    return any(any(k in sym for k in keys) for sym, _ in frames)


def classify(frames):
    if frames and frames[0][1]:
        if not has(frames, ("SYSCALL", "do_syscall_64")):
            return "kernel: interrupts, no syscall"
        for name, kernel_keys, _ in SYSCALLS:
            if has(frames, kernel_keys):
                return "kernel: " + name
        for name, _, wrapper in SYSCALLS:
            if any(sym == wrapper for sym, _ in frames):
                return "kernel: " + name
        return "kernel: other syscalls"
    for name, keys in USER:
        if has(frames, keys):
            return "user: " + name
    return "user: other"


def main():
    samples = read_samples(sys.argv[1])
    counts = collections.Counter(classify(f) for f in samples)
    for name, n in counts.most_common():
        print(f"{n / len(samples) * 100:6.1f}%  {name}")
    print(len(samples), "samples")


if __name__ == "__main__":
    main()
