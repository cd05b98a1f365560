"""Cut captured AMQP streams (relay.py output) into seed corpus files.

Usage: python corpus.py <capture-dir> <fuzz/corpus>

frames/         one file per distinct frame, plus runs of consecutive frames
                (the handshake with the protocol header, publish and deliver
                method+header+body, sliding windows of 4 frames)
method_header/  one file per distinct method or content-header payload
roundtrip/      the same payloads: bytes for arbitrary::Unstructured
Files above MAX_FILE octets are left out (libFuzzer is fastest on small
inputs); names say direction, what it is, and a content hash.
"""
import glob
import hashlib
import os
import struct
import sys

MAX_FILE = 16 * 1024
NAMES = {
    (10, 10): "connection.start", (10, 11): "connection.start-ok", (10, 30): "connection.tune",
    (10, 31): "connection.tune-ok", (10, 40): "connection.open", (10, 41): "connection.open-ok",
    (10, 50): "connection.close", (10, 51): "connection.close-ok", (20, 10): "channel.open",
    (20, 11): "channel.open-ok", (20, 40): "channel.close", (20, 41): "channel.close-ok",
    (40, 10): "exchange.declare", (40, 11): "exchange.declare-ok", (40, 20): "exchange.delete",
    (40, 21): "exchange.delete-ok", (50, 10): "queue.declare", (50, 11): "queue.declare-ok",
    (50, 20): "queue.bind", (50, 21): "queue.bind-ok", (50, 30): "queue.purge",
    (50, 31): "queue.purge-ok", (50, 40): "queue.delete", (50, 41): "queue.delete-ok",
    (50, 50): "queue.unbind", (50, 51): "queue.unbind-ok", (60, 10): "basic.qos",
    (60, 11): "basic.qos-ok", (60, 20): "basic.consume", (60, 21): "basic.consume-ok",
    (60, 30): "basic.cancel", (60, 31): "basic.cancel-ok", (60, 40): "basic.publish",
    (60, 50): "basic.return", (60, 60): "basic.deliver", (60, 70): "basic.get",
    (60, 71): "basic.get-ok", (60, 72): "basic.get-empty", (60, 80): "basic.ack",
    (60, 90): "basic.reject", (60, 110): "basic.recover", (60, 111): "basic.recover-ok",
    (60, 120): "basic.nack", (85, 10): "confirm.select", (85, 11): "confirm.select-ok",
    (90, 10): "tx.select", (90, 11): "tx.select-ok", (90, 20): "tx.commit",
    (90, 21): "tx.commit-ok", (90, 30): "tx.rollback", (90, 31): "tx.rollback-ok",
}


def frames(data):
    """(name, raw) for every frame; the protocol header first if present."""
    if data.startswith(b"AMQP"):
        yield "protocol-header", data[:8]
        data = data[8:]
    at = 0
    while at + 7 <= len(data):
        kind, _, size = struct.unpack(">BHI", data[at:at + 7])
        raw = data[at:at + 8 + size]
        assert raw[-1] == 0xCE, f"bad frame end at {at}"
        if kind == 1:
            name = NAMES.get(struct.unpack(">HH", raw[7:11]), "method")
        else:
            name = {2: "header", 3: "body", 8: "heartbeat"}[kind]
        yield name, raw
        at += 8 + size
    assert at == len(data), "stream ends inside a frame"


def write(out, sub, stem, blob, seen):
    digest = hashlib.sha1(blob).hexdigest()
    if len(blob) > MAX_FILE or (sub, digest) in seen:
        return
    seen.add((sub, digest))
    os.makedirs(os.path.join(out, sub), exist_ok=True)
    with open(os.path.join(out, sub, f"{stem}-{digest[:10]}"), "wb") as f:
        f.write(blob)


def main():
    capture, out = sys.argv[1], sys.argv[2]
    seen = set()
    for path in sorted(glob.glob(os.path.join(capture, "conn-*.*"))):
        direction = path.rsplit(".", 1)[1]
        stream = list(frames(open(path, "rb").read()))
        for name, raw in stream:
            write(out, "frames", f"{direction}-{name}", raw, seen)
            if name not in ("protocol-header", "body", "heartbeat"):
                for sub in ("method_header", "roundtrip"):
                    write(out, sub, f"{direction}-{name}", raw[7:-1], seen)
        for i in range(len(stream)):
            name = stream[i][0]
            if name == "protocol-header" or name.endswith(("publish", "deliver", "get-ok", "return")):
                run = [stream[i]]
                for nxt in stream[i + 1:]:
                    if nxt[0] not in ("header", "body", "connection.start-ok", "connection.tune-ok",
                                      "connection.open") or len(run) >= 8:
                        break
                    run.append(nxt)
                write(out, "frames", f"{direction}-run-{name}", b"".join(r for _, r in run), seen)
            window = stream[i:i + 4]
            if len(window) == 4 and i % 3 == 0:
                write(out, "frames", f"{direction}-window", b"".join(r for _, r in window), seen)


if __name__ == "__main__":
    main()
