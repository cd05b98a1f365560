//! The lane's rules and return matching, without a broker: frames in,
//! frames and reports out.

use std::sync::Arc;

use amq_protocol::protocol::basic::AMQPProperties;
use amq_protocol::protocol::{basic, channel, confirm, exchange, AMQPClass};
use amq_protocol::types::AMQPValue;
use bytes::{Bytes, BytesMut};

use super::lane::{Impersonation, Lane, Limits, State, Step};
use super::returned::{self, Match, Returning};
use super::{Outcome, Publish, Report};
use crate::metrics::BlockReason;
use crate::store::Route;
use nackd_core::protocol::content::{encode_header, rewrite_headers};
use nackd_core::protocol::frame::{Frame, FrameType};

const LIMITS: Limits<'static> = Limits {
    window: 100,
    frame_max: 4096,
    username: "guest",
    impersonation: Impersonation::Unknown,
};

fn header(body: &[u8], properties: AMQPProperties) -> Bytes {
    Bytes::from(encode_header(60, body.len() as u64, &properties))
}

fn to_queue(id: u64, queue: &str, body: &str) -> Publish {
    Publish {
        id,
        queue: Arc::from(queue),
        route: Route::Queue,
        header: header(body.as_bytes(), AMQPProperties::default()),
        body: Bytes::from(body.to_string()),
    }
}

fn to_exchange(id: u64, exchange: &str, key: &str, body: &str) -> Publish {
    Publish {
        route: Route::Exchange {
            exchange: exchange.into(),
            routing_key: key.into(),
        },
        ..to_queue(id, key, body)
    }
}

/// Opens channel `ch` for `lane` and answers its `channel.open` and
/// `confirm.select`; nothing closes or is reported meanwhile.
fn open_and_select(lane: &mut Lane, ch: u16) {
    let (mut out, mut reports) = (BytesMut::new(), Vec::new());
    lane.open(ch, &mut out);
    for ok in [
        AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
        AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
    ] {
        assert!(lane.on_method(ok, &mut out, &mut reports).is_none());
    }
    assert!(reports.is_empty());
}

/// Drives a lane through channel.open, confirm.select (and the passive
/// declare of a named exchange) on channel 1.
fn opened(exchange: &str) -> Lane {
    let mut lane = Lane::new(Arc::from(exchange));
    open_and_select(&mut lane, 1);
    let (mut out, mut reports) = (BytesMut::new(), Vec::new());
    if !exchange.is_empty() {
        assert_eq!(lane.state(), State::Opening(1, Step::Declare));
        let ok = AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {}));
        assert!(lane.on_method(ok, &mut out, &mut reports).is_none());
    }
    assert_eq!(lane.state(), State::Open(1));
    assert!(reports.is_empty());
    lane
}

/// Publishes what the window allows; returns how many went out.
fn send(lane: &mut Lane, reports: &mut Vec<Report>) -> usize {
    let mut out = BytesMut::new();
    let mut n = 0;
    while lane.publish_next(LIMITS, &mut out, reports) {
        n += 1;
    }
    n
}

fn ack(lane: &mut Lane, tag: u64, multiple: bool) -> Vec<Report> {
    let mut reports = Vec::new();
    let ack = AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
        delivery_tag: tag,
        multiple,
    }));
    lane.on_method(ack, &mut BytesMut::new(), &mut reports);
    reports
}

fn close(lane: &mut Lane, code: u16, text: &str) -> (super::lane::Closed, Vec<Report>) {
    let mut reports = Vec::new();
    let close = AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
        reply_code: code,
        reply_text: text.into(),
        class_id: 60,
        method_id: 40,
    }));
    let mut out = BytesMut::new();
    let closed = lane
        .on_method(close, &mut out, &mut reports)
        .expect("closed");
    assert!(!out.is_empty(), "close-ok written");
    (closed, reports)
}

fn ids(reports: &[Report]) -> Vec<u64> {
    reports.iter().map(|r| r.id).collect()
}

fn set_aside(reports: &[Report]) -> Vec<(u64, BlockReason, bool)> {
    reports
        .iter()
        .map(|r| match &r.outcome {
            Outcome::SetAside(s) => (r.id, s.reason, s.exchange_wide),
            other => panic!("{} was {other:?}", r.id),
        })
        .collect()
}

