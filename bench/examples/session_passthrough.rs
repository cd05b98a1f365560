//! The session core's pass-through cost, without sockets: a handshake, a
//! consumer, then N rounds of what a publisher and a consumer send through
//! nackd (publish + header + 1 KiB body from the client; deliver + header +
//! body and the publisher's confirm from the broker; a consumer ack every
//! 100 messages), fed to `nackd_core::session::Session` in bursts of 10
//! messages per read, as the pump would. Nothing is intercepted.
//!
//! Deterministic under valgrind, whatever else the machine runs, so a
//! change to the core's hot path is measured in instructions per message:
//!
//! ```sh
//! cargo build --release -p nackd-bench --example session_passthrough
//! valgrind --tool=callgrind --toggle-collect='*feed*' \
//!     --callgrind-out-file=/tmp/cg.out \
//!     target/release/examples/session_passthrough 20000
//! # callgrind's "Collected" / 20000 = the core's instructions per message
//! ```
//!
//! Only `feed` is counted: making the input (amq-protocol encoding every
//! frame) is done before, and is not what nackd spends.

use std::sync::Arc;
use std::time::{Duration, Instant};

use amq_protocol::protocol::{basic, channel, connection, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable, LongString};
use bytes::BytesMut;
use nackd_core::protocol::content;
use nackd_core::protocol::method;
use nackd_core::session::{Limits, Peer, Session};
use nackd_core::stats::SessionStats;

const BODY: usize = 1024;
const FRAME_MAX: u32 = 131_072;
const BURST: u64 = 10;

fn class(channel: u16, class: AMQPClass) -> Vec<u8> {
    method::encode(channel, &class).to_vec()
}

/// A header as applications send it: JSON, persistent, ids, a few headers.
fn header_payload() -> Vec<u8> {
    let mut headers = FieldTable::default();
    headers.insert(
        "tenant".into(),
        AMQPValue::LongString(LongString::from("acme")),
    );
    headers.insert(
        "trace-id".into(),
        AMQPValue::LongString(LongString::from("4bf92f3577b34da6a3ce929d0e0e4736")),
    );
    let props = basic::AMQPProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_message_id("msg-0000001".into())
        .with_headers(headers);
    content::encode_header(60, BODY as u64, &props)
}

/// The handshake both ways, a channel and a consumer on it.
fn open(s: &mut Session, now: Instant) {
    let up = |s: &mut Session, bytes: Vec<u8>| {
        s.handle_bytes(Peer::Upstream, &mut BytesMut::from(&bytes[..]), now)
    };
    let client = |s: &mut Session, bytes: Vec<u8>| {
        s.handle_bytes(Peer::Client, &mut BytesMut::from(&bytes[..]), now)
    };
    up(
        s,
        class(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Start(connection::Start {
                version_major: 0,
                version_minor: 9,
                server_properties: FieldTable::default(),
                mechanisms: "PLAIN".into(),
                locales: "en_US".into(),
            })),
        ),
    );
    client(
        s,
        class(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: FieldTable::default(),
                mechanism: "PLAIN".into(),
                response: "\0guest\0guest".into(),
                locale: "en_US".into(),
            })),
        ),
    );
    up(
        s,
        class(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Tune(connection::Tune {
                channel_max: 2047,
                frame_max: FRAME_MAX,
                heartbeat: 0,
            })),
        ),
    );
    client(
        s,
        class(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max: 2047,
                frame_max: FRAME_MAX,
                heartbeat: 0,
            })),
        ),
    );
    client(
        s,
        class(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: "/".into(),
            })),
        ),
    );
    up(
        s,
        class(
            0,
            AMQPClass::Connection(connection::AMQPMethod::OpenOk(connection::OpenOk {})),
        ),
    );
    client(
        s,
        class(
            1,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        ),
    );
    up(
        s,
        class(
            1,
            AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
        ),
    );
    client(
        s,
        class(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
                queue: "orders".into(),
                consumer_tag: "ctag-1".into(),
                no_local: false,
                no_ack: false,
                exclusive: false,
                nowait: false,
                arguments: FieldTable::default(),
            })),
        ),
    );
    up(
        s,
        class(
            1,
            AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
                consumer_tag: "ctag-1".into(),
            })),
        ),
    );
}

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(100_000);
    let now = Instant::now();
    let limits = Limits {
        max_frame: FRAME_MAX,
        handshake_timeout: Duration::from_secs(10),
    };
    let mut s = Session::new(
        limits,
        now + limits.handshake_timeout,
        now,
        Arc::new(SessionStats::new(&Default::default())),
        None,
    );
    open(&mut s, now);
    let bursts = input(n);
    let moved = feed(&mut s, bursts, now);
    println!("{n} messages, {moved} bytes forwarded");
}

/// What the publisher and the broker send, a burst of `BURST` messages at a
/// time: (client bytes, broker bytes).
fn input(n: u64) -> Vec<(BytesMut, BytesMut)> {
    let header = header_payload();
    let body = vec![b'x'; BODY];
    let mut bursts = Vec::new();
    let (mut from_client, mut from_broker) = (BytesMut::new(), BytesMut::new());
    for i in 1..=n {
        from_client.extend_from_slice(&method::publish(
            2,
            "orders",
            "order.created",
            false,
            &header,
            &body,
            FRAME_MAX,
        ));
        let deliver = basic::Deliver {
            consumer_tag: "ctag-1".into(),
            delivery_tag: i,
            redelivered: false,
            exchange: "orders".into(),
            routing_key: "order.created".into(),
        };
        from_broker.extend_from_slice(&class(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Deliver(deliver)),
        ));
        method::put_content(&mut from_broker, 1, &header, &body, FRAME_MAX);
        if i % 100 == 0 {
            from_client.extend_from_slice(&method::ack(1, i, true));
        }
        if i % BURST == 0 {
            from_broker.extend_from_slice(&method::ack(2, i, true));
            bursts.push((from_client.split(), from_broker.split()));
        }
    }
    bursts
}

/// Hands every burst to the core as the pump would, and takes what it
/// writes; the bytes forwarded.
#[inline(never)]
fn feed(s: &mut Session, bursts: Vec<(BytesMut, BytesMut)>, now: Instant) -> usize {
    let mut moved = 0;
    for (mut from_client, mut from_broker) in bursts {
        s.handle_bytes(Peer::Client, &mut from_client, now);
        s.handle_bytes(Peer::Upstream, &mut from_broker, now);
        let (to_client, to_upstream) = s.transmit();
        moved += to_client.len() + to_upstream.len();
        to_client.clear();
        to_upstream.clear();
    }
    moved
}
