//! The session as a state machine, without sockets or a broker: frames go
//! in from either side, the test plays the retry engine, and what nackd
//! writes upstream is read back frame by frame. The end-to-end tests (in
//! `tests/`) check the same paths against RabbitMQ.

use std::sync::Arc;
use std::time::{Duration, Instant};

use amq_protocol::protocol::{basic, channel, connection, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable};
use bytes::BytesMut;

use super::deferrals::{FALLBACK_DELAY, MAX_DELAY, MIN_DELAY, RATE_BURST, RATE_INTERVAL};
use super::machine::{Effect, Session};
use super::peer::Peer;
use super::{Limits, ACK_GRACE, SETTLE_TIMEOUT};
use crate::clock::Clock;
use crate::held::{Park, Parked, StoreError};
use crate::policy::Policies;
use crate::policy::{LivePolicies, Policy, PolicyConfig};
use crate::protocol::content::encode_header;
use crate::protocol::frame::{Frame, FrameDecoder, FrameType};
use crate::protocol::method::{self, put_frame};
use crate::protocol::reply::ReplyCode;
use crate::ready::{Readiness, Ready};
use crate::session::capture::Budget;
use crate::session::scope::Interception;
use crate::stats::{PassReason, SessionStats};

const Q: &str = "jobs";
/// The channel the pairs reserve to check delayed publishes (`check`):
/// the broker allows 2047, the client is offered 2046.
const RESERVED: u16 = 2047;
/// Where the tests' manual clock starts: 2023-11-14T22:13:20Z, in ms.
const EPOCH_MS: u64 = 1_700_000_000_000;

/// A session, the time it is at, and the test playing the retry engine.
struct Pair {
    s: Session,
    /// nackd's clock, moved by hand: the session's time is its time.
    clock: Clock,
    now: Instant,
    /// Parks asked and not answered yet.
    parks: Vec<Park>,
    /// Ids the session cancelled so far.
    cancelled: Vec<u64>,
    next_id: u64,
    /// What nackd sent on the reserved channel, one word per frame (see
    /// [`Pair::upstream`]).
    checks: Vec<String>,
}

fn pair() -> Pair {
    pair_with("delays = [\"1m\"]", 1 << 20)
}

/// A pair whose policy of the intercepted queue has `policy` (e.g. its
/// delays), with a capture budget of `budget` bytes.
fn pair_with(policy: &str, budget: usize) -> Pair {
    let text = format!("[[policy]]\nqueues = [\"{Q}\"]\n{policy}\n");
    let ready = Readiness::new();
    ready.set(Ready::Ready);
    let clock = Clock::manual(EPOCH_MS);
    let shared = Arc::new(Interception {
        policies: LivePolicies::new(policies(&text)),
        budget: Budget::new(budget),
        ready,
        clock: clock.clone(),
        delayed: crate::delayed::DelayedExchanges::new([], crate::delayed::DEFAULT_LIMIT, None),
    });
    let limits = Limits {
        max_frame: 131_072,
        handshake_timeout: Duration::from_secs(10),
    };
    let now = clock.now();
    let mut s = Session::new(
        limits,
        now + limits.handshake_timeout,
        now,
        SessionStats::detached(),
        Some(&shared),
    );
    // Tuned as RabbitMQ tunes: 2047 channels, of which nackd reserves one.
    let tune = connection::Tune {
        channel_max: RESERVED,
        frame_max: 131_072,
        heartbeat: 0,
    };
    let tune = frame_of(0, AMQPClass::Connection(connection::AMQPMethod::Tune(tune)));
    s.handle_bytes(Peer::Upstream, &mut BytesMut::from(&tune[..]), now);
    let ok = connection::TuneOk {
        channel_max: RESERVED - 1,
        frame_max: 131_072,
        heartbeat: 0,
    };
    let ok = frame_of(0, AMQPClass::Connection(connection::AMQPMethod::TuneOk(ok)));
    s.handle_bytes(Peer::Client, &mut BytesMut::from(&ok[..]), now);
    let (to_client, to_upstream) = s.transmit();
    to_client.clear();
    to_upstream.clear();
    s.open = true;
    Pair {
        s,
        clock,
        now,
        parks: Vec::new(),
        cancelled: Vec::new(),
        next_id: 100,
        checks: Vec::new(),
    }
}

/// The `[[policy]]` tables of `text`, compiled.
fn policies(text: &str) -> Policies {
    #[derive(serde::Deserialize)]
    struct File {
        policy: Vec<PolicyConfig>,
    }
    let file: File = toml::from_str(text).unwrap();
    let compiled: Vec<Policy> = file
        .policy
        .iter()
        .map(|p| Policy::new(p).unwrap())
        .collect();
    Policies::new(&compiled)
}

/// A pair whose client consumes the intercepted queue on channel 1 and
/// nacked its delivery 1: claimed, not answered by the store yet.
fn claimed() -> Pair {
    let mut p = pair();
    p.consume(1);
    p.deliver(1, 1);
    p.nack(1, 1);
    p
}

fn frame_of(channel: u16, class: AMQPClass) -> Vec<u8> {
    method::encode(channel, &class).to_vec()
}

fn publish_start(ch: u16, body_len: u64) -> Vec<u8> {
    let mut out = BytesMut::new();
    out.extend_from_slice(&frame_of(
        ch,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "".into(),
            routing_key: "elsewhere".into(),
            mandatory: false,
            immediate: false,
        })),
    ));
    put_frame(
        &mut out,
        FrameType::Header,
        ch,
        &encode_header(60, body_len, &Default::default()),
    );
    out.to_vec()
}

fn body(ch: u16, bytes: &[u8]) -> Vec<u8> {
    let mut out = BytesMut::new();
    put_frame(&mut out, FrameType::Body, ch, bytes);
    out.to_vec()
}

impl Pair {
    fn client(&mut self, bytes: &[u8]) {
        self.s
            .handle_bytes(Peer::Client, &mut BytesMut::from(bytes), self.now);
    }

    fn broker(&mut self, bytes: &[u8]) {
        self.s
            .handle_bytes(Peer::Upstream, &mut BytesMut::from(bytes), self.now);
    }

    /// What the session asked of the engine since the last call: parks
    /// are kept to answer, cancels recorded.
    fn effects(&mut self) {
        while let Some(effect) = self.s.poll_effect() {
            match effect {
                Effect::Park(park) => self.parks.push(park),
                Effect::Cancel(id) => self.cancelled.push(id),
            }
        }
    }

    /// The parks asked and not answered yet (the test answers them).
    fn take_parks(&mut self) -> Vec<Park> {
        self.effects();
        std::mem::take(&mut self.parks)
    }

    /// The engine answers the claim `key`.
    fn answer(&mut self, park: &Park, result: Result<u64, StoreError>) {
        let key = park.key;
        self.s.handle_parked(Parked { key, result }, self.now);
    }

    /// Time passes; no timer has fired yet.
    fn time_passes(&mut self, by: Duration) {
        self.clock.advance(by);
        self.now = self.clock.now();
    }

    /// The pump's timer fires.
    fn timer_fires(&mut self) {
        self.s.handle_timeout(self.now);
    }

