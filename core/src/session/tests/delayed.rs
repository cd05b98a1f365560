//! Delayed publishes in the session core: the declare rewritten, publishes
//! taken or sent on, the publisher's confirms in its own numbering, and
//! nackd's frames never inside a content.

use amq_protocol::protocol::BasicProperties;
use amq_protocol::protocol::{basic, channel, confirm, exchange, tx, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable, LongString};
use bytes::BytesMut;

use super::{describe, frame_of, pair, Pair};
use crate::held::{Route, StoreError};
use crate::protocol::content::encode_header;
use crate::protocol::frame::{FrameDecoder, FrameType};
use crate::protocol::method::{self, put_frame};

const X: &str = "waits";

/// A client's declare of `name` as delayed, of real type `direct`.
fn declare_named(ch: u16, name: &str, nowait: bool) -> Vec<u8> {
    let mut args = FieldTable::default();
    args.insert(
        "x-delayed-type".into(),
        AMQPValue::LongString(LongString::from("direct")),
    );
    frame_of(
        ch,
        AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
            exchange: name.into(),
            kind: "x-delayed-message".into(),
            passive: false,
            durable: true,
            auto_delete: false,
            internal: false,
            nowait,
            arguments: args,
        })),
    )
}

impl Pair {
    /// What nackd wrote to the client since the last call (see `upstream`).
    fn client_got(&mut self) -> Vec<String> {
        let mut buf = std::mem::take(self.s.transmit().0);
        let decoder = FrameDecoder::default();
        let mut seen = Vec::new();
        while let Some(frame) = decoder.decode(&mut buf).unwrap() {
            seen.push(describe(&frame));
        }
        seen
    }

    /// Opens channel `ch`, in confirm mode if `confirms`.
    fn open(&mut self, ch: u16, confirms: bool) {
        self.client(&frame_of(
            ch,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        ));
        self.broker(&frame_of(
            ch,
            AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
        ));
        if confirms {
            self.client(&frame_of(
                ch,
                AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
                    nowait: false,
                })),
            ));
        }
        self.upstream();
        self.client_got();
    }

    /// Declares `X` as a delayed exchange and the broker accepts it.
    fn declared(&mut self, ch: u16) {
        self.declare_delayed(ch);
        self.broker(&frame_of(
            ch,
            AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {})),
        ));
        self.client_got();
    }

    /// Declares `X` as a delayed exchange of real type `direct` (the broker
    /// has not answered yet).
    fn declare_delayed(&mut self, ch: u16) -> Vec<String> {
        self.client(&declare_named(ch, X, false));
        self.upstream()
    }

    /// A publish to `X` with `x-delay = delay` (none: no header).
    fn publish(&mut self, ch: u16, delay: Option<AMQPValue>) {
        let mut out = BytesMut::new();
        self.publish_frames(&mut out, ch, delay);
        self.client(&out);
        // The broker would take it from this client (see `check`).
        self.grant_checks();
    }

    /// The frames of [`Pair::publish`], its 3-byte body last.
    fn publish_frames(&self, out: &mut BytesMut, ch: u16, delay: Option<AMQPValue>) {
        out.extend_from_slice(&frame_of(
            ch,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: X.into(),
                routing_key: "k".into(),
                mandatory: false,
                immediate: false,
            })),
        ));
        let mut props = BasicProperties::default();
        if let Some(d) = delay {
            let mut h = FieldTable::default();
            h.insert("x-delay".into(), d);
            props = props.with_headers(h);
        }
        put_frame(out, FrameType::Header, ch, &encode_header(60, 3, &props));
        put_frame(out, FrameType::Body, ch, b"abc");
    }
}

fn ms(n: i64) -> Option<AMQPValue> {
    Some(AMQPValue::LongLongInt(n))
}

#[test]
fn a_delayed_declare_goes_as_its_real_type_and_is_remembered() {
    let mut p = pair();
    p.open(1, false);
    let mut buf = BytesMut::new();
    let mut args = FieldTable::default();
    args.insert(
        "x-delayed-type".into(),
        AMQPValue::LongString(LongString::from("topic")),
    );
    buf.extend_from_slice(&frame_of(
        1,
        AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
            exchange: X.into(),
            kind: "x-delayed-message".into(),
            passive: false,
            durable: true,
            auto_delete: false,
            internal: false,
            nowait: false,
            arguments: args,
        })),
    ));
    p.client(&buf);
    let mut up = std::mem::take(p.s.transmit().1);
    let frame = FrameDecoder::default().decode(&mut up).unwrap().unwrap();
    match method::decode_any(frame.payload_slice()).unwrap() {
        AMQPClass::Exchange(exchange::AMQPMethod::Declare(d)) => {
            assert_eq!(d.kind.as_str(), "topic");
            assert_eq!(d.exchange.as_str(), X);
            assert!(d.arguments.inner().contains_key("x-delayed-type"));
        }
        other => panic!("{other:?}"),
    }
    assert!(!p.is_delayed(), "not before the broker accepted it");
    p.broker(&frame_of(
        1,
        AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {})),
    ));
    assert!(p.is_delayed());
    p.client(&frame_of(
        1,
        AMQPClass::Exchange(exchange::AMQPMethod::Delete(exchange::Delete {
            exchange: X.into(),
            if_unused: false,
            nowait: false,
        })),
    ));
    p.broker(&frame_of(
        1,
        AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(exchange::DeleteOk {})),
    ));
    let shared = &p.s.scope.as_ref().unwrap().shared;
    assert!(!shared.delayed.is_delayed("/", X));
}

