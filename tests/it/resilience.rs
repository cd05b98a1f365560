//! How nackd behaves when a peer misbehaves, dies or goes quiet, and at its
//! limits: real RabbitMQ behind, real lapin (or raw bytes) in front.

use crate::common;

use std::time::{Duration, Instant};

use common::raw::{Ending, RawClient, Relay, RelayMode};
use common::*;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::BasicProperties;
use nackd_core::protocol::frame::{Frame, FrameType};

/// Declares, publishes one message and reads it back through `conn`.
async fn round_trip(conn: &lapin::Connection) {
    let ch = conn.create_channel().await.unwrap();
    let q = unique("alive");
    crate::common::declare_exclusive(&ch, &q).await;
    ch.basic_publish(
        "".into(),
        q.as_str().into(),
        BasicPublishOptions::default(),
        b"ping",
        BasicProperties::default(),
    )
    .await
    .unwrap();
    let mut got = None;
    for _ in 0..50 {
        got = ch
            .basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap();
        if got.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(got.expect("message back").delivery.data, b"ping");
    ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    ch.close(200, "done".into()).await.unwrap();
}

#[tokio::test]
async fn malformed_client_bytes_close_only_that_client_with_the_right_code() {
    let nackd = start("").await;
    let healthy = nackd.connect().await;
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        ("unknown frame type", b"\x09garbage-garbage".to_vec(), 501),
        (
            "oversized frame",
            vec![3, 0, 1, 0x7f, 0xff, 0xff, 0xff],
            501,
        ),
        ("wrong frame-end", vec![8, 0, 0, 0, 0, 0, 0, 0x00], 501),
        (
            "content header without a method",
            Frame::new(
                FrameType::Header,
                1,
                &[0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0],
            )
            .raw
            .to_vec(),
            505,
        ),
        (
            "method frame too short for its ids",
            Frame::new(FrameType::Method, 0, &[0, 10]).raw.to_vec(),
            502,
        ),
    ];
    for (what, bytes, code) in cases {
        let mut bad = RawClient::start(nackd.addr).await;
        bad.send(&bytes).await;
        match bad.ending().await {
            Ending::Close(got, text) => assert_eq!(got, code, "{what}: {text}"),
            Ending::Eof => panic!("{what}: closed without connection.close"),
        }
        assert_eq!(
            bad.ending().await,
            Ending::Eof,
            "{what}: socket closed after close-ok"
        );
        round_trip(&healthy).await;
    }
    assert!(healthy.status().connected());
}

#[tokio::test]
async fn negotiated_frame_max_is_enforced_after_tuning() {
    let nackd = start("").await;
    // The smallest frame_max the broker takes: 4.1+ resets a connection
    // tuned below 8192 (directly as through nackd), 3.x takes AMQP's 4096.
    let frame_max: u32 = if BROKER.at_least(4, 1) { 8192 } else { 4096 };
    let mut client = RawClient::open(nackd.addr, frame_max, 0).await;
    let open_channel = nackd_core::protocol::method::encode(
        1,
        &amq_protocol::protocol::AMQPClass::Channel(
            amq_protocol::protocol::channel::AMQPMethod::Open(
                amq_protocol::protocol::channel::Open {},
            ),
        ),
    );
    client.send(&open_channel).await;
    // A body frame one byte larger than RabbitMQ takes: a payload of
    // frame_max + 1 (it takes 8 octets over frame_max in all, and so does
    // nackd: tests/proxy.rs).
    let frame = Frame::new(FrameType::Body, 1, &vec![0u8; frame_max as usize + 1]);
    client.send(&frame.raw).await;
    match client.ending().await {
        Ending::Close(code, text) => {
            assert_eq!(code, 501, "{text}");
            assert!(text.contains(&format!("frame_max {frame_max}")), "{text}");
        }
        Ending::Eof => panic!("closed without connection.close"),
    }
}

#[tokio::test]
async fn other_protocol_headers_get_ours_and_a_close() {
    let nackd = start("").await;
    for header in [
        &b"AMQP\x01\x01\x00\x0a"[..],
        b"AMQP\x00\x01\x00\x00",
        b"GET / HTTP/1.1\r\n\r\n",
    ] {
        let mut client = RawClient::connect(nackd.addr).await;
        client.send(header).await;
        let mut reply = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut client.stream, &mut reply)
            .await
            .unwrap();
        assert_eq!(reply, b"AMQP\x00\x00\x09\x01", "{header:?}");
    }
}

