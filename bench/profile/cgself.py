#!/usr/bin/env python3
"""Instructions per message by function, from a callgrind dump (issue 24).

Usage: cgself.py CALLGRIND_FILE MESSAGES [TOP] [INCLUSIVE_REGEX]

The file must be written with --compress-strings=no --compress-pos=no.
callgrind_annotate 3.19 puts all self cost of a dump taken from a running
process (callgrind_control -d) on `clone`; this reads the file itself:
self cost = cost lines not right after a `calls=` line; inclusive cost =
self + the costs of the calls the function makes (recursion not handled).
MESSAGES: messages nackd moved between the two dumps (window.sh prints it).
"""
import collections
import re
import sys


def read(path):
    self_cost = collections.Counter()
    call_cost = collections.Counter()
    fn = cfn = None
    after_calls = False
    total = 0
    for line in open(path, errors="replace"):
        line = line.rstrip("\n")
        if line.startswith("fn="):
            fn, after_calls = line[3:], False
        elif line.startswith("cfn="):
            cfn = line[4:]
        elif line.startswith("calls="):
            after_calls = True
        elif line.startswith(("totals:", "summary:")):
            total = int(line.split()[1])
        elif line and (line[0].isdigit() or line[0] in "+-*"):
            parts = line.split()
            if len(parts) < 2:
                continue
            if after_calls:
                call_cost[(fn, cfn)] += int(parts[1])
                after_calls = False
            else:
                self_cost[fn] += int(parts[1])
    return total, self_cost, call_cost


def main():
    path, msgs = sys.argv[1], float(sys.argv[2])
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    pattern = re.compile(sys.argv[4] if len(sys.argv) > 4 else r"nackd::")
    total, self_cost, call_cost = read(path)
    print(f"total {total:,} Ir; {total / msgs:,.0f} Ir per message ({msgs:,.0f} messages)")
    print("\n-- self cost")
    for f, c in self_cost.most_common(top):
        print(f"{c / total * 100:6.2f}%  {c / msgs:8.0f} Ir/msg  {f[:150]}")
    inclusive = collections.Counter(self_cost)
    for (f, callee), cost in call_cost.items():
        if f != callee:
            inclusive[f] += cost
    print(f"\n-- inclusive cost, functions matching {pattern.pattern}")
    for f, c in inclusive.most_common():
        if pattern.search(f or ""):
            print(f"{c / total * 100:6.2f}%  {c / msgs:8.0f} Ir/msg  {f[:150]}")
    print("\n-- who calls memcpy, malloc, hashing, channel lookups")
    for callee in ["__memcpy_avx_unaligned_erms", "malloc",
                   "core::hash::BuildHasher::hash_one",
                   "nackd::session::channel::Channels::get"]:
        callers = sorted(((cost, f) for (f, c), cost in call_cost.items() if c == callee),
                         reverse=True)
        for cost, f in callers[:6]:
            print(f"{callee[:34]:34} {cost / msgs:7.0f} Ir/msg from {f[:110]}")


if __name__ == "__main__":
    main()