#[test]
fn publishes_without_a_positive_integer_delay_go_as_sent() {
    let mut p = pair();
    p.open(1, false);
    p.declared(1);
    for delay in [
        None,
        ms(0),
        ms(-5),
        Some(AMQPValue::LongString("10".into())),
    ] {
        p.publish(1, delay);
        assert_eq!(p.upstream(), ["publish 1", "header 1", "body 1"]);
    }
    assert!(p.take_parks().is_empty());
}

#[test]
fn a_delayed_publish_is_confirmed_by_nackd_in_the_publishers_numbering() {
    let mut p = pair();
    p.open(1, true);
    p.declared(1);
    p.publish(1, None); // publisher 1 = broker 1
    p.publish(1, ms(5000)); // publisher 2: nackd's
    p.publish(1, None); // publisher 3 = broker 2
    assert_eq!(
        p.upstream(),
        [
            "publish 1",
            "header 1",
            "body 1",
            "publish 1",
            "header 1",
            "body 1"
        ]
    );
    let parks = p.take_parks();
    assert_eq!(parks.len(), 1);
    assert_eq!(parks[0].delay, std::time::Duration::from_secs(5));
    assert_eq!(
        parks[0].route,
        Route::Delayed {
            exchange: X.into(),
            routing_key: "k".into()
        }
    );
    assert_eq!(&parks[0].body[..], b"abc");
    // The broker confirms its 1 and 2 at once: 2 still waits for the store.
    p.broker(&method::ack(1, 2, true));
    // (1 was numbered alike by both: covered as the broker covered it.)
    assert_eq!(p.client_got(), ["ack 1+", "ack 3"]);
    p.answer(&parks[0], Ok(7));
    assert_eq!(p.client_got(), ["ack 2"]);
    // From now on nothing is pending: a multiple stays one frame.
    p.publish(1, None); // publisher 4 = broker 3
    p.publish(1, None); // publisher 5 = broker 4
    p.broker(&method::ack(1, 4, true));
    assert_eq!(p.client_got(), ["ack 5+"]);
}

#[test]
fn a_delayed_publish_the_store_refuses_is_nacked() {
    let mut p = pair();
    p.open(1, true);
    p.declared(1);
    p.publish(1, ms(100));
    let parks = p.take_parks();
    p.answer(&parks[0], Err(StoreError::Full("test".into())));
    assert_eq!(p.client_got(), ["nack 1 no-requeue"]);
}

#[test]
fn a_delayed_publish_on_a_tx_channel_closes_the_connection_with_540() {
    let mut p = pair();
    p.open(1, false);
    p.declared(1);
    p.client(&frame_of(
        1,
        AMQPClass::Tx(tx::AMQPMethod::Select(tx::Select {})),
    ));
    p.upstream();
    p.publish(1, ms(100));
    assert!(p.take_parks().is_empty());
    let mut out = std::mem::take(p.s.transmit().0);
    let frame = FrameDecoder::default().decode(&mut out).unwrap().unwrap();
    match method::decode_any(frame.payload_slice()).unwrap() {
        AMQPClass::Connection(amq_protocol::protocol::connection::AMQPMethod::Close(c)) => {
            assert_eq!(c.reply_code, 540);
            assert!(
                c.reply_text.as_str().contains("transactional"),
                "{}",
                c.reply_text
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_channel_close_waits_for_the_store_to_answer_a_delayed_publish() {
    let mut p = pair();
    p.open(1, true);
    p.declared(1);
    p.publish(1, ms(100));
    p.client(&super::channel_close(1));
    assert!(p.upstream().is_empty(), "the close waits for the store");
    let parks = p.take_parks();
    p.answer(&parks[0], Ok(9));
    assert_eq!(p.client_got(), ["ack 1"]);
    assert_eq!(p.upstream(), ["channel.close 1"]);
}

#[test]
fn nackds_confirm_never_splits_a_content_to_the_client() {
    let mut p = pair();
    p.consume(1);
    p.client(&frame_of(
        1,
        AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
            nowait: false,
        })),
    ));
    p.declared(1);
    p.publish(1, ms(100));
    p.client_got();
    // A delivery on channel 1 has begun: deliver and header, body to come.
    let mut out = BytesMut::new();
    out.extend_from_slice(&frame_of(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
            consumer_tag: "c1".into(),
            delivery_tag: 1,
            redelivered: false,
            exchange: "".into(),
            routing_key: super::Q.into(),
        })),
    ));
    put_frame(
        &mut out,
        FrameType::Header,
        1,
        &encode_header(60, 3, &Default::default()),
    );
    p.broker(&out);
    let parks = p.take_parks();
    let delayed = parks.iter().find(|k| k.route.is_delayed()).unwrap();
    p.answer(delayed, Ok(3));
    assert_eq!(p.client_got(), ["Basic(Deliver(Deliver { consumer_tag: ShortString(\"c1\"), delivery_tag: 1, redelivered: false, exchange: ShortString(\"\"), routing_key: ShortString(\"jobs\") }))", "header 1"]);
    let mut body = BytesMut::new();
    put_frame(&mut body, FrameType::Body, 1, b"abc");
    p.broker(&body);
    assert_eq!(p.client_got(), ["body 1", "ack 1"]);
}

