//! One crafted message must not bring nackd down (issue 33, finding 3): a
//! message whose headers nest 20 000 arrays (about 100 KB, under
//! `frame_max`), published straight to the broker, is read by nackd's
//! lapin connections (dead-letter replay, the replica's streams). lapin's
//! parser recurses once per level; without the screen in front of it
//! (`src/screen.rs`) its thread overflows its stack and the process aborts.
//! The crafted message is published and read back by a raw client here:
//! lapin in this process would overflow as well.

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use amq_protocol::protocol::{basic, confirm, AMQPClass};
use bytes::Bytes;
use common::raw::RawClient;
use common::*;
use lapin::options::*;
use lapin::Channel;
use nackd_core::protocol::frame::FrameType;
use nackd_core::protocol::method;

const TOKEN: &str = "screen-test-token-0123456789";
/// Levels of nested arrays in the crafted message's headers.
const DEPTH: usize = 20_000;
const CRAFTED: &[u8] = b"crafted";

/// A content header payload (class 60) for a body of `body_size` octets
/// whose `headers` table holds `deep`: `depth` nested arrays.
fn crafted_header(depth: usize, body_size: u64) -> Vec<u8> {
    let mut value = vec![b'A', 0, 0, 0, 0];
    for _ in 1..depth {
        let inner = value;
        value = vec![b'A'];
        value.extend_from_slice(&(inner.len() as u32).to_be_bytes());
        value.extend_from_slice(&inner);
    }
    let mut table = vec![4];
    table.extend_from_slice(b"deep");
    table.extend_from_slice(&value);
    let mut payload = vec![0, 60, 0, 0];
    payload.extend_from_slice(&body_size.to_be_bytes());
    // delivery-mode (persistent) and headers.
    payload.extend_from_slice(&((1u16 << 13) | (1 << 12)).to_be_bytes());
    payload.extend_from_slice(&(table.len() as u32).to_be_bytes());
    payload.extend_from_slice(&table);
    payload.push(2);
    payload
}

fn broker_addr() -> SocketAddr {
    BROKER.addr().parse().expect("the broker's address")
}

/// Publishes the crafted message to `queue` straight to the broker (a raw
/// client: lapin cannot encode it either), confirmed: a stream read that
/// starts after this sees it before its own end marker.
async fn publish_crafted(queue: &str) -> Vec<u8> {
    let header = crafted_header(DEPTH, CRAFTED.len() as u64);
    assert!(header.len() < 131_072 - 8, "under frame_max");
    let mut raw = RawClient::open(broker_addr(), 131_072, 0).await;
    raw.open_channel(1).await;
    let select = AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select { nowait: false }));
    raw.send(&method::encode(1, &select)).await;
    match raw.method().await {
        Some(AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_))) => {}
        other => panic!("expected confirm.select-ok, got {other:?}"),
    }
    let publish = AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
        exchange: "".into(),
        routing_key: queue.into(),
        mandatory: false,
        immediate: false,
    }));
    let mut out = bytes::BytesMut::new();
    out.extend_from_slice(&method::encode(1, &publish));
    method::put_frame(&mut out, FrameType::Header, 1, &header);
    method::put_frame(&mut out, FrameType::Body, 1, CRAFTED);
    raw.send(&out).await;
    match raw.method().await {
        Some(AMQPClass::Basic(basic::AMQPMethod::Ack(_))) => {}
        other => panic!("expected the publish confirmed, got {other:?}"),
    }
    header
}

/// Every message of `queue` as (content header payload, body), read with
/// `basic.get` by a raw client and requeued when it disconnects.
async fn raw_peek(queue: &str) -> Vec<(Bytes, Bytes)> {
    let mut raw = RawClient::open(broker_addr(), 131_072, 0).await;
    raw.open_channel(1).await;
    let get = AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
        queue: queue.into(),
        no_ack: false,
    }));
    let mut all = Vec::new();
    loop {
        raw.send(&method::encode(1, &get)).await;
        match raw.method().await {
            Some(AMQPClass::Basic(basic::AMQPMethod::GetOk(_))) => {}
            Some(AMQPClass::Basic(basic::AMQPMethod::GetEmpty(_))) => break,
            other => panic!("expected get-ok or get-empty, got {other:?}"),
        }
        let header = raw.frame().await.expect("a content header");
        assert_eq!(header.kind, FrameType::Header);
        let size = nackd_core::protocol::content::body_size(header.payload_slice()).unwrap();
        let mut body = Vec::new();
        while (body.len() as u64) < size {
            let frame = raw.frame().await.expect("a body frame");
            assert_eq!(frame.kind, FrameType::Body);
            body.extend_from_slice(frame.payload_slice());
        }
        all.push((header.payload(), Bytes::from(body)));
    }
    all
}