    /// Opens channel `ch` with a consumer on the intercepted queue.
    fn consume(&mut self, ch: u16) {
        self.client(&frame_of(
            ch,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        ));
        self.broker(&frame_of(
            ch,
            AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
        ));
        let tag = format!("c{ch}");
        self.client(&frame_of(
            ch,
            AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
                queue: Q.into(),
                consumer_tag: tag.as_str().into(),
                no_local: false,
                no_ack: false,
                exclusive: false,
                nowait: false,
                arguments: FieldTable::default(),
            })),
        ));
        self.broker(&frame_of(
            ch,
            AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
                consumer_tag: tag.as_str().into(),
            })),
        ));
        self.upstream();
    }

    /// The broker delivers message `tag` on channel `ch`.
    fn deliver(&mut self, ch: u16, tag: u64) {
        let mut out = BytesMut::new();
        out.extend_from_slice(&frame_of(
            ch,
            AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
                consumer_tag: format!("c{ch}").as_str().into(),
                delivery_tag: tag,
                redelivered: false,
                exchange: "".into(),
                routing_key: Q.into(),
            })),
        ));
        put_frame(
            &mut out,
            FrameType::Header,
            ch,
            &encode_header(60, 3, &Default::default()),
        );
        put_frame(&mut out, FrameType::Body, ch, b"abc");
        self.broker(&out);
    }

    fn nack(&mut self, ch: u16, tag: u64) {
        self.client(&method::nack(ch, tag, false, true));
    }

    /// The engine stores every park asked so far; returns their ids.
    fn store(&mut self, ok: bool) -> Vec<u64> {
        let mut ids = Vec::new();
        for park in self.take_parks() {
            self.next_id += 1;
            ids.push(self.next_id);
            let result = match ok {
                true => Ok(self.next_id),
                false => Err(StoreError::Full("test".into())),
            };
            self.answer(&park, result);
        }
        ids
    }

    /// Ids the session cancelled so far.
    fn cancelled(&mut self) -> Vec<u64> {
        self.effects();
        self.cancelled.clone()
    }

    /// [`ACK_GRACE`] passes and the timer the core asked for fires.
    fn grace_passes(&mut self) {
        self.time_passes(ACK_GRACE);
        self.timer_fires();
    }

    /// What nackd wrote upstream since the last call, one word per frame:
    /// `ack 3`, `nack 3`, `ack 4+` (multiple), `channel.close 1`, `header 1`.
    /// Its frames on the reserved channel go to [`Pair::checks`] instead.
    fn upstream(&mut self) -> Vec<String> {
        let mut buf = std::mem::take(self.s.transmit().1);
        let decoder = FrameDecoder::default();
        let mut seen = Vec::new();
        let reserved = self.s.checks.channel();
        while let Some(frame) = decoder.decode(&mut buf).unwrap() {
            match Some(frame.channel) == reserved {
                true => self.checks.push(describe(&frame)),
                false => seen.push(describe(&frame)),
            }
        }
        seen
    }

    /// The broker tunes with `channel_max` = `broker`, the client answers
    /// with `client`.
    fn tune(&mut self, broker: u16, client: u16) {
        let tune = connection::Tune {
            channel_max: broker,
            frame_max: 131_072,
            heartbeat: 0,
        };
        self.broker(&frame_of(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Tune(tune)),
        ));
        let ok = connection::TuneOk {
            channel_max: client,
            frame_max: 131_072,
            heartbeat: 0,
        };
        self.client(&frame_of(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(ok)),
        ));
        let (to_client, to_upstream) = self.s.transmit();
        to_client.clear();
        to_upstream.clear();
    }

    /// The broker answers every check sent so far: it would take each
    /// publish (`tx.rollback-ok` on the reserved channel).
    fn grant_checks(&mut self) {
        self.upstream_keep();
        let reserved = self.s.checks.channel().expect("tuned");
        for _ in 0..self.s.checks.sent() {
            self.broker(&frame_of(
                reserved,
                AMQPClass::Tx(amq_protocol::protocol::tx::AMQPMethod::RollbackOk(
                    amq_protocol::protocol::tx::RollbackOk {},
                )),
            ));
        }
    }

    /// Moves nackd's frames on the reserved channel to [`Pair::checks`],
    /// leaving the rest for [`Pair::upstream`].
    fn upstream_keep(&mut self) {
        let mut buf = std::mem::take(self.s.transmit().1);
        let decoder = FrameDecoder::default();
        let mut rest = BytesMut::new();
        let reserved = self.s.checks.channel();
        while let Some(frame) = decoder.decode(&mut buf).unwrap() {
            match Some(frame.channel) == reserved {
                true => self.checks.push(describe(&frame)),
                false => rest.extend_from_slice(&frame.raw),
            }
        }
        let to_upstream = self.s.transmit().1;
        rest.extend_from_slice(to_upstream);
        *to_upstream = rest;
    }
}

fn describe(frame: &Frame) -> String {
    let ch = frame.channel;
    match frame.kind {
        FrameType::Header => return format!("header {ch}"),
        FrameType::Body => return format!("body {ch}"),
        FrameType::Heartbeat => return "heartbeat".into(),
        FrameType::Method => {}
    }
    let plus = |m: bool| if m { "+" } else { "" };
    match method::decode_any(frame.payload_slice()).unwrap() {
        AMQPClass::Basic(basic::AMQPMethod::Ack(a)) => {
            format!("ack {}{}", a.delivery_tag, plus(a.multiple))
        }
        AMQPClass::Basic(basic::AMQPMethod::Nack(n)) => {
            let drop = if n.requeue { "" } else { " no-requeue" };
            format!("nack {}{}{drop}", n.delivery_tag, plus(n.multiple))
        }
        AMQPClass::Basic(basic::AMQPMethod::Reject(r)) => format!("reject {}", r.delivery_tag),
        AMQPClass::Basic(basic::AMQPMethod::Publish(_)) => format!("publish {ch}"),
        AMQPClass::Basic(basic::AMQPMethod::Recover(_)) => format!("recover {ch}"),
        AMQPClass::Channel(channel::AMQPMethod::Close(_)) => format!("channel.close {ch}"),
        AMQPClass::Connection(connection::AMQPMethod::Close(_)) => "connection.close".into(),
        other => format!("{other:?}"),
    }
}

fn channel_close(ch: u16) -> Vec<u8> {
    method::channel_close(ch, ReplyCode::Success, "bye").to_vec()
}

#[test]
fn a_claimed_nack_is_acked_only_once_stored() {
    let mut p = claimed();
    assert!(p.upstream().is_empty(), "nothing before the store answers");
    p.store(true);
    assert_eq!(p.upstream(), ["ack 1"]);
    assert_eq!(p.s.stats.intercepted.get(), 1);
}

#[test]
fn settles_around_claimed_tags_never_touch_them() {
    let mut p = pair();
    p.consume(1);
    for tag in 1..=4 {
        p.deliver(1, tag);
    }
    p.nack(1, 2);
    // ack(≤3, multiple) with 2 claimed: 1 and 3 only.
    p.client(&method::ack(1, 3, true));
    assert_eq!(p.upstream(), ["ack 1", "ack 3"]);
    // nack(≤4, multiple) claims 4 too; reject of a claimed tag goes as sent.
    p.client(&method::nack(1, 4, true, true));
    assert!(p.upstream().is_empty());
    assert_eq!(p.take_parks().len(), 2);
}