#[tokio::test]
async fn heartbeats_keep_an_idle_connection_alive() {
    let nackd = start("").await;
    let conn = connect(&nackd.uri("heartbeat=1")).await;
    // More than three heartbeat intervals of silence from the application.
    tokio::time::sleep(Duration::from_millis(4500)).await;
    assert!(conn.status().connected(), "connection survived idle time");
    round_trip(&conn).await;
}

#[tokio::test]
async fn a_silent_client_is_detected_and_both_sides_are_closed() {
    let nackd = start("").await;
    let mut client = RawClient::open(nackd.addr, 131072, 1).await;
    let started = Instant::now();
    // The client sends nothing more, not even heartbeats.
    let _ = client.ending().await;
    // Two silent heartbeat intervals (2 s) are detected; `frame()` gives up
    // at 10 s of silence. 8 s leaves a loaded machine room.
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "closed after {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_hung_broker_is_detected_by_heartbeat_and_the_client_told() {
    let relay = Relay::start(BROKER.addr()).await;
    let nackd = start_upstream(&relay.addr.to_string(), "").await;
    let mut client = RawClient::open(nackd.addr, 131072, 1).await;
    relay.set(RelayMode::Freeze);
    let began = Instant::now();
    let heartbeat = nackd_core::protocol::method::heartbeat();
    let ending = loop {
        assert!(
            began.elapsed() < Duration::from_secs(15),
            "no close from nackd"
        );
        client.send(&heartbeat).await; // this client is alive
        if let Ok(Some(amq_protocol::protocol::AMQPClass::Connection(
            amq_protocol::protocol::connection::AMQPMethod::Close(close),
        ))) = tokio::time::timeout(Duration::from_millis(500), client.method()).await
        {
            break close;
        }
    };
    assert_eq!(ending.reply_code, 320, "{}", ending.reply_text);
    assert!(
        ending.reply_text.as_str().contains("upstream"),
        "{}",
        ending.reply_text
    );
}

#[tokio::test]
async fn killing_the_upstream_socket_closes_the_client_with_an_error() {
    let relay = Relay::start(BROKER.addr()).await;
    let nackd = start_upstream(&relay.addr.to_string(), "").await;
    let conn = nackd.connect().await;
    round_trip(&conn).await;
    relay.set(RelayMode::Kill);
    wait_for(
        Duration::from_secs(15),
        "client connection closed after the upstream socket died",
        || async { conn.status().connected() },
        |connected| !connected,
    )
    .await;
    assert!(
        conn.create_channel().await.is_err(),
        "no new channel on a dead connection"
    );
}

#[tokio::test]
async fn max_connections_refuses_the_extra_client_and_frees_the_slot() {
    let nackd = start("[limits]\nmax_connections = 1\n").await;
    let first = nackd.connect().await;
    let mut extra = RawClient::connect(nackd.addr).await;
    extra
        .send(nackd_core::protocol::frame::PROTOCOL_HEADER)
        .await;
    assert!(
        extra.frame().await.is_none(),
        "extra connection closed without a frame"
    );
    round_trip(&first).await;
    first.close(200, "bye".into()).await.unwrap();
    // The slot is freed when the session ends, after close-ok: wait for it.
    common::ops::until(nackd.metrics, "the first session gone", |s| {
        s.get("nackd_client_connections", &[]) == 0.0
    })
    .await;
    let second = nackd.connect().await;
    round_trip(&second).await;
}

#[tokio::test]
async fn handshake_timeout_drops_silent_and_stalled_clients() {
    let nackd = start("[limits]\nhandshake_timeout = \"500ms\"\n").await;
    // Each is dropped after the configured 500 ms, not the default 10 s:
    // 5 s of margin for a loaded machine still tells them apart.
    let began = Instant::now();
    let mut silent = RawClient::connect(nackd.addr).await;
    assert!(silent.frame().await.is_none());
    assert!(
        began.elapsed() < Duration::from_secs(5),
        "silent client dropped after {:?}",
        began.elapsed()
    );
    let began = Instant::now();
    let mut stalled = RawClient::start(nackd.addr).await; // never answers connection.start
    assert!(stalled.frame().await.is_none());
    assert!(
        began.elapsed() < Duration::from_secs(5),
        "stalled client dropped after {:?}",
        began.elapsed()
    );
    let ok = nackd.connect().await;
    round_trip(&ok).await;
}