#[test]
fn a_session_that_ends_keeps_its_delayed_publishes() {
    let mut p = pair();
    p.open(1, false);
    p.declared(1);
    p.publish(1, ms(100));
    p.publish(1, ms(200));
    let parks = p.take_parks();
    assert_eq!(parks.len(), 2);
    // The client is gone before the store answered either.
    let late = parks.iter().enumerate().map(|(i, k)| crate::held::Parked {
        key: k.key,
        result: Ok(50 + i as u64),
    });
    p.s.end(late);
    assert!(
        p.cancelled().is_empty(),
        "a publisher's message is not the broker's to take back"
    );
}

#[test]
fn a_delayed_message_is_stored_with_its_delay_spent() {
    let mut p = pair();
    p.open(1, false);
    p.declared(1);
    p.publish(1, Some(AMQPValue::LongInt(2500)));
    let parks = p.take_parks();
    let h = crate::protocol::content::decode_header(&parks[0].header).unwrap();
    let headers = h.properties.headers().clone().unwrap();
    assert_eq!(
        headers.inner().get("x-delay"),
        Some(&AMQPValue::LongInt(-2500))
    );
    assert_eq!(parks[0].delay, std::time::Duration::from_millis(2500));
}

#[test]
fn the_largest_x_delay_is_held_a_century_not_wrapped() {
    let mut p = pair();
    p.open(1, false);
    p.declared(1);
    p.publish(1, ms(i64::MAX));
    let parks = p.take_parks();
    assert_eq!(
        parks[0].delay,
        std::time::Duration::from_millis(crate::delayed::MAX_DELAY_MS)
    );
    // The engine counts due times in µs: no overflow.
    assert!(parks[0].delay.as_micros() < u128::from(u64::MAX) / 2);
}

impl Pair {
    fn is_delayed(&self) -> bool {
        let shared = &self.s.scope.as_ref().unwrap().shared;
        shared.delayed.is_delayed("/", X)
    }

    fn delete(&mut self, ch: u16, if_unused: bool) {
        self.client(&frame_of(
            ch,
            AMQPClass::Exchange(exchange::AMQPMethod::Delete(exchange::Delete {
                exchange: X.into(),
                if_unused,
                nowait: false,
            })),
        ));
        self.upstream();
    }

    /// The broker closes channel `ch` with `code`.
    fn broker_closes(&mut self, ch: u16, code: crate::protocol::reply::ReplyCode) {
        self.broker(&method::channel_close(ch, code, "refused"));
        self.client_got();
    }
}

#[test]
fn a_delete_the_broker_refuses_leaves_the_exchange_delayed() {
    let mut p = pair();
    p.open(1, false);
    p.declared(1);
    p.open(2, false);
    p.delete(2, true);
    assert!(
        p.is_delayed(),
        "nothing is deleted before the broker says so"
    );
    // Bound, so not unused: the broker refuses, the exchange stays.
    p.broker_closes(2, crate::protocol::reply::ReplyCode::CommandInvalid);
    assert!(p.is_delayed(), "a refused delete changes nothing");
    p.publish(1, ms(100));
    assert!(p.upstream().is_empty(), "still held by nackd");
    assert_eq!(p.take_parks().len(), 1);
    // A delete the broker does: forgotten at its delete-ok.
    p.delete(1, false);
    p.broker(&frame_of(
        1,
        AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(exchange::DeleteOk {})),
    ));
    assert!(!p.is_delayed());
}

#[test]
fn a_delayed_declare_the_broker_refuses_is_not_remembered() {
    let mut p = pair();
    p.open(1, false);
    p.declare_delayed(1);
    // E.g. a plain exchange of another type has the name: 406.
    p.broker_closes(1, crate::protocol::reply::ReplyCode::CommandInvalid);
    assert!(!p.is_delayed(), "the broker refused the declare");
    p.open(2, false);
    p.publish(2, ms(100));
    assert_eq!(p.upstream(), ["publish 2", "header 2", "body 2"]);
}

#[test]
fn a_delayed_publish_without_confirms_outlives_the_settle_timeout() {
    let mut p = pair();
    p.open(1, false);
    p.declared(1);
    p.publish(1, ms(100));
    p.client(&super::channel_close(1));
    assert!(p.upstream().is_empty(), "the close waits for the store");
    // The store is slow: the close goes on without its answer.
    p.time_passes(super::SETTLE_TIMEOUT);
    p.timer_fires();
    assert_eq!(p.upstream(), ["channel.close 1"]);
    // Its publisher was told nothing (no confirms): the copy the store
    // took at last is the only one, and must not be cancelled.
    let parks = p.take_parks();
    p.answer(&parks[0], Ok(11));
    assert!(p.cancelled().is_empty(), "the publish would be lost");
    // Likewise when the session ends before the store answers.
    let mut p = pair();
    p.open(1, false);
    p.declared(1);
    p.publish(1, ms(100));
    p.client(&super::channel_close(1));
    p.time_passes(super::SETTLE_TIMEOUT);
    p.timer_fires();
    let parks = p.take_parks();
    p.s.end([crate::held::Parked {
        key: parks[0].key,
        result: Ok(12),
    }]);
    assert!(p.cancelled().is_empty(), "the publish would be lost");
}

impl Pair {
    /// A delayed publish to `X` of a `size`-byte body in frames of 1000.
    fn publish_big(&mut self, ch: u16, size: usize) {
        let mut out = BytesMut::new();
        out.extend_from_slice(&frame_of(
            ch,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: X.into(),
                routing_key: "k".into(),
                mandatory: false,
                immediate: false,
            })),
        ));
        let mut h = FieldTable::default();
        h.insert("x-delay".into(), AMQPValue::LongLongInt(100));
        let props = BasicProperties::default().with_headers(h);
        put_frame(
            &mut out,
            FrameType::Header,
            ch,
            &encode_header(60, size as u64, &props),
        );
        for chunk in vec![7u8; size].chunks(1000) {
            put_frame(&mut out, FrameType::Body, ch, chunk);
        }
        self.client(&out);
        self.grant_checks();
    }
}