#[test]
fn a_channel_close_waits_for_the_ack_and_the_grace() {
    let mut p = claimed();
    p.client(&channel_close(1));
    assert!(p.upstream().is_empty(), "the close waits for the claim");
    p.store(true);
    assert_eq!(p.upstream(), ["ack 1"]);
    let acked = p.now;
    // Just before the grace's end (past a tick: the grace is the longer),
    // the close still waits, and the next wake is the grace's end itself.
    p.time_passes(ACK_GRACE - Duration::from_millis(1));
    p.timer_fires();
    assert!(p.upstream().is_empty(), "the close went before the grace");
    assert_eq!(
        p.s.poll_timeout(),
        acked + ACK_GRACE,
        "the grace timer is armed"
    );
    p.time_passes(Duration::from_millis(1));
    p.timer_fires();
    assert_eq!(p.upstream(), ["channel.close 1"]);
}

#[test]
fn a_close_right_after_an_ack_waits_the_grace_too() {
    let mut p = claimed();
    p.store(true);
    assert_eq!(p.upstream(), ["ack 1"]);
    p.client(&frame_of(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Recover(basic::Recover { requeue: true })),
    ));
    assert!(
        p.upstream().is_empty(),
        "recover waits for the broker to apply the ack"
    );
    p.grace_passes();
    assert_eq!(p.upstream(), ["recover 1"]);
}

#[test]
fn a_channel_that_keeps_nacking_does_not_hold_a_close_forever() {
    let mut p = claimed();
    p.consume(2);
    p.client(&channel_close(1));
    for tag in 1..=5 {
        p.deliver(2, tag);
        p.nack(2, tag);
        p.store(true);
    }
    p.deliver(2, 6);
    p.nack(2, 6); // unanswered, and younger than the close
    p.upstream();
    p.grace_passes();
    let sent = p.upstream();
    assert!(sent.contains(&"channel.close 1".to_string()), "{sent:?}");
}

#[test]
fn an_ack_waits_for_the_clients_publish_on_its_channel() {
    let mut p = claimed();
    p.client(&publish_start(1, 5));
    assert_eq!(p.upstream(), ["publish 1", "header 1"]);
    p.store(true);
    assert!(p.upstream().is_empty(), "no frame inside the content");
    p.client(&body(1, b"hello"));
    assert_eq!(p.upstream(), ["body 1", "ack 1"]);
}

#[test]
fn a_deferred_nack_waits_for_the_clients_publish_too() {
    let mut p = claimed();
    p.store(false);
    p.client(&publish_start(1, 5));
    p.upstream();
    p.time_passes(MAX_DELAY);
    p.timer_fires();
    assert!(p.upstream().is_empty(), "no frame inside the content");
    p.client(&body(1, b"hello"));
    assert_eq!(p.upstream(), ["body 1", "nack 1"]);
}

#[test]
fn a_hold_begun_mid_publish_does_not_split_the_content() {
    let mut p = claimed();
    p.consume(2);
    p.client(&publish_start(2, 5));
    p.client(&channel_close(1)); // held: claim 1 is unanswered
    assert_eq!(p.upstream(), ["publish 2", "header 2"]);
    p.client(&body(2, b"hello"));
    assert_eq!(
        p.upstream(),
        ["body 2"],
        "the content goes on past the hold"
    );
    p.store(true);
    p.grace_passes();
    assert_eq!(p.upstream(), ["ack 1", "channel.close 1"]);
}

#[test]
fn a_publish_begun_behind_a_hold_stays_whole_behind_it() {
    let mut p = pair();
    p.consume(1);
    p.consume(2);
    p.deliver(1, 1);
    p.nack(1, 1); // claim on channel 1
    p.deliver(2, 5);
    p.nack(2, 5); // claim on channel 2
    p.client(&channel_close(2)); // held
    p.client(&publish_start(1, 5));
    let parks = p.take_parks();
    p.answer(&parks[0], Ok(1));
    // The publish sits behind the hold whole: the ack goes first.
    assert_eq!(p.upstream(), ["ack 1"]);
    p.client(&body(1, b"hello"));
    assert!(p.upstream().is_empty());
    p.answer(&parks[1], Ok(2));
    p.grace_passes();
    assert_eq!(
        p.upstream(),
        [
            "ack 5",
            "channel.close 2",
            "publish 1",
            "header 1",
            "body 1"
        ]
    );
}

#[test]
fn a_store_that_never_answers_gives_the_nack_back_after_the_settle_timeout() {
    let mut p = claimed();
    p.client(&channel_close(1));
    p.time_passes(SETTLE_TIMEOUT);
    p.timer_fires();
    assert_eq!(p.upstream(), ["nack 1", "channel.close 1"]);
    // The store answers late: its copy is cancelled, nothing is acked.
    let ids = p.store(true);
    assert!(p.upstream().is_empty());
    assert_eq!(p.cancelled(), ids);
}

#[test]
fn a_session_that_ends_cancels_the_holds_it_could_not_ack() {
    let mut p = pair();
    p.consume(1);
    p.deliver(1, 1);
    p.deliver(1, 2);
    p.deliver(1, 3);
    p.nack(1, 1);
    p.nack(1, 2);
    p.nack(1, 3);
    p.client(&publish_start(1, 5));
    // 1 and 2 stored while the publish is half sent: their acks wait.
    let parks = p.take_parks();
    let mut deferred = Vec::new();
    for park in &parks[..2] {
        p.next_id += 1;
        deferred.push(p.next_id);
        p.answer(park, Ok(p.next_id));
    }
    // The client vanishes mid-publish; the engine answers 3 after that.
    p.s.handle_gone(Peer::Client, None, p.now);
    let late = Parked {
        key: parks[2].key,
        result: Ok(103),
    };
    p.s.end([late]);
    deferred.push(103);
    let mut cancelled = p.cancelled();
    cancelled.sort_unstable();
    assert_eq!(
        cancelled, deferred,
        "acks never sent, and the late answer: copies cancelled"
    );
}

#[test]
fn a_client_fault_closes_upstream_only_after_the_acks() {
    let mut p = claimed();
    p.client(b"\x09garbage-garbage");
    assert!(
        p.upstream().is_empty(),
        "connection.close waits for the claim"
    );
    p.store(true);
    p.grace_passes();
    assert_eq!(p.upstream(), ["ack 1", "connection.close"]);
}

/// A client stream that lost its framing (here the rest of an oversized
/// body, read by read) gets one connection.close, not one per read.
#[test]
fn a_client_stream_past_its_protocol_error_gets_one_connection_close() {
    let mut p = pair();
    p.client(&[3, 0, 1, 0, 0x10, 0, 0]); // a body frame of 1 MiB: too large
    p.client(&[b'X'; 64]);
    p.client(&[b'X'; 64]);
    let mut to_client = std::mem::take(p.s.transmit().0);
    let decoder = FrameDecoder::default();
    let mut closes = 0;
    while let Some(frame) = decoder.decode(&mut to_client).unwrap() {
        assert_eq!(describe(&frame), "connection.close");
        closes += 1;
    }
    assert_eq!(closes, 1);
}

