"""Logging TCP relay: 127.0.0.1:LISTEN -> 127.0.0.1:5672.

Each accepted connection N writes conn-N.c2s (client -> broker) and
conn-N.s2c (broker -> client) with the exact bytes relayed.
Usage: python relay.py <listen-port> <out-dir>
"""
import os
import socket
import sys
import threading

UPSTREAM = ("127.0.0.1", 5672)


def pump(src, dst, path):
    with open(path, "wb") as log:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            log.write(data)
            log.flush()
            try:
                dst.sendall(data)
            except OSError:
                break
    for s in (src, dst):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def main():
    port, out = int(sys.argv[1]), sys.argv[2]
    os.makedirs(out, exist_ok=True)
    lsock = socket.socket()
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("127.0.0.1", port))
    lsock.listen()
    n = 0
    while True:
        client, _ = lsock.accept()
        upstream = socket.create_connection(UPSTREAM)
        n += 1
        base = os.path.join(out, f"conn-{n}")
        threading.Thread(target=pump, args=(client, upstream, base + ".c2s"), daemon=True).start()
        threading.Thread(target=pump, args=(upstream, client, base + ".s2c"), daemon=True).start()


if __name__ == "__main__":
    main()
