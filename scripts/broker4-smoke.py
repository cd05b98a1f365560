#!/usr/bin/env python3
"""A real AMQP client against a RabbitMQ 4.x from scripts/broker4.

    python3 scripts/broker4-smoke.py PORT VERSION      (scripts/broker4 smoke V)

Checks, on 127.0.0.1:PORT as guest/guest: the node reports VERSION; one
message goes through a durable classic queue and one through a quorum
queue (publisher confirms, a consumer, an ack); global QoS is denied (the
prefetch applies per consumer); a transient non-exclusive queue is refused
with connection.close 541. Exits non-zero on the first check that fails.
"""
import sys
import time
import uuid

import pika
from pika.exceptions import ChannelClosedByBroker, ConnectionClosedByBroker

PORT = int(sys.argv[1])
VERSION = sys.argv[2]
PARAMS = pika.ConnectionParameters(
    host="127.0.0.1",
    port=PORT,
    credentials=pika.PlainCredentials("guest", "guest"),
    connection_attempts=1,
    socket_timeout=10,
    blocked_connection_timeout=30,
)
passed = 0


def ok(what):
    global passed
    passed += 1
    print(f"ok: {what}")


def fail(what):
    print(f"FAIL: {what}")
    print(f"{passed} passed, 1 failed")
    sys.exit(1)


def name(kind):
    return f"broker4-smoke-{kind}-{uuid.uuid4().hex[:8]}"


def round_trip(conn, args, kind):
    """Publishes one confirmed message to a new durable queue and consumes it."""
    ch = conn.channel()
    ch.confirm_delivery()
    q = name(kind)
    ch.queue_declare(q, durable=True, arguments=args)
    body = uuid.uuid4().bytes
    ch.basic_publish("", q, body, pika.BasicProperties(delivery_mode=2), mandatory=True)
    got = []

    def on_message(c, method, _props, b):
        got.append(b)
        c.basic_ack(method.delivery_tag)

    ch.basic_qos(prefetch_count=1)
    tag = ch.basic_consume(q, on_message)
    deadline = time.monotonic() + 15
    while not got and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.5)
    ch.basic_cancel(tag)
    if got != [body]:
        fail(f"{kind} queue {q}: expected our message back, got {got!r}")
    declared = ch.queue_declare(q, passive=True)
    if declared.method.message_count != 0:
        fail(f"{kind} queue {q}: {declared.method.message_count} messages left after the ack")
    ch.queue_delete(q)
    ch.close()
    ok(f"published (confirmed) and consumed one message through a {kind} queue")


def refused_541(what, act):
    """Runs act(channel) on a connection of its own: 4.x answers a denied
    deprecated feature with 541 INTERNAL_ERROR, a hard error that closes
    the whole connection, not just the channel."""
    conn = pika.BlockingConnection(PARAMS)
    try:
        act(conn.channel())
    except ConnectionClosedByBroker as e:
        if e.reply_code != 541:
            fail(f"{what}: connection closed with {e.reply_code} {e.reply_text}, expected 541")
        ok(f"{what}: connection closed with {e.reply_code} ({e.reply_text.splitlines()[0]})")
        return
    except ChannelClosedByBroker as e:
        fail(f"{what}: channel closed with {e.reply_code} {e.reply_text}, expected connection.close 541")
    fail(f"{what}: accepted, expected connection.close 541")


def global_qos_per_consumer(conn):
    """With global QoS denied, 4.x answers basic.qos(global=true) with qos-ok
    (and an error in its log) and applies the prefetch per consumer: two
    consumers under a "global" prefetch of 1 get one message each."""
    ch = conn.channel()
    q = name("qos")
    ch.queue_declare(q, durable=True)
    ch.confirm_delivery()
    for _ in range(6):
        ch.basic_publish("", q, b"m")
    ch.basic_qos(prefetch_count=1, global_qos=True)
    got = []
    for _ in range(2):
        ch.basic_consume(q, lambda _c, m, _p, _b: got.append(m.delivery_tag))
    deadline = time.monotonic() + 15
    while len(got) < 2 and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.2)
    conn.process_data_events(time_limit=1)  # a third delivery would show here
    ch.close()
    conn.channel().queue_delete(q)
    if len(got) != 2:
        fail(f"basic.qos(1, global=true) with 2 consumers: {len(got)} unacked deliveries, expected 2 (per consumer)")
    ok("basic.qos(global=true) is accepted but applied per consumer (global QoS denied)")


def main():
    conn = pika.BlockingConnection(PARAMS)
    version = conn._impl.server_properties.get("version", b"")
    version = version.decode() if isinstance(version, bytes) else str(version)
    if not version.startswith(VERSION + "."):
        fail(f"the broker on {PORT} says version {version!r}, expected {VERSION}.x")
    ok(f"connected to RabbitMQ {version} on 127.0.0.1:{PORT} as guest")

    round_trip(conn, None, "classic")
    round_trip(conn, {"x-queue-type": "quorum"}, "quorum")

    global_qos_per_consumer(conn)
    conn.close()

    transient = name("transient")
    refused_541(
        "declaring a transient non-exclusive queue",
        lambda ch: ch.queue_declare(transient, durable=False, exclusive=False, auto_delete=False),
    )
    print(f"{passed} passed, 0 failed")


main()