#[test]
fn an_ack_is_not_sent_after_nackds_connection_close() {
    let mut p = claimed();
    // nackd closes upstream for a reason of its own (e.g. the handshake).
    p.s.close_upstream("test");
    assert_eq!(p.upstream(), ["connection.close"]);
    let ids = p.store(true);
    assert!(
        p.upstream().is_empty(),
        "an ack after close would be dropped"
    );
    assert_eq!(p.cancelled(), ids);
}

#[test]
fn a_second_settle_of_a_claimed_tag_is_the_brokers_alone() {
    let mut p = claimed();
    p.client(&method::ack(1, 1, false));
    assert_eq!(p.upstream(), ["ack 1"], "the client's own ack, as sent");
    let ids = p.store(true);
    assert!(p.upstream().is_empty(), "no second ack from nackd");
    assert_eq!(p.cancelled(), ids);
}

fn connection_close() -> Vec<u8> {
    method::connection_close(ReplyCode::ConnectionForced, "node stopping", None).to_vec()
}

#[test]
fn no_ack_after_the_brokers_connection_close_even_once_answered() {
    for client_gone in [false, true] {
        let mut p = claimed();
        p.client(&channel_close(1));
        p.broker(&connection_close());
        if client_gone {
            p.s.handle_gone(Peer::Client, None, p.now);
        } else {
            p.client(&method::connection_close_ok());
        }
        p.upstream();
        let ids = p.store(true);
        let sent = p.upstream();
        assert!(!sent.contains(&"ack 1".to_string()), "{sent:?}");
        assert_eq!(p.cancelled(), ids);
    }
}

#[test]
fn a_close_of_a_channel_without_claims_goes_at_once() {
    let mut p = claimed();
    p.consume(2);
    p.client(&channel_close(2));
    assert_eq!(
        p.upstream(),
        ["channel.close 2"],
        "channel 1's claim is not 2's"
    );
}

#[test]
fn a_claim_is_given_up_only_once_it_is_old() {
    let mut p = pair();
    p.consume(1);
    p.consume(2);
    p.deliver(1, 1);
    p.nack(1, 1); // claim 1
    p.client(&channel_close(1));
    p.time_passes(SETTLE_TIMEOUT);
    p.deliver(2, 5);
    p.nack(2, 5); // claim 2, new
    p.client(&channel_close(2)); // held behind claim 2
    let sent = p.upstream();
    assert_eq!(sent, ["nack 1"], "only the old claim is given up");
    let parks = p.take_parks();
    p.answer(&parks[1], Ok(2));
    p.grace_passes();
    assert_eq!(
        p.upstream(),
        ["ack 5", "channel.close 1", "channel.close 2"]
    );
}

#[test]
fn the_grace_runs_from_when_a_deferred_ack_goes() {
    let mut p = claimed();
    p.client(&publish_start(1, 5));
    p.upstream();
    p.store(true);
    // The publish takes longer than the grace to end.
    p.time_passes(ACK_GRACE);
    p.client(&body(1, b"hello"));
    assert_eq!(p.upstream(), ["body 1", "ack 1"]);
    p.client(&channel_close(1));
    assert!(p.upstream().is_empty(), "the close waits for the grace");
    p.grace_passes();
    assert_eq!(p.upstream(), ["channel.close 1"]);
}

#[test]
fn a_give_up_skips_tags_the_client_settled_again() {
    let mut p = claimed();
    p.consume(2);
    p.client(&method::ack(1, 1, false));
    assert_eq!(p.upstream(), ["ack 1"]);
    p.client(&channel_close(1));
    p.time_passes(SETTLE_TIMEOUT);
    p.timer_fires();
    assert_eq!(
        p.upstream(),
        ["channel.close 1"],
        "no nack after the client's ack"
    );
}

#[test]
fn heartbeats_are_never_held_back() {
    let mut p = claimed();
    p.client(&channel_close(1));
    p.client(&method::heartbeat());
    assert_eq!(p.upstream(), ["heartbeat"]);
}

#[test]
fn nacks_after_a_held_recover_on_their_channel_pass_through() {
    let mut p = claimed();
    p.client(&frame_of(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Recover(basic::Recover { requeue: true })),
    ));
    p.deliver(1, 2);
    p.nack(1, 2);
    assert_eq!(
        p.take_parks().len(),
        1,
        "only the nack before the recover is claimed"
    );
    assert_eq!(p.s.stats.passed(PassReason::Closing), 1);
}

/// Issue 20, item 2: RabbitMQ 4.3 returns a timed-out consumer's deliveries
/// to their quorum queue and sends `basic.cancel`. A nack of one of them
/// afterwards must not be claimed (the queue has the message again: a held
/// copy would be a duplicate); it goes to the broker as sent.
#[test]
fn a_delivery_of_a_consumer_the_broker_cancelled_is_not_claimed() {
    let mut p = pair();
    p.consume(1);
    p.deliver(1, 1);
    p.deliver(1, 2);
    p.nack(1, 1);
    assert_eq!(p.take_parks().len(), 1, "claimed while its consumer lives");
    p.broker(&frame_of(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
            consumer_tag: "c1".into(),
            nowait: true,
        })),
    ));
    p.client(&method::nack(1, 2, false, false));
    assert!(
        p.take_parks().is_empty(),
        "not claimed once the broker took it back"
    );
    assert_eq!(p.upstream(), ["nack 2 no-requeue"]);
    assert_eq!(p.s.stats.passed(PassReason::Returned), 1);
}

/// A consumer tag is the channel's to reuse once cancelled: the client
/// cancels `c1` on the intercepted queue (its deliveries stay unacked) and
/// consumes another queue as `c1`. The broker cancelling that second
/// consumer (its queue deleted) takes back none of the first one's
/// deliveries: a nack of one is still claimed, not passed as sent (which,
/// requeue=false without a DLX, drops the message).
#[test]
fn a_broker_cancel_of_a_reused_tag_leaves_the_first_consumers_deliveries() {
    let mut p = pair();
    p.consume(1);
    p.deliver(1, 1);
    let cancel = basic::Cancel {
        consumer_tag: "c1".into(),
        nowait: false,
    };
    p.client(&frame_of(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Cancel(cancel)),
    ));
    let ok = basic::CancelOk {
        consumer_tag: "c1".into(),
    };
    p.broker(&frame_of(
        1,
        AMQPClass::Basic(basic::AMQPMethod::CancelOk(ok)),
    ));
    let consume = basic::Consume {
        queue: "other".into(),
        consumer_tag: "c1".into(),
        no_local: false,
        no_ack: false,
        exclusive: false,
        nowait: false,
        arguments: FieldTable::default(),
    };
    p.client(&frame_of(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Consume(consume)),
    ));
    let ok = basic::ConsumeOk {
        consumer_tag: "c1".into(),
    };
    p.broker(&frame_of(
        1,
        AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(ok)),
    ));
    let cancel = basic::Cancel {
        consumer_tag: "c1".into(),
        nowait: true,
    };
    p.broker(&frame_of(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Cancel(cancel)),
    ));
    p.upstream();
    p.client(&method::nack(1, 1, false, false));
    assert_eq!(
        p.take_parks().len(),
        1,
        "the first consumer's delivery is claimed"
    );
    assert_eq!(p.s.stats.passed(PassReason::Returned), 0);
}