/// `n` messages the broker dead-lettered from `orig` into `dlq`.
async fn dead_letters(ch: &Channel, dlq: &str, orig: &str, n: u32) {
    declare_durable(ch, dlq).await;
    declare_dead_lettering(ch, orig, dlq).await;
    for i in 0..n {
        assert!(publish(ch, orig, &i.to_be_bytes()).await.is_ack());
    }
    let mut consumer = consume(ch, orig, Some(100)).await;
    for _ in 0..n {
        let d = next(&mut consumer, Duration::from_secs(10))
            .await
            .expect("a message to reject");
        d.reject(BasicRejectOptions { requeue: false })
            .await
            .unwrap();
    }
    ch.basic_cancel(consumer.tag(), BasicCancelOptions::default())
        .await
        .unwrap();
}

/// A publish and a consume through nackd on a connection it had before.
async fn round_trip(ch: &Channel, q: &str, body: &[u8]) {
    assert!(publish(ch, q, body).await.is_ack());
    let d = ch
        .basic_get(q.into(), BasicGetOptions::default())
        .await
        .expect("the bystander's channel works")
        .expect("its message is there");
    assert_eq!(d.delivery.data, body);
    d.delivery.ack(BasicAckOptions::default()).await.unwrap();
}

/// A dead-letter queue holding the crafted message and messages the broker
/// dead-lettered: a dry run and a replay of it leave nackd and a client
/// connected through it untouched, set the crafted message aside with its
/// headers byte for byte, and move the others as before.
#[tokio::test]
async fn a_crafted_message_in_a_dead_letter_queue_is_set_aside_by_replay() {
    const N: u32 = 3;
    let (dlq, orig, own) = (
        unique("screen-dlq"),
        unique("screen-orig"),
        unique("screen-own"),
    );
    let nackd = start(&format!(
        "[metrics]\nadmin_token = \"{TOKEN}\"\n[[policy]]\nqueues = [\"{}\"]\ndelays = [\"1s\"]\n",
        unique("screen-policy")
    ))
    .await;
    let conn = direct().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    dead_letters(&ch, &dlq, &orig, N).await;
    publish_crafted(&dlq).await;
    wait_for(
        Duration::from_secs(10),
        "every message in the dead-letter queue",
        || async { message_count(&ch, &dlq).await },
        |n| *n == N + 1,
    )
    .await;
    let before = raw_peek(&dlq).await;
    let crafted_before = before
        .iter()
        .find(|(_, body)| body[..] == *CRAFTED)
        .expect("the crafted message")
        .clone();

    // A client of nackd, connected before the replay.
    let bystander = nackd.connect().await;
    let bch = bystander.create_channel().await.unwrap();
    bch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    declare_durable(&bch, &own).await;
    round_trip(&bch, &own, b"before").await;

    let path = format!("/api/replay{}", common::ops::query(&dlq)).replace("?queue=", "?dlq=");
    let dry = common::ops::json(nackd.metrics, "POST", &format!("{path}&dry_run=true"), Some(TOKEN)).await;
    assert_eq!(dry["examined"], N + 1, "{dry}");
    assert_eq!(dry["set_aside"], 1, "{dry}");
    assert_eq!(dry["destinations"][orig.as_str()], N, "{dry}");
    assert!(dry["error"].is_null(), "{dry}");
    round_trip(&bch, &own, b"after the dry run").await;

    let done = common::ops::json(nackd.metrics, "POST", &path, Some(TOKEN)).await;
    assert_eq!(done["examined"], N + 1, "{done}");
    assert_eq!(done["moved"], N, "{done}");
    assert_eq!(done["set_aside"], 1, "{done}");
    assert!(done["error"].is_null(), "{done}");
    wait_for(
        Duration::from_secs(30),
        "the others back in their queue",
        || async { (message_count(&ch, &orig).await, message_count(&ch, &dlq).await) },
        |c| c.0 == N && c.1 == 1,
    )
    .await;
    let after = raw_peek(&dlq).await;
    assert_eq!(after.len(), 1);
    assert_eq!(after[0].1, crafted_before.1, "the crafted body");
    assert!(
        after[0].0 == crafted_before.0,
        "the crafted message's properties changed ({} octets before, {} after)",
        crafted_before.0.len(),
        after[0].0.len()
    );
    common::ops::until(nackd.metrics, "the folds counted", |s| {
        s.sum("nackd_screen_folded_total") >= 2.0
    })
    .await;
    round_trip(&bch, &own, b"after the replay").await;
    assert!(bystander.status().connected());

    delete_queues(&ch, &[&dlq, &orig, &own]).await;
    let _ = bystander.close(200, "".into()).await;
    let _ = conn.close(200, "".into()).await;
    nackd.stop().await;
}

