"""Crafted seeds: field tables nested around MAX_TABLE_DEPTH (32), which the
fuzzers do not reach from the captured corpus alone in 10 minutes.
Usage: python crafted.py fuzz/corpus"""
import hashlib, os, struct, sys
out = sys.argv[1]
def nested(levels):
    v = b"V"
    for i in range(levels):
        if i % 2 == 0:
            v = b"A" + struct.pack(">I", len(v)) + v
        else:
            inner = b"\x01k" + v
            v = b"F" + struct.pack(">I", len(inner)) + inner
    return v
def table(levels):
    body = b"\x01a" + nested(levels)
    return struct.pack(">I", len(body)) + body
def header(levels):
    flags = (1 << 13) | (1 << 12)
    return struct.pack(">HHQH", 60, 0, 5, flags) + table(levels) + b"\x02"
def start_ok(levels):
    s = lambda b: bytes([len(b)]) + b
    l = lambda b: struct.pack(">I", len(b)) + b
    return struct.pack(">HH", 10, 11) + table(levels) + s(b"PLAIN") + l(b"\x00guest\x00guest") + s(b"en_US")
def consume(levels):
    s = lambda b: bytes([len(b)]) + b
    return struct.pack(">HHH", 60, 20, 0) + s(b"q") + s(b"ctag") + b"\x00" + table(levels)
def frame(kind, ch, payload):
    return struct.pack(">BHI", kind, ch, len(payload)) + payload + b"\xce"
def write(sub, name, blob):
    os.makedirs(os.path.join(out, sub), exist_ok=True)
    open(os.path.join(out, sub, f"crafted-{name}-{hashlib.sha1(blob).hexdigest()[:10]}"), "wb").write(blob)
for levels in (31, 32, 40):
    for name, payload, kind in (("header", header(levels), 2), ("connection.start-ok", start_ok(levels), 1), ("basic.consume", consume(levels), 1)):
        write("method_header", f"{name}-nested{levels}", payload)
        write("frames", f"{name}-nested{levels}", frame(kind, 0 if kind == 1 and name.startswith("conn") else 1, payload))