/// A nack nackd cannot claim behind a held recover goes to the broker with
/// requeue, whatever the client asked: as sent (requeue=false, no DLX) the
/// broker would drop the message. And it goes at once, ahead of the
/// recover: after it, RabbitMQ has requeued delivery 2 and forgotten its
/// tag, and a nack of it closes the channel (406 unknown delivery tag),
/// a break the client did not cause (the broker sent 2 only because nackd
/// held the recover back).
#[test]
fn a_nack_behind_a_held_recover_is_requeued_not_dropped() {
    let mut p = claimed();
    p.client(&frame_of(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Recover(basic::Recover { requeue: true })),
    ));
    p.deliver(1, 2);
    p.client(&method::nack(1, 2, false, false));
    assert_eq!(p.upstream(), ["nack 2"], "at once, ahead of the recover");
    p.store(true);
    p.grace_passes();
    assert_eq!(p.upstream(), ["ack 1", "recover 1"]);
    assert_eq!(p.s.stats.passed(PassReason::Closing), 1);
}

#[test]
fn tx_select_after_a_claim_waits_for_its_ack() {
    use amq_protocol::protocol::tx;
    let mut p = claimed();
    p.client(&frame_of(
        1,
        AMQPClass::Tx(tx::AMQPMethod::Select(tx::Select {})),
    ));
    assert!(p.upstream().is_empty());
    p.store(true);
    p.grace_passes();
    let sent = p.upstream();
    assert_eq!(
        sent[0], "ack 1",
        "the ack goes before the transaction: {sent:?}"
    );
}

#[test]
fn after_nackds_connection_close_client_frames_stop() {
    let mut p = pair();
    p.consume(1);
    p.s.handle_force(p.now);
    assert_eq!(p.upstream(), ["connection.close"]);
    p.client(&channel_close(1));
    p.deliver(1, 1);
    p.nack(1, 1);
    assert_eq!(p.upstream(), Vec::<String>::new());
    assert!(p.take_parks().is_empty(), "no claim after the close");
}

#[test]
fn a_connection_close_waits_for_the_claims_and_the_grace() {
    let mut p = claimed();
    p.client(&method::connection_close(ReplyCode::Success, "bye", None));
    assert!(p.upstream().is_empty(), "the close waits for the claim");
    p.store(true);
    assert_eq!(p.upstream(), ["ack 1"]);
    p.grace_passes();
    assert_eq!(p.upstream(), ["connection.close"]);
    assert!(p.cancelled().is_empty());
}

fn tune_ok(heartbeat: u16) -> Vec<u8> {
    frame_of(
        0,
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: 0,
            frame_max: 131_072,
            heartbeat,
        })),
    )
}

#[test]
fn a_client_silent_for_two_heartbeats_is_closed_upstream() {
    let mut p = pair();
    p.client(&tune_ok(1));
    p.upstream();
    for _ in 0..2 {
        p.time_passes(Duration::from_millis(1_000));
        p.broker(&method::heartbeat());
        p.timer_fires();
    }
    assert!(p.upstream().is_empty(), "two heartbeats are not missed yet");
    p.time_passes(Duration::from_millis(500));
    p.broker(&method::heartbeat());
    p.timer_fires();
    assert_eq!(p.upstream(), ["connection.close"]);
    assert!(!p.s.may_read(Peer::Client), "the client side is gone");
}

#[test]
fn a_pair_that_never_opens_ends_at_the_handshake_deadline() {
    let mut p = pair();
    p.s.open = false;
    p.time_passes(Duration::from_secs(9));
    p.timer_fires();
    assert!(!p.s.is_finished(p.now));
    p.time_passes(Duration::from_secs(1));
    p.timer_fires();
    assert!(p.s.is_finished(p.now), "both sides dropped at the deadline");
}

/// A pair (policy delay 2 s) whose client consumes on channel 1, got
/// deliveries 1 to `n`, and nacked (requeue=false) tag 1: claimed, and the
/// store refused it.
fn refused(n: u64) -> Pair {
    let mut p = pair_with("delays = [\"2s\"]", 1 << 20);
    p.consume(1);
    for tag in 1..=n {
        p.deliver(1, tag);
    }
    p.client(&method::nack(1, 1, false, false));
    p.store(false);
    p
}

/// A park the local store took but the replica did not (its stream was
/// deleted, say) is deferred as `no_replica`, as the nacks are that come
/// once the engine knows: the operator reads one reason for one cause.
#[test]
fn a_nack_the_replica_refuses_is_deferred_for_want_of_a_replica() {
    let mut p = pair_with("delays = [\"2s\"]", 1 << 20);
    p.consume(1);
    p.deliver(1, 1);
    p.client(&method::nack(1, 1, false, false));
    let parks = p.take_parks();
    assert_eq!(parks.len(), 1, "claimed while the engine said ready");
    p.answer(&parks[0], Err(StoreError::Replica("stream gone".into())));
    assert!(p.upstream().is_empty(), "not acked, not settled as sent");
    p.time_passes(Duration::from_secs(2));
    p.timer_fires();
    assert_eq!(p.upstream(), ["nack 1"], "requeued after the delay");
    assert_eq!(p.s.stats.deferred(PassReason::NoReplica), 1);
    assert_eq!(p.s.stats.deferred(PassReason::StoreUnavailable), 0);
}

#[test]
fn a_nack_the_store_refuses_is_requeued_after_the_policy_delay() {
    let mut p = refused(1);
    assert!(p.upstream().is_empty(), "not settled as sent (no drop)");
    p.time_passes(Duration::from_millis(1_999));
    p.timer_fires();
    assert!(p.upstream().is_empty(), "never before the delay");
    p.time_passes(Duration::from_millis(1));
    assert_eq!(p.s.poll_timeout(), p.now, "the core wakes at the due time");
    p.timer_fires();
    assert_eq!(
        p.upstream(),
        ["nack 1"],
        "requeue=true, whatever the client sent"
    );
    assert_eq!(p.s.stats.deferred(PassReason::StoreUnavailable), 1);
    assert_eq!(p.s.stats.passed_total(), 0);
    assert_eq!(p.s.stats.deferred_now.get(), 0);
}

#[test]
fn a_multiple_ack_does_not_cover_a_deferred_tag() {
    let mut p = refused(3);
    assert_eq!(p.s.stats.deferred_now.get(), 1);
    p.client(&method::ack(1, 3, true));
    assert_eq!(p.upstream(), ["ack 2", "ack 3"], "tag 1 is nackd's to nack");
    p.client(&method::nack(1, 0, true, false));
    assert!(
        p.upstream().is_empty(),
        "a nack of all does not drop it either"
    );
    p.time_passes(Duration::from_secs(2));
    p.timer_fires();
    assert_eq!(p.upstream(), ["nack 1"]);
}

#[test]
fn a_second_settle_of_a_deferred_tag_is_the_brokers_alone() {
    let mut p = refused(1);
    p.client(&method::ack(1, 1, false));
    assert_eq!(p.upstream(), ["ack 1"], "the client's own ack, as sent");
    p.time_passes(Duration::from_secs(2));
    p.timer_fires();
    assert!(p.upstream().is_empty(), "no nack after it");
    assert_eq!(p.s.stats.deferred_now.get(), 0);
}