/// Sends a basic.return carrying `p`'s content (as RabbitMQ does).
fn return_of(lane: &mut Lane, p: &Publish) {
    let ret = AMQPClass::Basic(basic::AMQPMethod::Return(basic::Return {
        reply_code: 312,
        reply_text: "NO_ROUTE".into(),
        exchange: p.exchange().into(),
        routing_key: p.routing_key().into(),
    }));
    lane.on_method(ret, &mut BytesMut::new(), &mut Vec::new());
    lane.on_content(&Frame::new(FrameType::Header, 1, &p.header));
    for chunk in p.body.chunks(3) {
        lane.on_content(&Frame::new(FrameType::Body, 1, chunk));
    }
}

#[test]
fn a_fresh_channel_sends_one_message_until_the_broker_confirms_one() {
    let mut lane = opened("");
    (1..=5).for_each(|i| lane.push(to_queue(i, "q", "x")));
    let mut reports = Vec::new();
    assert_eq!(send(&mut lane, &mut reports), 1, "slow start");
    assert_eq!(ack(&mut lane, 1, false)[0].outcome, Outcome::Confirmed);
    assert_eq!(
        send(&mut lane, &mut reports),
        4,
        "proven: the window applies"
    );
    let acked = ack(&mut lane, 5, true);
    assert_eq!(ids(&acked), vec![2, 3, 4, 5]);
    assert!(reports.is_empty());
}

#[test]
fn a_return_is_matched_to_its_own_publish_by_content_not_the_first_with_its_key() {
    // All go to exchange "dlx" with key "q": only the content tells them apart.
    let mut lane = opened("dlx");
    lane.push(to_exchange(1, "dlx", "q", "proves the channel"));
    send(&mut lane, &mut Vec::new());
    assert_eq!(ack(&mut lane, 1, false)[0].outcome, Outcome::Confirmed);
    let second = to_exchange(3, "dlx", "q", "second");
    lane.push(to_exchange(2, "dlx", "q", "first"));
    lane.push(second.clone());
    lane.push(to_exchange(4, "dlx", "q", "third"));
    assert_eq!(send(&mut lane, &mut Vec::new()), 3);
    return_of(&mut lane, &second);
    let settled = ack(&mut lane, 4, true);
    let outcomes: Vec<(u64, bool)> = settled
        .iter()
        .map(|r| (r.id, matches!(r.outcome, Outcome::Returned { .. })))
        .collect();
    assert_eq!(outcomes, vec![(2, false), (3, true), (4, false)]);
}

#[test]
fn return_matching_looks_at_exchange_key_and_content() {
    let a = to_queue(1, "q", "same"); // exchange "", key "q"
    let b = to_exchange(2, "dlx", "q", "same"); // same key, other exchange
    let c = to_exchange(3, "dlx", "q", "other");
    let mut ret = Returning::new(312, "NO_ROUTE", "dlx", "q", 100);
    assert!(!ret.on_header(b.header.clone()));
    assert!(ret.on_body(&b.body));
    let inflight = [(&a, false), (&c, false), (&b, false)];
    assert_eq!(returned::find(&ret, inflight.into_iter()), Match::Exact(2));
    // One already returned is not matched twice.
    let inflight = [(&a, false), (&b, true), (&c, false)];
    assert_eq!(
        returned::find(&ret, inflight.into_iter()),
        Match::Unsure(vec![2])
    );
}

/// `p` with headers `x-retry-count` and `a` (as a retry carries them,
/// unsorted), or in key order as RabbitMQ 4.3 returns them.
fn with_headers(p: &Publish, sorted: bool) -> Publish {
    let (count, a) = (
        ("x-retry-count", AMQPValue::LongLongInt(1)),
        ("a", AMQPValue::LongString("b".into())),
    );
    let set = if sorted { [a, count] } else { [count, a] };
    Publish {
        header: Bytes::from(rewrite_headers(&p.header, &set).unwrap()),
        ..p.clone()
    }
}