#[test]
fn a_delayed_publish_beyond_the_memory_budget_is_not_buffered() {
    // A budget of 4 KB: a 10 KB delayed publish does not fit.
    let mut p = super::pair_with("delays = [\"1m\"]", 4096);
    p.open(1, true);
    p.declared(1);
    p.publish_big(1, 10_000);
    assert!(p.take_parks().is_empty());
    assert!(p.upstream().is_empty(), "never routed early");
    assert_eq!(p.client_got(), ["nack 1 no-requeue"]);
    // One that fits is taken as usual, and the budget is given back.
    p.publish_big(1, 2000);
    assert_eq!(p.take_parks().len(), 1);
    let budget = &p.s.scope.as_ref().unwrap().shared.budget;
    assert_eq!(budget.used(), 0);
    // Without confirms nackd cannot say no: routed at once, as when the
    // store cannot take it.
    p.open(2, false);
    p.publish_big(2, 10_000);
    assert!(p.take_parks().is_empty());
    let mut expect = vec!["publish 2", "header 2"];
    expect.extend(["body 2"; 10]);
    assert_eq!(p.upstream(), expect);
    // A body size no memory could hold is refused before anything grows.
    let mut out = BytesMut::new();
    out.extend_from_slice(&frame_of(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: X.into(),
            routing_key: "k".into(),
            mandatory: false,
            immediate: false,
        })),
    ));
    let mut h = FieldTable::default();
    h.insert("x-delay".into(), AMQPValue::LongLongInt(100));
    let props = BasicProperties::default().with_headers(h);
    put_frame(
        &mut out,
        FrameType::Header,
        1,
        &encode_header(60, u64::MAX, &props),
    );
    put_frame(&mut out, FrameType::Body, 1, b"abc");
    p.client(&out);
    assert!(p.upstream().is_empty());
    assert!(p.take_parks().is_empty());
}

#[test]
fn a_delayed_publish_after_the_broker_closed_its_channel_is_not_taken() {
    let mut p = pair();
    p.open(1, true);
    p.declared(1);
    // An earlier publish failed (say 404): the broker closes the channel
    // and discards what the client pipelined after it.
    p.broker_closes(1, crate::protocol::reply::ReplyCode::CommandInvalid);
    p.publish(1, ms(100));
    assert!(
        p.take_parks().is_empty(),
        "the broker would have discarded it: nackd must not deliver it later"
    );
    assert!(p.client_got().is_empty(), "no confirm on a closed channel");
}

#[test]
fn a_refused_declare_leaves_another_sessions_declare_alone() {
    let mut p = pair();
    p.open(1, false);
    p.declare_delayed(1); // direct
                          // Meanwhile another session declares it as topic, and the broker
                          // takes that one: this one is refused (406).
    let shared = p.s.scope.as_ref().unwrap().shared.clone();
    shared.delayed.declare("/", X, "topic");
    p.broker_closes(1, crate::protocol::reply::ReplyCode::CommandInvalid);
    assert!(p.is_delayed(), "the other declare stands");
}

/// A `basic.publish` to `exchange` whose routing key is the byte 0xff
/// (legal AMQP, and RabbitMQ routes it), with a 3-byte content.
fn publish_binary_key(ch: u16, exchange: &str, delay: Option<AMQPValue>) -> BytesMut {
    let mut payload = vec![0, 60, 0, 40, 0, 0];
    payload.push(exchange.len() as u8);
    payload.extend_from_slice(exchange.as_bytes());
    payload.extend_from_slice(&[1, 0xff, 0]);
    let mut out = BytesMut::new();
    put_frame(&mut out, FrameType::Method, ch, &payload);
    let mut props = BasicProperties::default();
    if let Some(d) = delay {
        let mut h = FieldTable::default();
        h.insert("x-delay".into(), d);
        props = props.with_headers(h);
    }
    put_frame(
        &mut out,
        FrameType::Header,
        ch,
        &encode_header(60, 3, &props),
    );
    put_frame(&mut out, FrameType::Body, ch, b"abc");
    out
}