#[test]
fn a_close_or_recover_forgets_deferred_tags_and_is_not_held_by_them() {
    let recover = frame_of(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Recover(basic::Recover { requeue: true })),
    );
    let broker_close = method::channel_close(1, ReplyCode::ChannelError, "x").to_vec();
    for (what, ending) in [("close", channel_close(1)), ("recover", recover)] {
        let mut p = refused(1);
        p.client(&ending);
        assert_eq!(p.upstream().len(), 1, "{what} goes at once");
        p.time_passes(Duration::from_secs(2));
        p.timer_fires();
        assert!(p.upstream().is_empty(), "{what}: the broker requeued it");
        assert_eq!(p.s.stats.deferred_now.get(), 0, "{what}");
    }
    let mut p = refused(1);
    p.broker(&broker_close);
    p.time_passes(Duration::from_secs(2));
    p.timer_fires();
    assert!(p.upstream().is_empty(), "the broker closed the channel");
    let mut p = refused(1);
    p.s.handle_gone(Peer::Upstream, None, p.now);
    assert_eq!(p.s.stats.deferred_now.get(), 0, "upstream gone");
}

#[test]
fn deferred_nacks_go_at_a_bounded_rate() {
    let mut p = pair_with("delays = [\"1s\"]", 1 << 20);
    p.consume(1);
    let n = u64::from(RATE_BURST) + 20;
    for tag in 1..=n {
        p.deliver(1, tag);
    }
    p.client(&method::nack(1, n, true, false));
    p.store(false);
    assert_eq!(p.s.stats.deferred_now.get(), n as i64);
    p.time_passes(Duration::from_secs(1));
    p.timer_fires();
    assert_eq!(
        p.upstream().len(),
        RATE_BURST as usize,
        "a burst, then the rate"
    );
    assert_eq!(p.s.poll_timeout(), p.now + RATE_INTERVAL);
    p.time_passes(RATE_INTERVAL * 10);
    p.timer_fires();
    assert_eq!(p.upstream().len(), 10);
    p.time_passes(RATE_INTERVAL * 10);
    p.timer_fires();
    assert_eq!(p.upstream().len(), 10);
    assert_eq!(p.s.stats.deferred_now.get(), 0);
}

#[test]
fn without_a_lease_a_nack_is_deferred_not_dropped() {
    let mut p = pair_with("delays = [\"2s\"]", 1 << 20);
    p.s.scope.as_ref().unwrap().shared.ready.set(Ready::NoLease);
    p.consume(1);
    p.deliver(1, 1);
    p.client(&method::reject(1, 1, false));
    assert!(p.take_parks().is_empty(), "nothing parked without a lease");
    assert!(p.upstream().is_empty(), "not rejected as sent");
    p.time_passes(Duration::from_secs(2));
    p.timer_fires();
    assert_eq!(p.upstream(), ["nack 1"]);
    assert_eq!(p.s.stats.deferred(PassReason::NoLease), 1);
}

#[test]
fn over_the_capture_budget_a_nack_is_deferred_by_the_fallback_delay() {
    let mut p = pair_with("delays = [\"5s\"]", 1);
    p.consume(1);
    p.deliver(1, 1);
    p.client(&method::nack(1, 1, false, false));
    assert!(p.upstream().is_empty(), "not nacked as sent");
    p.time_passes(FALLBACK_DELAY);
    p.timer_fires();
    assert_eq!(p.upstream(), ["nack 1"]);
    assert_eq!(p.s.stats.deferred(PassReason::OverBudget), 1);
}

#[test]
fn a_requeue_pass_policy_still_forwards_as_sent() {
    let mut p = pair_with("delays = [\"5s\"]\nrequeue = \"pass\"", 1);
    p.consume(1);
    p.deliver(1, 1);
    p.nack(1, 1);
    assert_eq!(
        p.upstream(),
        ["nack 1"],
        "over budget, but pass is what the user asked"
    );
    assert_eq!(p.s.stats.passed(PassReason::RequeuePass), 1);
}

#[test]
fn a_refused_nack_behind_a_tx_select_goes_back_before_it() {
    use amq_protocol::protocol::tx;
    let mut p = claimed();
    p.client(&frame_of(
        1,
        AMQPClass::Tx(tx::AMQPMethod::Select(tx::Select {})),
    ));
    p.store(false);
    p.grace_passes();
    let sent = p.upstream();
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert_eq!(sent[0], "nack 1", "not inside the transaction: {sent:?}");
}

#[test]
fn at_shutdown_deferred_nacks_go_before_the_close() {
    let mut p = refused(1);
    p.s.handle_force(p.now);
    assert_eq!(p.upstream(), ["nack 1", "connection.close"]);
}

/// A retry whose schedule is exhausted goes to the dead-letter exchange at
/// once (its plan has no delay). When the store refuses it, its deferral
/// must not be the 100 ms floor: the client nacks the redelivery again,
/// the store refuses again, and ten requeues a second spend a quorum
/// queue's delivery-limit (20 on RabbitMQ 4.0-4.2) in two seconds, after
/// which the broker drops the message. It waits the fallback delay.
#[test]
fn an_exhausted_nack_the_store_refuses_waits_the_fallback_delay_not_the_floor() {
    use amq_protocol::protocol::basic::AMQPProperties;
    use amq_protocol::types::AMQPValue;
    let mut p = pair_with(
        "delays = [\"2s\"]\non_exhausted = { exchange = \"dlx\" }",
        1 << 20,
    );
    p.consume(1);
    // Retried once already: the next retry is past the schedule.
    let mut headers = FieldTable::default();
    headers.insert("x-retry-count".into(), AMQPValue::LongLongInt(1));
    let props = AMQPProperties::default().with_headers(headers);
    let mut out = BytesMut::new();
    out.extend_from_slice(&frame_of(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
            consumer_tag: "c1".into(),
            delivery_tag: 1,
            redelivered: true,
            exchange: "".into(),
            routing_key: Q.into(),
        })),
    ));
    put_frame(
        &mut out,
        FrameType::Header,
        1,
        &encode_header(60, 3, &props),
    );
    put_frame(&mut out, FrameType::Body, 1, b"abc");
    p.broker(&out);
    p.client(&method::nack(1, 1, false, false));
    assert_eq!(
        p.store(false).len(),
        1,
        "parked for the dead-letter exchange"
    );
    p.time_passes(MIN_DELAY);
    p.timer_fires();
    assert!(p.upstream().is_empty(), "not requeued after the floor");
    p.time_passes(FALLBACK_DELAY - MIN_DELAY);
    p.timer_fires();
    assert_eq!(p.upstream(), ["nack 1"]);
}

/// A deferred nack that waited for the client's publish is no ack the
/// broker needs time to apply: a close right after it is not held back.
#[test]
fn a_deferred_nack_after_a_publish_does_not_hold_a_close() {
    let mut p = refused(1);
    p.client(&publish_start(1, 5));
    p.upstream();
    p.time_passes(Duration::from_secs(2));
    p.timer_fires();
    p.client(&body(1, b"hello"));
    assert_eq!(p.upstream(), ["body 1", "nack 1"]);
    p.client(&channel_close(1));
    assert_eq!(p.upstream(), ["channel.close 1"], "no grace to wait");
}

