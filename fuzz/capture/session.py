"""A real pika session through the logging relay, covering the methods nackd
cares about. Usage: python session.py <relay-port>"""
import datetime
import decimal
import sys
import time

import pika

PORT = int(sys.argv[1])


def params(**kw):
    return pika.ConnectionParameters(
        host="127.0.0.1", port=PORT, virtual_host="/",
        credentials=pika.PlainCredentials("guest", "guest"),
        client_properties={"connection_name": "nackd-corpus-capture"}, **kw)


def headers():
    return {
        "x-retry-count": 3,
        "big": 2**40,
        "neg": -5,
        "str": "héllo ✓",
        "bytes": b"\x00\x01\xfe\xff",
        "flag": True,
        "none": None,
        "dec": decimal.Decimal("3.14"),
        "when": datetime.datetime(2024, 5, 1, 12, 0, 0),
        "nested": {"a": 1, "b": ["x", 2, {"deep": False}]},
        "list": [1, "two", [3, [4]], None],
    }


def props(i=0):
    return pika.BasicProperties(
        content_type="application/json", content_encoding="gzip",
        headers=headers(), delivery_mode=2, priority=5,
        correlation_id=f"corr-{i}", reply_to="replies", expiration="60000",
        message_id=f"msg-{i}", timestamp=1_700_000_000, type="order.created",
        user_id="guest", app_id="corpus-capture")


def main_session():
    conn = pika.BlockingConnection(params(heartbeat=1))
    ch = conn.channel()
    ch.exchange_declare("corpus.x", "topic", durable=False, auto_delete=True)
    ch.exchange_declare("corpus.dlx", "fanout", auto_delete=True)
    ch.queue_declare("corpus.dlq", auto_delete=False, arguments={"x-queue-type": "classic"})
    ch.queue_bind("corpus.dlq", "corpus.dlx")
    ch.queue_declare("corpus.q", arguments={
        "x-dead-letter-exchange": "corpus.dlx", "x-max-priority": 10,
        "x-queue-type": "classic"})
    ch.queue_bind("corpus.q", "corpus.x", routing_key="order.*")
    ch.queue_purge("corpus.q")
    ch.queue_purge("corpus.dlq")
    anon = ch.queue_declare("", exclusive=True).method.queue
    ch.basic_qos(prefetch_count=50)

    # publishes: full properties, no properties, empty body, multi-frame body
    for i in range(4):
        ch.basic_publish("corpus.x", "order.created", b'{"n": %d}' % i, props(i))
    ch.basic_publish("", "corpus.q", b"plain")
    ch.basic_publish("", "corpus.q", b"", pika.BasicProperties(headers={}))
    ch.basic_publish("", "corpus.q", bytes(range(256)) * 1200, props(99))
    ch.basic_publish("", anon, b"to server-named queue")

    # basic.get: get-ok, ack; then get on the server-named queue; then get-empty
    m, _, _ = ch.basic_get("corpus.q")
    ch.basic_ack(m.delivery_tag)
    m, _, _ = ch.basic_get(anon, auto_ack=True)
    m, _, _ = ch.basic_get("corpus.nonexistent-but-empty" if False else anon)
    assert m is None

    # consume / deliver; ack, nack(multiple), reject -> dead-lettered
    got = []
    def on_msg(c, method, p, body):
        got.append(method.delivery_tag)
    tag = ch.basic_consume("corpus.q", on_msg, consumer_tag="ctag-corpus")
    while len(got) < 6:
        conn.process_data_events(time_limit=0.2)
    ch.basic_ack(got[0])
    ch.basic_nack(got[2], multiple=True, requeue=True)  # covers 2, 3 -> redelivered
    ch.basic_reject(got[4], requeue=False)  # dead-lettered with x-death
    ch.basic_nack(got[5], multiple=False, requeue=False)
    while len(got) < 8:
        conn.process_data_events(time_limit=0.2)
    ch.basic_recover(requeue=True)
    conn.process_data_events(time_limit=0.5)
    ch.basic_cancel(tag)
    time.sleep(2.5)  # heartbeats both ways
    conn.process_data_events(time_limit=0.1)

    # dead-lettered messages come back with broker-written x-death headers
    dl = []
    ch2 = conn.channel()
    t2 = ch2.basic_consume("corpus.dlq", lambda c, m, p, b: dl.append(m.delivery_tag))
    while len(dl) < 2:
        conn.process_data_events(time_limit=0.2)
    ch2.basic_nack(dl[-1], multiple=True, requeue=False)
    ch2.basic_cancel(t2)
    ch2.close()

    # tx mode
    tx = conn.channel()
    tx.tx_select()
    tx.basic_publish("", "corpus.q", b"in tx", props(7))
    tx.tx_rollback()
    tx.basic_publish("", "corpus.q", b"in tx 2")
    tx.tx_commit()
    tx.close()

    # confirm mode, mandatory publish that is returned
    cf = conn.channel()
    cf.confirm_delivery()
    cf.basic_publish("", "corpus.q", b"confirmed", props(8))
    try:
        cf.basic_publish("", "no-such-queue", b"returned", props(9), mandatory=True)
    except pika.exceptions.UnroutableError:
        pass
    cf.close()

    # a channel closed by the broker (404 on passive declare)
    bad = conn.channel()
    try:
        bad.queue_declare("corpus.absent", passive=True)
    except pika.exceptions.ChannelClosedByBroker:
        pass

    ch.queue_unbind("corpus.q", "corpus.x", routing_key="order.*")
    ch.queue_delete("corpus.q")
    ch.queue_delete("corpus.dlq")
    ch.exchange_delete("corpus.x")
    ch.exchange_delete("corpus.dlx")
    ch.close()
    conn.close()


def small_frames_session():
    """frame_max 4096: a big body is cut into many body frames."""
    conn = pika.BlockingConnection(params(frame_max=4096, channel_max=16))
    ch = conn.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.basic_publish("", q, b"z" * 20000, props(1))
    while True:
        m, p, body = ch.basic_get(q)
        if m:
            ch.basic_reject(m.delivery_tag, requeue=False)
            break
    conn.close()


if __name__ == "__main__":
    main_session()
    small_frames_session()
    print("ok")
