#!/usr/bin/env python3
"""Where a retry's lateness goes, read off the wire.

Capture loopback while `nackd-bench retry --mechanisms nackd` runs, then
read the capture:

    tcpdump -i lo -s 0 -B 65536 -w /tmp/retry.pcap 'tcp port 5672 or tcp port NACKD_PORT'
    python3 bench/profile/retry_trace.py /tmp/retry.pcap --broker-port 5672 --delays 100,200,400

Every message body starts with the bench's 8-byte id. For each retry the
script finds, by wire time (when the frame's last byte was captured):

    nack      the consumer's basic.nack reaching nackd (its delivery tag
              mapped back to the id nackd delivered with it);
    republish nackd's basic.publish of that id to the broker;
    upstream  the broker's basic.deliver of it to nackd;
    deliver   nackd's basic.deliver of it to the consumer;

and prints percentiles of each step: republish - (nack + delay) (the
engine's part, timer included), upstream - republish (the broker),
deliver - upstream (nackd's session), and the whole of it,
deliver - nack - delay. The consumer's own figure (what nackd-bench
prints) adds the consumer's reading and its client's queue on top.

Needs dpkt (`pip install dpkt`).
"""

import argparse
import collections
import struct
import sys

import dpkt

BASIC = 60
PUBLISH, DELIVER, ACK, REJECT, NACK = 40, 60, 80, 90, 120


class Flow:
    """One direction of one TCP connection: bytes in order, frames out."""

    def __init__(self):
        self.buf = b""
        self.next_seq = None
        self.header_checked = False
        self.awaiting = {}  # channel -> (kind, info) until its body's first frame

    def feed(self, seq, data):
        if self.next_seq is not None:
            if seq + len(data) <= self.next_seq:
                return  # a retransmission of what we have
            if seq < self.next_seq:
                data = data[self.next_seq - seq:]
        self.next_seq = seq + len(data)
        self.buf += data

    def frames(self):
        if not self.header_checked and len(self.buf) >= 8:
            if self.buf.startswith(b"AMQP"):
                self.buf = self.buf[8:]
            self.header_checked = True
        while len(self.buf) >= 7:
            kind, channel, size = struct.unpack(">BHI", self.buf[:7])
            if kind not in (1, 2, 3, 8) or size > 16 * 1024 * 1024:
                raise ValueError("not AMQP")
            if len(self.buf) < 8 + size:
                return
            payload = self.buf[7:7 + size]
            self.buf = self.buf[8 + size:]
            yield kind, channel, payload


def shortstr(b, at):
    n = b[at]
    return b[at + 1:at + 1 + n], at + 1 + n


def method(payload):
    cls, meth = struct.unpack(">HH", payload[:4])
    if cls != BASIC:
        return None
    args = payload[4:]
    if meth == DELIVER:
        _, at = shortstr(args, 0)
        (tag,) = struct.unpack(">Q", args[at:at + 8])
        _, at = shortstr(args, at + 9)
        key, _ = shortstr(args, at)
        return ("deliver", (key, tag))
    if meth == PUBLISH:
        _, at = shortstr(args, 2)
        key, _ = shortstr(args, at)
        return ("publish", (key, None))
    if meth in (NACK, REJECT):
        (tag,) = struct.unpack(">Q", args[:8])
        return ("nack", tag)
    return None


def read(path, broker_port):
    """Events: (time, what, conn, channel, id or tag)."""
    flows = {}
    dead = set()
    events = []
    with open(path, "rb") as f:
        reader = dpkt.pcap.Reader(f)
        link = dpkt.sll.SLL if reader.datalink() == dpkt.pcap.DLT_LINUX_SLL else dpkt.ethernet.Ethernet
        for ts, raw in reader:
            ip = link(raw).data
            if not isinstance(ip, (dpkt.ip.IP, dpkt.ip6.IP6)):
                continue
            tcp = ip.data
            if not isinstance(tcp, dpkt.tcp.TCP) or not tcp.data:
                continue
            key = (tcp.sport, tcp.dport)
            if key in dead:
                continue
            flow = flows.setdefault(key, Flow())
            flow.feed(tcp.seq, bytes(tcp.data))
            try:
                for kind, channel, payload in flow.frames():
                    if kind == 1:
                        m = method(payload)
                        if m is not None:
                            if m[0] == "nack":
                                events.append((ts, "nack", key, channel, m[1]))
                            else:
                                flow.awaiting[channel] = m
                    elif kind == 3 and channel in flow.awaiting:
                        what, (rkey, tag) = flow.awaiting.pop(channel)
                        if len(payload) < 8:
                            continue
                        # The routing key is the round's queue: ids start
                        # at 0 in every round.
                        (mid,) = struct.unpack(">Q", payload[:8])
                        events.append((ts, what, key, channel, ((rkey, mid), tag)))
            except ValueError:
                dead.add(key)
    return events