/// Issue 20: RabbitMQ 4.3 returns a message with its headers sorted by
/// key; the return is still its publish's, not a guess kept as NO_ROUTE.
#[test]
fn a_return_with_its_headers_reordered_by_the_broker_is_matched_exactly() {
    let mut lane = opened("dlx");
    lane.push(to_exchange(1, "dlx", "q", "proves the channel"));
    send(&mut lane, &mut Vec::new());
    ack(&mut lane, 1, false);
    let sent = with_headers(&to_exchange(2, "dlx", "q", "retry"), false);
    lane.push(sent.clone());
    lane.push(with_headers(&to_exchange(3, "dlx", "q", "other"), false));
    send(&mut lane, &mut Vec::new());
    let came_back = with_headers(&sent, true);
    assert_ne!(came_back.header, sent.header);
    return_of(&mut lane, &came_back);
    let settled = ack(&mut lane, 3, true);
    assert!(
        matches!(settled[0].outcome, Outcome::Returned { .. }),
        "{settled:?}"
    );
    assert_eq!(settled[1].outcome, Outcome::Confirmed);
}

#[test]
fn a_return_matching_nothing_exactly_keeps_every_candidate() {
    let mut lane = opened("dlx");
    lane.push(to_exchange(1, "dlx", "q", "a"));
    send(&mut lane, &mut Vec::new());
    ack(&mut lane, 1, false);
    lane.push(to_exchange(2, "dlx", "q", "b"));
    lane.push(to_exchange(3, "dlx", "q", "c"));
    lane.push(to_exchange(4, "dlx", "other", "d"));
    send(&mut lane, &mut Vec::new());
    return_of(
        &mut lane,
        &to_exchange(9, "dlx", "q", "changed by the broker"),
    );
    let settled = ack(&mut lane, 4, true);
    let kept: Vec<u64> = settled
        .iter()
        .filter(|r| matches!(&r.outcome, Outcome::SetAside(s) if s.reason == BlockReason::NoRoute))
        .map(|r| r.id)
        .collect();
    assert_eq!(
        kept,
        vec![2, 3],
        "either may be the returned one: neither is completed"
    );
    assert_eq!(settled[2].outcome, Outcome::Confirmed);
}

/// Issue 20, item 4: RabbitMQ 4.3 refuses a passive declare (403) to a user
/// without `configure` permission who may still publish (`write`). The
/// lane must not set its messages aside for that: it opens a channel
/// without the check and publishes; what the publish meets still counts.
#[test]
fn a_refused_passive_declare_does_not_stop_the_publishes() {
    let mut lane = Lane::new(Arc::from("dlx"));
    (1..=2).for_each(|i| lane.push(to_exchange(i, "dlx", "q", "x")));
    open_and_select(&mut lane, 1);
    assert_eq!(lane.state(), State::Opening(1, Step::Declare));
    let (closed, reports) = close(
        &mut lane,
        403,
        "ACCESS_REFUSED - access to exchange 'dlx' in vhost '/' refused for user 'pub'",
    );
    assert_eq!((closed.set_aside, closed.again), (0, 0));
    assert!(reports.is_empty(), "nothing set aside");
    assert!(lane.wants_channel());
    // The next channel skips the check and publishes.
    let mut lane = reopen(lane);
    let mut reports = Vec::new();
    assert_eq!(send(&mut lane, &mut reports), 1, "the first one alone");
    let settled = ack(&mut lane, 1, false);
    assert_eq!(ids(&settled), vec![1]);
}

#[test]
fn a_missing_exchange_found_by_the_passive_declare_sets_the_lane_aside_unsent() {
    let mut lane = Lane::new(Arc::from("typo"));
    (1..=3).for_each(|i| lane.push(to_exchange(i, "typo", "q", "x")));
    open_and_select(&mut lane, 1);
    let mut reports = Vec::new();
    assert_eq!(
        send(&mut lane, &mut reports),
        0,
        "nothing before the declare-ok"
    );
    let (closed, reports) = close(
        &mut lane,
        404,
        "NOT_FOUND - no exchange 'typo' in vhost '/'",
    );
    assert_eq!((closed.set_aside, closed.again), (3, 0));
    assert_eq!(
        set_aside(&reports),
        vec![
            (1, BlockReason::NoExchange, true),
            (2, BlockReason::NoExchange, true),
            (3, BlockReason::NoExchange, true)
        ]
    );
    assert_eq!(lane.state(), State::Closed);
    assert!(!lane.wants_channel(), "nothing left to send");
}