#[tokio::test]
async fn shutdown_stops_accepting_then_closes_sessions_after_grace() {
    // 5 s of grace: the round trip "during the grace period" below must fit
    // in it on a loaded machine too.
    let nackd = start("[limits]\nshutdown_grace = \"5s\"\n").await;
    let conn = nackd.connect().await;
    let cancelled = Instant::now();
    nackd.shutdown.cancel();
    wait_for(
        Duration::from_secs(10),
        "the listener closed",
        || async { tokio::net::TcpStream::connect(nackd.addr).await.is_err() },
        |refused| *refused,
    )
    .await;
    round_trip(&conn).await; // still served during the grace period
    tokio::time::timeout(Duration::from_secs(20), nackd.task)
        .await
        .expect("nackd stops")
        .unwrap();
    // The grace runs from the cancel on: measured from there, however long
    // the steps above took, nackd cannot have stopped before it was over.
    assert!(
        cancelled.elapsed() >= Duration::from_secs(5),
        "grace period honoured: stopped {:?} after the cancel",
        cancelled.elapsed()
    );
    eventually(Duration::from_secs(10), "client sees the close", || {
        !conn.status().connected()
    })
    .await;
}

#[tokio::test]
async fn after_close_ok_the_client_closes_its_socket_first() {
    let nackd = start("").await;
    let mut client = RawClient::open(nackd.addr, 131072, 0).await;
    client
        .send(&nackd_core::protocol::method::connection_close(
            nackd_core::protocol::reply::ReplyCode::Success,
            "bye",
            None,
        ))
        .await;
    match client.method().await {
        Some(amq_protocol::protocol::AMQPClass::Connection(
            amq_protocol::protocol::connection::AMQPMethod::CloseOk(_),
        )) => {}
        other => panic!("expected close-ok, got {other:?}"),
    }
    // As RabbitMQ does, nackd leaves the socket for the client to close, so
    // clients do not see the end of the stream before they handled close-ok.
    let mut byte = [0u8; 1];
    let early = tokio::time::timeout(
        Duration::from_millis(300),
        tokio::io::AsyncReadExt::read(&mut client.stream, &mut byte),
    )
    .await;
    assert!(
        early.is_err(),
        "nackd closed the socket before the client did: {early:?}"
    );
}

/// Nacking thousands of messages and closing at once (channel, then
/// connection) must not lose a single upstream ack: every close waits until
/// nackd has acked what it holds, so the broker requeues none of them.
#[tokio::test]
async fn closing_right_after_a_burst_of_nacks_loses_no_ack() {
    const N: u32 = 2000;
    let q = unique("close-burst");
    let nackd = start(&format!(
        "[[policy]]\nqueues = [\"{q}\"]\ndelays = [\"10m\"]\n"
    ))
    .await;
    let direct = direct().await;
    let dch = direct.create_channel().await.unwrap();
    dch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut quorum = FieldTable::default();
    quorum.insert(
        "x-queue-type".into(),
        lapin::types::AMQPValue::LongString("quorum".into()),
    );
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    dch.queue_declare(q.as_str().into(), durable, quorum)
        .await
        .unwrap();
    for i in 0..N {
        publish(&dch, &q, &i.to_be_bytes()).await;
    }
    for close_connection_only in [false, true] {
        let conn = nackd.connect().await;
        let ch = conn.create_channel().await.unwrap();
        let mut c = consume(&ch, &q, Some(500)).await;
        for _ in 0..N / 2 {
            let d = next(&mut c, Duration::from_secs(20))
                .await
                .expect("delivery");
            d.nack(BasicNackOptions::default()).await.unwrap();
        }
        if !close_connection_only {
            let _ = ch.close(200, "".into()).await;
        }
        let _ = conn.close(200, "".into()).await;
    }
    let held = [("vhost", "/"), ("queue", q.as_str())];
    common::ops::until(nackd.metrics, "all held", |s| {
        s.get("nackd_held_messages", &held) == f64::from(N)
    })
    .await;
    // Every one was acked upstream: none is back in the queue.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let left = message_count(&dch, &q).await;
    assert_eq!(left, 0, "the broker requeued messages nackd holds");
    dch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    nackd.stop().await;
}