#[test]
fn a_publish_with_a_routing_key_that_is_not_utf8_goes_as_sent() {
    let mut p = pair();
    p.open(1, true);
    // No delayed exchange yet, then one: a publish elsewhere is the
    // broker's to judge (RabbitMQ takes any bytes as a routing key).
    for _ in 0..2 {
        let sent = publish_binary_key(1, "plain", ms(100));
        p.client(&sent);
        assert_eq!(&std::mem::take(p.s.transmit().1)[..], &sent[..]);
        p.declared(1);
    }
    p.broker(&method::ack(1, 2, true));
    assert_eq!(p.client_got(), ["ack 2+"]);
    // To the delayed exchange nackd cannot keep that key: it says so
    // rather than route the message early.
    p.client(&publish_binary_key(1, X, ms(100)));
    assert_eq!(p.upstream(), ["connection.close"], "nothing of the publish");
    assert!(p.take_parks().is_empty());
    let mut out = std::mem::take(p.s.transmit().0);
    let frame = FrameDecoder::default().decode(&mut out).unwrap().unwrap();
    match method::decode_any(frame.payload_slice()).unwrap() {
        AMQPClass::Connection(amq_protocol::protocol::connection::AMQPMethod::Close(c)) => {
            assert_eq!(c.reply_code, 540, "{}", c.reply_text);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_delayed_publish_whose_channel_the_broker_closes_midway_is_not_taken() {
    let mut p = pair();
    p.open(1, true);
    p.declared(1);
    let mut all = BytesMut::new();
    p.publish_into(&mut all, 1, ms(100));
    let body_at = all.len() - (8 + 3);
    // Method and header; then the broker closes the channel; then the body.
    p.client(&all[..body_at]);
    p.broker_closes(1, crate::protocol::reply::ReplyCode::CommandInvalid);
    p.client(&all[body_at..]);
    assert!(
        p.take_parks().is_empty(),
        "the broker discards it after its close: nackd must not deliver it later"
    );
}

impl Pair {
    /// The frames of [`Pair::publish`], into `out`.
    fn publish_into(&mut self, out: &mut BytesMut, ch: u16, delay: Option<AMQPValue>) {
        out.extend_from_slice(&frame_of(
            ch,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: X.into(),
                routing_key: "k".into(),
                mandatory: false,
                immediate: false,
            })),
        ));
        let mut props = BasicProperties::default();
        if let Some(d) = delay {
            let mut h = FieldTable::default();
            h.insert("x-delay".into(), d);
            props = props.with_headers(h);
        }
        put_frame(out, FrameType::Header, ch, &encode_header(60, 3, &props));
        put_frame(out, FrameType::Body, ch, b"abc");
    }
}

#[test]
fn a_publish_routed_at_once_after_confirm_select_takes_no_publisher_tag() {
    let mut p = pair();
    p.open(1, false);
    p.declared(1);
    p.publish(1, ms(100)); // no confirms yet: taken, publisher tag none
    p.client(&frame_of(
        1,
        AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
            nowait: false,
        })),
    ));
    p.upstream();
    // The store refuses it: routed at once, now on a confirm channel, so
    // the broker numbers it (its 1) though the publisher did not.
    let parks = p.take_parks();
    p.answer(&parks[0], Err(StoreError::Full("test".into())));
    assert_eq!(p.upstream(), ["publish 1", "header 1", "body 1"]);
    p.publish(1, None); // publisher 1 = broker 2
    p.upstream();
    p.broker(&method::ack(1, 1, false));
    assert!(p.client_got().is_empty(), "broker 1 is not the publisher's");
    p.broker(&method::ack(1, 2, false));
    assert_eq!(p.client_got(), ["ack 1"]);
}

#[test]
fn a_delayed_publish_without_confirms_refused_after_the_session_ended_is_counted_lost() {
    let mut p = pair();
    p.open(1, false);
    p.declared(1);
    p.publish(1, ms(100));
    let parks = p.take_parks();
    p.s.end([crate::held::Parked {
        key: parks[0].key,
        result: Err(StoreError::Full("test".into())),
    }]);
    assert_eq!(p.s.stats.delayed_lost.get(), 1, "a silent loss");
}

/// A publisher whose every frame nackd takes still owes the broker its
/// heartbeats: without them the broker closes the connection after two.
/// nackd's checks of those publishes are frames the broker hears (and
/// where there are none, nackd sends a heartbeat: see `tick`).
#[test]
fn a_publisher_of_delayed_messages_only_keeps_its_broker_connection_alive() {
    let mut p = pair();
    p.client(&super::tune_ok(2));
    p.open(1, true);
    p.declared(1);
    p.upstream();
    p.checks.clear();
    let mut silent = 0;
    for i in 0..12 {
        p.publish(1, ms(60_000));
        p.store(true);
        p.time_passes(std::time::Duration::from_millis(500));
        p.timer_fires();
        let sent = p.upstream();
        match sent.is_empty() && p.checks.is_empty() {
            true => silent += 1,
            false => silent = 0,
        }
        assert!(silent < 2, "the broker heard nothing for a second ({i})");
        p.checks.clear();
        p.broker(&crate::protocol::method::heartbeat());
    }
}

impl Pair {
    /// A publish to `X` with `x-delay`, whose check the test answers.
    fn publish_unanswered(&mut self, ch: u16, delay: Option<AMQPValue>) {
        let mut out = BytesMut::new();
        out.extend_from_slice(&frame_of(
            ch,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: X.into(),
                routing_key: "k".into(),
                mandatory: false,
                immediate: false,
            })),
        ));
        let mut h = FieldTable::default();
        if let Some(d) = delay {
            h.insert("x-delay".into(), d);
        }
        let props = BasicProperties::default().with_headers(h);
        put_frame(
            &mut out,
            FrameType::Header,
            ch,
            &encode_header(60, 3, &props),
        );
        put_frame(&mut out, FrameType::Body, ch, b"abc");
        self.client(&out);
    }

    /// The broker refuses the oldest check: it closes the reserved channel.
    fn refuse_check(&mut self) {
        let reserved = self.s.checks.channel().unwrap();
        self.broker(&method::channel_close(
            reserved,
            crate::protocol::reply::ReplyCode::CommandInvalid,
            "ACCESS_REFUSED - write access to exchange 'waits' in vhost '/' refused for user 'ro'",
        ));
    }

    /// A nowait declare of `X` as delayed.
    fn declare_nowait(&mut self, ch: u16) {
        self.client(&declare_named(ch, X, true));
    }
}