#[test]
fn an_exchange_deleted_while_publishes_are_in_flight_sets_them_all_aside() {
    let mut lane = opened("dlx");
    lane.push(to_exchange(1, "dlx", "q", "a"));
    send(&mut lane, &mut Vec::new());
    ack(&mut lane, 1, false);
    (2..=4).for_each(|i| lane.push(to_exchange(i, "dlx", "q", "x")));
    send(&mut lane, &mut Vec::new());
    lane.push(to_exchange(5, "dlx", "q", "x"));
    let (closed, reports) = close(&mut lane, 404, "NOT_FOUND - no exchange 'dlx' in vhost '/'");
    assert_eq!((closed.set_aside, closed.again), (4, 0));
    assert_eq!(
        ids(&reports),
        vec![2, 3, 4, 5],
        "in order, none sent again now"
    );
}

#[test]
fn a_channel_error_with_one_publish_in_flight_names_it_and_the_rest_flows() {
    let mut lane = opened("");
    (1..=3).for_each(|i| lane.push(to_queue(i, "q", "x")));
    assert_eq!(send(&mut lane, &mut Vec::new()), 1);
    let (closed, reports) = close(
        &mut lane,
        406,
        "PRECONDITION_FAILED - message size 10 is larger than configured max size 5",
    );
    assert_eq!((closed.set_aside, closed.again), (1, 0));
    assert_eq!(
        set_aside(&reports),
        vec![(1, BlockReason::PreconditionFailed, false)]
    );
    assert!(lane.wants_channel(), "2 and 3 wait for the next channel");
    assert_eq!(lane.len(), (2, 0));
}

#[test]
fn a_channel_error_with_several_in_flight_sends_them_again_one_at_a_time() {
    let mut lane = opened("");
    lane.push(to_queue(1, "q", "x"));
    send(&mut lane, &mut Vec::new());
    ack(&mut lane, 1, false);
    (2..=4).for_each(|i| lane.push(to_queue(i, "q", "x")));
    assert_eq!(send(&mut lane, &mut Vec::new()), 3);
    lane.push(to_queue(5, "q", "x"));
    let (closed, reports) = close(&mut lane, 406, "PRECONDITION_FAILED - bad");
    assert!(
        reports.is_empty(),
        "the broker did not say which: nobody is blamed"
    );
    assert_eq!((closed.set_aside, closed.again), (0, 3));
    // Reopened: probe mode, the suspects first and in order.
    let mut lane = reopen(lane);
    let mut reports = Vec::new();
    assert_eq!(send(&mut lane, &mut reports), 1);
    assert_eq!(ids(&ack(&mut lane, 1, false)), vec![2]);
    assert_eq!(send(&mut lane, &mut reports), 3, "proven again: 3, 4, 5");
    let (closed, reports) = close(&mut lane, 406, "PRECONDITION_FAILED - bad");
    assert_eq!(closed.again, 3);
    let mut lane = reopen(lane);
    assert_eq!(send(&mut lane, &mut Vec::new()), 1);
    let (closed, reports2) = close(&mut lane, 406, "PRECONDITION_FAILED - bad");
    assert_eq!(closed.set_aside, 1, "alone, the culprit is exact");
    assert_eq!(
        set_aside(&reports2),
        vec![(3, BlockReason::PreconditionFailed, false)]
    );
    assert!(reports.is_empty());
    assert_eq!(lane.len(), (2, 0), "4 and 5 go on");
}

fn reopen(mut lane: Lane) -> Lane {
    open_and_select(&mut lane, 2);
    assert_eq!(lane.state(), State::Open(2));
    lane
}

#[test]
fn what_the_broker_would_refuse_is_set_aside_before_it_is_sent() {
    let mut lane = opened("");
    let mut big = to_queue(1, "q", "x");
    big.header = Bytes::from(vec![0u8; LIMITS.frame_max as usize]);
    lane.push(big);
    lane.push(with_user(to_queue(2, "q", "x"), "alice"));
    lane.push(with_user(to_queue(3, "q", "x"), "guest"));
    let refused = Limits {
        impersonation: Impersonation::Refused,
        ..LIMITS
    };
    let (mut out, mut reports) = (BytesMut::new(), Vec::new());
    while lane.publish_next(refused, &mut out, &mut reports) {}
    assert_eq!(
        set_aside(&reports),
        vec![
            (1, BlockReason::FrameMax, false),
            (2, BlockReason::UserId, false)
        ]
    );
    assert_eq!(lane.len(), (0, 1), "its own user_id goes");
}

