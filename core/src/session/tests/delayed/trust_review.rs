//! An adversarial review of the trust checks (delayed publishes checked
//! in the publisher's name, the delayed exchanges changed at the broker's
//! word): each test is one sequence the review found wrong, and asserts
//! what the broker would do without nackd.

use amq_protocol::protocol::{basic, channel, exchange, AMQPClass};

use super::super::{body, channel_close, frame_of, pair, publish_start};
use super::{declare_named, ms, X};
use crate::protocol::reply::ReplyCode;

fn declare_ok(ch: u16) -> Vec<u8> {
    frame_of(
        ch,
        AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {})),
    )
}

fn close_ok(ch: u16) -> Vec<u8> {
    frame_of(
        ch,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    )
}

/// A delayed declare the client pipelines on a channel the broker already
/// closed is discarded by the broker: nackd neither waits for its answer
/// nor keeps the session's checks back for it.
#[test]
fn a_declare_on_a_channel_the_broker_closed_holds_nothing_back() {
    let mut p = pair();
    p.open(1, false);
    p.open(2, true);
    p.declared(2);
    p.broker_closes(1, ReplyCode::CommandInvalid);
    p.client(&declare_named(1, "other", true));
    p.upstream();
    p.client(&close_ok(1));
    p.upstream();
    p.publish_unanswered(2, ms(1000));
    p.upstream();
    assert_eq!(p.s.checks.sent(), 1, "the check goes at once");
    assert!(!p.s.publishes.declaring("other"));
    p.grant_checks();
    let parks = p.take_parks();
    p.answer(&parks[0], Ok(1));
    assert_eq!(p.client_got(), ["ack 1"]);
}

/// A publish still waiting for its check when the session ends was never
/// stored: without confirms it is lost, and counted so.
#[test]
fn a_publish_still_checked_when_the_session_ends_is_counted_lost() {
    let mut p = pair();
    p.open(1, false);
    p.declared(1);
    p.upstream();
    p.publish_unanswered(1, ms(1000));
    p.upstream();
    p.s.end([]);
    assert!(p.take_parks().is_empty());
    assert_eq!(p.s.stats.delayed_lost.get(), 1);
}

/// A publish the broker refuses, then the client's channel.close waiting
/// behind the barrier: the publish goes before the close, as the client
/// sent it, so the client gets the broker's refusal.
#[test]
fn a_refused_publish_goes_before_the_channel_close_that_waits() {
    let mut p = pair();
    p.open(1, true);
    p.declared(1);
    p.upstream();
    p.publish_unanswered(1, ms(60_000));
    p.client(&channel_close(1));
    assert!(p.upstream().is_empty(), "the close waits for the check");
    p.refuse_check();
    p.grace_passes();
    assert_eq!(
        p.upstream(),
        ["publish 1", "header 1", "body 1", "channel.close 1"]
    );
}

/// Likewise a publish whose exchange stopped being delayed (its declare
/// was refused) while its check was out.
#[test]
fn a_publish_whose_exchange_is_not_delayed_after_all_goes_before_the_close() {
    let mut p = pair();
    p.open(1, false);
    p.open(2, false);
    p.declare_nowait(1);
    p.upstream();
    p.publish_unanswered(2, ms(60_000));
    p.client(&channel_close(2));
    p.broker_closes(1, ReplyCode::CommandInvalid);
    p.grant_checks();
    p.grace_passes();
    let up = p.upstream();
    let close_at = up.iter().position(|f| f == "channel.close 2");
    let publish_at = up.iter().position(|f| f == "publish 2");
    assert!(publish_at.is_some() && close_at.is_some(), "{up:?}");
    assert!(publish_at < close_at, "{up:?}");
}

/// Without confirms, a publish the store refuses is routed at once: before
/// the client's channel.close that waits, not after it.
#[test]
fn an_unconfirmed_publish_the_store_refuses_goes_before_the_close() {
    let mut p = pair();
    p.open(1, false);
    p.declared(1);
    p.upstream();
    p.publish_unanswered(1, ms(60_000));
    p.grant_checks();
    let parks = p.take_parks();
    p.client(&channel_close(1));
    assert!(p.upstream().is_empty());
    p.answer(&parks[0], Err(crate::held::StoreError::Full("test".into())));
    p.grace_passes();
    assert_eq!(
        p.upstream(),
        ["publish 1", "header 1", "body 1", "channel.close 1"]
    );
}

/// A publish handed back while a plain publish of its channel is behind
/// the barrier follows that publish's last frame, and each confirm of the
/// broker reaches the publisher under its own tag.
#[test]
fn a_publish_handed_back_during_a_content_behind_the_barrier_follows_it() {
    let mut p = pair();
    p.consume(2);
    p.deliver(2, 1);
    p.nack(2, 1);
    p.open(1, true);
    p.declared(1);
    p.upstream();
    p.publish_unanswered(1, ms(60_000)); // publisher 1: checked
    p.client(&frame_of(
        2,
        AMQPClass::Basic(basic::AMQPMethod::Recover(basic::Recover { requeue: true })),
    ));
    p.client(&publish_start(1, 3)); // publisher 2, plain, behind the barrier
    p.refuse_check(); // publisher 1 is handed back while 2 is in flight
    p.client(&body(1, b"abc"));
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
        ],
    );
    // The broker numbers publisher 2 first (1), then publisher 1 (2).
    p.broker(&crate::protocol::method::ack(1, 1, false));
    assert_eq!(p.client_got(), ["ack 2"]);
    p.broker(&crate::protocol::method::ack(1, 2, false));
    assert_eq!(p.client_got(), ["ack 1"]);
}