def pct(xs, p):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("pcap")
    ap.add_argument("--broker-port", type=int, default=5672)
    ap.add_argument("--delays", default="100,200,400")
    ap.add_argument("--consumer", help="the file of nackd-bench retry --consumer-trace")
    args = ap.parse_args()
    delays = [int(d) / 1000 for d in args.delays.split(",")]
    bp = args.broker_port
    events = read(args.pcap, bp)
    events.sort(key=lambda e: e[0])
    # nackd -> consumer deliveries: (conn, channel, tag) -> id, and per id
    # the times of every step in order.
    tags = {}
    per_id = collections.defaultdict(list)
    for ts, what, key, ch, v in events:
        sport, dport = key
        if what == "deliver" and sport != bp:
            mid, tag = v
            tags[(key, ch, tag)] = mid
            per_id[mid].append((ts, "deliver"))
        elif what == "deliver" and sport == bp:
            per_id[v[0]].append((ts, "upstream"))
        elif what == "publish" and dport == bp:
            per_id[v[0]].append((ts, "publish"))
        elif what == "nack" and dport != bp:
            back = (key[1], key[0])
            mid = tags.get((back, ch, v))
            if mid is not None:
                per_id[mid].append((ts, "nack"))
    seen = {}
    if args.consumer:
        with open(args.consumer) as f:
            for line in f:
                q, mid, n, t_seen, t_before, t_after = line.split()
                seen[(q.encode(), int(mid), int(n))] = (int(t_seen) / 1e6, int(t_before) / 1e6, int(t_after) / 1e6)
    steps = collections.defaultdict(list)
    worst = []
    for mid, evs in per_id.items():
        attempt = 0
        i = 0
        while i < len(evs):
            if evs[i][1] != "nack":
                i += 1
                continue
            t_nack = evs[i][0]
            rest = evs[i + 1:]
            pub = next((t for t, w in rest if w == "publish"), None)
            up = next((t for t, w in rest if w == "upstream" and pub is not None and t >= pub), None)
            dl = next((t for t, w in rest if w == "deliver" and up is not None and t >= up), None)
            if attempt < len(delays) and None not in (pub, up, dl):
                due = t_nack + delays[attempt]
                steps["engine: republish - due"].append((pub - due) * 1e3)
                steps["broker: upstream - republish"].append((up - pub) * 1e3)
                steps["session: deliver - upstream"].append((dl - up) * 1e3)
                total = (dl - due) * 1e3
                steps["whole: deliver - due"].append(total)
                mine = seen.get((mid[0], mid[1], attempt))
                again = seen.get((mid[0], mid[1], attempt + 1))
                if mine and again:
                    steps["client: nack on wire - nack asked"].append((t_nack - mine[1]) * 1e3)
                    steps["client: read - deliver on wire"].append((again[0] - dl) * 1e3)
                    steps["consumer's lateness"].append((again[0] - mine[1] - delays[attempt]) * 1e3)
                worst.append((total, mid, attempt, (pub - due) * 1e3, (up - pub) * 1e3, (dl - up) * 1e3, t_nack))
            attempt += 1
            i += 1
    print(f"retries traced: {len(steps['whole: deliver - due'])}")
    print(f"{'step':32} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for name in ["engine: republish - due", "broker: upstream - republish",
                 "session: deliver - upstream", "whole: deliver - due",
                 "client: nack on wire - nack asked", "client: read - deliver on wire",
                 "consumer's lateness"]:
        if not steps[name]:
            continue
        xs = steps[name]
        print(f"{name:32} {pct(xs, 50):8.2f} {pct(xs, 90):8.2f} {pct(xs, 99):8.2f} {max(xs) if xs else float('nan'):8.2f}")
    worst.sort(reverse=True)
    t0 = events[0][0] if events else 0
    print("the 10 latest (ms): whole = engine + broker + session, at s into the capture")
    for total, mid, attempt, e, b, s, t in worst[:10]:
        print(f"  id {mid[1]:6} of {mid[0].decode(errors='replace')} attempt {attempt + 1}: {total:7.2f} = {e:7.2f} + {b:7.2f} + {s:7.2f}  at {t - t0:6.2f} s")


if __name__ == "__main__":
    sys.exit(main())