/// Trust, item 1: the broker is asked, in the publisher's name, before a
/// delayed publish is held; one it would refuse goes to it as sent, and
/// the refusal the client gets is the broker's own.
#[test]
fn a_delayed_publish_the_broker_would_refuse_goes_to_it_as_sent() {
    let mut p = pair();
    p.open(1, true);
    p.declared(1);
    p.checks.clear();
    p.publish_unanswered(1, ms(60_000));
    assert!(
        p.upstream().is_empty(),
        "nothing on the client's channel yet"
    );
    assert_eq!(
        p.checks,
        [
            "Channel(Open(Open))",
            "Tx(Select(Select))",
            "publish 2047",
            "header 2047",
            "body 2047",
            "Tx(Rollback(Rollback))"
        ]
    );
    assert!(
        p.take_parks().is_empty(),
        "nothing stored before the broker's word"
    );
    assert!(p.client_got().is_empty(), "no confirm yet");
    p.refuse_check();
    // nackd answers the broker's close on its channel, and sends the
    // publish on the client's channel as it was sent.
    assert_eq!(p.upstream(), ["publish 1", "header 1", "body 1"]);
    assert!(
        p.checks.iter().any(|c| c.contains("CloseOk")),
        "{:?}",
        p.checks
    );
    assert!(p.take_parks().is_empty(), "never stored");
    assert!(p.client_got().is_empty(), "nackd confirms nothing");
    assert_eq!(p.s.stats.delayed_denied.get(), 1);
    // The broker refuses it there too: its close reaches the client as is.
    p.broker(&method::channel_close(
        1,
        crate::protocol::reply::ReplyCode::CommandInvalid,
        "ACCESS_REFUSED",
    ));
    assert_eq!(p.client_got(), ["channel.close 1"]);
}

/// A refused check on a channel that publishes more: the broker confirms
/// the handed-over publish under its own number, which is the publisher's
/// again, and a `multiple` confirm never covers a publish still open.
#[test]
fn a_handed_over_publish_keeps_the_publishers_numbering() {
    let mut p = pair();
    p.open(1, true);
    p.declared(1);
    p.publish_unanswered(1, ms(60_000)); // publisher 1: checked
    p.publish_unanswered(1, None); // publisher 2 = broker 1
    p.refuse_check(); // publisher 1 = broker 2 (say the broker took it after all)
    assert_eq!(
        p.upstream(),
        [
            "publish 1",
            "header 1",
            "body 1",
            "publish 1",
            "header 1",
            "body 1"
        ]
    );
    p.broker(&method::ack(1, 1, false));
    assert_eq!(p.client_got(), ["ack 2"], "not 2+: 1 is still open");
    p.broker(&method::ack(1, 2, true));
    assert_eq!(p.client_got(), ["ack 1+"], "1 is the only one open");
}

/// The reserved channel is the broker's highest; the client is offered one
/// fewer and may not use it.
#[test]
fn the_client_cannot_use_the_reserved_channel() {
    let mut p = pair();
    p.client(&frame_of(
        super::RESERVED,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    ));
    assert_eq!(p.upstream(), ["connection.close"]);
    let mut out = std::mem::take(p.s.transmit().0);
    let frame = FrameDecoder::default().decode(&mut out).unwrap().unwrap();
    match method::decode_any(frame.payload_slice()).unwrap() {
        AMQPClass::Connection(amq_protocol::protocol::connection::AMQPMethod::Close(c)) => {
            assert_eq!(c.reply_code, 504, "{c:?}");
        }
        other => panic!("{other:?}"),
    }
}

/// Trust, items 1 and 2: a `nowait` declare goes to the broker in its
/// waiting form; the exchange is delayed only at the broker's
/// `declare-ok`, which the client (that asked for none) does not get. A
/// publish sent right after it is held meanwhile, its check waiting for
/// the answer.
#[test]
fn a_nowait_declare_counts_at_the_brokers_ok_and_a_publish_after_it_waits() {
    let mut p = pair();
    p.open(1, true);
    p.declare_nowait(1);
    let sent = p.upstream();
    assert_eq!(sent.len(), 1);
    assert!(sent[0].contains("nowait: false"), "{sent:?}");
    assert!(!p.is_delayed());
    p.publish_unanswered(1, ms(60_000));
    p.upstream();
    assert!(
        p.checks.is_empty(),
        "the check waits for the declare's answer"
    );
    p.broker(&frame_of(
        1,
        AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {})),
    ));
    assert!(p.is_delayed());
    assert!(
        p.client_got().is_empty(),
        "the client asked for no declare-ok"
    );
    p.upstream();
    assert!(
        p.checks.iter().any(|c| c == "publish 2047"),
        "{:?}",
        p.checks
    );
    p.grant_checks();
    assert_eq!(p.take_parks().len(), 1, "held once the broker said yes");
}

/// Trust, item 1: a declare the broker refuses (no configure permission,
/// another type) changes nothing, `nowait` or not; a publish that waited
/// for it goes to the broker as sent.
#[test]
fn a_refused_nowait_declare_changes_nothing_and_the_publish_goes_as_sent() {
    let mut p = pair();
    p.open(1, false);
    p.open(2, false);
    p.declare_nowait(1);
    p.publish_unanswered(2, ms(60_000));
    p.upstream();
    p.broker_closes(1, crate::protocol::reply::ReplyCode::CommandInvalid);
    assert!(!p.is_delayed(), "the broker refused the declare");
    // Its check went when the answer came; the broker takes the publish
    // (say the exchange exists), but it is not a delayed exchange's.
    p.grant_checks();
    assert_eq!(p.upstream(), ["publish 2", "header 2", "body 2"]);
    assert!(p.take_parks().is_empty());
}