fn with_user(mut p: Publish, user: &str) -> Publish {
    let props = AMQPProperties::default().with_user_id(user.into());
    p.header = header(&p.body, props);
    p
}

#[test]
fn the_first_foreign_user_id_goes_alone_and_its_answer_is_learnt() {
    let mut lane = opened("");
    lane.push(to_queue(1, "q", "x"));
    send(&mut lane, &mut Vec::new());
    ack(&mut lane, 1, false);
    lane.push(to_queue(2, "q", "x"));
    lane.push(with_user(to_queue(3, "q", "x"), "alice"));
    lane.push(to_queue(4, "q", "x"));
    assert_eq!(
        send(&mut lane, &mut Vec::new()),
        1,
        "2 goes; 3 waits for the lane to drain"
    );
    ack(&mut lane, 2, false);
    assert_eq!(send(&mut lane, &mut Vec::new()), 1, "3 goes alone");
    assert_eq!(lane.len(), (1, 1), "4 waits for its answer");
    let (closed, reports) = close(
        &mut lane,
        406,
        "PRECONDITION_FAILED - user_id property set to 'alice' but authenticated user was 'guest'",
    );
    assert_eq!(closed.set_aside, 1);
    assert_eq!(set_aside(&reports), vec![(3, BlockReason::UserId, false)]);
    assert_eq!(lane.take_learned(), Some(Impersonation::Refused));
    assert_eq!(lane.len(), (1, 0), "4 is not blamed");

    // With the impersonator tag the broker confirms it: learnt too.
    let mut lane = opened("");
    lane.push(with_user(to_queue(5, "q", "x"), "alice"));
    lane.push(to_queue(6, "q", "x"));
    assert_eq!(send(&mut lane, &mut Vec::new()), 1);
    assert_eq!(ack(&mut lane, 1, false)[0].outcome, Outcome::Confirmed);
    assert_eq!(lane.take_learned(), Some(Impersonation::Allowed));
    assert_eq!(send(&mut lane, &mut Vec::new()), 1);
}

#[test]
fn a_channel_error_that_blames_nothing_in_flight_waits_for_the_exchange_backoff() {
    let mut lane = opened("");
    lane.push(to_queue(1, "q", "x"));
    let (closed, reports) = close(&mut lane, 541, "INTERNAL_ERROR");
    assert_eq!(closed.set_aside, 1, "no reopen loop: the lane waits");
    assert_eq!(
        set_aside(&reports),
        vec![(1, BlockReason::ChannelError, true)]
    );
}

#[test]
fn a_lost_connection_puts_unconfirmed_publishes_back_in_order() {
    let mut lane = opened("dlx");
    lane.push(to_exchange(1, "dlx", "q", "a"));
    send(&mut lane, &mut Vec::new());
    ack(&mut lane, 1, false);
    let returned = to_exchange(3, "dlx", "q", "c");
    for p in [
        to_exchange(2, "dlx", "q", "b"),
        returned.clone(),
        to_exchange(4, "dlx", "q", "d"),
    ] {
        lane.push(p);
    }
    send(&mut lane, &mut Vec::new());
    return_of(&mut lane, &returned);
    lane.push(to_exchange(5, "dlx", "q", "e"));
    let mut reports = Vec::new();
    lane.disconnected(&mut reports);
    assert_eq!(
        ids(&reports),
        vec![3],
        "returned: the broker did not route it"
    );
    assert!(matches!(reports[0].outcome, Outcome::Returned { .. }));
    assert_eq!(lane.len(), (3, 0), "2 and 4, then 5");
    let mut lane = reopen_named(lane);
    assert_eq!(
        send(&mut lane, &mut Vec::new()),
        1,
        "a new channel starts slow"
    );
    assert_eq!(ids(&ack(&mut lane, 1, false)), vec![2]);
    assert_eq!(send(&mut lane, &mut Vec::new()), 2);
    assert_eq!(ids(&ack(&mut lane, 3, true)), vec![4, 5]);
}

fn reopen_named(mut lane: Lane) -> Lane {
    let (mut out, mut reports) = (BytesMut::new(), Vec::new());
    lane.open(2, &mut out);
    for ok in [
        AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
        AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
        AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {})),
    ] {
        lane.on_method(ok, &mut out, &mut reports);
    }
    lane
}