/// The time a retry's headers carry is the clock's at the nack: the one
/// clock the engine schedules by, moved by hand here.
#[test]
fn the_retry_headers_carry_the_clocks_time_at_the_nack() {
    let mut p = pair();
    p.consume(1);
    p.deliver(1, 1);
    p.time_passes(Duration::from_secs(5));
    p.nack(1, 1);
    let parks = p.take_parks();
    let park = parks.last().expect("a park");
    let header = crate::protocol::content::decode_header(&park.header).unwrap();
    let headers = header.properties.headers().clone().unwrap();
    let Some(AMQPValue::FieldArray(deaths)) = headers.inner().get("x-death") else {
        panic!("no x-death: {headers:?}");
    };
    let Some(AMQPValue::FieldTable(death)) = deaths.as_slice().first() else {
        panic!("an empty x-death");
    };
    assert_eq!(
        death.inner().get("time"),
        Some(&AMQPValue::Timestamp(EPOCH_MS / 1000 + 5))
    );
}

/// A `basic.consume` of `queue` as `tag` on channel `ch`.
fn consume_frame(ch: u16, queue: &str, tag: &str, nowait: bool) -> Vec<u8> {
    frame_of(
        ch,
        AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
            queue: queue.into(),
            consumer_tag: tag.into(),
            no_local: false,
            no_ack: false,
            exclusive: false,
            nowait,
            arguments: FieldTable::default(),
        })),
    )
}

/// The broker delivers message `tag` to consumer `consumer` on channel `ch`.
fn deliver_to(ch: u16, consumer: &str, tag: u64) -> Vec<u8> {
    let mut out = BytesMut::new();
    out.extend_from_slice(&frame_of(
        ch,
        AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
            consumer_tag: consumer.into(),
            delivery_tag: tag,
            redelivered: false,
            exchange: "".into(),
            routing_key: "r".into(),
        })),
    ));
    put_frame(
        &mut out,
        FrameType::Header,
        ch,
        &encode_header(60, 3, &Default::default()),
    );
    put_frame(&mut out, FrameType::Body, ch, b"abc");
    out.to_vec()
}

/// The client cancels `c1` (waiting for cancel-ok) and at once consumes
/// the intercepted queue with `nowait` under the same tag, which the
/// broker accepts: it applies the cancel first. Until its `cancel-ok`, the
/// broker's deliveries to `c1` are still the first consumer's, from the
/// queue nackd does not intercept: a nack of one goes to the broker as
/// sent, it is not claimed (and republished into the other queue). The
/// `cancel-ok` ends the first consumer only: the second one's deliveries
/// are claimed.
#[test]
fn a_tag_reused_with_nowait_before_the_cancel_ok_keeps_each_delivery_with_its_consumer() {
    let mut p = pair();
    p.client(&frame_of(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    ));
    p.client(&consume_frame(1, "other", "c1", false));
    p.broker(&frame_of(
        1,
        AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
            consumer_tag: "c1".into(),
        })),
    ));
    p.client(&frame_of(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
            consumer_tag: "c1".into(),
            nowait: false,
        })),
    ));
    p.client(&consume_frame(1, Q, "c1", true));
    // Sent by the broker before it read the cancel: the first consumer's.
    p.broker(&deliver_to(1, "c1", 1));
    p.broker(&frame_of(
        1,
        AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk {
            consumer_tag: "c1".into(),
        })),
    ));
    // After the cancel-ok: the second consumer's, from the intercepted queue.
    p.broker(&deliver_to(1, "c1", 2));
    p.upstream();
    p.client(&method::nack(1, 1, false, true));
    assert!(
        p.take_parks().is_empty(),
        "a delivery from the queue nackd does not intercept is not claimed"
    );
    assert_eq!(p.upstream(), ["nack 1"]);
    p.client(&method::nack(1, 2, false, true));
    let parks = p.take_parks();
    assert_eq!(parks.len(), 1, "the second consumer's delivery is claimed");
    assert_eq!(&*parks[0].queue, Q);
}

/// nackd tracks a channel from the first frame that names it, and a client
/// names any number it likes: 65 535 channels, highest first, must cost
/// the same per channel as lowest first. (Kept sorted in a `Vec`, each new
/// lowest channel moved every tracked one: 53 s of one worker thread
/// for half a MiB of frames, every other session on it stalled.)
#[test]
fn channels_opened_highest_first_cost_no_more_than_lowest_first() {
    let mut p = pair();
    // A broker without a channel limit: the client may use all but the
    // one nackd reserves.
    p.tune(0, 0);
    let mut bytes = BytesMut::new();
    for ch in (1..u16::MAX).rev() {
        bytes.extend_from_slice(&frame_of(
            ch,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        ));
    }
    let started = std::time::Instant::now();
    p.client(&bytes);
    let took = started.elapsed();
    assert_eq!(
        p.upstream().len(),
        usize::from(u16::MAX - 1),
        "all forwarded"
    );
    assert!(took < Duration::from_secs(20), "took {took:?}");
}

/// A frame beyond the negotiated `channel_max` closes the connection
/// (504) without nackd tracking that channel, nor any the client names
/// after its error.
#[test]
fn frames_beyond_channel_max_create_no_channel_state() {
    let mut p = pair();
    let tune = connection::TuneOk {
        channel_max: 10,
        frame_max: 131_072,
        heartbeat: 0,
    };
    p.client(&frame_of(
        0,
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(tune)),
    ));
    p.client(&body(60_000, b"x"));
    assert!(p.s.channels.peek(60_000).is_none());
    p.client(&body(50_000, b"x"));
    assert!(p.s.channels.peek(50_000).is_none(), "nor after the error");
    let mut to_client = std::mem::take(p.s.transmit().0);
    let frame = FrameDecoder::default()
        .decode(&mut to_client)
        .unwrap()
        .unwrap();
    match method::decode_any(frame.payload_slice()).unwrap() {
        AMQPClass::Connection(connection::AMQPMethod::Close(c)) => {
            assert_eq!(c.reply_code, ReplyCode::ChannelError.code())
        }
        other => panic!("{other:?}"),
    }
}

/// A delivery read in place (`peek_deliver`) whose method, header and body
/// come one byte per read is tracked and captured whole: its nack parks
/// the body the broker sent, and every byte reaches the client unchanged.
#[test]
fn a_delivery_split_into_one_byte_reads_is_captured_whole() {
    let mut p = pair();
    p.consume(1);
    let wire = deliver_to(1, "c1", 1);
    let mut input = BytesMut::new();
    for byte in &wire {
        input.extend_from_slice(&[*byte]);
        p.s.handle_bytes(Peer::Upstream, &mut input, p.now);
    }
    assert!(input.is_empty());
    let to_client = std::mem::take(p.s.transmit().0);
    assert!(to_client.ends_with(&wire), "forwarded as read");
    p.nack(1, 1);
    let parks = p.take_parks();
    assert_eq!(parks.len(), 1);
    assert_eq!(&parks[0].body[..], b"abc");
}

/// A client that broke the protocol and then repeats `connection.close`
/// without reading gets one close-ok: each one is not another reply queued
/// for a client that does not read (memory that grew with every frame).
#[test]
fn a_client_repeating_connection_close_after_its_fault_gets_one_close_ok() {
    let mut p = claimed();
    p.s.transmit().0.clear();
    p.client(&body(1, b"stray")); // a body with no publish before it: 505
    for _ in 0..100 {
        p.client(&connection_close());
    }
    let mut to_client = std::mem::take(p.s.transmit().0);
    let decoder = FrameDecoder::default();
    let mut sent = Vec::new();
    while let Some(frame) = decoder.decode(&mut to_client).unwrap() {
        sent.push(describe(&frame));
    }
    assert_eq!(
        sent,
        ["connection.close", "Connection(CloseOk(CloseOk))"],
        "one close, one close-ok"
    );
}