/// Trust, item 2: a `nowait` delete of a delayed exchange the broker
/// refuses (`if-unused` while bound: 406) leaves it delayed; one it does
/// makes it plain at its `delete-ok`, which the client does not get.
#[test]
fn a_refused_nowait_delete_leaves_the_exchange_delayed() {
    let mut p = pair();
    p.open(1, false);
    p.declared(1);
    let delete = |if_unused| {
        frame_of(
            1,
            AMQPClass::Exchange(exchange::AMQPMethod::Delete(exchange::Delete {
                exchange: X.into(),
                if_unused,
                nowait: true,
            })),
        )
    };
    p.client(&delete(true));
    let sent = p.upstream();
    assert!(sent[0].contains("nowait: false"), "{sent:?}");
    p.broker_closes(1, crate::protocol::reply::ReplyCode::CommandInvalid);
    assert!(p.is_delayed(), "a refused delete changes nothing");
    p.client(&frame_of(
        1,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    ));
    p.open(1, false);
    p.client(&delete(false));
    p.upstream();
    assert!(p.is_delayed(), "not before the broker's answer");
    p.broker(&frame_of(
        1,
        AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(exchange::DeleteOk {})),
    ));
    assert!(!p.is_delayed());
    assert!(
        p.client_got().is_empty(),
        "the client asked for no delete-ok"
    );
}

/// Each vhost holds at most `[delayed] max_exchanges`: one more closes the
/// connection with 530, and nothing goes to the broker.
#[test]
fn a_delayed_exchange_beyond_the_limit_is_refused_with_530() {
    let mut p = pair();
    p.open(1, false);
    let shared = p.s.scope.as_ref().unwrap().shared.clone();
    for i in 0..crate::delayed::DEFAULT_LIMIT {
        shared.delayed.declare("/", &format!("d{i}"), "direct");
    }
    assert_eq!(p.declare_delayed(1), ["connection.close"]);
    let mut out = std::mem::take(p.s.transmit().0);
    let frame = FrameDecoder::default().decode(&mut out).unwrap().unwrap();
    match method::decode_any(frame.payload_slice()).unwrap() {
        AMQPClass::Connection(amq_protocol::protocol::connection::AMQPMethod::Close(c)) => {
            assert_eq!(c.reply_code, 530, "{c:?}");
            assert!(c.reply_text.as_str().contains("max_exchanges"), "{c:?}");
        }
        other => panic!("{other:?}"),
    }
    assert!(!p.is_delayed());
}

/// A check the settle timeout gave up (its publisher got a nack) is not
/// held when the broker answers at last.
#[test]
fn a_check_given_up_is_not_held_when_the_broker_answers_late() {
    let mut p = pair();
    p.open(1, true);
    p.declared(1);
    p.publish_unanswered(1, ms(60_000));
    p.client(&super::channel_close(1));
    p.time_passes(super::SETTLE_TIMEOUT);
    p.timer_fires();
    assert_eq!(p.client_got(), ["nack 1 no-requeue"]);
    p.grant_checks();
    assert!(p.take_parks().is_empty(), "its publisher was told nack");
}

/// Issue 33, item 8: a publish nackd gives back to the broker goes in the
/// client's order, behind a barrier when one is up, never ahead of a
/// publish the client sent before it reached the broker: the broker's
/// numbering, which the publisher's confirms follow, stays right.
#[test]
fn a_handed_over_publish_does_not_jump_the_barrier() {
    let mut p = pair();
    p.consume(2);
    p.deliver(2, 1);
    p.nack(2, 1); // claimed, not stored yet: a recover must wait
    p.open(1, true);
    p.declared(1);
    p.publish_unanswered(1, ms(60_000)); // publisher 1: checked
    p.client(&frame_of(
        2,
        AMQPClass::Basic(basic::AMQPMethod::Recover(basic::Recover { requeue: true })),
    ));
    p.publish_unanswered(1, None); // publisher 2: behind the barrier
    assert!(p.upstream().is_empty(), "held behind the barrier");
    p.refuse_check(); // publisher 1 goes back to the broker, after 2
    assert!(p.upstream().is_empty(), "still behind the barrier");
    p.store(true);
    p.grace_passes();
    assert_eq!(
        p.upstream(),
        [
            "ack 1",
            "recover 2",
            "publish 1",
            "header 1",
            "body 1",
            "publish 1",
            "header 1",
            "body 1"
        ]
    );
    // The broker numbers 2 first, then 1: each confirm is the right one.
    p.broker(&method::ack(1, 1, false));
    assert_eq!(p.client_got(), ["ack 2"]);
    p.broker(&method::ack(1, 2, false));
    assert_eq!(p.client_got(), ["ack 1"]);
}

/// Issue 33, item 5: a delayed publish the store does not answer within
/// the settle timeout is given up, with or without a close: its publisher
/// gets a nack, and its ticket says so, so that the engine deletes the
/// copy the store writes later instead of firing it (the publisher has
/// republished it meanwhile: it would arrive twice), even once this
/// session has ended.
#[test]
fn a_delayed_publish_given_up_is_withdrawn_from_the_engine() {
    let mut p = pair();
    p.open(1, true);
    p.declared(1);
    p.publish(1, ms(100));
    let parks = p.take_parks();
    assert_eq!(parks.len(), 1);
    p.time_passes(super::SETTLE_TIMEOUT);
    p.timer_fires();
    assert_eq!(p.client_got(), ["nack 1 no-requeue"]);
    assert!(
        !parks[0].ticket.stored(),
        "the engine must delete the copy, not fire it"
    );
    // The session ends before the store answers.
    p.s.end([]);
    assert!(p.cancelled().is_empty());
}