/// Two tasks of one connection, each "open, declare, publish with
/// x-delay, close": the second's declare waits behind the first's barrier,
/// and its check waits for that declare: the barrier does not wait for
/// that check, so nothing stalls until the settle timeout.
#[test]
fn a_declare_behind_the_barrier_and_its_publishes_do_not_wait_on_each_other() {
    let mut p = pair();
    p.open(1, true);
    p.open(2, true);
    p.declared(1);
    p.upstream();
    p.publish_unanswered(1, ms(60_000)); // task 1
    p.client(&channel_close(1));
    p.client(&declare_named(2, X, false)); // task 2, behind the barrier
    p.publish_unanswered(2, ms(60_000));
    p.client(&channel_close(2));
    p.grant_checks(); // task 1's check (task 2's waits for its declare)
    p.store(true);
    assert_eq!(p.client_got(), ["ack 1"]);
    p.grace_passes();
    let up = p.upstream();
    assert!(
        up.iter().any(|f| f.contains("Declare")),
        "the declare went: {up:?}"
    );
    p.broker(&declare_ok(2));
    assert_eq!(
        p.s.checks.sent(),
        1,
        "task 2's check went at the declare-ok"
    );
    p.grant_checks();
    let parks = p.take_parks();
    assert_eq!(parks.len(), 1);
    let got = p.client_got();
    assert!(!got.iter().any(|f| f.starts_with("nack")), "{got:?}");
}

/// After a publish the broker refuses on a channel, it closes the channel
/// and discards the later publishes there: nackd holds none of them.
#[test]
fn a_publish_after_a_refused_one_on_its_channel_is_not_held() {
    let mut p = pair();
    p.open(1, true);
    p.declared(1);
    p.upstream();
    p.publish_unanswered(1, ms(60_000)); // publisher 1: refused
    p.publish_unanswered(1, ms(60_000)); // publisher 2: would pass
    p.refuse_check();
    p.grant_checks();
    assert!(p.take_parks().is_empty(), "publisher 2 is not held");
    assert_eq!(
        p.upstream(),
        [
            "publish 1",
            "header 1",
            "body 1",
            "publish 1",
            "header 1",
            "body 1"
        ],
        "both go to the broker, which refuses the first and discards the second"
    );
    // A third publish on the channel is not taken either.
    p.publish_unanswered(1, ms(60_000));
    assert_eq!(p.upstream(), ["publish 1", "header 1", "body 1"]);
    assert!(p.client_got().is_empty(), "nackd confirms none of them");
}

/// A check kept back is no word to the broker: a client that only sends
/// delayed publishes still has heartbeats sent in its name.
#[test]
fn held_checks_do_not_stop_the_heartbeat_owed_to_the_broker() {
    let mut p = pair();
    p.client(&super::super::tune_ok(2));
    p.open(1, false);
    p.open(2, true);
    p.client(&declare_named(1, X, false)); // unanswered: checks are held
    p.upstream();
    p.checks.clear();
    let mut silent_ms = 0;
    let mut longest = 0;
    for _ in 0..12 {
        p.publish_unanswered(2, ms(60_000));
        p.time_passes(std::time::Duration::from_millis(500));
        p.timer_fires();
        match p.upstream().is_empty() && p.checks.is_empty() {
            true => silent_ms += 500,
            false => silent_ms = 0,
        }
        longest = longest.max(silent_ms);
        p.broker(&crate::protocol::method::heartbeat());
    }
    assert!(
        longest < 2000,
        "the broker heard nothing for {longest} ms (heartbeat 2 s)"
    );
}

/// Declares sent together, before any declare-ok, cannot take the vhost
/// past `[delayed] max_exchanges` together.
#[test]
fn declares_sent_together_stay_within_max_exchanges() {
    let mut p = pair();
    p.open(1, false);
    let shared = p.s.scope.as_ref().unwrap().shared.clone();
    let limit = crate::delayed::DEFAULT_LIMIT;
    for i in 0..limit - 2 {
        shared.delayed.declare("/", &format!("d{i}"), "direct");
    }
    let mut out = Vec::new();
    for i in 0..3 {
        out.extend_from_slice(&declare_named(1, &format!("new{i}"), false));
    }
    p.client(&out);
    let sent = p.upstream();
    assert_eq!(sent.len(), 3, "{sent:?}");
    assert_eq!(
        sent[2], "connection.close",
        "the third is refused: two places were left"
    );
}