/// A client that stopped reading and then went: what was queued for it is
/// dropped, so the broker is read again and its close-ok ends the pair at
/// once instead of at the close timeout.
#[test]
fn a_client_gone_with_a_full_buffer_does_not_stop_the_broker_being_read() {
    let mut p = pair();
    p.consume(1);
    p.s.transmit().0.clear();
    let mut tag = 0;
    while p.s.may_read(Peer::Upstream) {
        tag += 1;
        p.deliver(1, tag);
    }
    p.s.handle_gone(Peer::Client, None, p.now);
    assert_eq!(p.upstream(), ["connection.close"]);
    assert!(
        p.s.may_read(Peer::Upstream),
        "the broker's close-ok must be read"
    );
    p.broker(&method::connection_close_ok());
    assert!(p.s.is_finished(p.now), "ended by the close-ok");
}

mod delayed;

fn cancel(ch: u16, tag: &str, nowait: bool) -> Vec<u8> {
    frame_of(
        ch,
        AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
            consumer_tag: tag.into(),
            nowait,
        })),
    )
}

/// Issue 33, item 8: after a `nowait` cancel the broker may still deliver
/// what it sent before it read the cancel. Those deliveries are tracked:
/// a `multiple` ack that nackd rewrites around a claimed tag settles them
/// too (untracked, they stayed unacked for good).
#[test]
fn a_delivery_after_a_nowait_cancel_is_covered_by_a_rewritten_multiple_ack() {
    let mut p = pair();
    p.consume(1);
    p.deliver(1, 1);
    p.deliver(1, 2);
    p.nack(1, 2);
    p.client(&cancel(1, "c1", true));
    p.upstream();
    p.deliver(1, 3); // sent before the broker read the cancel
    p.client(&method::ack(1, 3, true));
    let sent = p.upstream();
    assert!(sent.iter().any(|f| f == "ack 3"), "{sent:?}");
    assert!(sent.iter().any(|f| f.starts_with("ack 1")), "{sent:?}");
    assert!(
        !sent.iter().any(|f| f.starts_with("ack 2")),
        "2 is claimed: {sent:?}"
    );
}

/// Issue 33, item 8: RabbitMQ 4.3 returns a timed-out consumer's
/// deliveries to their queue and cancels it. A claim of one waiting for
/// the store is not acked once stored (the held copy is cancelled: the
/// broker redelivers the message), and a deferred one is not nacked: the
/// broker would close the channel for an unknown delivery tag.
#[test]
fn after_the_broker_cancels_a_consumer_nackd_settles_none_of_its_tags() {
    let mut p = refused(3); // tag 1 deferred
    p.nack(1, 2); // tag 2 claimed, the store has not answered
    assert_eq!(p.s.deferrals.len(), 1);
    p.broker(&cancel(1, "c1", true));
    assert_eq!(p.s.deferrals.len(), 0, "the deferred nack is forgotten");
    let ids = p.store(true);
    assert_eq!(ids.len(), 1);
    p.time_passes(Duration::from_secs(10));
    p.timer_fires();
    assert!(p.upstream().is_empty(), "no ack, no nack of a returned tag");
    assert_eq!(p.cancelled(), ids, "the held copy is cancelled");
}

/// Issue 33, item 8: each session caches the policy of the queues it
/// meets; a client that consumes a new server-named queue again and again
/// must not grow that cache for ever.
#[test]
fn the_policy_cache_of_a_session_is_bounded() {
    let mut p = pair();
    let scope = p.s.scope.as_mut().unwrap();
    for i in 0..5 * super::scope::CACHED {
        let queue: Arc<str> = Arc::from(format!("amq.gen-{i}"));
        assert!(scope.policy(&queue).is_none());
        assert!(scope.cached() <= super::scope::CACHED);
    }
    assert!(scope.policy(&Arc::from(Q)).is_some(), "still answers");
}

/// Issue 33, item 6: the settle timeout runs on the session's tick, not
/// only while a close waits. A store that never answers (a stuck `fsync`)
/// gets the claim deferred within the settle timeout: the delivery goes
/// back to the broker after the policy's delay instead of staying unacked
/// for good (prefetch full, consumers stopped).
#[test]
fn a_silent_store_defers_the_claim_without_any_close() {
    let mut p = pair_with("delays = [\"2s\"]", 1 << 20);
    p.consume(1);
    p.deliver(1, 1);
    p.nack(1, 1);
    let parks = p.take_parks();
    assert_eq!(parks.len(), 1);
    p.time_passes(SETTLE_TIMEOUT - Duration::from_millis(1));
    p.timer_fires();
    assert_eq!(p.s.stats.deferred_now.get(), 0, "not before the timeout");
    p.time_passes(Duration::from_millis(1));
    p.timer_fires();
    assert_eq!(p.s.stats.deferred(PassReason::StoreUnavailable), 1);
    assert_eq!(p.s.stats.deferred_now.get(), 1, "given up: deferred");
    assert!(
        !parks[0].ticket.stored(),
        "a copy the store writes later is deleted, not fired"
    );
    // Back to the broker after the policy's delay, requeued.
    p.time_passes(Duration::from_secs(2));
    p.timer_fires();
    assert_eq!(p.upstream(), ["nack 1"]);
    // The store answers at last: nothing is acked (the engine deleted
    // the copy; were it answered Ok, the session cancels it too).
    p.answer(&parks[0], Ok(7));
    assert!(p.upstream().is_empty());
    assert_eq!(p.cancelled(), [7]);
}

/// The give-up and the store's answer race: a claim the engine stored
/// first is not given up (its answer is on its way), and is acked.
#[test]
fn a_claim_the_engine_stored_first_is_not_given_up() {
    let mut p = claimed();
    let parks = p.take_parks();
    assert!(parks[0].ticket.stored(), "the engine stores it first");
    p.time_passes(SETTLE_TIMEOUT);
    p.timer_fires();
    assert_eq!(p.s.stats.deferred_now.get(), 0, "not deferred");
    p.answer(&parks[0], Ok(8));
    assert_eq!(p.upstream(), ["ack 1"]);
    assert!(p.cancelled().is_empty());
}

/// While the engine says the store stalls, nacks are deferred at once
/// instead of each waiting a settle timeout for a store that is stuck.
#[test]
fn while_the_store_stalls_nacks_are_deferred_at_once() {
    let mut p = pair_with("delays = [\"2s\"]", 1 << 20);
    p.s.scope.as_ref().unwrap().shared.ready.set_stalled(true);
    p.consume(1);
    p.deliver(1, 1);
    p.nack(1, 1);
    assert!(p.take_parks().is_empty(), "nothing parked on a stuck store");
    assert_eq!(p.s.stats.deferred(PassReason::StoreUnavailable), 1);
    p.time_passes(Duration::from_secs(2));
    p.timer_fires();
    assert_eq!(p.upstream(), ["nack 1"]);
}