/// Without confirms the publisher was told nothing: the store's copy is
/// the only one, and the settle timeout does not withdraw it.
#[test]
fn a_delayed_publish_without_confirms_is_never_withdrawn() {
    let mut p = pair();
    p.open(1, false);
    p.declared(1);
    p.publish(1, ms(100));
    let parks = p.take_parks();
    p.time_passes(super::SETTLE_TIMEOUT);
    p.timer_fires();
    assert!(parks[0].ticket.stored(), "the store's copy stands");
}

mod trust_review;

/// A pair whose shared set of delayed exchanges is not synced: another
/// instance may have declared `X` delayed, this one cannot tell.
fn unsynced(confirms: bool) -> Pair {
    let mut p = pair();
    p.open(1, confirms);
    let shared = p.s.scope.as_ref().unwrap().shared.clone();
    shared.delayed.set_synced(false);
    p
}

#[test]
fn while_unsynced_a_publish_without_a_delay_goes_as_sent() {
    let mut p = unsynced(true);
    p.publish(1, None);
    assert_eq!(p.upstream(), ["publish 1", "header 1", "body 1"]);
    assert!(p.take_parks().is_empty());
}

#[test]
fn while_unsynced_a_delayed_publish_to_an_exchange_not_known_delayed_is_nacked() {
    let mut p = unsynced(true);
    let budget = p.s.scope.as_ref().unwrap().shared.budget.clone();
    // Its method and header: its body is not kept meanwhile.
    let mut whole = BytesMut::new();
    p.publish_frames(&mut whole, 1, ms(5000));
    let body_at = whole.len() - (8 + 3);
    p.client(&whole[..body_at]);
    assert_eq!(budget.used(), 0, "no capture budget for a refused publish");
    // The registry is read before its body comes: refused all the same,
    // never held with a delay the broker would not apply.
    p.s.scope.as_ref().unwrap().shared.delayed.set_synced(true);
    p.client(&whole[body_at..]);
    assert!(p.upstream().is_empty(), "not routed at once");
    assert!(p.take_parks().is_empty(), "not held either");
    assert_eq!(p.client_got(), ["nack 1 no-requeue"]);
    assert_eq!(p.s.stats.delayed_refused.get(), 1);
    p.s.scope.as_ref().unwrap().shared.delayed.set_synced(false);
    p.publish(1, ms(5000));
    assert!(p.upstream().is_empty(), "not routed at once");
    assert!(p.take_parks().is_empty(), "not held either");
    assert_eq!(p.client_got(), ["nack 2 no-requeue"]);
    assert_eq!(p.s.stats.delayed_refused.get(), 2);
    // Once synced, the exchange (still not delayed) takes it as sent.
    p.s.scope.as_ref().unwrap().shared.delayed.set_synced(true);
    p.publish(1, ms(5000));
    assert_eq!(p.upstream(), ["publish 1", "header 1", "body 1"]);
    assert!(p.take_parks().is_empty());
}

#[test]
fn while_unsynced_a_delayed_publish_without_confirms_closes_the_connection_with_506() {
    let mut p = unsynced(false);
    p.publish(1, ms(5000));
    assert!(p.take_parks().is_empty());
    let ups = p.upstream();
    assert!(!ups.iter().any(|f| f.starts_with("publish")), "{ups:?}");
    let mut out = std::mem::take(p.s.transmit().0);
    let frame = FrameDecoder::default().decode(&mut out).unwrap().unwrap();
    match method::decode_any(frame.payload_slice()).unwrap() {
        AMQPClass::Connection(amq_protocol::protocol::connection::AMQPMethod::Close(c)) => {
            assert_eq!(c.reply_code, 506);
            assert!(
                c.reply_text.as_str().contains("registry"),
                "{}",
                c.reply_text
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn while_unsynced_an_exchange_known_delayed_is_held_as_ever() {
    let mut p = unsynced(true);
    p.declared(1);
    p.publish(1, ms(5000));
    assert!(p.upstream().is_empty());
    assert_eq!(p.take_parks().len(), 1);
}

#[test]
fn while_unsynced_a_delete_the_broker_accepts_goes_to_the_registry() {
    let mut p = unsynced(false);
    let shared = p.s.scope.as_ref().unwrap().shared.clone();
    shared.delayed.share_with(crate::delayed::Sharing {
        clock: shared.clock.clone(),
        origin: 1,
        wake: Box::new(|| {}),
    });
    // Another instance may have declared it delayed: the delete waits for
    // the broker's answer (nowait as the waiting form), which counts.
    p.client(&frame_of(
        1,
        AMQPClass::Exchange(exchange::AMQPMethod::Delete(exchange::Delete {
            exchange: "other".into(),
            if_unused: false,
            nowait: true,
        })),
    ));
    assert_eq!(p.upstream().len(), 1);
    assert!(
        shared.delayed.unshared().is_empty(),
        "not before the answer"
    );
    p.broker(&frame_of(
        1,
        AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(exchange::DeleteOk {})),
    ));
    assert!(p.client_got().is_empty(), "nowait: the ok stays with nackd");
    let deleted = crate::delayed::Change::Deleted {
        vhost: "/".into(),
        name: "other".into(),
    };
    let unshared = shared.delayed.unshared();
    assert_eq!(unshared.len(), 1);
    assert_eq!(unshared[0].0, deleted);
}