/// The replica's reads: a stream holding the crafted message (someone
/// published to it) is read to its end as nackd reads a stream to rebuild
/// or adopt: the read fails with a reason for that stream, and the process
/// and its connection carry on. (RabbitMQ 3.10 and 4.3 store a 0-9-1
/// publish to a stream as AMQP 1.0 and hand back a flattened header, so
/// here the broker, not the screen, removes the nesting; the screen covers
/// a broker that would not.)
#[tokio::test]
async fn a_crafted_message_in_a_replica_stream_fails_only_that_read() {
    use nackd::replica::client::{Client, ClientError};
    use nackd::replica::{Record, Target};
    let target = Target {
        nodes: vec![BROKER.addr().to_string()],
        vhost: "/".into(),
        username: "guest".into(),
        password: "guest".into(),
        heartbeat: Duration::from_secs(5),
        cluster_size: None,
        tls: None,
    };
    let (crafted, clean) = (unique("screen-stream"), unique("screen-stream-clean"));
    let client = Client::connect(&target, 0, "screen test").await.unwrap();
    client.declare_stream(&crafted).await.unwrap();
    client.declare_stream(&clean).await.unwrap();
    publish_crafted(&crafted).await;
    match client.read_all(&crafted).await {
        Err(ClientError::Malformed(stream)) => assert_eq!(stream, crafted),
        other => panic!("expected the crafted stream refused, got {other:?}"),
    }
    let record = Record::Done(vec![7]);
    client.append_confirmed(&clean, &record).await.unwrap();
    let read = client.read_all(&clean).await.unwrap();
    assert_eq!(read, vec![record]);
    assert!(client.alive());
    client.delete(&crafted).await.unwrap();
    client.delete(&clean).await.unwrap();
    client.close().await;
}

/// The admin list's path: a crafted message can reach nackd's store only
/// through a nack of a client of nackd. Consumed through nackd by a raw
/// client and nacked, it cannot be held (nackd's own decoder refuses its
/// headers without recursing, so they cannot be rewritten): the nack is
/// deferred with reason `bad_headers` and the message comes back; the
/// admin list stays readable and empty, and nackd and a client connected
/// through it carry on.
#[tokio::test]
async fn a_crafted_message_nacked_through_nackd_is_deferred_not_held() {
    let (queue, own) = (unique("screen-held"), unique("screen-held-own"));
    let nackd = start(&format!(
        "[metrics]\nadmin_token = \"{TOKEN}\"\n[[policy]]\nqueues = [\"{queue}\"]\ndelays = [\"1s\"]\n"
    ))
    .await;
    let conn = direct().await;
    let ch = conn.create_channel().await.unwrap();
    declare_durable(&ch, &queue).await;
    let bystander = nackd.connect().await;
    let bch = bystander.create_channel().await.unwrap();
    bch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    declare_durable(&bch, &own).await;
    round_trip(&bch, &own, b"before").await;

    publish_crafted(&queue).await;
    let mut raw = RawClient::open(nackd.addr, 131_072, 0).await;
    raw.open_channel(1).await;
    raw.consume(1, &queue).await;
    let tag = raw.delivery().await;
    raw.send(&method::nack(1, tag, false, true)).await;
    common::ops::until(nackd.metrics, "the nack deferred", |s| {
        s.get("nackd_nacks_deferred_total", &[("reason", "bad_headers")]) >= 1.0
    })
    .await;
    let again = raw.delivery().await;
    assert!(again > tag, "the crafted message comes back");

    let q = common::ops::query(&queue);
    let listed =
        common::ops::json(nackd.metrics, "GET", &format!("/api/held{q}"), Some(TOKEN)).await;
    assert_eq!(listed["total"], 0, "{listed}");
    round_trip(&bch, &own, b"after").await;
    assert!(bystander.status().connected());

    drop(raw);
    delete_queues(&ch, &[&queue, &own]).await;
    let _ = bystander.close(200, "".into()).await;
    let _ = conn.close(200, "".into()).await;
    nackd.stop().await;
}
